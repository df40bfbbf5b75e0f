"""TPU (Mosaic) sparse KV gather: HBM -> HBM DMAs of the selected chunks, no VMEM round trip.

Grid (B, Hkv). Chunk indices come by scalar prefetch; every copy moves one chunk of one head
([chunk, 1, D], strided in the cache layout). At most `chunks_per_step` copies per tensor are in
flight: copy i starts after copy i - depth has been waited for. Empty slots (-1) copy chunk 0 and are
zeroed by the caller (a DMA has no source of zeros).
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


def _kernel(idx_ref, k_hbm, v_hbm, k_out, v_out, sems, *, kv_heads, n_sel, chunk, n_chunks, depth):
  b, h = pl.program_id(0), pl.program_id(1)
  base = (b * kv_heads + h) * n_sel

  def copies(i):
    cid = jnp.clip(idx_ref[base + i], 0, n_chunks - 1)
    src, dst = pl.ds(cid * chunk, chunk), pl.ds(i * chunk, chunk)
    heads = pl.ds(h, 1)
    return (pltpu.make_async_copy(k_hbm.at[b, src, heads], k_out.at[b, dst, heads], sems.at[0]),
            pltpu.make_async_copy(v_hbm.at[b, src, heads], v_out.at[b, dst, heads], sems.at[1]))

  def wait(i):
    # Copies are the same size, so any descriptor waits for one of them.
    for c in copies(i):
      c.wait()

  def issue(i, carry):
    pl.when(i >= depth)(lambda: wait(i - depth))
    for c in copies(i):
      c.start()
    return carry

  def drain(i, carry):
    wait(i)
    return carry

  lax.fori_loop(0, n_sel, issue, 0)
  lax.fori_loop(max(n_sel - depth, 0), n_sel, drain, 0)


def gather_chunks(k: jax.Array, v: jax.Array, chunk_idx: jax.Array, *, chunk_size: int,
                  block_sizes: _common.BlockSizes = _common.TPU_BLOCK_SIZES,
                  interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """k, v [B,S,Hkv,D], chunk_idx [B,Hkv,n_sel] -> (k_sel, v_sel) [B, n_sel*chunk, Hkv, D]; empty slots hold
  chunk 0 (the dispatcher zeroes them)."""
  bsz, s, hkv, d = k.shape
  n_sel = chunk_idx.shape[-1]
  kernel = functools.partial(_kernel, kv_heads=hkv, n_sel=n_sel, chunk=chunk_size, n_chunks=s // chunk_size,
                             depth=min(block_sizes.chunks_per_step, n_sel))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out_shape = jax.ShapeDtypeStruct((bsz, n_sel * chunk_size, hkv, d), k.dtype)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(bsz, hkv),
          in_specs=[any_spec, any_spec],
          out_specs=[any_spec, any_spec],
          scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
      ),
      out_shape=[out_shape, out_shape],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=_common.tpu_interpret(interpret),
      name="sparse_kv_gather_tpu",
  )(chunk_idx.astype(jnp.int32).reshape(-1), k, v)
