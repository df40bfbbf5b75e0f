"""TPU (Mosaic) kernel: a few query rows per kv head against a long KV set, dense or by chunk index.

Layout. K/V stay in the cache layout [B, S, Hkv, D], read as the free view [B, S, Hkv*D], so a block is
`rows x lanes` of contiguous memory. The lane width L of a block must be a multiple of 128 (or the whole
row): with D % 128 == 0 one block holds one head; otherwise it holds `hpb` heads and each query row is
zero outside its own head's D lanes, so q @ k^T picks out that head exactly and the output keeps only
those lanes (the wrapper slices them). Grid (B, Hkv, steps); the online-softmax state lives in VMEM.

Dense mode: step j reads keys [j*bk, (j+1)*bk); steps past the sequence length re-use the last block
index (no new DMA) and skip compute. Indexed mode: step j reads `m` selected chunks, each through its own
BlockSpec whose index map reads the chunk index from scalar-prefetched SMEM (as in splash attention).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from longspec_jax.pallas_kernels import _common

_DTYPES = (jnp.float32, jnp.bfloat16)


def heads_per_lane_block(head_dim: int, kv_heads: int) -> int:
  if head_dim % 128 == 0:
    return 1
  if 128 % head_dim == 0 and kv_heads % (128 // head_dim) == 0:
    return 128 // head_dim
  return kv_heads


def dense_block(kv_len: int, block_kv: int) -> int | None:
  """Rows per dense step: the whole key range if it fits, else the largest multiple of 8 dividing it."""
  if kv_len <= block_kv:
    return kv_len
  for bk in range(block_kv - block_kv % 8, 7, -8):
    if kv_len % bk == 0:
      return bk
  return None


def unsupported_reason(*, kv_len: int, dtype: jax.typing.DTypeLike, chunk_size: int | None,
                       block_sizes: _common.BlockSizes) -> str | None:
  if jnp.dtype(dtype) not in [jnp.dtype(t) for t in _DTYPES]:
    return f"dtype {jnp.dtype(dtype)} (supported: float32, bfloat16)"
  if chunk_size is None:
    if dense_block(kv_len, block_sizes.block_kv) is None:
      return f"kv_len {kv_len} has no multiple-of-8 divisor <= block_kv {block_sizes.block_kv}"
  elif chunk_size % 8:
    return f"chunk_size {chunk_size} is not a multiple of 8 (TPU sublane tiling)"
  return None


def _kernel(*refs, kv_heads, n_kv_refs, chunk, n_slots, mode, n0, sm_scale, dense_rows, num_steps):
  indexed = dense_rows is None
  n_prefetch = 3 if indexed else 2
  lengths_ref, nvis_ref = refs[0], refs[1]
  idx_ref = refs[2] if indexed else None
  q_ref, param_ref = refs[n_prefetch:n_prefetch + 2]
  k_refs = refs[n_prefetch + 2:n_prefetch + 2 + n_kv_refs]
  v_refs = refs[n_prefetch + 2 + n_kv_refs:n_prefetch + 2 + 2 * n_kv_refs]
  o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[n_prefetch + 2 + 2 * n_kv_refs:]
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n = lengths_ref[b]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _common.MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def step():
    if indexed:
      rows = n_kv_refs * chunk
      col = lax.broadcasted_iota(jnp.int32, (1, rows), 1)
      pos = jnp.full((1, rows), -1, jnp.int32)
      base = (b * kv_heads + h) * n_slots + j * n_kv_refs
      for t in range(n_kv_refs):
        cid = idx_ref[base + t]
        # Decide emptiness on the scalar; the vectors only see ints (position < 0 = empty slot).
        start = jnp.where(cid >= 0, (cid - t) * chunk, -(1 << 30))
        in_t = (col >= t * chunk) & (col < (t + 1) * chunk)
        pos = jnp.where(in_t, start + col, pos)
      if n_kv_refs == 1:
        k, v = k_refs[0][...], v_refs[0][...]
      else:
        # Chunks of 8 rows are half a packed bf16 tile; join them in f32, where 8 rows are a full tile.
        k = jnp.concatenate([r[...].astype(jnp.float32) for r in k_refs], axis=0).astype(k_refs[0].dtype)
        v = jnp.concatenate([r[...].astype(jnp.float32) for r in v_refs], axis=0).astype(v_refs[0].dtype)
    else:
      pos = j * dense_rows + lax.broadcasted_iota(jnp.int32, (1, dense_rows), 1)
      k, v = k_refs[0][...], v_refs[0][...]

    param = param_ref[...]  # [R, 1]
    if mode == _common.SCALE_GIVEN:
      scale = sm_scale * param
    else:
      n_vis = jnp.full(param.shape, jnp.maximum(nvis_ref[b * kv_heads + h], 1), jnp.int32).astype(jnp.float32)
      scale = sm_scale * jnp.maximum(1.0, 1.0 + param * jnp.log(n_vis / n0))
    s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    pos = jnp.broadcast_to(pos, s.shape)  # compare at full tile shape rather than broadcasting a bool row
    valid = (pos >= 0) & (pos < n)
    s = jnp.where(valid, s * scale, _common.MASK_VALUE)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m_prev - m_new)
    l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = corr * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_sc[...] = m_new

  if indexed:
    step()
  else:
    pl.when(j * dense_rows < n)(step)

  @pl.when(j == num_steps - 1)
  def _finish():
    l = l_sc[...]
    nonempty = l > 0
    safe_l = jnp.where(nonempty, l, 1.0)
    o_ref[...] = jnp.where(nonempty, acc_sc[...] / safe_l, 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(safe_l), -jnp.inf)


def attention_rows(q_rows: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, param_rows: jax.Array,
                   n_visible: jax.Array, *, mode: str, n0: float | None, sm_scale: float,
                   chunk_idx: jax.Array | None = None, chunk_size: int | None = None,
                   block_sizes: _common.BlockSizes = _common.TPU_BLOCK_SIZES,
                   interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """q_rows [B,Hkv,R,D], k/v [B,S,Hkv,D], lengths [B], param_rows [B,Hkv,R] (rho or alpha), n_visible
  [B,Hkv], chunk_idx [B,Hkv,nsel] or None -> (out [B,Hkv,R,D] in q dtype, lse [B,Hkv,R] f32)."""
  bsz, hkv, r, d = q_rows.shape
  s = k.shape[1]
  hpb = heads_per_lane_block(d, hkv)
  lanes = hpb * d
  seg = (jnp.arange(hkv) % hpb)[:, None] == jnp.arange(hpb)[None, :]  # [Hkv, hpb]: own lane segment
  q_pad = jnp.where(seg[None, :, None, :, None], q_rows[:, :, :, None, :], 0).reshape(bsz, hkv, r, lanes)
  k3 = k.reshape(bsz, s, hkv * d)
  v3 = v.reshape(bsz, s, hkv * d)
  lengths = lengths.astype(jnp.int32)
  prefetch = [lengths, n_visible.astype(jnp.int32).reshape(-1)]

  if chunk_idx is None:
    bk = dense_block(s, block_sizes.block_kv)
    num_steps, n_kv_refs, n_slots, chunk = s // bk, 1, 0, None

    def kv_map(b, h, j, lens, nvis):
      # lax.div, not //: floor division lowers through sign(), which needs the chip's info at lowering time.
      last = jnp.maximum(lax.div(lens[b] + bk - 1, bk) - 1, 0)
      return b, jnp.minimum(j, last), lax.div(h, hpb)

    kv_specs = [pl.BlockSpec((None, bk, lanes), kv_map)]
  else:
    chunk, nc = chunk_size, s // chunk_size
    nsel = chunk_idx.shape[-1]
    n_kv_refs = min(block_sizes.chunks_per_step, nsel)
    num_steps = pl.cdiv(nsel, n_kv_refs)
    n_slots = num_steps * n_kv_refs
    idx = jnp.pad(chunk_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, n_slots - nsel)), constant_values=-1)
    prefetch.append(idx.reshape(-1))
    bk = None

    def chunk_map(b, h, j, lens, nvis, idx_flat, t):
      cid = idx_flat[(b * hkv + h) * n_slots + j * n_kv_refs + t]
      return b, jnp.clip(cid, 0, nc - 1), lax.div(h, hpb)

    kv_specs = [pl.BlockSpec((None, chunk, lanes), functools.partial(chunk_map, t=t)) for t in range(n_kv_refs)]

  row_map = lambda b, h, j, *_: (b, h, 0, 0)
  kernel = functools.partial(
      _kernel, kv_heads=hkv, n_kv_refs=n_kv_refs, chunk=chunk, n_slots=n_slots, mode=mode,
      n0=None if n0 is None else float(n0), sm_scale=float(sm_scale), dense_rows=bk, num_steps=num_steps)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(bsz, hkv, num_steps),
          in_specs=[pl.BlockSpec((None, None, r, lanes), row_map), pl.BlockSpec((None, None, r, 1), row_map),
                    *kv_specs, *kv_specs],
          out_specs=[pl.BlockSpec((None, None, r, lanes), row_map), pl.BlockSpec((None, None, r, 1), row_map)],
          scratch_shapes=[pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                          pltpu.VMEM((r, lanes), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((bsz, hkv, r, lanes), q_rows.dtype),
                 jax.ShapeDtypeStruct((bsz, hkv, r, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=_common.tpu_interpret(interpret),
      name="length_masked_attention_tpu",
  )(*prefetch, q_pad, param_rows.astype(jnp.float32)[..., None], *([k3] * n_kv_refs), *([v3] * n_kv_refs))
  out = jnp.sum(jnp.where(seg[None, :, None, :, None], out.reshape(bsz, hkv, r, hpb, d), 0), axis=3)
  return out.astype(q_rows.dtype), lse[..., 0]
