"""Losses shared by target and drafter training."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, weights=None):
  """Mean token CE. logits [..., V] (any float), targets [...] int, weights [...] (None = all ones).
  Returns (loss, total_weight)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  if weights is None:
    weights = jnp.ones_like(nll)
  total = jnp.sum(weights)
  return jnp.sum(nll * weights) / jnp.maximum(total, 1e-9), total


def per_token_nll(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
