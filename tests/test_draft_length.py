"""Draft length chosen per step (inference/draft_length.py through the engine): the rule by hand, the sizes it
picks counted (never timed) for drafters that are always right and always wrong, exactness of every size and of
0-size steps for every kind of drafter state, and sampling that still follows the target."""

import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter, one_hot_probs
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.inference.draft_length import (DraftLengthRule, choose_size_index, default_sizes, next_probe_wait,
                                                 step_counts, update_rates)
from longspec_jax.inference.generate import generate
from longspec_jax.model import create_model

from tests.compiled import compiled
from tests.test_speculative import (N_POS, N_SAMPLES, PREFIX, V, _cfg, _chi2_pvalues, _exact_marginals, _prompts,
                                    peaky_model)


@dataclasses.dataclass(frozen=True)
class ConstantDrafter(DrafterSpec):
  """Drafts one fixed token every time: wrong whenever the target predicts anything else."""
  vocab_size: int
  token: int
  name: str = "constant"
  taps: tuple = ()
  needs_target_kv: bool = False
  max_draft_tokens = None
  catch_up_in_propose = False

  def init_state(self, params, prefill, max_len):
    return None

  def propose(self, params, state, ctx, key, num_draft, sample):
    drafts = jnp.full((ctx.tokens.shape[0], num_draft), self.token, jnp.int32)
    return drafts, one_hot_probs(drafts, self.vocab_size) if sample else None, state

  def update(self, params, state, verify):
    return state


