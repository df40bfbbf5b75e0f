"""Attention for the target: blockwise causal (online softmax; no [T, T] matrix) and attention over a static cache.

Query heads of one KV group are merged into the row dimension and (batch, kv_head) into one batch dimension:
XLA:CPU runs that layout several times faster than two batch dims, and it is the natural GQA layout for kernels.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp

from longspec_jax.kv_cache import quantize_kv

PyTree = TypeVar("PyTree")
NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free


def _group_queries(q, kv_heads):
  """[B, T, Hq, D] -> [B*Hkv, T*G, D] with row r = t*G + g."""
  b, t, hq, d = q.shape
  g = hq // kv_heads
  return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b * kv_heads, t * g, d)


def _ungroup(o, b, t, hq):
  n, _, d = o.shape
  kv_heads = n // b
  return o.reshape(b, kv_heads, t, hq // kv_heads, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)


def _kv_major(x):
  """[B, S, Hkv, D] -> [B*Hkv, S, D]."""
  b, s, h, d = x.shape
  return x.transpose(0, 2, 1, 3).reshape(b * h, s, d)


KV_PARTS = 3  # int8 parts per query / probability row over an int8 cache (see _int8_rows)


def materialize(x: PyTree) -> PyTree:
  """x (an array or a pytree of them), computed on its own. XLA:CPU contracts a product and a sum into one FMA
  whenever they share a fusion, and which ops share a fusion depends on the shapes, so a one-row decode step and a
  many-row verify pass can round the same product differently (~1e-7). A rounding product that a sum or a rounding
  to int8 reads goes through here; products by powers of two are exact and need not."""
  return jax.lax.optimization_barrier(x)


PART_BASE = 128.0  # each int8 part holds the rounded remainder of the ones before it times this (a power of two)


def int8_parts(x: jax.Array, scale: jax.Array, num_parts: int) -> list[jax.Array]:
  """u = x / scale (entries within +-127) as num_parts rounded parts p0, p1, ... with u ~ p0 + p1 / 128 +
  p2 / 128**2 + ...: each part is the rounded remainder of the ones before it (|r| <= 1/2) times 128, so every
  part fits in int8. After u every step is exact (u - round(u) is exact, and so is a product by 128), so a row's
  parts are the same bits whatever rows share the pass; u is x times the reciprocal of scale computed on scale's
  own (unbroadcast) shape, not `x / scale`: XLA turns a division by a broadcast into a multiplication by its
  reciprocal in some fusions and not in others."""
  u = materialize(x * (1.0 / scale))
  parts = []
  for _ in range(num_parts):
    p = jnp.round(u)
    parts.append(p)
    u = (u - p) * PART_BASE
  return parts


def combine_parts(sums: list[jax.Array]) -> jax.Array:
  """The inverse of `int8_parts` after an integer product or sum: int32 sums of p0, p1, ... -> fp32
  p0 + (p1 + p2 / 128) / 128 (Horner; products by 1/128 are exact, so an FMA rounds as the sum alone would)."""
  y = sums[-1].astype(jnp.float32)
  for part in sums[-2::-1]:
    y = part.astype(jnp.float32) + y * (1.0 / PART_BASE)
  return y


def _int8_rows(x: jax.Array, scale: jax.Array) -> jax.Array:
  """x [N, R, C] ~ scale [N, R, 1] * (p0 + p1 / 128 + p2 / 128**2) as int8 rows [N, 3R, C] (p0 rows, p1 rows, p2
  rows), as `model.int8_matmul` splits activations: within ~3e-7 of the row's largest entry."""
  return jnp.concatenate(int8_parts(x, scale, KV_PARTS), axis=1).astype(jnp.int8)


def _row_scale(x: jax.Array) -> jax.Array:
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
  return jnp.where(scale > 0, scale, 1.0)


def _from_parts(acc: jax.Array, scale: jax.Array) -> jax.Array:
  """The inverse of `_int8_rows` after an integer product: int32 [N, 3R, C'] -> fp32 [N, R, C']."""
  r = acc.shape[1] // KV_PARTS
  return combine_parts([acc[:, i * r:(i + 1) * r] for i in range(KV_PARTS)]) * scale


def _probability_sum(p_cache: jax.Array, p_new: jax.Array) -> jax.Array:
  """Sum over the keys of probabilities in [0, 1] (the cache's [N, R, S] and the new rows' [N, R, Tk]) in two
  fixed-point parts of 13 bits each, summed in int32 (S * 2**13 < 2**31 up to `INT8_KV_MAX_LEN`): integer sums are
  exact, so a row's softmax denominator is the same bits however a pass splits its keys between cache and new rows
  and whatever rows share the pass (a float sum's order depends on both). Scaling by powers of two is exact, so no
  product rounds. Within 2**-27 per key."""
  def sums(p):
    hi = jnp.round(p * 2.0 ** 13)
    lo = jnp.round((p * 2.0 ** 13 - hi) * 2.0 ** 13)
    return jnp.stack([jnp.sum(x.astype(jnp.int32), axis=-1) for x in (hi, lo)])

  hi, lo = sums(p_cache) + sums(p_new)
  return (hi.astype(jnp.float32) + lo.astype(jnp.float32) * 2.0 ** -13) * 2.0 ** -13


