"""Pieces shared by the Pallas kernels: block sizes, input checks, row layout, backend choice, lowering check."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "tpu", "gpu")
SCALE_GIVEN = "given"
SCALE_FIXED_SLOPE = "fixed_slope"
# Finite mask value: with it, max() and exp() never see inf - inf inside the kernels.
MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the kernels.

  block_kv: keys per step in dense mode (TPU: rows of one VMEM block, lowered to a divisor of the key
    length; GPU: rows per loop iteration, a power of two >= 16).
  chunks_per_step: selected chunks read per step in indexed (sparse / top-k) mode; a selection that is
    not a multiple of it is padded with empty slots.
  num_splits: GPU only; programs per (sequence, kv head) that split the key range (flash-decoding),
    merged by log-sum-exp. Keeps the GPU busy when batch x kv heads is small.
  """

  block_kv: int = 512
  chunks_per_step: int = 16
  num_splits: int = 1

  def __post_init__(self):
    for f in dataclasses.fields(self):
      val = getattr(self, f.name)
      if not isinstance(val, int) or isinstance(val, bool) or val < 1:
        raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {val!r}")


TPU_BLOCK_SIZES = BlockSizes(block_kv=512, chunks_per_step=16, num_splits=1)
GPU_BLOCK_SIZES = BlockSizes(block_kv=64, chunks_per_step=8, num_splits=16)


def check_attention_inputs(q: jax.Array, k: jax.Array, v: jax.Array,
                           lengths: jax.typing.ArrayLike) -> tuple[int, int, int, int, int, int]:
  """Validates q [B,Tq,Hq,D], k/v [B,S,Hkv,D], lengths [B]; returns (B, Tq, Hq, D, S, Hkv)."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, q_len, q_heads, head_dim], got shape {q.shape}")
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(
        f"k and v must both be [batch, kv_len, kv_heads, head_dim] with equal shapes, got {k.shape} and {v.shape}")
  b, tq, hq, d = q.shape
  _, s, hkv, dk = k.shape
  if k.shape[0] != b:
    raise ValueError(f"batch mismatch: q has {b}, k/v have {k.shape[0]}")
  if dk != d:
    raise ValueError(f"head_dim mismatch: q has {d}, k/v have {dk}")
  if hq % hkv:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv}) for grouped-query attention")
  if tq < 1 or s < 1:
    raise ValueError(f"need at least one query row and one key, got q_len={tq}, kv_len={s}")
  if jnp.shape(lengths) != (b,):
    raise ValueError(f"lengths must have shape ({b},), got {jnp.shape(lengths)}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise ValueError(f"lengths must be integers, got {jnp.result_type(lengths)}")
  return b, tq, hq, d, s, hkv


def check_chunk_idx(chunk_idx: jax.typing.ArrayLike, batch: int, kv_heads: int) -> int:
  """Validates chunk indices [B, Hkv, n_selected]; returns n_selected."""
  shape = jnp.shape(chunk_idx)
  if len(shape) != 3 or shape[:2] != (batch, kv_heads):
    raise ValueError(f"chunk_idx must have shape ({batch}, {kv_heads}, n_selected), got {shape}")
  if not jnp.issubdtype(jnp.result_type(chunk_idx), jnp.integer):
    raise ValueError(f"chunk_idx must be integers, got {jnp.result_type(chunk_idx)}")
  if shape[2] < 1:
    raise ValueError("chunk_idx must select at least one chunk")
  return shape[2]


def check_chunk_size(chunk_size: int, kv_len: int) -> None:
  if not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
  if kv_len % chunk_size:
    raise ValueError(f"kv_len ({kv_len}) must be a multiple of chunk_size ({chunk_size})")


def num_selected_chunks(budget: int, chunk_size: int) -> int:
  """Static number of chunks that fit a KV budget (budget // chunk_size)."""
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}")
  if budget < chunk_size:
    raise ValueError(f"budget ({budget}) is smaller than one chunk ({chunk_size})")
  return budget // chunk_size


