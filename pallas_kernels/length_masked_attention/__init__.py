"""Length-masked (or top-k chunk) attention for drafters: a few query rows against the first `lengths` keys of a
long KV set, output + lse, so views over disjoint key sets merge exactly (`merge_attention_views`). The logits can
also be scaled in the kernel (`rho`, or SharpDraft's fixed slope with `alpha`); the drafters scale their queries
before instead (`SharpDraft.scale_queries`), so every caller there uses it unscaled.

`length_masked_attention` picks the kernel by `jax.default_backend()` (TPU Mosaic, GPU Triton) and falls
back to the jnp reference on CPU or for shapes a kernel does not take; `impl=` forces a choice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from longspec_jax.pallas_kernels import _common
from longspec_jax.pallas_kernels._common import BlockSizes, GPU_BLOCK_SIZES, TPU_BLOCK_SIZES
from longspec_jax.pallas_kernels.length_masked_attention import gpu, reference, tpu
from longspec_jax.pallas_kernels.length_masked_attention.reference import (
    chunk_positions,
    reference_merge_attention_views,
    reference_length_masked_attention,
    select_chunks,
    sharpdraft_rho,
)

__all__ = [
    "BlockSizes",
    "chunk_positions",
    "merge_attention_views",
    "length_masked_attention",
    "reference_merge_attention_views",
    "reference_length_masked_attention",
    "select_chunks",
    "sharpdraft_rho",
]

merge_attention_views = reference_merge_attention_views  # a few elementwise ops: XLA fuses them, no kernel


def unsupported_reasons(q: jax.Array, k: jax.Array, chunk_size: int | None,
                        block_sizes: BlockSizes | None) -> tuple[str | None, str | None]:
  """(TPU reason, GPU reason) why a kernel cannot take these inputs; None where it can."""
  return (
      tpu.unsupported_reason(kv_len=k.shape[1], dtype=k.dtype, chunk_size=chunk_size,
                             block_sizes=block_sizes or TPU_BLOCK_SIZES),
      gpu.unsupported_reason(head_dim=q.shape[-1], dtype=k.dtype, chunk_size=chunk_size,
                             block_sizes=block_sizes or GPU_BLOCK_SIZES),
  )


def run_attention(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, mode: str,
                  param: jax.Array, n0: float | None, sm_scale: float, chunk_idx: jax.Array | None = None,
                  chunk_size: int | None = None, block_sizes: BlockSizes | None = None,
                  interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """Attention over all valid keys (chunk_idx None) or the selected chunks, with the chosen implementation.

  Inputs are validated by the caller; lengths are clipped to [0, S]; param [B, Hq] is rho or alpha.
  """
  if q.dtype != k.dtype or k.dtype != v.dtype:
    raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, tq, s, hkv = q.shape[0], q.shape[1], k.shape[1], k.shape[2]
  if chunk_idx is None:
    n_visible = jnp.broadcast_to(lengths[:, None], (b, hkv))
  else:
    pos = chunk_positions(chunk_idx, chunk_size)
    n_visible = jnp.sum((pos >= 0) & (pos < lengths[:, None, None]), axis=-1)
  impl = _common.resolve_impl(impl, *unsupported_reasons(q, k, chunk_size, block_sizes))
  if impl == "reference":
    scale = reference.head_scales(mode, param, n_visible, n0, sm_scale)
    if chunk_idx is None:
      key_mask = jnp.broadcast_to((jnp.arange(s) < lengths[:, None])[:, None, :], (b, hkv, s))
      return reference.key_masked_attention(q, k, v, key_mask, scale)
    return reference.chunk_attention(q, k, v, lengths, chunk_idx, chunk_size, scale)
  kernel = tpu if impl == "tpu" else gpu
  blocks = block_sizes or (TPU_BLOCK_SIZES if impl == "tpu" else GPU_BLOCK_SIZES)
  param_rows = _common.to_rows(jnp.broadcast_to(param[:, None, :], (b, tq, q.shape[2])), hkv)
  out, lse = kernel.attention_rows(
      _common.to_rows(q, hkv), k, v, lengths, param_rows, n_visible, mode=mode, n0=n0, sm_scale=sm_scale,
      chunk_idx=chunk_idx, chunk_size=chunk_size, block_sizes=blocks, interpret=interpret)
  return _common.from_rows(out, tq), _common.from_rows(lse, tq)


def length_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.typing.ArrayLike, *,
                            rho: jax.typing.ArrayLike | None = None, alpha: jax.typing.ArrayLike | None = None,
                            n0: float | None = None, sm_scale: float | None = None, top_k: int | None = None,
                            chunk_size: int = 8, window_chunks: int = 1,
                            chunk_scores: jax.typing.ArrayLike | None = None, block_sizes: BlockSizes | None = None,
                            impl: str = "auto", interpret: Any = False) -> tuple[jax.Array, jax.Array]:
  """Attention over keys 0..lengths-1 (optionally logit-scaled); returns (out [B,Tq,Hq,D], lse [B,Tq,Hq] f32).

  q [B, Tq, Hq, D] (Tq = draft block, 1..16); k, v [B, S, Hkv, D] with Hq % Hkv == 0; lengths [B]: keys
  0..n-1 are valid. Logits are sm_scale (default D^-0.5) * rho * q.k with rho either given (`rho`,
  broadcast to [B, Hq], meant to be >= 1) or SharpDraft's fixed slope (`alpha` broadcast to [B, Hq],
  `n0` the trained key count): rho = max(1, 1 + alpha ln(n / n0)), n = keys the row attends.

  top_k=None attends every valid key. top_k=k attends only the sink chunk, the `window_chunks` most
  recent chunks and the k best-scoring other chunks of `chunk_size` keys (see `select_chunks`;
  `chunk_scores` [B, Hkv, S // chunk_size] overrides the mean-key scores). Rows with no visible key give
  out = 0, lse = -inf. K/V rows past the length are ignored but must be finite (0 * nan = nan).
  impl: "auto" | "reference" | "tpu" | "gpu"; interpret=True runs a kernel in Pallas interpret mode.
  """
  b, tq, hq, d, s, hkv = _common.check_attention_inputs(q, k, v, lengths)
  mode, param = _common.scale_params(rho, alpha, n0, b, hq)
  lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s)
  chunk_idx = None
  if top_k is not None:
    chunk_idx = select_chunks(q, k, lengths, chunk_size=chunk_size, top_k=top_k, window_chunks=window_chunks,
                              chunk_scores=chunk_scores)
  return run_attention(impl, q, k, v, lengths, mode=mode, param=param, n0=n0,
                       sm_scale=d ** -0.5 if sm_scale is None else sm_scale, chunk_idx=chunk_idx,
                       chunk_size=chunk_size if top_k is not None else None, block_sizes=block_sizes,
                       interpret=interpret)
