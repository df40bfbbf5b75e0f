"""Distillation losses against the teacher's top-k soft labels, checked against sums written out by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.training.losses import topk_distillation


def _case():
  # Student over 4 tokens; teacher keeps its top 2 (tokens 2 and 0) with probabilities 0.6 and 0.3.
  q = np.array([0.1, 0.2, 0.4, 0.3])
  logits = jnp.log(jnp.asarray(q))[None]
  ids = jnp.asarray([[2, 0]])
  logp = jnp.log(jnp.asarray([[0.6, 0.3]]))
  return logits, ids, logp


def test_kl_by_hand():
  logits, ids, logp = _case()
  # p = (0.6, 0.3, rest 0.1), q = (0.4, 0.1, rest 0.5)
  want = 0.6 * math.log(0.6 / 0.4) + 0.3 * math.log(0.3 / 0.1) + 0.1 * math.log(0.1 / 0.5)
  loss, total = topk_distillation(logits, ids, logp, "kl")
  assert float(loss) == pytest.approx(want, rel=1e-5) and float(total) == 1.0


def test_tv_by_hand():
  logits, ids, logp = _case()
  want = 0.5 * (abs(0.6 - 0.4) + abs(0.3 - 0.1) + abs(0.1 - 0.5))
  assert float(topk_distillation(logits, ids, logp, "tv")[0]) == pytest.approx(want, rel=1e-5)


def test_hard_is_ce_on_the_teacher_argmax():
  logits, ids, logp = _case()
  assert float(topk_distillation(logits, ids, logp, "hard")[0]) == pytest.approx(-math.log(0.4), rel=1e-5)


def test_zero_when_the_student_is_the_teacher_and_weights():
  q = np.array([0.1, 0.2, 0.4, 0.3])
  logits = jnp.log(jnp.asarray(np.stack([q, q[::-1]])))
  ids = jnp.asarray([[2, 3], [0, 1]])
  logp = jnp.log(jnp.asarray([[0.4, 0.3], [0.3, 0.4]]))
  for kind in ("kl", "tv"):
    assert float(topk_distillation(logits, ids, logp, kind)[0]) == pytest.approx(0.0, abs=1e-6)
  # Weights pick rows: only the second row (a mismatch) counts.
  bad_ids = jnp.asarray([[2, 3], [2, 3]])
  w = jnp.asarray([0.0, 1.0])
  loss, total = topk_distillation(logits, bad_ids, jnp.log(jnp.asarray([[0.4, 0.3], [0.4, 0.3]])), "tv", w)
  want = 0.5 * (abs(0.4 - 0.2) + abs(0.3 - 0.1) + abs(0.3 - 0.7))
  assert float(total) == 1.0 and float(loss) == pytest.approx(want, rel=1e-5)
  with pytest.raises(ValueError, match="must be one of"):
    topk_distillation(logits, ids, logp, "js")


def test_masked_teacher_tokens_join_the_rest_on_both_sides():
  logits, ids, logp = _case()
  # Token 0 (p 0.3, q 0.1) cannot be produced: p = (0.6, rest 0.4), q = (0.4, rest 0.6).
  mask = jnp.asarray([[True, False]])
  want = 0.6 * math.log(0.6 / 0.4) + 0.4 * math.log(0.4 / 0.6)
  assert float(topk_distillation(logits, ids, logp, "kl", topk_mask=mask)[0]) == pytest.approx(want, rel=1e-5)
  want_tv = 0.5 * (abs(0.6 - 0.4) + abs(0.4 - 0.6))
  assert float(topk_distillation(logits, ids, logp, "tv", topk_mask=mask)[0]) == pytest.approx(want_tv, rel=1e-5)
