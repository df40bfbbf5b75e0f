"""Attention for the target: blockwise causal (online softmax; no [T, T] matrix) and attention over a static cache.

Query heads of one KV group are merged into the row dimension and (batch, kv_head) into one batch dimension:
XLA:CPU runs that layout several times faster than two batch dims, and it is the natural GQA layout for kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def causal_attention(q, k, v, *, block: int = 512, scale: float | None = None):
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


def masked_attention(q, k, v, visible, *, scale: float | None = None, return_lse: bool = False):
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


def cached_attention(q, k_cache, v_cache, q_positions, *, scale: float | None = None, return_lse: bool = False):
  """Few new queries against a static cache that already holds them. q [B, T, Hq, D] at q_positions [B, T];
  k/v_cache [B, S, Hkv, D]. Key j is visible to a query at position p iff j <= p.

  One product per KV head, with the query heads of its group merged into the rows and the batch as the only batch
  dimension: a product with (batch, kv_head) batch dims over the [B, S, Hkv, D] cache makes XLA:CPU transpose the
  whole cache first, about twice the time (`scripts/bench_decode_ops.py`)."""
  b, t, hq, d = q.shape
  s, kv_heads = k_cache.shape[1], k_cache.shape[2]
  g = hq // kv_heads
  scale = d ** -0.5 if scale is None else scale
  visible = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
  visible = jnp.repeat(visible, g, axis=1)  # rows t*G + j, as the grouped queries below
  outs, lses = [], []
  for h in range(kv_heads):
    qh = q[:, :, h * g:(h + 1) * g].reshape(b, t * g, d)
    sc = jnp.einsum("brd,bsd->brs", qh, k_cache[:, :, h].astype(q.dtype), preferred_element_type=jnp.float32)
    sc = jnp.where(visible, sc * scale, NEG_INF)
    lse = jax.nn.logsumexp(sc, axis=-1)
    p = jnp.exp(sc - lse[..., None])
    o = jnp.einsum("brs,bsd->brd", p.astype(v_cache.dtype), v_cache[:, :, h], preferred_element_type=jnp.float32)
    outs.append(o.reshape(b, t, g, d))
    lses.append(lse.reshape(b, t, g))
  out = jnp.concatenate(outs, axis=2).astype(q.dtype)
  if return_lse:
    return out, jnp.concatenate(lses, axis=2)
  return out
