"""Verification of a drafted block against the target's logits: greedy and lossless rejection sampling.

Greedy: accept drafts while they equal the target's argmax; the target's token at the first mismatch (or after
the last draft) is committed too. Sampling (Leviathan et al. / Chen et al.): accept draft i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from norm(max(p_i - q_i, 0)); if all K are accepted,
sample a bonus token from p_{K+1}. p and q are the *processed* distributions (temperature / top-k / top-p applied
identically), so the committed tokens follow the processed target distribution exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from longspec_jax.sampling import SamplingParams, processed_log_probs


def verify_greedy(target_logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """target_logits [B, K+1, V], drafts [B, K] -> (num_accepted [B], committed [B, K+1])."""
  target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
  match = (drafts == target_tokens[:, :-1]).astype(jnp.int32)
  num_accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
  # Up to num_accepted the drafts equal the target's tokens, so the target row is the committed block.
  return num_accepted, target_tokens


def verify_sampling(key: jax.Array, target_logits: jax.Array, drafts: jax.Array, draft_probs: jax.Array,
                    sp: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """Rejection sampling. draft_probs [B, K, V] are the drafter's processed probabilities q."""
  b, k1, v = target_logits.shape
  k = k1 - 1
  p = jnp.exp(processed_log_probs(target_logits, sp))  # [B, K+1, V]
  q = draft_probs.astype(jnp.float32)
  p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  key_accept, key_resample = jax.random.split(key)
  u = jax.random.uniform(key_accept, (b, k))
  accept = (u * q_d < p_d).astype(jnp.int32)
  num_accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
  # Residual distributions for every position; position K has q = 0 (the bonus samples from p).
  q_full = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)
  residual = jnp.maximum(p - q_full, 0.0)
  mass = residual.sum(-1, keepdims=True)
  residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p)  # p == q: any reject is measure-zero
  at_n = jnp.take_along_axis(residual, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  log_at_n = jnp.where(at_n > 0, jnp.log(jnp.where(at_n > 0, at_n, 1.0)), -jnp.inf)
  correction = jax.random.categorical(key_resample, log_at_n, axis=-1).astype(jnp.int32)
  pos = jnp.arange(k1)[None, :]
  drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
  committed = jnp.where(pos < num_accepted[:, None], drafts_ext, correction[:, None])
  return num_accepted, committed
