"""Draft length chosen per step: among a few sizes compiled once (0 = a plain decode step), the one with the most
expected committed tokens per unit of step cost, from running estimates of the drafter's acceptance.

Model. Two rates: a, the chance that the first draft is accepted, and b, the chance that a draft is accepted given
the one before it was. A step that verifies s drafts then commits E(s) = 1 + a (1 + b + ... + b^(s-1)) tokens per
sequence on average and costs C(s) decode steps (AR's one-row step is 1): measured per size (`costs`, from
`longspec calibrate-draft-length`), or by default 1 + draft_cost * p * [s > 0] + row_cost * s, where p is the
drafter's proposal-cost scale (1 for a learned drafter's pass, 0 for a lookup in the token buffer). The rule picks
argmax_s sum_b E_b(s) / C(s) over the batch's active sequences: one size per step for the whole batch. With a = b
this is the usual geometric model; the second rate is what lets it see all-or-nothing acceptance (a repeat that
prompt lookup found is either wrong at once or right for many tokens: a = 0.5, b = 0.95 asks for K, where one
geometric rate of ~0.6 would settle on 3 drafts).

Draft classes. A drafter may sort its sequences, before it proposes, into classes whose acceptance differs
(`draft_classes` and `draft_class(ctx)`: prompt lookup by the length of the n-gram it matched, 0 = none). The
rule keeps both rates per class: a lookup that matched 3 tokens is usually right while one with no match is
nearly always wrong, and one pair of rates would average them. Each rate is an exponential moving average of its
per-step estimate over the active sequences of the class: a from whether the first draft was accepted, b from
the drafts after an accepted one (accepted / (accepted + rejections); a sequence that accepts all s drafts saw no
rejection); only steps that verified drafts move them. After `probe_every` consecutive 0-size steps, one step
uses the smallest positive size, so the rates can recover. A probe whose first draft every sequence rejected
multiplies the wait before the next by `probe_backoff` (up to `max_probe_every`); any accepted draft resets it. A
drafter that is never right (SmolLM2's DFlash at T = 1) so pays for 2 probes in 64 tokens instead of 3, and
ever fewer after.

Lossless: the size is a function of committed tokens and earlier steps only (the class, the rates, a counter),
and every size is an exact verification (greedy or rejection sampling), so the output distribution is the
target's whatever the sizes.

The default costs are round numbers from this CPU's SmolLM2-135M suite runs (a 9-row verify pass ~1.8 decode
steps, a learned drafter's proposal ~0.4); calibrated costs replace them per drafter and machine. A step's cost
relative to an AR step changes with the context (on an AMD EPYC x2, a K = 15 step of prompt lookup costs 2.4 AR
steps at a 1408-position cache, 2.9 at 4608 and 3.4 at 9216), so calibrated costs may be given at several cache
lengths (`cost_contexts`); `at_context` interpolates them at the call's cache length, which `engine.prepare` knows
on the host (the cache is static), so the compiled step sees one row of costs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from collections.abc import Sequence

  from jax.typing import ArrayLike


@dataclasses.dataclass(frozen=True)
class DraftLengthRule:
  """Static (hashable): part of the engine's GenerationConfig."""
  sizes: tuple[int, ...]  # ascending, distinct, sizes[-1] = K; 0 allowed (a decode step)
  # measured step cost per size, in AR steps; () = the model below. With cost_contexts: one such row per context
  costs: tuple[float, ...] | tuple[tuple[float, ...], ...] = ()
  cost_contexts: tuple[int, ...] = ()  # ascending cache lengths the rows of `costs` were measured at
  draft_cost: float = 0.4  # (no costs) a proposal's cost, in AR steps
  row_cost: float = 0.1  # (no costs) each verified draft row's extra cost, in AR steps
  initial_rate: float = 0.5  # both rates (first draft, continuation) before any step verified drafts
  # (a, b) per draft class before any step observed them (calibrate-draft-length measures them on held-out
  # text); () = initial_rate for every class
  prior_rates: tuple[tuple[float, float], ...] = ()
  decay: float = 0.8  # EMA weight of the old rate per step that observed it
  probe_every: int = 16  # after this many 0-size steps in a row, one step with the smallest positive size
  probe_backoff: float = 2.0  # the wait grows by this after a probe that accepted nothing (1: a fixed interval)
  max_probe_every: int = 256  # the longest wait between probes

  def __post_init__(self):
    s = self.sizes
    problems = []
    if not s or list(s) != sorted(set(s)) or s[0] < 0 or s[-1] < 1:
      problems.append(f"sizes must be ascending distinct integers >= 0 with a largest >= 1, got {list(s)}")
    rows = self.costs if self.cost_contexts else (self.costs,) if self.costs else ()
    if self.cost_contexts and (list(self.cost_contexts) != sorted(set(self.cost_contexts))
                               or self.cost_contexts[0] < 1 or len(self.costs) != len(self.cost_contexts)):
      problems.append(f"cost_contexts must be ascending distinct lengths >= 1, one per row of costs "
                      f"({len(self.costs)} rows), got {list(self.cost_contexts)}")
    elif any(not isinstance(r, tuple) or len(r) != len(s) or any(not isinstance(c, (int, float)) for c in r)
             or min(r) <= 0 for r in rows):
      per = " per context" if self.cost_contexts else ""
      problems.append(f"costs must be one positive number per size ({len(s)}){per}, got {self.costs}")
    if self.draft_cost < 0 or self.row_cost < 0:
      problems.append(f"draft_cost and row_cost must be >= 0, got {self.draft_cost}, {self.row_cost}")
    if not 0 <= self.initial_rate <= 1 or not 0 <= self.decay < 1:
      problems.append(f"need 0 <= initial_rate <= 1 and 0 <= decay < 1, got {self.initial_rate}, {self.decay}")
    if any(len(r) != 2 or not all(0 <= x <= 1 for x in r) for r in self.prior_rates):
      problems.append(f"prior_rates must be (a, b) pairs in [0, 1], one per draft class, got {self.prior_rates}")
    if self.probe_every < 1 or self.probe_backoff < 1 or self.max_probe_every < self.probe_every:
      problems.append(f"need probe_every >= 1, probe_backoff >= 1 and max_probe_every >= probe_every, got "
                      f"{self.probe_every}, {self.probe_backoff}, {self.max_probe_every}")
    if problems:
      raise ValueError("; ".join(problems))

  @property
  def max_size(self) -> int:
    return self.sizes[-1]

  def at_context(self, cache_len: int) -> "DraftLengthRule":
    """The rule with one row of costs for a cache of `cache_len` positions: linear between the two measured
    contexts around it, the nearest row outside them (a ratio of two costs that both grow with the context is not
    safe to extrapolate)."""
    if not self.cost_contexts:
      return self
    ctx = np.asarray(self.cost_contexts, np.float64)
    table = np.asarray(self.costs, np.float64)  # [contexts, sizes]
    row = [float(np.interp(cache_len, ctx, table[:, j])) for j in range(table.shape[1])]
    return dataclasses.replace(self, costs=tuple(round(c, 4) for c in row), cost_contexts=())

  def step_costs(self, proposal_scale: float | jax.Array = 1.0) -> jax.Array:
    """C(s) per size, in AR steps: the measured costs, else the model with the proposal cost scaled by
    `proposal_scale` (a float, or a traced [] array inside the loop)."""
    if self.cost_contexts:
      raise ValueError("a rule with costs per context needs one context first: rule.at_context(cache_len)")
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
    def frozen(v):  # JSON lists -> tuples (the rule is hashable: a static argument of the engine's programs)
      return tuple(frozen(x) for x in v) if isinstance(v, list) else v
    return cls(**{k: frozen(v) for k, v in obj.items()})


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


