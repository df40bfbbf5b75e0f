"""Static KV cache: one preallocated [batch, kv_heads, S_max, head_dim] buffer per layer for K and for V, plus
per-sequence lengths.

Writes land at each sequence's own offset; rejected speculative rows are never erased, the length pointer simply
does not cover them and later writes overwrite them.

Layout, and why: one buffer per layer, because XLA:CPU materialises a slice of a stacked [L, ...] buffer before a
dot reads it (a copy of the layer's whole cache on every decode step); heads before positions, so that the
attention of one KV head reads one contiguous [S, D] block and (batch, kv_head) merges into a single batch
dimension for free. Measured on SmolLM2-135M shapes at 8K: the 30 layers' attention for one decode row went from
~110 ms to ~15 ms (`scripts/profile_verify.py`).

Cache dtypes (`KV_DTYPES`): float32, bfloat16, or int8 with one fp32 scale per token and KV head (`quantize_kv`),
kept beside the values as [B, Hkv, S_max] per layer. A row is quantized once, when it is written, and every reader
(a one-row decode step, a K+1-row verify pass reading its own new rows, a drafter reading `new_kv`) reads the same
values: `kv_round_trip` gives a pass the values its rows will have in the cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from longspec_jax.config import KV_DTYPES
# int8 x int8 products summed in int32 over S positions stay exact while S * 127 * 127 < 2**31.
INT8_KV_MAX_LEN = (2 ** 31 - 1) // (127 * 127)


def check_kv_dtype(name: str) -> str:
  """The KV cache dtype's name, or one clear error."""
  if name not in KV_DTYPES:
    raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
  return name


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Rows [..., D] -> (int8 values [..., D], fp32 scales [...]): x ~ values * scale, one symmetric scale per row.

  The scale is max |x| / 127 rounded up to 17 significant bits: then values * scale is exact in fp32 (7 + 17 bits)
  and quantizing the dequantized rows again gives the same values and scales, so a row a pass read dequantized
  (`kv_round_trip`) lands in the cache as the same bytes whichever form the writer was handed."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  scale = jax.lax.bitcast_convert_type((bits + 0x7F) & jnp.uint32(0xFFFFFF80), jnp.float32)
  return jnp.round(x * (1.0 / scale)[..., None]).astype(jnp.int8), scale


def dequantize_kv(values: jax.Array, scale: jax.Array, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
  return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def kv_round_trip(x: jax.Array, kv_dtype: str) -> jax.Array:
  """The values rows x [..., D] have once written to a cache of `kv_dtype` (x itself for float32)."""
  if kv_dtype == "int8":
    return dequantize_kv(*quantize_kv(x), x.dtype)
  if jnp.dtype(kv_dtype) == x.dtype:
    return x
  return x.astype(kv_dtype).astype(x.dtype)


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, Hkv, S_max, D]
  v: tuple[jax.Array, ...]  # per layer [B, Hkv, S_max, D]
  lengths: jax.Array  # [B] int32: committed positions per sequence
  k_scale: tuple[jax.Array, ...] | None = None  # int8 cache: per layer [B, Hkv, S_max] fp32; None otherwise
  v_scale: tuple[jax.Array, ...] | None = None

  @classmethod
  def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
            dtype: jax.typing.DTypeLike = jnp.float32) -> "KVCache":
    shape = (batch, kv_heads, max_len, head_dim)
    per_layer = lambda shp, dt: tuple(jnp.zeros(shp, dt) for _ in range(num_layers))
    cache = cls(k=per_layer(shape, dtype), v=per_layer(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))
    if jnp.dtype(dtype) != jnp.int8:
      return cache
    if max_len > INT8_KV_MAX_LEN:
      raise ValueError(f"an int8 KV cache holds at most {INT8_KV_MAX_LEN} positions (its int32 sums), got {max_len}")
    return cache.replace(k_scale=per_layer(shape[:3], jnp.float32), v_scale=per_layer(shape[:3], jnp.float32))

  @property
  def kv_dtype(self) -> str:
    """The cache dtype's name (`KV_DTYPES`)."""
    return jnp.dtype(self.k[0].dtype).name

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

  @property
  def nbytes(self) -> int:
    scales = self.k_scale + self.v_scale if self.k_scale is not None else ()
    return sum(x.nbytes for x in self.k + self.v + scales) + self.lengths.nbytes

  def layer_scales(self, layer: int) -> tuple[jax.Array | None, jax.Array | None]:
    """(k scales, v scales) [B, Hkv, S_max] of an int8 cache's layer; (None, None) for a float cache."""
    if self.k_scale is None:
      return None, None
    return self.k_scale[layer], self.v_scale[layer]

  def write_prefix(self, layer: int, k: jax.Array, v: jax.Array) -> "KVCache":
    """Writes rows [B, T, Hkv, D] at positions 0..T-1 of every sequence (prefill)."""
    put = lambda buf, x: jax.lax.dynamic_update_slice(buf, jnp.swapaxes(x, 1, 2).astype(buf.dtype),
                                                      (0,) * buf.ndim)
    return self._put(layer, k, v, put)

  def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array) -> "KVCache":
    """Writes rows [B, T, Hkv, D] at each sequence's own positions [B, T]; positions >= S_max are dropped."""
    rows = jnp.arange(k.shape[0])[:, None]
    # Advanced indices on axes 0 and 2 around a slice: the indexed block is [B, T, Hkv, D], k's own layout (and
    # [B, T, Hkv] for the scales).
    put = lambda buf, x: buf.at[rows, :, positions].set(x.astype(buf.dtype), mode="drop")
    return self._put(layer, k, v, put)

  def _put(self, layer: int, k: jax.Array, v: jax.Array, put) -> "KVCache":
    swap = lambda bufs, new: bufs[:layer] + (new,) + bufs[layer + 1:]
    if self.k_scale is None:
      return self.replace(k=swap(self.k, put(self.k[layer], k)), v=swap(self.v, put(self.v[layer], v)))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return self.replace(k=swap(self.k, put(self.k[layer], kq)), v=swap(self.v, put(self.v[layer], vq)),
                        k_scale=swap(self.k_scale, put(self.k_scale[layer], ks)),
                        v_scale=swap(self.v_scale, put(self.v_scale[layer], vs)))


# For every jitted program that updates a KV cache in place. XLA:CPU's default copy insertion copies a buffer that
# one op reads and a later op updates in place (here: every layer's cache, every step, several copies each); its
# region analysis proves the read comes first and keeps the update in place (SmolLM2-135M, one decode row at 8K:
# ~200 ms -> ~45 ms). A DebugOptions field: the TPU and GPU compilers do not read it.
COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
