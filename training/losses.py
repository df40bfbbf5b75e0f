"""Losses shared by target and drafter training."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """Mean token CE. logits [..., V] (any float), targets [...] int, weights [...] (None = all ones).
  Returns (loss, total_weight)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  if weights is None:
    weights = jnp.ones_like(nll)
  total = jnp.sum(weights)
  return jnp.sum(nll * weights) / jnp.maximum(total, 1e-9), total


def per_token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


DISTILL_KINDS = ("kl", "tv", "hard")


def topk_distillation(logits: jax.Array, topk_ids: jax.Array, topk_logprobs: jax.Array, kind: str = "kl",
                      weights: jax.Array | None = None, topk_mask: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """Loss against a teacher's top-k next-token distribution (the distillation store's soft labels).

  logits [..., V] student; topk_ids / topk_logprobs [..., k] the teacher's k most likely tokens and their
  log-probabilities under its full softmax. The teacher's remaining mass 1 - sum(p_topk) is one "rest" outcome,
  compared with the student's mass outside those k tokens, so both sides are proper distributions over k + 1
  outcomes:
    kl   = sum_i p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)     (forward KL, teacher first)
    tv   = (sum_i |p_i - q_i| + |p_rest - q_rest|) / 2                          (total variation)
    hard = cross entropy against the teacher's argmax (topk_ids[..., 0])
  topk_mask [..., k] (None = all True): False moves that teacher token into the rest on both sides (a token the
  student cannot produce, e.g. outside a draft vocabulary; its id must still index `logits`).
  Returns (weighted mean loss, total weight), as `cross_entropy`."""
  if kind not in DISTILL_KINDS:
    raise ValueError(f"distillation loss must be one of {DISTILL_KINDS}, got {kind!r}")
  if kind == "hard":
    return cross_entropy(logits, topk_ids[..., 0], weights)
  logq_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  logq = jnp.take_along_axis(logq_all, topk_ids, axis=-1)
  logp = topk_logprobs.astype(jnp.float32)
  keep = jnp.ones(topk_ids.shape, bool) if topk_mask is None else topk_mask
  p, q = jnp.where(keep, jnp.exp(logp), 0.0), jnp.where(keep, jnp.exp(logq), 0.0)
  eps = 1e-9
  p_rest = jnp.clip(1.0 - p.sum(-1), 0.0, 1.0)
  q_rest = jnp.clip(1.0 - q.sum(-1), 0.0, 1.0)
  if kind == "kl":
    per_token = (jnp.sum(jnp.where(keep, p * (logp - logq), 0.0), -1)
                 + p_rest * (jnp.log(p_rest + eps) - jnp.log(q_rest + eps)))
  else:
    per_token = 0.5 * (jnp.sum(jnp.abs(p - q), -1) + jnp.abs(p_rest - q_rest))
  if weights is None:
    weights = jnp.ones_like(per_token)
  total = jnp.sum(weights)
  return jnp.sum(per_token * weights) / jnp.maximum(total, 1e-9), total
