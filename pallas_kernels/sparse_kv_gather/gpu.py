"""GPU (Pallas Triton) sparse KV gather: each program copies `chunks_per_step` selected chunks of one head.

Grid (B, Hkv, steps). Rows are read with gathered pointers from the cache layout and written to the
compact buffer; empty slots (-1) are written as zeros. Triton tiles must be powers of two, so the chunk
size, chunks_per_step and head_dim must be.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from longspec_jax.pallas_kernels import _common


def unsupported_reason(*, head_dim: int, chunk_size: int, block_sizes: _common.BlockSizes) -> str | None:
  for name, val in (("head_dim", head_dim), ("chunk_size", chunk_size),
                    ("chunks_per_step", block_sizes.chunks_per_step)):
    if not _common.is_power_of_2(val):
      return f"{name} {val} is not a power of two"
  return None


def _kernel(idx_ref, k_ref, v_ref, k_out, v_out, *, chunk, per_step):
  step = pl.program_id(2)
  rows = per_step * chunk
  col = jnp.arange(rows, dtype=jnp.int32)
  cid = idx_ref[step * per_step + col // chunk]
  valid = cid >= 0
  src = jnp.clip(jnp.where(valid, cid * chunk + col % chunk, 0), 0, k_ref.shape[0] - 1)
  dst = pl.ds(step * rows, rows)
  k_out[dst, :] = jnp.where(valid[:, None], k_ref[src, :], 0)
  v_out[dst, :] = jnp.where(valid[:, None], v_ref[src, :], 0)


def gather_chunks(k: jax.Array, v: jax.Array, chunk_idx: jax.Array, *, chunk_size: int,
                  block_sizes: _common.BlockSizes = _common.GPU_BLOCK_SIZES,
                  interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """k, v [B,S,Hkv,D], chunk_idx [B,Hkv,n_sel] -> (k_sel, v_sel) [B, n_sel*chunk, Hkv, D], empty slots zero."""
  bsz, s, hkv, d = k.shape
  n_sel = chunk_idx.shape[-1]
  per_step = min(block_sizes.chunks_per_step, _common.next_power_of_2(n_sel))
  steps = pl.cdiv(n_sel, per_step)
  idx = jnp.pad(chunk_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, steps * per_step - n_sel)), constant_values=-1)
  padded_rows = steps * per_step * chunk_size
  cache_spec = pl.BlockSpec((None, s, None, d), lambda b, h, i: (b, 0, h, 0))
  out_spec = pl.BlockSpec((None, padded_rows, None, d), lambda b, h, i: (b, 0, h, 0))
  out_shape = jax.ShapeDtypeStruct((bsz, padded_rows, hkv, d), k.dtype)
  k_sel, v_sel = pl.pallas_call(
      functools.partial(_kernel, chunk=chunk_size, per_step=per_step),
      grid=(bsz, hkv, steps),
      in_specs=[pl.BlockSpec((None, None, idx.shape[-1]), lambda b, h, i: (b, h, 0)), cache_spec, cache_spec],
      out_specs=[out_spec, out_spec],
      out_shape=[out_shape, out_shape],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="sparse_kv_gather_gpu",
  )(idx, k, v)
  return k_sel[:, :n_sel * chunk_size], v_sel[:, :n_sel * chunk_size]