def check_rule_target(value: str, target: str, dtype: str) -> None:
  """Refuses a rule JSON calibrated for another target or target dtype (its step costs and acceptance rates are
  that target's): `target` is the run's target as calibrate-draft-length records it (a name, or a directory)."""
  if value in ("fixed", "auto"):
    return
  measured = json.loads(Path(value).read_text()).get("measured") or {}  # a bare rule records nothing: not checked
  rule_target, rule_dtype = measured.get("model"), measured.get("dtype")
  if (rule_target is not None and Path(str(rule_target)).name != Path(target).name) or (
      rule_dtype is not None and rule_dtype != dtype):
    recorded = rule_dtype or "dtype not recorded"
    raise ValueError(f"draft-length rule {value} was calibrated for target {rule_target} ({recorded}), not this "
                     f"run's {target} ({dtype}): its costs and acceptance rates do not hold "
                     f"here; calibrate one with `longspec calibrate-draft-length --model {target} --dtype {dtype}`")


def default_sizes(num_draft: int) -> tuple[int, ...]:
  """0, 1, 3 and K (those below K), and 7, 15, ... up to K / 2: with a long K (prompt lookup at K = 15 accepts
  ~10 drafts after a long match and ~2 after a short one) the sizes stay about a factor 2 apart."""
  extra = {2 ** i - 1 for i in range(3, num_draft.bit_length() + 1) if 2 ** i - 1 <= num_draft / 2}
  return tuple(sorted(({0, 1, 3, num_draft} | extra) & set(range(num_draft + 1))))


