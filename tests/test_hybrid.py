"""The hybrid drafter (prompt lookup where the text repeats, a learned drafter elsewhere): which part proposes,
exactness against AR with the shipped EAGLE-3 and with draft length per step, and sampling that follows the
target."""

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import LoadedDrafter, ProposeContext
from longspec_jax.drafters.hybrid import HybridDrafter
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.inference.generate import generate
from longspec_jax.model import create_model
from longspec_jax.sampling import SamplingParams
from tests.test_draft_length import ConstantDrafter
from tests.test_speculative import N_POS, N_SAMPLES, PREFIX, V, _cfg, _chi2_pvalues, _exact_marginals, peaky_model


def test_lookup_proposes_on_a_match_and_the_learned_drafter_elsewhere():
  hybrid = HybridDrafter(PromptLookupDrafter(V), ConstantDrafter(V, token=2), min_match=2)
  tokens = np.zeros((2, 16), np.int32)
  tokens[0, :8] = [5, 6, 7, 8, 9, 5, 6, 7]  # ends with "5 6 7", seen before: the lookup continues with 8 9
  tokens[1, :8] = [10, 11, 12, 13, 14, 15, 16, 17]  # no repeat
  ctx = ProposeContext(tokens=jnp.asarray(tokens), num_tokens=jnp.asarray([8, 8]), sampling=SamplingParams.make(0.0))
  drafts, q, _ = hybrid.propose(None, None, ctx, None, 3, False)
  assert drafts.tolist() == [[8, 9, 5], [2, 2, 2]] and q is None
  _, q, _ = hybrid.propose(None, None, ctx, None, 3, True)
  assert q.shape == (2, 3, V) and float(q[0, 0, 8]) == 1.0 and float(q[1, 0, 2]) == 1.0
  # draft classes (draft_length keeps a rate per class): the matched n-gram length, 0 where the learned one proposes
  assert hybrid.draft_class(ctx).tolist() == [3, 0] and PromptLookupDrafter(V).draft_class(ctx).tolist() == [3, 0]
  assert hybrid.proposal_cost_scale == (1.0, 0.0) and hybrid.draft_classes == 4
  only_match = ctx.replace(tokens=jnp.asarray(np.stack([tokens[0], tokens[0]])))
  assert hybrid.propose(None, None, only_match, None, 2, False)[0].tolist() == [[8, 9], [8, 9]]
  with pytest.raises(ValueError, match="min_match"):
    HybridDrafter(PromptLookupDrafter(V), ConstantDrafter(V, token=2), min_match=4)


def test_hybrid_with_the_shipped_eagle3_equals_ar():
  from longspec_jax.targets import load_target
  target = load_target()
  repeats = [0] + list(range(5, 60)) * 3
  fresh = [0] + list(range(100, 160))
  prompts = [repeats, fresh, repeats[:70]]
  ar = generate(target, prompts, max_new_tokens=32, eos_id=-1).tokens
  hybrid = load_drafter("hybrid", target)
  fixed = generate(target, prompts, max_new_tokens=32, eos_id=-1, drafter=hybrid, num_draft=4)
  assert fixed.tokens == ar  # with draft_length="auto": test_shipped_drafters' bf16-weight target
  assert fixed.stats["tau"] >= 2.0  # two of the three prompts repeat: the lookup finds the repeat
  # learned=: a block drafter (DFlash, with its shipped checkpoint) in place of EAGLE-3
  with_dflash = load_drafter("hybrid", target, learned="dflash")
  assert with_dflash.spec.learned.name == "dflash"
  assert generate(target, prompts, max_new_tokens=32, eos_id=-1, drafter=with_dflash, num_draft=4).tokens == ar
  for bad, message in (("prompt-lookup", "must name a drafter with a checkpoint"), ("hybrid", "must name")):
    with pytest.raises(ValueError, match=message):
      load_drafter("hybrid", target, learned=bad)
  with pytest.raises(ValueError, match="--learned applies to hybrid"):
    load_drafter("eagle3", target, learned="dflash")


def test_hybrid_sampling_follows_the_target():
  model = peaky_model()
  learned = standalone_from_model(create_model(_cfg(layers=1), seed=7), "classic")
  hybrid = LoadedDrafter(HybridDrafter(PromptLookupDrafter(V), learned.spec, min_match=1), learned.params)
  out = generate(model, [PREFIX] * N_SAMPLES, max_new_tokens=N_POS, temperature=1.0, seed=11, eos_id=-1,
                 drafter=hybrid, num_draft=2)
  assert min(_chi2_pvalues(out.tokens, _exact_marginals(model, SamplingParams.make(1.0)))) > 0.01 / N_POS


def _replay_script():
  import importlib.util
  from pathlib import Path
  path = Path(__file__).resolve().parents[1] / "scripts" / "compare_suffix_drafters.py"
  spec = importlib.util.spec_from_file_location("compare_suffix_drafters", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_replay_of_token_matching_drafters_by_hand():
  """scripts/compare_suffix_drafters.py replays greedy speculative decoding from the target's greedy tokens:
  checked by hand, and against the engine (prompt lookup on a tiny target: the same tau)."""
  mod = _replay_script()
  # The continuation repeats the prompt: the oracle-like suffix match proposes it all.
  prompt, cont = [1, 5, 6, 7, 8, 9, 5, 6], [7, 8, 9, 5, 6, 7, 8]
  tau, steps = mod.replay(prompt, cont, mod.suffix_match(8), k=3)
  # steps: ctx ends "5 6 7": proposes 8 9 5 (all right) + 1 -> 4 tokens (pos 1 -> 5); then "...5 6": 7 8 (cut at
  # the end of the continuation) -> commits the last 2 tokens.
  assert steps == 2 and tau == pytest.approx(6 / 2)
  assert mod.replay(prompt, cont, lambda ctx, k: [], k=3) == (1.0, 6)  # nothing proposed: one token per step
  assert mod.suffix_match(8)([1, 2, 3], 2) == []  # no earlier match
  assert mod.suffix_match(2)([4, 1, 2, 9, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # latest occurrence of the longest match
  # Against the engine: our prompt lookup replayed gives the tau generate() measures.
  target = peaky_model()
  prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1).tokens[0]
  spec = generate(target, prompts, max_new_tokens=24, eos_id=-1, num_draft=3,
                  drafter=LoadedDrafter(PromptLookupDrafter(V)))
  replayed, _ = mod.replay(prompts[0], ar, mod.ours_lookup(V, len(prompts[0]) + 24 + 4), k=3)
  assert replayed == pytest.approx(spec.stats["tau"])