def scale_params(rho: jax.typing.ArrayLike | None, alpha: jax.typing.ArrayLike | None, n0: float | None, batch: int,
                 q_heads: int) -> tuple[str, jax.Array]:
  """Returns (mode, per-(sequence, q head) parameter [B, Hq] f32): rho itself, or alpha for the fixed slope."""
  if rho is not None and alpha is not None:
    raise ValueError("pass either rho (given scales) or alpha (fixed-slope rule), not both")
  if alpha is not None:
    if n0 is None or not float(n0) > 0:
      raise ValueError(f"the fixed-slope rule needs n0 > 0 (trained key count), got {n0!r}")
    mode, param = SCALE_FIXED_SLOPE, alpha
  else:
    mode, param = SCALE_GIVEN, 1.0 if rho is None else rho
  param = jnp.asarray(param, jnp.float32)
  try:
    param = jnp.broadcast_to(param, (batch, q_heads))
  except ValueError:
    name = "alpha" if mode == SCALE_FIXED_SLOPE else "rho"
    raise ValueError(
        f"{name} must broadcast to (batch, q_heads) = ({batch}, {q_heads}), got shape {param.shape}") from None
  return mode, param


def to_rows(x: jax.Array, kv_heads: int) -> jax.Array:
  """[B, Tq, Hq, ...] -> [B, Hkv, Tq*G, ...]: the query rows that share one kv head become one block."""
  b, tq, hq = x.shape[:3]
  g = hq // kv_heads
  x = x.reshape(b, tq, kv_heads, g, *x.shape[3:])
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(b, kv_heads, tq * g, *x.shape[4:])


def from_rows(x: jax.Array, q_len: int) -> jax.Array:
  """Inverse of to_rows: [B, Hkv, Tq*G, ...] -> [B, Tq, Hq, ...]."""
  b, hkv, r = x.shape[:3]
  g = r // q_len
  x = x.reshape(b, hkv, q_len, g, *x.shape[3:])
  x = jnp.moveaxis(x, 1, 2)
  return x.reshape(b, q_len, hkv * g, *x.shape[4:])


def merge_by_lse(outs: jax.Array, lses: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Merges attention results stacked on `axis` by their log-sum-exp (outs has one more trailing dim)."""
  lses = lses.astype(jnp.float32)
  m = jnp.max(lses, axis=axis, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # all views empty: keep weights at exp(-inf) = 0, not nan
  w = jnp.exp(lses - m)
  total = jnp.sum(w, axis=axis, keepdims=True)
  out = jnp.sum(outs.astype(jnp.float32) * w[..., None], axis=axis)
  total = jnp.squeeze(total, axis)
  nonempty = total > 0
  out = jnp.where(nonempty[..., None], out / jnp.where(nonempty, total, 1.0)[..., None], 0.0)
  lse = jnp.where(nonempty, jnp.squeeze(m, axis) + jnp.log(jnp.where(nonempty, total, 1.0)), -jnp.inf)
  return out, lse


def resolve_impl(impl: str, tpu_reason: str | None, gpu_reason: str | None) -> str:
  """Picks the implementation. An explicit kernel that cannot take the inputs is an error; auto falls back."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "tpu" and tpu_reason:
    raise ValueError(f"the TPU kernel does not support these inputs: {tpu_reason}")
  if impl == "gpu" and gpu_reason:
    raise ValueError(f"the GPU kernel does not support these inputs: {gpu_reason}")
  if impl != "auto":
    return impl
  backend = jax.default_backend()
  if backend == "tpu" and not tpu_reason:
    return "tpu"
  if backend == "gpu" and not gpu_reason:
    return "gpu"
  return "reference"


def tpu_interpret(interpret: Any) -> Any:
  """True -> TPU interpret mode (simulates VMEM, DMAs, semaphores); an InterpretParams passes through."""
  if interpret is True:
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return interpret


def is_power_of_2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def next_power_of_2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def check_lowering(fn: Callable[..., Any], platform: str, *args: Any) -> jax.export.Exported:
  """Exports jit(fn) for `platform` ("tpu" or "cuda") from any host; raises if a kernel does not lower.

  args are jax.ShapeDtypeStruct (or arrays). Triton custom calls carry no serialization-compatibility
  guarantee, so that one safety check is disabled; the kernel is still fully lowered to Triton IR.
  """
  disabled = []
  if platform in ("cuda", "rocm"):
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(*args)
