"""Qwen3 / Llama decoder in Flax NNX with a static KV cache and hidden-state taps.

`Transformer.__call__` has three static modes:
  * "train":   causal over the T given tokens, no cache (blockwise attention, optional per-layer remat);
  * "prefill": the cache is empty; T tokens are written at offset 0 for every sequence (blockwise attention);
  * "extend":  T new tokens per sequence are written at that sequence's own offset (cache.lengths) and attend
               to the whole cache (decode: T=1, verification: T=K+1).
The cache's `lengths` are not advanced here: the caller commits as many rows as it accepts.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.attention import causal_attention, combine_parts, extend_attention, int8_parts, materialize
from longspec_jax.config import ModelConfig
from longspec_jax.kv_cache import KVCache, check_kv_dtype, kv_round_trip
from longspec_jax.rope import apply_rope, rope_frequencies

MODES = ("train", "prefill", "extend")


def _param(rngs, shape, axes, init=None, dtype=jnp.float32):
  init = init or nnx.initializers.normal(0.02)
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def matmul(x: jax.Array, w: jax.Array, spec: str, out_dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
  """`einsum(spec, x, w)` in out_dtype (default x's dtype).

  Weights stored narrower than the activations (bf16 weights, fp32 activations) are multiplied as stored, and x is
  split into two bf16 parts, x ~ hi + lo (hi = x rounded, lo = the rest rounded), multiplied in one product of
  twice the rows with fp32 accumulation. Rounding x itself to bf16 would be faster by a hair but not lossless: its
  ~4e-3 steps turn the ~1e-7 differences between a one-row decode step and a many-row verify pass into different
  greedy tokens (half of 8 SmolLM2 prompts at 4K parted from AR within 64 tokens); hi + lo keeps x to ~16 bits and
  the product within ~2e-6 of fp32. Converting the weights to fp32 instead writes a wide copy of them on every call
  (~10x slower here). A one-row product thus runs as two rows: XLA:CPU's bf16 matrix-vector product is ~6x slower
  than its two-row product, and a bf16 product of 2-16 rows costs about the same (it reads half the weight bytes
  of fp32)."""
  if w.dtype.itemsize >= x.dtype.itemsize:
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out_dtype or x.dtype)
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  n = rows.shape[0]
  hi = rows.astype(w.dtype)
  lo = (rows - hi.astype(jnp.float32)).astype(w.dtype)
  y = jnp.einsum(spec, jnp.concatenate([hi, lo]), w, preferred_element_type=jnp.float32)
  y = y[:n] + y[n:]
  return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype or x.dtype)


INT8_PARTS = 3  # int8 parts per activation row in int8_matmul (see there)


def int8_matmul(x: jax.Array, w_int8: jax.Array, w_scale: jax.Array, spec: str,
                out_dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
  """`einsum(spec, x, w)` for int8 weights w = w_int8 * w_scale (one fp32 scale per output channel).

  The products are integer products (int8 x int8, int32 sums: exact, whatever rows share them), which XLA:CPU runs
  several times faster than fp32 on CPUs with int8 matrix units. Each row of x is split into INT8_PARTS int8 parts
  (`attention.int8_parts`), x ~ s * (p0 + p1 / 128 + p2 / 128**2) with s = max|x| / 127, and the parts are
  multiplied as rows of one product. The split is continuous in x up to the last part's rounding, ~3e-7 of the
  row's largest entry (with two parts, ~3e-5: a one-row and a many-row pass over SmolLM2 at 4K then differed by
  ~7e-3 in the logits). Every float op around the product is per row and no rounding product shares a fusion with
  a sum (`attention.materialize`), so a row's output is the same bits whatever rows share the pass: over an int8
  cache, whose quantization would turn any difference into a step, a one-row decode step and a many-row verify
  pass agree bit for bit. Fewer than 4 part rows are padded to 4: XLA:CPU's int8 products of 1-2 rows are slower
  than of 4."""
  rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  n = rows.shape[0]
  s = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) / 127.0
  s = jnp.where(s > 0, s, 1.0)
  parts = int8_parts(rows, s, INT8_PARTS)
  pad = max(0, 4 - INT8_PARTS * n)
  stacked = jnp.concatenate(parts + ([jnp.zeros((pad, rows.shape[1]), rows.dtype)] if pad else []))
  acc = jnp.einsum(spec, stacked.astype(jnp.int8), w_int8, preferred_element_type=jnp.int32)
  y = materialize(combine_parts([acc[i * n:(i + 1) * n] for i in range(INT8_PARTS)]) * s * w_scale)
  return y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype or x.dtype)


def quantize_per_channel(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(int8 values, fp32 scales): w ~ values * scales, symmetric, one scale (max |w| / 127) per index along `axis`
  (the output channel)."""
  w = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w), axis=1 - axis) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  return jnp.round(w / jnp.expand_dims(scale, 1 - axis)).astype(jnp.int8), scale


