"""Draft length chosen per step: among a few sizes compiled once (0 = a plain decode step), the one with the most
expected committed tokens per unit of step cost, from running estimates of the drafter's acceptance rate.

Model. With per-draft acceptance rate a (each draft accepted with probability a, given the ones before it were),
a step that verifies s drafts commits E(s) = 1 + a + ... + a^s tokens per sequence on average and costs C(s)
decode steps (AR's one-row step is 1): measured per size (`costs`, from `longspec calibrate-draft-length`), or by
default 1 + draft_cost * p * [s > 0] + row_cost * s, where p is the drafter's proposal-cost scale (1 for a learned
drafter's pass, 0 for a lookup in the token buffer). The rule picks argmax_s sum_b E_b(s) / C(s) over the batch's
active sequences: one size per step for the whole batch.

Draft classes. A drafter may sort its sequences, before it proposes, into classes whose acceptance differs
(`draft_classes` and `draft_class(ctx)`: prompt lookup by the length of the n-gram it matched, 0 = none). The
rule then keeps one rate per class. This is what makes bursty acceptance work: a lookup that matched 3 tokens is
usually right while one with no match is nearly always wrong, and a single average would turn it down between
repeats and up inside them too late. Each rate is an exponential moving average of the per-step estimate
a_hat = accepted / (accepted + rejections) over the active sequences of that class (a sequence that accepts all
s drafts saw no rejection), moved only by steps that verified drafts. After `probe_every` consecutive 0-size
steps, one step uses the smallest positive size, so a rate can recover.

Lossless: the size is a function of committed tokens and earlier steps only (the class, the rates, a counter),
and every size is an exact verification (greedy or rejection sampling), so the output distribution is the
target's whatever the sizes.

The default costs are round numbers from this CPU's SmolLM2-135M suite runs (a 9-row verify pass ~1.8 decode
steps, a learned drafter's proposal ~0.4); calibrated costs replace them per drafter and machine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DraftLengthRule:
  """Static (hashable): part of the engine's GenerationConfig."""
  sizes: tuple[int, ...]  # ascending, distinct, sizes[-1] = K; 0 allowed (a decode step)
  costs: tuple[float, ...] = ()  # measured step cost per size, in AR steps; () = the model below
  draft_cost: float = 0.4  # (no costs) a proposal's cost, in AR steps
  row_cost: float = 0.1  # (no costs) each verified draft row's extra cost, in AR steps
  initial_rate: float = 0.5  # the acceptance rate assumed before any step verified drafts
  decay: float = 0.8  # EMA weight of the old rate per step that verified drafts
  probe_every: int = 16  # after this many 0-size steps in a row, one step with the smallest positive size

  def __post_init__(self):
    s = self.sizes
    problems = []
    if not s or list(s) != sorted(set(s)) or s[0] < 0 or s[-1] < 1:
      problems.append(f"sizes must be ascending distinct integers >= 0 with a largest >= 1, got {list(s)}")
    if self.costs and (len(self.costs) != len(s) or min(self.costs) <= 0):
      problems.append(f"costs must be one positive number per size ({len(s)}), got {list(self.costs)}")
    if self.draft_cost < 0 or self.row_cost < 0:
      problems.append(f"draft_cost and row_cost must be >= 0, got {self.draft_cost}, {self.row_cost}")
    if not 0 <= self.initial_rate <= 1 or not 0 <= self.decay < 1:
      problems.append(f"need 0 <= initial_rate <= 1 and 0 <= decay < 1, got {self.initial_rate}, {self.decay}")
    if self.probe_every < 1:
      problems.append(f"probe_every must be >= 1, got {self.probe_every}")
    if problems:
      raise ValueError("; ".join(problems))

  @property
  def max_size(self) -> int:
    return self.sizes[-1]

  def step_costs(self, proposal_scale=1.0):
    """C(s) per size, in AR steps: the measured costs, else the model with the proposal cost scaled by
    `proposal_scale` (a float, or a traced [] array inside the loop)."""
    if self.costs:
      return jnp.asarray(self.costs, jnp.float32)
    s = jnp.asarray(self.sizes, jnp.float32)
    return 1.0 + self.draft_cost * proposal_scale * (s > 0) + self.row_cost * s


  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: dict) -> "DraftLengthRule":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - known)
    if unknown:
      raise ValueError(f"unknown draft-length rule keys {unknown}; expected some of {sorted(known)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in obj.items()})


def read_draft_length(value: str) -> "str | DraftLengthRule":
  """A draft_length given as text (CLI, suite method option): "fixed" / "auto" as they are, else the path of a
  rule JSON (calibrate-draft-length's file, or a bare rule)."""
  if value in ("fixed", "auto"):
    return value
  path = Path(value)
  if not path.is_file():
    raise FileNotFoundError(f"draft-length rule {path} not found (give fixed, auto, or a calibrate-draft-length "
                            "JSON)")
  try:
    obj = json.loads(path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"draft-length rule {path} is not JSON: {e}") from None
  return DraftLengthRule.from_json(obj.get("rule", obj))


def default_sizes(num_draft: int) -> tuple[int, ...]:
  """0, 1, 3 and K (those below K)."""
  return tuple(sorted({0, 1, 3, num_draft} & set(range(num_draft + 1))))


def expected_tokens(rate, sizes) -> jax.Array:
  """E(s) = sum_{i=0..s} rate^i for each size (the committed tokens of a step verifying s drafts)."""
  s = jnp.asarray(sizes, jnp.float32)
  r = jnp.clip(jnp.asarray(rate, jnp.float32), 0.0, 0.999)
  return (1.0 - r ** (s + 1.0)) / (1.0 - r)


def choose_size_index(rule: DraftLengthRule, row_rates, active, idle_steps, proposal_scale=1.0) -> jax.Array:
  """[] int32 index into rule.sizes for this step, from each sequence's rate (its class's) [B] over the active
  sequences [B]."""
  row_rates = jnp.asarray(row_rates, jnp.float32)
  tokens = jnp.sum(jnp.where(jnp.asarray(active)[:, None], expected_tokens(row_rates[:, None], rule.sizes), 0.0),
                   axis=0)
  best = jnp.argmax(tokens / rule.step_costs(proposal_scale)).astype(jnp.int32)
  if rule.sizes[0] != 0 or len(rule.sizes) == 1:
    return best
  probe = (best == 0) & (idle_steps >= rule.probe_every)
  return jnp.where(probe, 1, best)


def update_rates(rule: DraftLengthRule, rates, size, num_accepted, active, classes) -> jax.Array:
  """The per-class rates [C] after a step that verified `size` drafts ([] traced) and accepted num_accepted [B]
  on the active sequences [B] of classes [B]; a class with no active sequence, or a 0-size step, leaves its rate
  unchanged."""
  in_class = active[None, :] & (classes[None, :] == jnp.arange(rates.shape[0])[:, None])  # [C, B]
  n = jnp.sum(jnp.where(in_class, num_accepted[None, :], 0), axis=1).astype(jnp.float32)
  rejections = jnp.sum(in_class & (num_accepted < size)[None, :], axis=1).astype(jnp.float32)
  seen = (size > 0) & (n + rejections > 0)
  estimate = n / jnp.maximum(n + rejections, 1.0)
  return jnp.where(seen, rule.decay * rates + (1.0 - rule.decay) * estimate, rates)