def expected_tokens(rates: ArrayLike, sizes: Sequence[int]) -> jax.Array:
  """E(s) = 1 + a (1 + b + ... + b^(s-1)) for each size, from rates [..., 2] = (a, b): [..., n_sizes]."""
  s = jnp.asarray(sizes, jnp.float32)
  rates = jnp.asarray(rates, jnp.float32)
  a, b = rates[..., :1], jnp.clip(rates[..., 1:], 0.0, 0.999)
  return 1.0 + a * (1.0 - b ** s) / (1.0 - b)


def choose_size_index(rule: DraftLengthRule, row_rates: ArrayLike, active: ArrayLike, idle_steps: int | jax.Array,
                      proposal_scale: float | jax.Array = 1.0, probe_wait: int | jax.Array | None = None) -> jax.Array:
  """[] int32 index into rule.sizes for this step, from each sequence's rates (its class's) [B, 2] over the
  active sequences [B]; a probe after `probe_wait` idle steps (default rule.probe_every)."""
  tokens = jnp.sum(jnp.where(jnp.asarray(active)[:, None], expected_tokens(row_rates, rule.sizes), 0.0), axis=0)
  best = jnp.argmax(tokens / rule.step_costs(proposal_scale)).astype(jnp.int32)
  if rule.sizes[0] != 0 or len(rule.sizes) == 1:
    return best
  probe = (best == 0) & (idle_steps >= (rule.probe_every if probe_wait is None else probe_wait))
  return jnp.where(probe, 1, best)


def next_probe_wait(rule: DraftLengthRule, probe_wait: jax.Array, probed: bool | jax.Array,
                    accepted_any: bool | jax.Array) -> jax.Array:
  """The idle steps before the next probe after a step: back to probe_every once any draft was accepted, longer
  (x probe_backoff, capped) after a probe that accepted nothing."""
  longer = jnp.minimum(jnp.ceil(probe_wait * rule.probe_backoff), rule.max_probe_every).astype(jnp.int32)
  return jnp.where(accepted_any, jnp.int32(rule.probe_every), jnp.where(probed, longer, probe_wait))


def initial_rates(rule: DraftLengthRule, num_classes: int) -> jax.Array:
  if rule.prior_rates:
    if len(rule.prior_rates) != num_classes:
      raise ValueError(f"the draft-length rule has prior rates for {len(rule.prior_rates)} draft classes; the "
                       f"drafter has {num_classes} (calibrate the rule with the same method)")
    return jnp.asarray(rule.prior_rates, jnp.float32)
  return jnp.full((num_classes, 2), rule.initial_rate, jnp.float32)


def step_counts(num_classes: int, size: int | jax.Array, num_accepted: jax.Array, active: jax.Array,
                classes: jax.Array) -> jax.Array:
  """What one step observed, per draft class [C, 4]: first drafts accepted, first drafts verified, later drafts
  accepted (after an accepted first one), later drafts tried (accepted + rejections; a sequence that accepted
  all `size` drafts saw no rejection). All zero for a 0-size step."""
  in_class = active[None, :] & (classes[None, :] == jnp.arange(num_classes)[:, None]) & (size > 0)  # [C, B]
  n = num_accepted[None, :]
  after = in_class & (n >= 1) & (size >= 2)
  cont_hits = jnp.sum(jnp.where(after, n - 1, 0), axis=1)
  return jnp.stack([jnp.sum(in_class & (n >= 1), axis=1), jnp.sum(in_class, axis=1), cont_hits,
                    cont_hits + jnp.sum(after & (n < size), axis=1)], axis=1).astype(jnp.int32)


def update_rates(rule: DraftLengthRule, rates: jax.Array, counts: jax.Array) -> jax.Array:
  """The per-class rates [C, 2] after a step that observed `counts` [C, 4] (step_counts): each rate moves toward
  that step's estimate of it, hits / tries, where the step tried it at all."""
  counts = counts.astype(jnp.float32)
  hits, tries = counts[:, 0::2], counts[:, 1::2]
  estimate = hits / jnp.maximum(tries, 1.0)
  return jnp.where(tries > 0, rule.decay * rates + (1.0 - rule.decay) * estimate, rates)


def observed_rates(counts: ArrayLike) -> list:
  """(a, b) per class from accumulated step_counts [C, 4] (None where never tried): calibration's priors."""
  c = np.asarray(counts, np.float64)
  return [[round(float(h / t), 4) if t else None for h, t in ((row[0], row[1]), (row[2], row[3]))] for row in c]