class Linear(nnx.Module):
  def __init__(self, din, dout, axes, *, bias=False, rngs, std=0.02):
    self.kernel = _param(rngs, (din, dout), axes, nnx.initializers.normal(std))
    self.bias = nnx.Param(jnp.zeros((dout,)), logical_axes=(axes[1],)) if bias else None
    self.kernel_scale = nnx.data(None)  # set by quantize_int8: the kernel is then int8, one scale per output channel

  def quantize_int8(self) -> None:
    """Stores the kernel as int8 with a symmetric fp32 scale per output channel (max |w| / 127)."""
    axes = getattr(self.kernel, "logical_axes", (None, None))
    values, scale = quantize_per_channel(self.kernel[...], axis=1)
    self.kernel = nnx.Param(values, logical_axes=axes)
    self.kernel_scale = nnx.Param(scale, logical_axes=(axes[1],))

  def __call__(self, x):
    if self.kernel_scale is not None:
      y = int8_matmul(x, self.kernel[...], self.kernel_scale[...], "...i,io->...o")
    else:
      y = matmul(x, self.kernel[...], "...i,io->...o")
    return y + self.bias[...].astype(x.dtype) if self.bias is not None else y


def fixed_order_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis in one fixed order (a pairwise tree of elementwise adds), whatever the leading shape:
  XLA picks a reduction's summation order per shape, so `jnp.sum` over one row alone and among eight can round
  differently (~3e-8 in an RMSNorm)."""
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    paired = x[..., :half] + x[..., half:2 * half]
    x = jnp.concatenate([paired, x[..., 2 * half:]], axis=-1) if x.shape[-1] % 2 else paired
  return x[..., 0]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, row_exact: bool = False) -> jax.Array:
  """scale * x / rms(x) over the last axis, in fp32, in x's dtype. row_exact: a row's result is the same bits
  whatever rows share the pass (the mean square in `fixed_order_sum`'s order, no product next to a sum: see
  `attention.materialize`); it costs compile time (the int8 target sets it, `Transformer.quantize_int8`)."""
  x32 = x.astype(jnp.float32)
  if row_exact:
    n = x32.shape[-1]
    mean_square_eps = (fixed_order_sum(materialize(x32 * x32)) + n * eps)[..., None] * (1.0 / n)
  else:
    mean_square_eps = jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps
  return (scale.astype(jnp.float32) * (x32 * jax.lax.rsqrt(mean_square_eps))).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim, eps, *, rngs, axis="norm"):
    del rngs
    self.scale = nnx.Param(jnp.ones((dim,)), logical_axes=(axis,))
    self.eps = eps
    self.row_exact = False  # see rms_norm

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps, self.row_exact)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs, in_features: int | None = None, qk_norm: bool | None = None):
    """in_features: width of the q/k/v input (default hidden_size; EAGLE-3 reads 2H). qk_norm: default by family."""
    hd, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    din = in_features or cfg.hidden_size
    out_std = 0.02 / (2 * cfg.num_hidden_layers) ** 0.5
    self.q_proj = Linear(din, hq * hd, ("embed", "q_heads"), bias=cfg.attention_bias, rngs=rngs)
    self.k_proj = Linear(din, hkv * hd, ("embed", "kv_heads"), bias=cfg.attention_bias, rngs=rngs)
    self.v_proj = Linear(din, hkv * hd, ("embed", "kv_heads"), bias=cfg.attention_bias, rngs=rngs)
    self.o_proj = Linear(hq * hd, cfg.hidden_size, ("q_heads", "embed"), bias=cfg.attention_bias, rngs=rngs,
                         std=out_std)
    if cfg.family == "qwen3" if qk_norm is None else qk_norm:
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, rngs=rngs, axis="head_dim")
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, rngs=rngs, axis="head_dim")
    else:
      self.q_norm = self.k_norm = None
    self.cfg = cfg

  def qkv(self, x: jax.Array, positions: jax.Array,
          rope: tuple[jax.Array, float]) -> tuple[jax.Array, jax.Array, jax.Array]:
    cfg = self.cfg
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq, scaling = rope
    return apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling), v

  def out(self, o: jax.Array) -> jax.Array:
    b, t = o.shape[:2]
    return self.o_proj(o.reshape(b, t, -1))


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs):
    h, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = Linear(h, f, ("embed", "mlp"), bias=cfg.mlp_bias, rngs=rngs)
    self.up_proj = Linear(h, f, ("embed", "mlp"), bias=cfg.mlp_bias, rngs=rngs)
    self.down_proj = Linear(f, h, ("mlp", "embed"), bias=cfg.mlp_bias, rngs=rngs,
                            std=0.02 / (2 * cfg.num_hidden_layers) ** 0.5)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, rope, cache: KVCache | None, layer: int, mode: str, attn_block: int,
               sharpdraft=None, tree_mask=None, kv_dtype: str = "float32"):
    """Writes this layer's new K/V rows into `cache` (prefill, extend); returns (x, cache, (k, v)). `tree_mask`
    (extend): which new rows each new row sees, [T, T], instead of the causal order. Every mode attends over the
    K/V rows as a cache of `kv_dtype` holds them (`kv_round_trip`), and returns those rows."""
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions, rope)
    k, v = kv_round_trip(k, kv_dtype), kv_round_trip(v, kv_dtype)
    if sharpdraft is not None:  # in every mode a query at position p sees keys 0..p, i.e. p + 1 of them
      q = sharpdraft.scale_queries(layer, q, positions + 1)
    if mode == "train":
      o = causal_attention(q, k, v, block=attn_block)
    elif mode == "prefill":
      cache = cache.write_prefix(layer, k, v)
      o = causal_attention(q, k, v, block=attn_block)
    else:
      # Attend over the cache as it was, then write: the write stays in place (see extend_attention).
      k_scale, v_scale = cache.layer_scales(layer)
      o = extend_attention(q, k, v, cache.k[layer], cache.v[layer], positions, new_visible=tree_mask,
                           k_scale=k_scale, v_scale=v_scale)
      cache = cache.write(layer, k, v, positions)
    x = x + self.self_attn.out(o)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache, (k, v)


@flax.struct.dataclass
class ForwardOutput:
  logits: jax.Array | None  # [B, T or P, V] fp32
  cache: KVCache | None
  taps: jax.Array | None  # [B, T, n_taps, H]: residual stream at the requested indices (i = input of layer i)
  new_kv: tuple | None  # (k, v) each [L, B, T, Hkv, D]: the rows this pass wrote
  hidden: jax.Array | None  # [B, T, H] final normed hidden state


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, remat: bool = False,
               attn_block: int = 512, kv_dtype: str | None = None):
    """kv_dtype: the KV cache's dtype (`kv_cache.KV_DTYPES`; default the activations' dtype), which every mode
    attends as (train mode too: a loss measured with it is the loss of decoding over that cache)."""
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs,
                                  embedding_init=nnx.initializers.normal(0.02))
    self.embed_tokens.embedding = nnx.Param(self.embed_tokens.embedding[...], logical_axes=("vocab", "embed"))
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size,
                                                                ("embed", "vocab"), rngs=rngs)
    self.dtype = dtype
    self.kv_dtype = check_kv_dtype(kv_dtype or jnp.dtype(dtype).name)
    self.remat = remat
    self.attn_block = attn_block
    self.head_int8 = nnx.data(None)  # set by quantize_int8: an int8 copy of the LM head [V, H] and its scales [V]
    self.head_scale = nnx.data(None)

  def quantize_int8(self) -> "Transformer":
    """The decoder layers' projections in int8 (see `int8_matmul`) and the logits from an int8 copy of the LM head
    (a scale per vocabulary row), in place; the embedding and LM head weights stay as they are (drafters read
    them). Its RMSNorms become row-exact (`rms_norm`), so every row computes alike in any pass. Returns self."""
    for layer in self.layers:
      for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        lin.quantize_int8()
      for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                   layer.self_attn.k_norm):
        if norm is not None:
          norm.row_exact = True  # with the integer products, a row computes alike in any pass (int8 KV cache)
    self.norm.row_exact = True
    head = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...].T
    values, scale = quantize_per_channel(head, axis=0)
    self.head_int8 = nnx.Param(values, logical_axes=("vocab", "embed"))
    self.head_scale = nnx.Param(scale, logical_axes=("vocab",))
    return self

  def with_kv_dtype(self, kv_dtype: str) -> "Transformer":
    """Sets the KV cache dtype (`kv_cache.KV_DTYPES`) in place; returns self."""
    self.kv_dtype = check_kv_dtype(kv_dtype)
    return self

  def embed(self, tokens: jax.Array) -> jax.Array:
    return self.embed_tokens.embedding[...][tokens].astype(self.dtype)

  def logits_from_hidden(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden [.., H] -> fp32 logits via the (possibly tied) LM head."""
    if self.head_int8 is not None:
      return int8_matmul(h, self.head_int8[...], self.head_scale[...], "...h,vh->...v", jnp.float32)
    if self.lm_head is None:
      return matmul(h, self.embed_tokens.embedding[...], "...h,vh->...v", jnp.float32)
    return self.lm_head(h).astype(jnp.float32)

  def __call__(self, tokens, *, cache: KVCache | None = None, positions=None, mode: str = "train",
               taps: Sequence[int] = (), return_kv: bool = False, logits_at=None, return_logits: bool = True,
               sharpdraft=None, write_cache: bool = True, tree_mask=None):
    """tokens [B, T]. `logits_at` [B, P] (indices into T) limits the LM head to those rows.

    `write_cache=False` (extend): attend over the cache and the new rows but leave the cache as it was; the caller
    writes `new_kv` itself (the engine does, after the `lax.switch` over draft sizes: a branch that updated the
    cache made XLA copy every layer's whole cache on every step).

    `sharpdraft` (a `longspec_jax.sharpdraft.SharpDraft`, for a standalone drafter) scales every query after q-norm
    and RoPE by its `scale_queries`; None leaves the attention untouched.

    `tree_mask` [T, T] bool (extend, a draft tree's verification): new row t sees new row t' iff mask[t, t'];
    `positions` then give each row its depth past the cache."""
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "train" and cache is None:
      raise ValueError(f"mode {mode!r} needs a KV cache")
    if not write_cache and not (mode == "extend" and return_kv):
      raise ValueError("write_cache=False is for mode='extend' with return_kv=True (the caller writes the rows)")
    if tree_mask is not None and (mode != "extend" or write_cache):
      raise ValueError("tree_mask is for mode='extend' with write_cache=False (the caller writes the accepted rows)")
    cfg = self.cfg
    b, t = tokens.shape
    if positions is None:
      start = cache.lengths if mode == "extend" else jnp.zeros((b,), jnp.int32)
      positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    rope = rope_frequencies(cfg, jnp.max(positions))
    kv_dtype = self.kv_dtype if cache is None else cache.kv_dtype
    taps = tuple(taps)
    for i in taps:
      if not 0 <= i <= cfg.num_hidden_layers:
        raise ValueError(f"tap index {i} outside [0, {cfg.num_hidden_layers}]")

    x = self.embed(tokens)
    tapped = {}
    new_k, new_v = [], []
    for li, layer in enumerate(self.layers):
      if li in taps:
        tapped[li] = x
      if self.remat and mode == "train":
        fn = nnx.remat(lambda lyr, x_, p_: lyr(x_, p_, rope, None, li, "train", self.attn_block, sharpdraft,
                                               kv_dtype=kv_dtype)[0])
        x = fn(layer, x, positions)
      else:
        x, written, (k, v) = layer(x, positions, rope, cache, li, mode, self.attn_block, sharpdraft, tree_mask,
                                   kv_dtype)
        cache = written if write_cache else cache
        if return_kv:
          new_k.append(k)
          new_v.append(v)
    if cfg.num_hidden_layers in taps:
      tapped[cfg.num_hidden_layers] = x
    h = self.norm(x)
    if logits_at is not None:
      h_sel = jnp.take_along_axis(h, logits_at[..., None], axis=1)
    else:
      h_sel = h
    logits = self.logits_from_hidden(h_sel) if return_logits else None
    return ForwardOutput(
        logits=logits, cache=cache,
        taps=jnp.stack([tapped[i] for i in taps], axis=2) if taps else None,
        new_kv=(jnp.stack(new_k), jnp.stack(new_v)) if return_kv else None,
        hidden=h)

  def last_query_attention_logits(self, tokens: jax.Array) -> list[jax.Array]:
    """Per layer, the pre-softmax logits (1/sqrt(d) applied) of the last token's query against all T keys of
    `tokens` [B, T] (causal, no cache): [B, Hq, 1, T] each. SharpDraft calibrates on them."""
    cfg = self.cfg
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    rope = rope_frequencies(cfg, t - 1)
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    x = self.embed(tokens)
    out = []
    for li, layer in enumerate(self.layers):
      q, k, _ = layer.self_attn.qkv(layer.input_layernorm(x), positions, rope)
      k = jnp.repeat(k, g, axis=2)  # q head h reads kv head h // g
      out.append(jnp.einsum("bqhd,bkhd->bhqk", q[:, -1:], k, preferred_element_type=jnp.float32)
                 * cfg.head_dim ** -0.5)
      if li + 1 < len(self.layers):
        x = layer(x, positions, rope, None, li, "train", self.attn_block)[0]
    return out

  def init_cache(self, batch: int, max_len: int, dtype: jax.typing.DTypeLike | None = None) -> KVCache:
    cfg = self.cfg
    return KVCache.zeros(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim,
                         dtype or self.kv_dtype)


def param_count(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def create_model(cfg: ModelConfig, seed: int = 0, **kw: Any) -> Transformer:
  return Transformer(cfg, rngs=nnx.Rngs(seed), **kw)


def default_target_config(vocab_size: int = 8192, **overrides: Any) -> ModelConfig:
  """The shipped default target: 8-layer d256 Qwen3-style model (~9M parameters, tied embeddings)."""
  from longspec_jax.config import RopeConfig
  base = dict(family="qwen3", vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
              num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=32768, rope=RopeConfig(theta=100000.0), rms_norm_eps=1e-6,
              tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1, mask_token_id=2)
  base.update(overrides)
  return ModelConfig(**base)