@dataclasses.dataclass(frozen=True)
class StretchDrafter(DrafterSpec):
  """Always right (the inner drafter is the target itself) in odd stretches of 8 committed tokens, always wrong in
  even ones, and it says which stretch it is in before proposing: two draft classes."""
  inner: Any
  vocab_size: int
  wrong_token: int = 2
  name: str = "stretch"
  taps: tuple = ()
  needs_target_kv: bool = False
  max_draft_tokens = None
  catch_up_in_propose = True
  draft_classes = 2

  def draft_class(self, ctx, params=None):
    return (ctx.num_tokens // 8) % 2

  def init_state(self, params, prefill, max_len):
    return self.inner.init_state(params, prefill, max_len)

  def propose(self, params, state, ctx, key, num_draft, sample):
    drafts, _, state = self.inner.propose(params, state, ctx, key, num_draft, sample)
    drafts = jnp.where(self.draft_class(ctx)[:, None] == 1, drafts, self.wrong_token)
    return drafts, one_hot_probs(drafts, self.vocab_size) if sample else None, state

  def update(self, params, state, verify):
    return self.inner.update(params, state, verify)


@pytest.fixture(scope="module")
def target():
  return create_model(_cfg(), seed=0)


def choose(rule, rate, idle=0, scale=1.0, rows=1, cont=None):
  """The size index for `rows` sequences whose first draft is accepted at `rate` and each later one at `cont`
  (default: the same rate, the geometric model)."""
  rates = jnp.tile(jnp.asarray([[rate, rate if cont is None else cont]]), (rows, 1))
  return int(choose_size_index(rule, rates, jnp.ones(rows, bool), idle, scale))


def both(rates):
  return jnp.repeat(jnp.asarray(rates)[:, None], 2, axis=1)


def test_rule_by_hand():
  rule = DraftLengthRule((0, 1, 3, 8), draft_cost=0.4, row_cost=0.1)
  # rate 0: E = 1 at every size, the cheapest (0) wins; rate ~1: E = s + 1, K wins (9 / 2.2 > 4 / 1.7 > 1).
  assert choose(rule, 0.0) == 0 and choose(rule, 0.99) == 3
  # rate 0.5: E = 1, 1.5, 1.875, ~2.0 over costs 1, 1.5, 1.7, 2.2 -> 1.10 at size 3 is the best
  assert choose(rule, 0.5) == 2 and choose(rule, 0.5, rows=3) == 2
  # a free proposal (lookup): costs 1, 1.1, 1.3, 1.8. Rate 0.5: size 3 (1.875 / 1.3 = 1.44) > size 1 (1.36);
  # rate 0.2: size 1 (1.2 / 1.1 = 1.09) > size 0 (1), where a 0.4-step proposal makes 0 the best
  assert choose(rule, 0.5, scale=0.0) == 2 and choose(rule, 0.2, scale=0.0) == 1 and choose(rule, 0.2) == 0
  # all-or-nothing acceptance (a = 0.5, b = 0.95): E(8) = 1 + 0.5 * 6.63 = 4.32 over 1.8 beats E(3) = 2.43 over
  # 1.3; one geometric rate of 0.6 would pick 3 (2.18 / 1.3 > 2.48 / 1.8)
  assert choose(rule, 0.5, scale=0.0, cont=0.95) == 3 and choose(rule, 0.6, scale=0.0) == 2
  # a switched-off drafter is probed with the smallest positive size after probe_every idle steps
  assert choose(rule, 0.0, idle=rule.probe_every) == 1
  # one size for the batch: two sequences at rate 0.95 outweigh one at 0 (K: 2 * 7.4 + 1 = 15.8 over 2.2 = 7.2)
  mixed = choose_size_index(rule, both([0.95, 0.0, 0.95, 0.95]), jnp.asarray([True, True, True, False]), 0)
  assert int(mixed) == 3
  # a finished sequence does not count: the one active row at rate 0 decides
  assert int(choose_size_index(rule, both([0.95, 0.0]), jnp.asarray([False, True]), 0)) == 0


def test_rates_by_class_by_hand():
  rule = DraftLengthRule((0, 1, 3, 8))
  rates, on = jnp.full((3, 2), 0.5), jnp.ones(4, bool)

  def after(size, accepted, active, classes):
    counts = step_counts(3, jnp.int32(size), jnp.asarray(accepted), jnp.asarray(active), jnp.asarray(classes))
    return counts, update_rates(rule, rates, counts)
  # one class: every first draft accepted (a_hat = 1); after it 1, 1, 1 and 2 more accepted with 3 rejections
  # (the row that accepted all 3 saw none): b_hat = 5 / 8
  counts, new = after(3, [2, 2, 2, 3], on, [0, 0, 0, 0])
  assert counts.tolist() == [[4, 4, 5, 8], [0, 0, 0, 0], [0, 0, 0, 0]]
  np.testing.assert_allclose(new, [[0.6, 0.4 + 0.2 * 5 / 8], [0.5, 0.5], [0.5, 0.5]], rtol=1e-6)
  # classes apart: class 0 rows rejected at once (a_hat = 0, b not observed), class 2 rows accepted everything
  counts, new = after(3, [0, 3, 0, 3], on, [0, 2, 0, 2])
  assert counts.tolist() == [[0, 2, 0, 0], [0, 0, 0, 0], [2, 2, 4, 4]]
  np.testing.assert_allclose(new, [[0.4, 0.5], [0.5, 0.5], [0.6, 0.6]], rtol=1e-6)
  # a 0-size step observes nothing; a 1-size step cannot observe b; an inactive row does not count
  assert not after(0, [0, 0, 0, 0], on, [0, 0, 0, 0])[0].any()
  np.testing.assert_allclose(after(1, [1, 1, 1, 1], on, [0, 0, 0, 0])[1][0], [0.6, 0.5], rtol=1e-6)
  counts, new = after(3, [0, 3, 0, 0], [False, True, False, False], [1, 1, 2, 2])
  np.testing.assert_allclose(new, [[0.5, 0.5], [0.6, 0.6], [0.5, 0.5]], rtol=1e-6)
  assert default_sizes(8) == (0, 1, 3, 8) and default_sizes(2) == (0, 1, 2) and default_sizes(1) == (0, 1)
  assert default_sizes(15) == (0, 1, 3, 7, 15) and default_sizes(16) == (0, 1, 3, 7, 16)
  assert default_sizes(31) == (0, 1, 3, 7, 15, 31) and default_sizes(7) == (0, 1, 3, 7)
  for bad in (dict(sizes=()), dict(sizes=(3, 1)), dict(sizes=(0,)), dict(sizes=(0, 2), decay=1.0),
              dict(sizes=(0, 2), draft_cost=-1.0), dict(sizes=(0, 2), probe_every=0),
              dict(sizes=(0, 2), prior_rates=((0.5, 1.5),))):
    with pytest.raises(ValueError):
      DraftLengthRule(**bad)


def test_always_right_takes_k_and_always_wrong_takes_zero(target):
  prompts = _prompts(4, [3, 40, 17, 90])
  ar = generate(target, prompts, max_new_tokens=120, eos_id=-1).tokens
  right = generate(target, prompts, max_new_tokens=120, eos_id=-1, num_draft=6, draft_length="auto",
                   drafter=standalone_from_model(target, "classic"))  # the target drafting for itself
  assert right.tokens == ar
  share = right.stats["size_share"]
  assert right.stats["draft_sizes"] == [0, 1, 3, 6] and share[-1] >= 0.8 and share[0] == 0.0
  wrong_drafter = LoadedDrafter(ConstantDrafter(V, token=2))
  wrong = generate(target, prompts, max_new_tokens=120, eos_id=-1, num_draft=6, draft_length="auto",
                   drafter=wrong_drafter)
  assert wrong.tokens == ar
  assert wrong.stats["size_share"][0] >= 0.8, wrong.stats
  assert 1.0 <= wrong.stats["rows_per_step"] < 1.5
  fixed = generate(target, prompts, max_new_tokens=120, eos_id=-1, num_draft=6, drafter=wrong_drafter)
  assert fixed.target_forwards == wrong.target_forwards  # nothing accepted either way: one token per pass
  assert "size_share" not in fixed.stats


def test_probe_wait_by_hand():
  rule = DraftLengthRule((0, 1, 3), probe_every=16, probe_backoff=2.0, max_probe_every=100)
  wait = lambda w, probed, accepted: int(next_probe_wait(rule, jnp.int32(w), probed, accepted))
  assert wait(16, True, False) == 32 and wait(64, True, False) == 100  # a failed probe: longer, capped
  assert wait(64, True, True) == 16 and wait(64, False, True) == 16  # any accepted draft: back to probe_every
  assert wait(32, False, False) == 32  # a step that probed nothing changes nothing
  fixed = DraftLengthRule((0, 1), probe_every=4, probe_backoff=1.0)
  assert int(next_probe_wait(fixed, jnp.int32(4), True, False)) == 4


def test_failed_probes_back_off(target):
  """A drafter that is always wrong, under a rule whose costs make 0 the choice: with a fixed interval of 2 it is
  probed on every third step; with backoff x2 the waits are 2, 4, 8, 16, 32 (5 probes in 70 steps). Counted, and
  the output equals AR both ways."""
  prompts = _prompts(1, [40])
  ar = generate(target, prompts, max_new_tokens=70, eos_id=-1).tokens
  drafter = LoadedDrafter(ConstantDrafter(V, token=2))
  probes = {}
  for backoff in (1.0, 2.0):
    rule = DraftLengthRule((0, 1), costs=(1.0, 100.0), probe_every=2, probe_backoff=backoff)
    out = generate(target, prompts, max_new_tokens=70, eos_id=-1, drafter=drafter, draft_length=rule)
    assert out.tokens == ar
    assert out.stats["accept_hist"][1] == 0  # never right: no probe reset the wait
    probes[backoff] = round(out.stats["size_share"][1] * out.target_forwards)
  assert probes[1.0] == 23 and probes[2.0] == 5, probes


def test_rates_per_draft_class_follow_bursts(target):
  """A drafter right in one class and wrong in the other gets one rate per class: K where it is right, decode steps
  where it is wrong, rather than one averaged size. One sequence: a batch takes one size for all its rows."""
  prompts = _prompts(1, [3])
  ar = generate(target, prompts, max_new_tokens=96, eos_id=-1).tokens
  inner = standalone_from_model(target, "classic")
  drafter = LoadedDrafter(StretchDrafter(inner.spec, V), inner.params)
  out = generate(target, prompts, max_new_tokens=96, eos_id=-1, num_draft=6, draft_length="auto", drafter=drafter)
  assert out.tokens == ar
  wrong, right = out.stats["class_rates"]  # (first draft, continuation) per class
  assert min(right) > 0.9 and wrong[0] < 0.5, out.stats  # wrong: from 0.5, moved only by the probes
  share = out.stats["size_share"]
  assert share[0] >= 0.3 and share[-1] >= 0.2, out.stats


@pytest.mark.parametrize("name", ["self", "pard", "prompt-lookup"])
def test_zero_size_steps_keep_the_drafter_current(target, name):
  """A rule that verifies no drafts for two steps in three (costs make 0 the choice, probes make 1): output equals
  AR, and the target drafting for itself has every probe accepted, so its state caught up on the 0-size steps."""
  drafter = {"self": standalone_from_model(target, "classic"),
             "pard": standalone_from_model(create_model(_cfg(layers=1), seed=7), "pard"),
             "prompt-lookup": LoadedDrafter(PromptLookupDrafter(V))}[name]
  prompts = _prompts(4, [3, 40, 17, 90])
  ar = generate(target, prompts, max_new_tokens=30, eos_id=-1).tokens
  rule = DraftLengthRule((0, 1), costs=(1.0, 100.0), probe_every=2, probe_backoff=1.0)
  out = generate(target, prompts, max_new_tokens=30, eos_id=-1, drafter=drafter, draft_length=rule)
  assert out.tokens == ar
  assert out.stats["size_share"][1] == pytest.approx(1 / 3, abs=0.05)
  hist = out.stats["accept_hist"]
  if name == "self":
    assert hist[0] == 0 and hist[1] > 0


def test_sampling_with_draft_length_follows_the_target():
  from longspec_jax.sampling import SamplingParams
  model = peaky_model()
  drafter = standalone_from_model(create_model(_cfg(layers=1), seed=7), "classic")
  marg = _exact_marginals(model, SamplingParams.make(1.0))
  rule = DraftLengthRule((0, 1, 2), draft_cost=0.2, row_cost=0.05, probe_every=1)
  out = generate(model, [PREFIX] * N_SAMPLES, max_new_tokens=N_POS, temperature=1.0, seed=11, eos_id=-1,
                 drafter=drafter, draft_length=rule)
  assert min(out.stats["size_share"]) < 1.0  # more than one size was used
  assert min(_chi2_pvalues(out.tokens, marg)) > 0.01 / N_POS


def test_bad_draft_length(target):
  lookup = LoadedDrafter(PromptLookupDrafter(V))
  with pytest.raises(ValueError, match="apply to speculative decoding"):
    generate(target, [[3, 4, 5]], draft_length="auto")
  with pytest.raises(ValueError, match="draft_length must be"):
    generate(target, [[3, 4, 5]], drafter=lookup, draft_length="sometimes")
  with pytest.raises(ValueError, match="differs from the draft_length rule"):
    generate(target, [[3, 4, 5]], drafter=lookup, num_draft=4, draft_length=DraftLengthRule((0, 2)))
  with pytest.raises(ValueError, match="prior rates for 2 draft classes; the drafter has 4"):
    generate(target, [[3, 4, 5]], drafter=lookup, draft_length=DraftLengthRule((0, 2), prior_rates=((0.5, 0.5),) * 2))


def test_costs_per_context_by_hand(target):
  """A rule with costs at several cache lengths: linear between them, the nearest row outside, one row per call
  (engine.prepare resolves it at the call's cache length), a JSON round trip, and clear errors."""
  rule = DraftLengthRule((0, 1, 4), costs=((1.0, 1.2, 1.6), (1.0, 1.6, 3.0)), cost_contexts=(1000, 3000))
  assert rule.at_context(2000).costs == (1.0, 1.4, 2.3) and rule.at_context(2000).cost_contexts == ()
  assert rule.at_context(500).costs == (1.0, 1.2, 1.6) and rule.at_context(9000).costs == (1.0, 1.6, 3.0)
  assert DraftLengthRule.from_json(json.loads(json.dumps(rule.to_json()))) == rule
  flat = DraftLengthRule((0, 1, 4), costs=(1.0, 1.2, 1.6))
  assert flat.at_context(123) is flat
  with pytest.raises(ValueError, match="needs one context first"):
    rule.step_costs()
  with pytest.raises(ValueError, match="one per row of costs"):
    DraftLengthRule((0, 1, 4), costs=((1.0, 1.2, 1.6),), cost_contexts=(1000, 3000))
  with pytest.raises(ValueError, match="ascending distinct"):
    DraftLengthRule((0, 1, 4), costs=((1.0, 1.2, 1.6),) * 2, cost_contexts=(3000, 1000))
  with pytest.raises(ValueError, match="one positive number per size \\(3\\) per context"):
    DraftLengthRule((0, 1, 4), costs=(1.0, 1.2), cost_contexts=(1000, 3000))  # flat costs, not rows
  with pytest.raises(ValueError, match="one positive number per size \\(3\\), got"):
    DraftLengthRule((0, 1, 4), costs=(1.0, 1.2))
  from longspec_jax.inference import engine
  lookup = LoadedDrafter(PromptLookupDrafter(V))
  config, _, _ = engine.prepare(target, _prompts(1, [40]), 16, drafter=lookup, draft_length=rule, eos_id=-1)
  assert config.draft_length == rule.at_context(config.max_len) and config.draft_length.cost_contexts == ()
  # so the choice follows the context: a = 0.5, b = 0.9 gives E = 1, 1.5, 2.72 per size; K pays where a K-step
  # costs 1.6 (1.70 tokens per AR step) and not where it costs 3.0 (0.91; size 1: 0.94; size 0: 1)
  cheap, dear = rule.at_context(1000), rule.at_context(3000)
  assert choose(cheap, 0.5, cont=0.9) == 2 and choose(dear, 0.5, cont=0.9) == 0


def _cache_copies(target, drafter, draft_length, cache_shape):
  """Copies of buffers shaped `cache_shape` in the compiled decode program."""
  import re

  import jax

  from longspec_jax.inference import engine
  c, p, i = engine.prepare(target, _prompts(1, [40]), 16, drafter=drafter, draft_length=draft_length, eos_id=-1,
                           num_draft=4)
  state = jax.eval_shape(lambda: engine.prefill_and_start(c, p, i))
  hlo = engine.decode_program.lower(c, p, i, state, jnp.int32(0)).compile().as_text()
  shape = "f32[" + ",".join(map(str, cache_shape(state))) + "]"
  return shape, [l for l in hlo.split("\n") if re.search(r"= " + re.escape(shape) + r"\{[^}]*\} copy\(", l)]


def test_size_switch_keeps_the_target_cache_in_place(target):
  """The adaptive step's lax.switch must not copy the target's KV cache: a branch returns its K/V rows and the step
  writes them after the switch (written inside the branches, XLA copied every layer's cache on every step)."""
  shape, copies = _cache_copies(target, LoadedDrafter(PromptLookupDrafter(V)), "auto",
                                lambda s: s.target_cache.k[0].shape)
  assert int(shape.split(",")[2]) >= 64 and not copies, f"{len(copies)} copies of {shape}"


@pytest.mark.parametrize("draft_length", ["fixed", "auto"])
def test_eagle3_chain_and_update_keep_the_drafter_cache_in_place(target, draft_length):
  """EAGLE-3's chain keeps its rows out of the drafter cache and its update runs after the size switch: with the
  chain written into the cache, XLA copied the cache on every chain step (K = 4: 12 copies a step); with the
  update inside the switch's branches, 12 more."""
  from longspec_jax.drafters.eagle3 import create_eagle3_net, default_aux_layers, drafter_config, eagle3_from_net
  tc = target.cfg
  aux = default_aux_layers(tc.num_hidden_layers)
  # A head_dim unlike the target's, so that the drafter cache's shape names only it.
  arch = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=tc.head_dim + 4, intermediate_size=64)
  eagle = eagle3_from_net(create_eagle3_net(drafter_config(tc, **arch), tc, aux, seed=1), target, aux)
  shape, copies = _cache_copies(target, eagle, draft_length, lambda s: s.drafter_state.cache.k[0].shape)
  assert int(shape.split(",")[2]) >= 64 and not copies, f"{len(copies)} copies of {shape}"


