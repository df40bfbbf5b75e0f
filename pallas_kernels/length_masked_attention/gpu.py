"""GPU (Pallas Triton) kernel: a few query rows per kv head against a long KV set, dense or by chunk index.

Grid (B, Hkv, num_splits): each program walks its share of the key steps with an online softmax and
writes a partial output and log-sum-exp; the splits are merged by log-sum-exp afterwards (flash-decoding),
so a small batch still fills the GPU. Keys are read with gathered row pointers straight from the cache
layout [B, S, Hkv, D]: contiguous rows in dense mode, the selected chunks' rows in indexed mode, so the
sparse variant never materialises the gather. Triton wants power-of-two tiles of at least 16 for dot:
query rows are padded to that; head_dim and the rows per step must already be powers of two.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from longspec_jax.pallas_kernels import _common

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_MIN_DOT = 16


def chunks_per_step(chunk_size: int, block_sizes: _common.BlockSizes) -> int:
  """Chunks read per loop step: at least enough for a 16-row dot."""
  return max(block_sizes.chunks_per_step, -(-_MIN_DOT // chunk_size))


def unsupported_reason(*, head_dim: int, dtype: jax.typing.DTypeLike, chunk_size: int | None,
                       block_sizes: _common.BlockSizes) -> str | None:
  if jnp.dtype(dtype) not in [jnp.dtype(t) for t in _DTYPES]:
    return f"dtype {jnp.dtype(dtype)} (supported: float32, bfloat16, float16)"
  if not _common.is_power_of_2(head_dim) or head_dim < _MIN_DOT:
    return f"head_dim {head_dim} is not a power of two >= {_MIN_DOT}"
  if chunk_size is None:
    if not _common.is_power_of_2(block_sizes.block_kv) or block_sizes.block_kv < _MIN_DOT:
      return f"block_kv {block_sizes.block_kv} is not a power of two >= {_MIN_DOT}"
  elif not _common.is_power_of_2(chunk_size) or not _common.is_power_of_2(block_sizes.chunks_per_step):
    return f"chunk_size {chunk_size} and chunks_per_step {block_sizes.chunks_per_step} must be powers of two"
  return None


def _kernel(lengths_ref, nvis_ref, q_ref, param_ref, k_ref, v_ref, *rest, step_rows, chunk, steps_per_split,
            num_steps, mode, n0, sm_scale):
  indexed = chunk is not None
  if indexed:
    idx_ref, o_ref, lse_ref = rest
  else:
    o_ref, lse_ref = rest
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kv_len = k_ref.shape[0]
  n = lengths_ref[b]
  q = q_ref[...]
  param = param_ref[...]
  if mode == _common.SCALE_GIVEN:
    scale = sm_scale * param
  else:
    n_vis = jnp.maximum(nvis_ref[b, h], 1).astype(jnp.float32)
    scale = sm_scale * jnp.maximum(1.0, 1.0 + param * jnp.log(n_vis / n0))
  col = jnp.arange(step_rows, dtype=jnp.int32)

  def body(i, carry):
    acc, m_prev, l_prev = carry
    if indexed:
      cid = idx_ref[i * (step_rows // chunk) + col // chunk]  # gathered chunk index per key row
      pos = jnp.where(cid >= 0, cid * chunk + col % chunk, -1)
      valid = (pos >= 0) & (pos < n)
    else:
      pos = i * step_rows + col
      valid = pos < n
    rows = jnp.clip(pos, 0, kv_len - 1)
    k = k_ref[rows, :]
    v = v_ref[rows, :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(valid[None, :], s * scale[:, None], _common.MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m_prev - m_new)
    acc = corr[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, corr * l_prev + jnp.sum(p, axis=1)

  lo = split * steps_per_split
  hi = jnp.minimum(lo + steps_per_split, num_steps)
  if not indexed:
    hi = jnp.minimum(hi, (n + step_rows - 1) // step_rows)  # no work past the sequence length
  r, d = q.shape
  init = (jnp.zeros((r, d), jnp.float32), jnp.full((r,), _common.MASK_VALUE, jnp.float32),
          jnp.zeros((r,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty[:, None], acc / safe_l[:, None], 0.0)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)


def attention_rows(q_rows: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, param_rows: jax.Array,
                   n_visible: jax.Array, *, mode: str, n0: float | None, sm_scale: float,
                   chunk_idx: jax.Array | None = None, chunk_size: int | None = None,
                   block_sizes: _common.BlockSizes = _common.GPU_BLOCK_SIZES,
                   interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """Same contract as the TPU `attention_rows`: -> (out [B,Hkv,R,D] in q dtype, lse [B,Hkv,R] f32)."""
  bsz, hkv, r, d = q_rows.shape
  s = k.shape[1]
  rp = max(_MIN_DOT, _common.next_power_of_2(r))
  q_pad = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rp - r), (0, 0)))
  param_pad = jnp.pad(param_rows.astype(jnp.float32), ((0, 0), (0, 0), (0, rp - r)))
  inputs = [lengths.astype(jnp.int32), n_visible.astype(jnp.int32), q_pad, param_pad, k, v]
  if chunk_idx is None:
    step_rows, num_steps = block_sizes.block_kv, pl.cdiv(s, block_sizes.block_kv)
  else:
    m = chunks_per_step(chunk_size, block_sizes)
    step_rows, num_steps = m * chunk_size, pl.cdiv(chunk_idx.shape[-1], m)
    inputs.append(jnp.pad(chunk_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, num_steps * m - chunk_idx.shape[-1])),
                          constant_values=-1))
  splits = min(block_sizes.num_splits, num_steps)
  steps_per_split = pl.cdiv(num_steps, splits)
  in_specs = [
      pl.BlockSpec((bsz,), lambda b, h, sp: (0,)),
      pl.BlockSpec((bsz, hkv), lambda b, h, sp: (0, 0)),
      pl.BlockSpec((None, None, rp, d), lambda b, h, sp: (b, h, 0, 0)),
      pl.BlockSpec((None, None, rp), lambda b, h, sp: (b, h, 0)),
      pl.BlockSpec((None, s, None, d), lambda b, h, sp: (b, 0, h, 0)),
      pl.BlockSpec((None, s, None, d), lambda b, h, sp: (b, 0, h, 0)),
  ]
  if chunk_idx is not None:
    in_specs.append(pl.BlockSpec((None, None, inputs[-1].shape[-1]), lambda b, h, sp: (b, h, 0)))
  kernel = functools.partial(
      _kernel, step_rows=step_rows, chunk=chunk_size if chunk_idx is not None else None,
      steps_per_split=steps_per_split, num_steps=num_steps, mode=mode, n0=None if n0 is None else float(n0),
      sm_scale=float(sm_scale))
  out, lse = pl.pallas_call(
      kernel,
      grid=(bsz, hkv, splits),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, rp, d), lambda b, h, sp: (b, h, sp, 0, 0)),
                 pl.BlockSpec((None, None, None, rp), lambda b, h, sp: (b, h, sp, 0))],
      out_shape=[jax.ShapeDtypeStruct((bsz, hkv, splits, rp, d), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, hkv, splits, rp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="length_masked_attention_gpu",
  )(*inputs)
  out, lse = _common.merge_by_lse(out[:, :, :, :r], lse[:, :, :, :r], axis=2)
  return out.astype(q_rows.dtype), lse
