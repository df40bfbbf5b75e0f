"""Rotary position embeddings with the HF rope types (default, linear, dynamic NTK, yarn, llama3)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.attention import materialize
from longspec_jax.config import ModelConfig, RopeConfig


def _yarn(r: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  factor = r.factor
  orig = r.original_max_position_embeddings

  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if r.attention_factor is not None:
    attn_factor = r.attention_factor
  elif r.mscale and r.mscale_all_dim:
    attn_factor = get_mscale(factor, r.mscale) / get_mscale(factor, r.mscale_all_dim)
  else:
    attn_factor = get_mscale(factor)

  def correction_dim(rot):
    return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

  low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
  if r.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  pos_freqs = r.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  extrapolation_weight = 1 - ramp
  inv = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
  return inv.astype(np.float32), float(attn_factor)


def _llama3(r: RopeConfig, dim: int) -> np.ndarray:
  inv = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  old = r.original_max_position_embeddings
  low_wav, high_wav = old / r.low_freq_factor, old / r.high_freq_factor
  wav = 2 * math.pi / inv
  scaled = np.where(wav > low_wav, inv / r.factor, inv)
  smooth = (old / wav - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
  smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
  medium = ~(wav < high_wav) & ~(wav > low_wav)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_frequencies(cfg: ModelConfig, max_position: int | jax.Array | None = None) -> tuple[jax.Array, float]:
  """Returns (inv_freq [head_dim/2], attention_scaling). `max_position` (traced ok) is only read by the dynamic
  NTK type, which like HF rescales its base from the largest position in the current forward."""
  r, dim = cfg.rope, cfg.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
  if r.rope_type == "default":
    return jnp.asarray(1.0 / r.theta ** exponents), 1.0
  if r.rope_type == "linear":
    return jnp.asarray(1.0 / r.theta ** exponents / r.factor), 1.0
  if r.rope_type == "yarn":
    inv, scale = _yarn(r, dim)
    return jnp.asarray(inv), scale
  if r.rope_type == "llama3":
    return jnp.asarray(_llama3(r, dim)), 1.0
  # dynamic NTK
  base_len = cfg.max_position_embeddings
  seq_len = jnp.maximum(jnp.asarray(max_position, jnp.float32) + 1, base_len)
  base = r.theta * ((r.factor * seq_len / base_len) - (r.factor - 1)) ** (dim / (dim - 2))
  return 1.0 / base ** jnp.asarray(exponents), 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scaling: float = 1.0) -> jax.Array:
  """x [B, T, H, D], positions [B, T] -> rotated x (HF rotate-half convention), computed in fp32."""
  # The angles on their own: fused into cos / sin, their product was contracted into an FMA in some programs and not
  # others, so a one-row and a many-row pass rotated alike rows differently (see `attention.materialize`).
  angles = materialize(positions[..., None].astype(jnp.float32) * inv_freq)  # [B, T, D/2]
  cos = (jnp.cos(angles) * scaling)[:, :, None, :]
  sin = (jnp.sin(angles) * scaling)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