def _learned_drafter(target, name):
  """A tiny random drafter of a method whose update keeps its state current (so 0-size steps defer it)."""
  from longspec_jax.drafters.dflash import create_dflash, dflash_config_for, dflash_from_model
  from longspec_jax.drafters.eagle3 import create_eagle3_net, default_aux_layers, drafter_config, eagle3_from_net
  from longspec_jax.drafters.longspark import create_longspark, longspark_config_for, longspark_from_model
  tc = target.cfg
  if name == "dflash":
    return dflash_from_model(create_dflash(dflash_config_for(tc, num_layers=1, num_target_taps=2, block_size=5),
                                           seed=1), target)
  if name == "longspark":
    return longspark_from_model(create_longspark(longspark_config_for(tc, num_layers=1, raw_window=16), seed=3),
                                target)
  aux = default_aux_layers(tc.num_hidden_layers)
  return eagle3_from_net(create_eagle3_net(drafter_config(tc, intermediate_size=64), tc, aux, seed=1), target, aux)


@pytest.mark.parametrize("name", ["eagle3", "dflash", "longspark"])
def test_zero_size_steps_defer_the_update_exactly(target, name):
  """0-size steps hold their verified rows and the drafter's update reads them in one call before the next
  proposal (or when the rows fill their buffer): the drafter then proposes what per-step updates make it propose
  (same drafts, same q; their states differ only in rows past the committed length, junk either way), and while
  rows are held its state is left untouched (the update really is skipped)."""
  import functools
  import jax
  from longspec_jax.drafters.base import ProposeContext
  from longspec_jax.inference import engine
  from longspec_jax.sampling import SamplingParams
  drafter = _learned_drafter(target, name)
  k = 4
  rule = DraftLengthRule((0, k), initial_rate=0.0, probe_every=1000, max_probe_every=1000)  # always 0
  config, params, inputs = engine.prepare(target, _prompts(2, [9, 33]), 24, drafter=drafter, draft_length=rule,
                                          eos_id=-1)
  assert engine.defers_update(config)
  step = jax.jit(engine.step, static_argnums=0)
  step_at0 = jax.jit(lambda c, p, i, s: engine.step_at(c, p, i, s, 0)[0], static_argnums=0)
  flush = jax.jit(lambda c, p, s: engine._flush_before(c, p, s, jnp.bool_(True)), static_argnums=0)

  @functools.partial(jax.jit, static_argnums=0)
  def proposal(c, p, i, s):
    ctx = ProposeContext(tokens=s.tokens, num_tokens=s.num_tokens, sampling=SamplingParams.make(1.0))
    greedy = c.drafter.propose(p.drafter, s.drafter_state, ctx, jax.random.key(0), k, False)[0]
    return greedy, c.drafter.propose(p.drafter, s.drafter_state, ctx, jax.random.key(0), k, True)[1]

  start = compiled(engine.prefill_and_start, config, params, inputs)
  # Room for 2 (K+1) rows: a step flushes first when more than K+1 are held. 3 and K+2 steps: every row held;
  # K+3: flushed, then its own row held; 3K+3: flushed at steps K+3 and 2K+5, then 3 rows held.
  for steps, count in ((3, 3), (k + 2, k + 2), (k + 3, 1), (3 * k + 3, 3)):
    held, per_step = start, start
    for _ in range(steps):
      held, per_step = step(config, params, inputs, held), step_at0(config, params, inputs, per_step)
    assert int(held.size_hist[0]) == steps and held.tokens.tolist() == per_step.tokens.tolist()
    assert held.deferred.count.tolist() == [count] * 2
    if steps == count:  # nothing read yet
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), held.drafter_state, start.drafter_state)
    flushed = flush(config, params, held)
    assert flushed.deferred.count.tolist() == [0, 0]
    (drafts, q), (want_drafts, want_q) = (proposal(config, params, inputs, s) for s in (flushed, per_step))
    assert drafts.tolist() == want_drafts.tolist()
    np.testing.assert_allclose(q, want_q, rtol=1e-4, atol=1e-6)


