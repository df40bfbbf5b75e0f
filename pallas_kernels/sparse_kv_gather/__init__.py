"""Sparse KV gather (BudgetDraft-style drafter caches) and attention over selected chunks by index.

`gather_kv_chunks` copies the selected chunks of a large cache into a compact, fixed-size budget buffer.
`sparse_chunk_attention` attends over the selected chunks directly, reading them by index inside the
kernel (scalar-prefetched block indices on TPU, gathered row pointers on GPU) without building that buffer.
Both pick the kernel by `jax.default_backend()` and fall back to the jnp reference on CPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from longspec_jax.pallas_kernels import _common
from longspec_jax.pallas_kernels._common import BlockSizes, GPU_BLOCK_SIZES, TPU_BLOCK_SIZES, num_selected_chunks
from longspec_jax.pallas_kernels.length_masked_attention import chunk_positions, run_attention
from longspec_jax.pallas_kernels.sparse_kv_gather import gpu, tpu
from longspec_jax.pallas_kernels.sparse_kv_gather.reference import (
    check_gather_inputs,
    reference_gather_kv_chunks,
    reference_sparse_chunk_attention,
)

__all__ = [
    "BlockSizes",
    "chunk_positions",
    "gather_kv_chunks",
    "num_selected_chunks",
    "reference_gather_kv_chunks",
    "reference_sparse_chunk_attention",
    "sparse_chunk_attention",
]


def gather_kv_chunks(k: jax.Array, v: jax.Array, chunk_idx: jax.Array, *, chunk_size: int,
                     block_sizes: BlockSizes | None = None, impl: str = "auto",
                     interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """Gathers selected chunks of K and V into a compact buffer: (k_sel, v_sel) [B, n_sel*chunk_size, Hkv, D].

  k, v [B, S, Hkv, D] (S a multiple of chunk_size); chunk_idx [B, Hkv, n_sel] int, n_sel static
  (= num_selected_chunks(budget, chunk_size)), -1 marks an empty slot, which comes back as zeros. Slot t
  of head h holds key position chunk_positions(chunk_idx, chunk_size)[b, h, t] (-1 when empty).
  impl: "auto" | "reference" | "tpu" | "gpu"; interpret=True runs a kernel in Pallas interpret mode.
  """
  check_gather_inputs(k, v, chunk_idx, chunk_size)
  gpu_reason = gpu.unsupported_reason(head_dim=k.shape[-1], chunk_size=chunk_size,
                                      block_sizes=block_sizes or GPU_BLOCK_SIZES)
  impl = _common.resolve_impl(impl, None, gpu_reason)
  if impl == "reference":
    return reference_gather_kv_chunks(k, v, chunk_idx, chunk_size=chunk_size)
  if impl == "gpu":
    return gpu.gather_chunks(k, v, chunk_idx, chunk_size=chunk_size, block_sizes=block_sizes or GPU_BLOCK_SIZES,
                             interpret=interpret)
  k_sel, v_sel = tpu.gather_chunks(k, v, chunk_idx, chunk_size=chunk_size,
                                   block_sizes=block_sizes or TPU_BLOCK_SIZES, interpret=interpret)
  empty = jnp.moveaxis(chunk_positions(chunk_idx, chunk_size) < 0, 1, 2)[..., None]
  return jnp.where(empty, 0, k_sel).astype(k.dtype), jnp.where(empty, 0, v_sel).astype(v.dtype)


def sparse_chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.typing.ArrayLike,
                           chunk_idx: jax.typing.ArrayLike, *, chunk_size: int,
                           rho: jax.typing.ArrayLike | None = None, alpha: jax.typing.ArrayLike | None = None,
                           n0: float | None = None, sm_scale: float | None = None,
                           block_sizes: BlockSizes | None = None, impl: str = "auto",
                           interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """Attention over the valid keys (< lengths[b]) of the selected chunks, read by index from the full cache.

  q [B, Tq, Hq, D]; k, v [B, S, Hkv, D]; chunk_idx [B, Hkv, n_sel] (-1 = empty; indices should be
  distinct: a repeated chunk is attended twice). Query scaling as in `length_masked_attention` (rho
  given, or alpha/n0 with n = valid selected keys). Returns (out [B,Tq,Hq,D], lse [B,Tq,Hq] f32).
  """
  b, _, hq, d, s, hkv = _common.check_attention_inputs(q, k, v, lengths)
  _common.check_chunk_size(chunk_size, s)
  _common.check_chunk_idx(chunk_idx, b, hkv)
  mode, param = _common.scale_params(rho, alpha, n0, b, hq)
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s)
  return run_attention(impl, q, k, v, lengths, mode=mode, param=param, n0=n0,
                       sm_scale=d ** -0.5 if sm_scale is None else sm_scale, chunk_idx=jnp.asarray(chunk_idx),
                       chunk_size=chunk_size, block_sizes=block_sizes, interpret=interpret)
