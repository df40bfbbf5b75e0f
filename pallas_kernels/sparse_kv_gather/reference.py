"""Plain-jnp definition of the sparse KV gather and of attention over the selected chunks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longspec_jax.pallas_kernels import _common
from longspec_jax.pallas_kernels.length_masked_attention import reference as lma_reference
from longspec_jax.pallas_kernels.length_masked_attention.reference import chunk_positions


def reference_gather_kv_chunks(k: jax.Array, v: jax.Array, chunk_idx: jax.Array, *,
                               chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """Copies the selected chunks of K and V into a compact buffer.

  k, v [B, S, Hkv, D]; chunk_idx [B, Hkv, n_sel] (chunk c covers keys [c*chunk_size, (c+1)*chunk_size);
  -1 = empty slot). Returns (k_sel, v_sel) [B, n_sel*chunk_size, Hkv, D], cache layout; slot i of head h
  holds key position chunk_positions(chunk_idx, chunk_size)[b, h, i]; empty slots are zero.
  """
  check_gather_inputs(k, v, chunk_idx, chunk_size)
  pos = chunk_positions(chunk_idx, chunk_size)
  empty = jnp.moveaxis(pos < 0, 1, 2)[..., None]
  k_sel = jnp.where(empty, 0, lma_reference.gather_rows(k, pos)).astype(k.dtype)
  v_sel = jnp.where(empty, 0, lma_reference.gather_rows(v, pos)).astype(v.dtype)
  return k_sel, v_sel


def reference_sparse_chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.typing.ArrayLike,
                                     chunk_idx: jax.Array, *, chunk_size: int,
                                     rho: jax.typing.ArrayLike | None = None,
                                     alpha: jax.typing.ArrayLike | None = None, n0: float | None = None,
                                     sm_scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Reference for `sparse_chunk_attention`: attention over the valid keys of the selected chunks."""
  b, _, hq, d, s, hkv = _common.check_attention_inputs(q, k, v, lengths)
  _common.check_chunk_size(chunk_size, s)
  _common.check_chunk_idx(chunk_idx, b, hkv)
  mode, param = _common.scale_params(rho, alpha, n0, b, hq)
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s)
  pos = chunk_positions(chunk_idx, chunk_size)
  n_visible = jnp.sum((pos >= 0) & (pos < lengths[:, None, None]), axis=-1)
  scale = lma_reference.head_scales(mode, param, n_visible, n0, d ** -0.5 if sm_scale is None else sm_scale)
  return lma_reference.chunk_attention(q, k, v, lengths, chunk_idx, chunk_size, scale)


def check_gather_inputs(k: jax.Array, v: jax.Array, chunk_idx: jax.typing.ArrayLike, chunk_size: int) -> None:
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(
        f"k and v must both be [batch, kv_len, kv_heads, head_dim] with equal shapes, got {k.shape} and {v.shape}")
  _common.check_chunk_size(chunk_size, k.shape[1])
  _common.check_chunk_idx(chunk_idx, k.shape[0], k.shape[2])