def test_deferred_updates_keep_greedy_exact(target):
  """Drafters whose 0-size steps defer their update, under a rule that mixes sizes: output equals AR (the hybrid's
  in test_hybrid_lookup_steps_hold_their_rows)."""
  prompts = _prompts(3, [5, 40, 21])
  ar = generate(target, prompts, max_new_tokens=30, eos_id=-1).tokens
  rule = DraftLengthRule((0, 1, 3), costs=(1.0, 2.0, 2.5), probe_every=2, probe_backoff=1.0)
  for name in ("eagle3", "dflash", "longspark"):
    out = generate(target, prompts, max_new_tokens=30, eos_id=-1, drafter=_learned_drafter(target, name),
                   draft_length=rule)
    assert out.tokens == ar, name
    assert out.stats["size_share"][0] > 0.3, name


def load_hybrid_parts(target):
  """Prompt lookup + a tiny EAGLE-3: steps where every sequence took the lookup hold their rows too."""
  from longspec_jax.drafters.hybrid import HybridDrafter
  eagle = _learned_drafter(target, "eagle3")
  return LoadedDrafter(HybridDrafter(PromptLookupDrafter(V), eagle.spec), eagle.params)


def test_hybrid_lookup_steps_hold_their_rows(target):
  """A hybrid step where every sequence drafted by lookup does not read the learned drafter's state: its committed
  rows (several when drafts were accepted) are held for a later update, like a 0-size step's; the output equals
  AR's."""
  import jax
  from longspec_jax.inference import engine
  rule = DraftLengthRule((0, 1, 3), costs=(1.0, 2.0, 2.5), probe_every=2, probe_backoff=1.0)
  prompts = _prompts(3, [5, 40, 21])
  config, params, inputs = engine.prepare(target, prompts, 30, drafter=load_hybrid_parts(target), draft_length=rule,
                                          eos_id=-1)
  step = jax.jit(engine.step, static_argnums=0)
  state, held_on_drafting_steps = compiled(engine.prefill_and_start, config, params, inputs), 0
  while not bool(jnp.all(state.done)):
    new = step(config, params, inputs, state)
    drafted = int(new.size_hist[0]) == int(state.size_hist[0])
    grew = (new.deferred.count - state.deferred.count).tolist()
    held_on_drafting_steps += drafted and min(grew) > 1 and grew == (new.num_tokens - state.num_tokens).tolist()
    state = new
  assert held_on_drafting_steps >= 2
  assert engine.output_tokens(state, inputs) == generate(target, prompts, max_new_tokens=30, eos_id=-1).tokens