def _int8_product(spec: str, parts: jax.Array, values: jax.Array) -> jax.Array:
  return jnp.einsum(spec, parts, values, preferred_element_type=jnp.int32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = 512,
                     scale: float | None = None) -> jax.Array:
  """Causal self-attention over T new tokens. q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D].

  Online softmax over key blocks; key blocks after the query block are skipped (lax.cond), so work and memory
  are O(T * block) per head instead of O(T^2) memory.
  """
  b, t, hq, d = q.shape
  kv_heads = k.shape[2]
  g = hq // kv_heads
  scale = d ** -0.5 if scale is None else scale
  blk = min(block, t)
  nb = -(-t // blk)
  pad = nb * blk - t
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
  qg = _group_queries(q, kv_heads).reshape(b * kv_heads, nb, blk * g, d)
  kg = _kv_major(k).reshape(b * kv_heads, nb, blk, d)
  vg = _kv_major(v).reshape(b * kv_heads, nb, blk, d)
  q_tok = jnp.arange(blk * g) // g  # token offset of each row inside its block
  k_tok = jnp.arange(blk)

  # Checkpointed per block pair, with every array it reads passed in explicitly: closed-over arrays would be
  # saved as residuals at every step and make the backward pass quadratic in memory.
  @jax.checkpoint
  def step(carry, qi, kb, vb, j, i):
    m, l, acc = carry
    s = jnp.einsum("nrd,ncd->nrc", qi, kb, preferred_element_type=jnp.float32) * scale
    visible = (j * blk + k_tok[None, :]) <= (i * blk + q_tok[:, None])
    s = jnp.where(visible[None], s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum("nrc,ncd->nrd", p.astype(vb.dtype), vb,
                                             preferred_element_type=jnp.float32)
    return m_new, l, acc

  def q_block(i):
    qi = jax.lax.dynamic_index_in_dim(qg, i, axis=1, keepdims=False)
    n, r = qi.shape[0], qi.shape[1]
    init = (jnp.full((n, r), NEG_INF, jnp.float32), jnp.zeros((n, r), jnp.float32),
            jnp.zeros((n, r, d), jnp.float32))

    def body(carry, kv_j):
      kb, vb, j = kv_j
      carry = jax.lax.cond(j <= i, lambda c: step(c, qi, kb, vb, j, i), lambda c: c, carry)
      return carry, None

    (m, l, acc), _ = jax.lax.scan(body, init, (kg.transpose(1, 0, 2, 3), vg.transpose(1, 0, 2, 3),
                                               jnp.arange(nb)))
    return (acc / l[..., None]).astype(q.dtype)

  if nb == 1:
    out = q_block(0)[:, None]
  else:
    out = jax.lax.map(q_block, jnp.arange(nb)).transpose(1, 0, 2, 3)  # [N, nb, blk*G, D]
  out = out.reshape(b * kv_heads, nb * blk * g, d)
  return _ungroup(out, b, nb * blk, hq)[:, :t]


def dense_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *, scale: float | None = None,
                           return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Dense attention with an explicit mask. q [B, T, Hq, D]; k/v [B, S, Hkv, D]; visible [B, T, S] bool, or
  [B, Hkv, T, S] for a mask per KV head (BudgetDraft training: each head keeps its own chunks)."""
  b, t, hq, d = q.shape
  kv_heads = k.shape[2]
  g = hq // kv_heads
  scale = d ** -0.5 if scale is None else scale
  qg = q.reshape(b, t, kv_heads, g, d)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where(visible[:, None, None] if visible.ndim == 3 else visible[:, :, None], s, NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse[..., None])
  out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32).reshape(b, t, hq, d).astype(q.dtype)
  if return_lse:
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, hq)
  return out


def extend_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     positions: jax.Array, *, scale: float | None = None, return_lse: bool = False,
                     new_visible: jax.typing.ArrayLike | None = None, cache_end: jax.Array | None = None,
                     k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
  """T new rows against a static cache and, causally, each other. q [B, T, Hq, D] at positions [B, T]
  (increasing by one along T); the new rows' k/v [B, Tk, Hkv, D], Tk >= T: the last T belong to the queries,
  the first Tk - T are new rows just before them (a drafter's chain, kept out of the cache); k/v_cache
  [B, Hkv, S, D] (the `KVCache` layout), read before this pass writes its rows into it: cache row j is visible iff
  it precedes the first new row (rows at or past it are stale or the new rows themselves), new row t' to query t
  iff t' <= t + Tk - T. A draft tree gives its own `new_visible` [T, Tk] (new row t' to query t) and `cache_end` [B]
  (cache rows before it are visible; default: the first new row's position). An int8 cache (`KVCache.k_scale`)
  gives its scales [B, Hkv, S] as k/v_scale: the products are then integer products (int8 rows; the queries and
  probabilities each in three int8 parts), exact sums that XLA:CPU runs on int8 matrix units.

  Reading the cache before the write keeps the write in place: when a product read the updated buffer, XLA:CPU
  copied the layer's whole cache several times per step (a 1-row decode at 8K took ~10x its bandwidth floor).
  The query heads of a KV group are merged into the rows and (batch, kv_head) into one batch dimension, so each
  product reads one contiguous [S, D] block per KV head."""
  b, t, hq, d = q.shape
  t_new = k.shape[1]
  kv_heads, s = k_cache.shape[1], k_cache.shape[2]
  n = b * kv_heads
  g = hq // kv_heads
  scale = d ** -0.5 if scale is None else scale
  qg = _group_queries(q, kv_heads)  # [B*Hkv, T*G, D], row r = t*G + g
  int8 = k_scale is not None
  if int8:
    # Cache rows and new rows alike through integer products of the int8 rows (the new ones quantized here, as
    # they will be written): a row reads the same whether this pass wrote it or an earlier one did.
    (kq_new, ks_new), (vq_new, vs_new) = quantize_kv(_kv_major(k)), quantize_kv(_kv_major(v))
    q32 = qg.astype(jnp.float32)  # the parts split fp32 rows, whatever the activations' dtype
    q_scale = _row_scale(q32)
    q_parts = _int8_rows(q32, q_scale)
    score = lambda kq, ks: _from_parts(_int8_product("nrd,nsd->nrs", q_parts, kq), q_scale) * ks[:, None, :]
    sc_cache = score(k_cache.reshape(n, s, d), k_scale.reshape(n, s))
    sc_new = score(kq_new, ks_new)
  else:
    sc_cache = jnp.einsum("nrd,nsd->nrs", qg, k_cache.reshape(n, s, d).astype(q.dtype),
                          preferred_element_type=jnp.float32)
    sc_new = jnp.einsum("nrd,nsd->nrs", qg, _kv_major(k).astype(q.dtype), preferred_element_type=jnp.float32)
  if cache_end is None:
    cache_end = positions[:, 0] - (t_new - t)
  cache_visible = jnp.arange(s)[None, :] < cache_end[:, None]  # [B, S]
  if new_visible is None:
    new_visible = jnp.tril(jnp.ones((t, t_new), bool), t_new - t)
  new_visible = jnp.repeat(jnp.asarray(new_visible), g, axis=0)  # [T*G, Tk]
  sc_cache = jnp.where(jnp.repeat(cache_visible, kv_heads, axis=0)[:, None, :], sc_cache * scale, NEG_INF)
  sc_new = jnp.where(new_visible[None], sc_new * scale, NEG_INF)
  # One exp per score: normalise the [rows, D] output rather than the [rows, S] probabilities.
  m = jnp.maximum(sc_cache.max(-1), sc_new.max(-1))[..., None]
  p_cache, p_new = jnp.exp(sc_cache - m), jnp.exp(sc_new - m)
  if int8:
    denom = _probability_sum(p_cache, p_new)
    # p * v_scale in int8 parts on one scale per query row (the largest over cache and new rows), so the int32
    # sums over cache and new rows add exactly, however a pass splits them.
    w_cache, w_new = p_cache * v_scale.reshape(n, 1, s), p_new * vs_new[:, None, :]
    w_scale = jnp.maximum(w_cache.max(-1), w_new.max(-1))[..., None] / 127.0
    w_scale = jnp.where(w_scale > 0, w_scale, 1.0)
    o = _from_parts(_int8_product("nrs,nsd->nrd", _int8_rows(w_cache, w_scale), v_cache.reshape(n, s, d))
                    + _int8_product("nrs,nsd->nrd", _int8_rows(w_new, w_scale), vq_new), w_scale)
  else:
    o = (jnp.einsum("nrs,nsd->nrd", p_cache.astype(v_cache.dtype), v_cache.reshape(n, s, d),
                    preferred_element_type=jnp.float32)
         + jnp.einsum("nrs,nsd->nrd", p_new.astype(v.dtype), _kv_major(v), preferred_element_type=jnp.float32))
    denom = p_cache.sum(-1) + p_new.sum(-1)
  o = o * (1.0 / denom)[..., None]
  lse = m[..., 0] + jnp.log(denom)
  out = _ungroup(o, b, t, hq).astype(q.dtype)
  if return_lse:
    return out, _ungroup(lse[..., None], b, t, hq)[..., 0]
  return out

