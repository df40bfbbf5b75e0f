"""Temperature / top-k / top-p as traced values, so changing them never recompiles. Greedy is temperature 0.

The same `processed_log_probs` is applied to target and drafter distributions in speculative sampling, which is
what makes rejection sampling exact for the processed target distribution.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

NEG_INF = -1e30


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [] float32; 0 = greedy
  top_k: jax.Array  # [] int32; 0 = off
  top_p: jax.Array  # [] float32; 1 = off

  @classmethod
  def make(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def _filter_top_k_top_p(scaled, sp: SamplingParams):
  """Masks `scaled` [..., V] outside top-k and the top-p nucleus (ties at a cutoff kept together)."""
  v = scaled.shape[-1]
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)
  kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, sorted_desc.shape[:-1])[..., None], axis=-1)
  scaled = jnp.where(scaled >= kth, scaled, NEG_INF)
  # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
  sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, NEG_INF)
  probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  keep_sorted = mass_before < sp.top_p
  cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled >= cutoff, scaled, NEG_INF)


def processed_log_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """logits [..., V] -> log-probabilities after temperature, top-k and top-p (masked entries -> NEG_INF)."""
  logits = logits.astype(jnp.float32)
  temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
  scaled = logits / temp
  # The sort over V costs more than a small model's decode step on CPU: run it only when a filter is on
  # (a runtime branch, so the parameters stay traced and changing them never recompiles).
  filtered = (sp.top_k > 0) | (sp.top_p < 1)
  scaled = jax.lax.cond(filtered, _filter_top_k_top_p, lambda x, _: x, scaled, sp)
  return jax.nn.log_softmax(scaled, axis=-1)


def sample_token(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """[B, V] logits -> [B] tokens: argmax when temperature == 0, else a sample of the processed distribution."""
  def sampled(logits):
    return jax.random.categorical(key, processed_log_probs(logits, sp), axis=-1).astype(jnp.int32)

  def greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  return jax.lax.cond(sp.temperature > 0, sampled, greedy, logits)