def test_fixed_vs_adaptive_plot_pairs_cells_by_method(tmp_path, capsys):
  """scripts/plot_draft_length.py pairs each method's K-fixed cell with its rule's cell at the same context, takes
  the first folder that has a cell, skips AR, peers, other temperatures and incomplete cells, and names a missing
  folder."""
  pytest.importorskip("matplotlib")
  from scripts.plot_draft_length import main

  def cell(method, ctx, speedup, temperature=0.0, complete=True):
    return {"method": method, "context": ctx, "temperature": temperature, "complete": complete,
            "speedup": speedup, "speedup_ci": [speedup - 0.1, speedup + 0.1]}

  def suite(name, cells):
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps({"cells": cells}))
    return str(d)

  fixed = suite("fixed", [cell("ar", 512, 1.0), cell("eagle3:num_draft=7", 512, 0.61),
                          cell("eagle3:num_draft=7", 4096, 0.52), cell("llama.cpp-ar", 512, 2.4),
                          cell("eagle3:num_draft=7,draft_length=r.json", 512, 9.0)])
  adaptive_a = suite("adaptive_a", [cell("eagle3:num_draft=7,draft_length=r.json", 512, 1.03),
                                    cell("eagle3:num_draft=7,draft_length=r.json", 4096, 7.0, complete=False),
                                    cell("eagle3:num_draft=7,draft_length=r.json", 4096, 8.0, temperature=1.0)])
  adaptive_b = suite("adaptive_b", [cell("eagle3:num_draft=7,draft_length=r.json", 512, 5.0),
                                    cell("eagle3:num_draft=7,draft_length=r.json", 4096, 1.07)])
  png = tmp_path / "plot.png"
  main(["--fixed", fixed, "--adaptive", adaptive_a, adaptive_b, "--out", str(png)])
  table = capsys.readouterr().out
  assert ("| eagle3:num_draft=7 | 0.61 [0.51, 0.71] / 1.03 [0.93, 1.13] | 0.52 [0.42, 0.62] / 1.07 [0.97, 1.17] |"
          in table), table
  assert "llama.cpp" not in table and "| ar |" not in table
  assert png.stat().st_size > 0
  with pytest.raises(SystemExit, match="missing/results.json not found"):
    main(["--fixed", str(tmp_path / "missing"), "--adaptive", adaptive_a, "--out", str(png)])
