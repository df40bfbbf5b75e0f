"""Plain-jnp definition of length-masked (top-k) attention; the kernels are tested against it.

logits[b, t, h, s] = sm_scale * rho[b, h] * <q[b, t, h], k[b, s, h // G]>, keys s < lengths[b] only.
rho is given per (sequence, q head) or follows SharpDraft's fixed slope rho = max(1, 1 + alpha ln(n / n0)),
n = number of keys the row actually attends (all valid keys, or the valid keys of the selected chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from longspec_jax.pallas_kernels import _common


def sharpdraft_rho(n_visible: jax.typing.ArrayLike, alpha: jax.typing.ArrayLike,
                   n0: float | jax.Array) -> jax.Array:
  """rho(n) = max(1, 1 + alpha * ln(n / n0)); n is clamped to >= 1 so an empty view gives rho = 1."""
  n = jnp.maximum(jnp.asarray(n_visible, jnp.float32), 1.0)
  return jnp.maximum(1.0, 1.0 + jnp.asarray(alpha, jnp.float32) * jnp.log(n / n0))


def key_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array,
                         scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [B,Tq,Hq,D], k/v [B,S,Hkv,D], key_mask [B,Hkv,S] bool, scale [B,Hq] -> (out [B,Tq,Hq,D], lse [B,Tq,Hq]).

  Rows with no visible key return out = 0 and lse = -inf. The few query rows are put in [B, Hkv, G*Tq, D] order
  first, so both products come out in the order the softmax reads ([B, Hkv, rows, S]); with the rows in Tq-major
  order XLA:CPU transposed (copied) the [B, Hkv, G, Tq, S] logits twice per call, each copy G*Tq rows of the
  whole key range.
  """
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  rows = q.reshape(b, tq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)  # row = g * Tq + t
  logits = jnp.einsum("bkrd,bskd->bkrs", rows, k, preferred_element_type=jnp.float32)
  logits = (logits.reshape(b, hkv, g, tq, -1) * scale.reshape(b, hkv, g)[..., None, None]).reshape(logits.shape)
  mask = key_mask[:, :, None, :]
  m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1)  # [B, Hkv, rows]
  out = jnp.einsum("bkrs,bskd->bkrd", p, v.astype(jnp.float32))
  nonempty = l > 0
  out = jnp.where(nonempty[..., None], out / jnp.where(nonempty, l, 1.0)[..., None], 0.0)
  lse = jnp.where(nonempty, m[..., 0] + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  to_q_order = lambda x: jnp.moveaxis(x.reshape(b, hkv, g, tq, *x.shape[3:]), 3, 1).reshape(b, tq, hq, *x.shape[3:])
  return to_q_order(out).astype(q.dtype), to_q_order(lse)


def select_chunks(q: jax.Array, k: jax.Array, lengths: jax.Array, *, chunk_size: int, top_k: int, window_chunks: int,
                  chunk_scores: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Chunk indices attended in top-k mode: [B, Hkv, 1 + window_chunks + top_k] int32, -1 = empty slot.

  Order: the sink chunk 0, the `window_chunks` most recent chunks (oldest first; the last one holds key
  n-1), then the `top_k` best other chunks by score (best first). Chunks are distinct. The score of a
  chunk is the mean query of the block (over rows and the q heads of the kv group) against the mean of
  the chunk's valid keys, unless `chunk_scores` [B, Hkv, n_chunks] is given (e.g. from cached chunk
  summaries; computing mean keys here reads all of K). Selection runs outside the kernels (lax.top_k
  does not lower inside Pallas).
  """
  b, tq, hq, d, s, hkv = _common.check_attention_inputs(q, k, k, lengths)
  _common.check_chunk_size(chunk_size, s)
  nc = s // chunk_size
  for name, val in (("top_k", top_k), ("window_chunks", window_chunks)):
    if not isinstance(val, int) or val < 0:
      raise ValueError(f"{name} must be a non-negative int, got {val!r}")
  if top_k > nc - 1:
    raise ValueError(f"top_k ({top_k}) exceeds the {nc - 1} non-sink chunks of kv_len {s} / chunk_size {chunk_size}")
  n = jnp.clip(lengths.astype(jnp.int32), 0, s)
  n_chunks = (n + chunk_size - 1) // chunk_size  # chunks holding at least one valid key
  sink = jnp.where(n > 0, 0, -1)[:, None, None]
  sink = jnp.broadcast_to(sink, (b, hkv, 1))
  win = n_chunks[:, None] - 1 - jnp.arange(window_chunks)[::-1]
  win = jnp.where(win >= 1, win, -1)  # chunk 0 is already the sink
  win = jnp.broadcast_to(win[:, None, :], (b, hkv, window_chunks))
  parts = [sink, win]
  if top_k:
    if chunk_scores is None:
      tok_valid = (jnp.arange(s)[None, :] < n[:, None]).reshape(b, nc, chunk_size)
      kc = k.astype(jnp.float32).reshape(b, nc, chunk_size, hkv, d)
      ksum = jnp.sum(jnp.where(tok_valid[..., None, None], kc, 0.0), axis=2)
      kmean = ksum / jnp.maximum(jnp.sum(tok_valid, axis=2), 1)[..., None, None]
      qmean = jnp.mean(q.astype(jnp.float32).reshape(b, tq, hkv, hq // hkv, d), axis=(1, 3))
      scores = jnp.einsum("bhd,bchd->bhc", qmean, kmean)
    else:
      if jnp.shape(chunk_scores) != (b, hkv, nc):
        raise ValueError(f"chunk_scores must have shape ({b}, {hkv}, {nc}), got {jnp.shape(chunk_scores)}")
      scores = jnp.asarray(chunk_scores, jnp.float32)
    cid = jnp.arange(nc)[None, :]
    candidate = (cid >= 1) & (cid < (n_chunks - window_chunks)[:, None])
    scores = jnp.where(candidate[:, None, :], scores, -jnp.inf)
    vals, top = lax.top_k(scores, top_k)
    parts.append(jnp.where(vals > -jnp.inf, top, -1))  # fewer candidates than top_k (or nan scores)
  return jnp.concatenate(parts, axis=-1).astype(jnp.int32)


def chunk_key_mask(chunk_idx: jax.Array, lengths: jax.Array, chunk_size: int, kv_len: int) -> jax.Array:
  """[B, Hkv, S] mask of the valid keys inside the selected chunks (indices assumed distinct)."""
  cid = jnp.arange(kv_len) // chunk_size
  in_sel = jnp.any(chunk_idx[..., None] == cid, axis=2)
  return in_sel & (jnp.arange(kv_len) < lengths[:, None, None])


def chunk_positions(chunk_idx: jax.Array, chunk_size: int) -> jax.Array:
  """Key position of every slot of the selected chunks: [B, Hkv, n_selected * chunk_size], -1 = empty."""
  pos = chunk_idx[..., None] * chunk_size + jnp.arange(chunk_size)
  pos = jnp.where(chunk_idx[..., None] >= 0, pos, -1)
  return pos.reshape(*chunk_idx.shape[:2], -1).astype(jnp.int32)


def gather_rows(x: jax.Array, positions: jax.Array) -> jax.Array:
  """x [B, S, Hkv, D], positions [B, Hkv, T] -> [B, T, Hkv, D]; empty slots (-1) read row 0."""
  b, s, hkv, _ = x.shape
  rows = jnp.clip(positions, 0, s - 1)
  out = x[jnp.arange(b)[:, None, None], rows, jnp.arange(hkv)[None, :, None]]  # [B, Hkv, T, D]
  return jnp.moveaxis(out, 1, 2)


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, chunk_idx: jax.Array,
                    chunk_size: int, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention over the selected chunks only, reading O(budget) keys: gathers them, then masks."""
  pos = chunk_positions(chunk_idx, chunk_size)
  key_mask = (pos >= 0) & (pos < lengths[:, None, None])
  return key_masked_attention(q, gather_rows(k, pos), gather_rows(v, pos), key_mask, scale)


def reference_length_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                                      rho: jax.typing.ArrayLike | None = None,
                                      alpha: jax.typing.ArrayLike | None = None, n0: float | None = None,
                                      sm_scale: float | None = None, top_k: int | None = None, chunk_size: int = 8,
                                      window_chunks: int = 1,
                                      chunk_scores: jax.typing.ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  """Reference for `length_masked_attention`: returns (out [B,Tq,Hq,D] in q.dtype, lse [B,Tq,Hq] f32)."""
  b, tq, hq, d, s, hkv = _common.check_attention_inputs(q, k, v, lengths)
  mode, param = _common.scale_params(rho, alpha, n0, b, hq)
  sm_scale = d ** -0.5 if sm_scale is None else sm_scale
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
  if top_k is None:
    key_mask = jnp.broadcast_to((jnp.arange(s)[None, :] < lengths[:, None])[:, None, :], (b, hkv, s))
  else:
    idx = select_chunks(q, k, lengths, chunk_size=chunk_size, top_k=top_k, window_chunks=window_chunks,
                        chunk_scores=chunk_scores)
    key_mask = chunk_key_mask(idx, lengths, chunk_size, s)
  n_visible = jnp.sum(key_mask, axis=-1)
  return key_masked_attention(q, k, v, key_mask, head_scales(mode, param, n_visible, n0, sm_scale))


def head_scales(mode: str, param: jax.Array, n_visible: jax.Array, n0: float | None, sm_scale: float) -> jax.Array:
  """sm_scale * rho per (sequence, q head); param [B, Hq], n_visible [B, Hkv] keys each kv head attends."""
  if mode == _common.SCALE_GIVEN:
    return sm_scale * param
  g = param.shape[1] // n_visible.shape[1]
  return sm_scale * sharpdraft_rho(jnp.repeat(n_visible, g, axis=1), param, n0)


def reference_merge_attention_views(outs: Sequence[jax.Array],
                                    lses: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Merges attention over disjoint key sets: outs [..., D] and lses [...] per view -> (out, lse).

  Exact: equals attention over the union of the views' keys. Views with lse = -inf (no keys) weigh 0.
  """
  if len(outs) != len(lses) or not outs:
    raise ValueError(f"need the same, non-zero number of outputs and lses, got {len(outs)} and {len(lses)}")
  for o, l in zip(outs, lses):
    if o.shape[:-1] != l.shape or o.shape != outs[0].shape:
      raise ValueError(f"each view needs out [..., D] and lse [...] of matching shapes, got {o.shape} and {l.shape}")
  out, lse = _common.merge_by_lse(jnp.stack(outs), jnp.stack(lses), axis=0)
  return out.astype(outs[0].dtype), lse

