"""Pallas kernels for drafter attention: length-masked (or top-k chunk) attention and sparse KV gather.

Each kernel has a jnp reference, a TPU (Mosaic) and a GPU (Triton) kernel, and a dispatcher that picks by
`jax.default_backend()` and falls back to the reference on CPU (see docs/kernels.md).
"""

from longspec_jax import check_namespaced

check_namespaced(__name__)

from longspec_jax.pallas_kernels._common import BlockSizes, check_lowering, num_selected_chunks  # noqa: E402
from longspec_jax.pallas_kernels.length_masked_attention import (  # noqa: E402  (after the namespace check)
    chunk_positions,
    merge_attention_views,
    length_masked_attention,
    reference_length_masked_attention,
    select_chunks,
    sharpdraft_rho,
)
from longspec_jax.pallas_kernels.sparse_kv_gather import (  # noqa: E402
    gather_kv_chunks,
    reference_gather_kv_chunks,
    reference_sparse_chunk_attention,
    sparse_chunk_attention,
)

__all__ = [
    "BlockSizes",
    "check_lowering",
    "chunk_positions",
    "gather_kv_chunks",
    "merge_attention_views",
    "num_selected_chunks",
    "length_masked_attention",
    "reference_gather_kv_chunks",
    "reference_length_masked_attention",
    "reference_sparse_chunk_attention",
    "select_chunks",
    "sharpdraft_rho",
    "sparse_chunk_attention",
]
