"""The combined drafter (LongSpark + BudgetDraft's sparse DFlash, summed log-probs, + the DeLS head): lossless
(greedy == AR at batch 1 and 2 with the ring wrapping, chi-square sampling), each part reads its own taps, one part
alone is that part, the state does not grow with the context, the loader's parts / budget options and bad input."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import state_nbytes
from longspec_jax.drafters.budget import DFlashBudgetDrafter
from longspec_jax.drafters.combined import BlockEnsembleDrafter, ensemble, parse_parts
from longspec_jax.drafters.dels import DeLSDrafter, dels_from_head, save_dels_dir
from longspec_jax.drafters.dflash import create_dflash, dflash_config_for, dflash_from_model, save_dflash_dir
from longspec_jax.drafters.longspark import (create_longspark, longspark_config_for, longspark_from_model,
                                             save_longspark_dir)
from longspec_jax.inference.generate import generate
from longspec_jax.sampling import SamplingParams
from longspec_jax.drafters.base import PrefillResult, ProposeContext
from tests.compiled import compiled
from tests.test_dels import _cfg, _head
from tests.test_speculative import (N_POS, _chi2_pvalues, _exact_marginals, _prompts, _sample,  # noqa: F401
                                    peaky_target, target)

BLOCK = 5  # DFlash block of 5 = 4 drafts; LongSpark block of 4


def _longspark_model(t):
  return create_longspark(longspark_config_for(t.cfg, num_layers=1, raw_window=16, num_global_slots=4,
                                               block_size=BLOCK - 1), seed=3)


def _dflash_model(t):
  """Reads target layers 0 and 1 (taps 1, 2), LongSpark layer 1 (tap 2): the union has a tap LongSpark skips."""
  cfg = dflash_config_for(t.cfg, num_layers=1, num_target_taps=2, block_size=BLOCK)
  return create_dflash(dataclasses.replace(cfg, target_layer_ids=(0, 1)), seed=1)


def _parts(t, budget=16, tail_tokens=24):
  ls = longspark_from_model(_longspark_model(t), t)
  df = dflash_from_model(_dflash_model(t), t)
  df = type(df)(DFlashBudgetDrafter(graphdef=df.spec.graphdef, cfg=df.spec.cfg, budget=budget,
                                    tail_tokens=tail_tokens), df.params)
  return ls, df


def _state_and_ctx(t, spec, params, n):
  """A drafter state after prefilling one random n-token prompt (taps and target K/V), and the propose context."""
  toks = jnp.asarray(np.random.default_rng(5).integers(3, t.cfg.vocab_size, (1, n)), jnp.int32)
  out = compiled(t, toks, cache=t.init_cache(1, n + 8), mode="prefill", taps=spec.taps, return_kv=True)
  buf = jnp.concatenate([toks, jnp.full((1, 8), 7, jnp.int32)], 1)
  pre = PrefillResult(prompt_tokens=toks, tokens=buf, prompt_lens=jnp.asarray([n]), taps=out.taps,
                      new_kv=out.new_kv, target_cache=None)
  ctx = ProposeContext(tokens=buf, num_tokens=jnp.asarray([n + 1]), sampling=SamplingParams.make(0.0))
  return compiled(spec.init_state, params, pre, n + 8), ctx


def _combined(t, dels=True, weights=(0.5, 0.5), seed=0):
  loaded = ensemble(list(_parts(t)), weights)
  return dels_from_head(loaded, _cfg(), _head(_cfg(), seed), name="combined") if dels else loaded


# With and without the head, each at one batch size (the other pairings add compile time, not coverage: the head
# and the ensemble handle each row alike).
@pytest.mark.parametrize("batch,lengths,dels", [(1, [70], True), (2, [45, 13], False)])
def test_greedy_combined_equals_ar(target, dels, batch, lengths):
  d = _combined(target, dels)
  ls, df = d.spec.base.parts if dels else d.spec.parts
  assert ls.taps == (2,) and df.taps == (1, 2)  # each part gets its own slice of the union
  assert d.spec.max_draft_tokens == BLOCK - 1
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=40, eos_id=-1)
  for k in ((1, BLOCK - 1) if batch == 1 else (BLOCK - 1,)):  # 40 new tokens wrap the 24-row ring
    assert generate(target, prompts, max_new_tokens=40, eos_id=-1, drafter=d, num_draft=k).tokens == ar.tokens


def test_block_logits_are_the_weighted_sum_of_the_parts(target):
  ls, df = _parts(target)
  both = ensemble([ls, df], (0.25, 0.75))
  state, ctx = _state_and_ctx(target, both.spec, both.params, 60)
  z = compiled(both.spec.block_logits, both.params, state, ctx.pending, 3)
  parts = [compiled(p.spec.block_logits, p.params, s, ctx.pending, 3) for p, s in zip((ls, df), state)]
  want = 0.25 * jax.nn.log_softmax(parts[0], -1) + 0.75 * jax.nn.log_softmax(parts[1], -1)
  np.testing.assert_allclose(np.asarray(z), np.asarray(want), rtol=1e-5, atol=1e-5)
  # Each part's state is the one it builds alone from its own taps.
  alone, _ = _state_and_ctx(target, ls.spec, ls.params, 60)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), state[0], alone)


def test_combined_sampling_matches_target_distribution(peaky_target):
  d = _combined(peaky_target, dels=True, seed=2)
  marg = _exact_marginals(peaky_target, SamplingParams.make(1.0))
  pvals = _chi2_pvalues(_sample(peaky_target, d, 1.0, 0, 1.0, seed=29), marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_state_does_not_grow_with_the_context(target):
  d = _combined(target)
  sizes = {state_nbytes(_state_and_ctx(target, d.spec, d.params, n)[0]) for n in (30, 90)}
  assert len(sizes) == 1, sizes


def _save(target, tmp_path):
  save_longspark_dir(_longspark_model(target), tmp_path / "ls")
  save_dflash_dir(_dflash_model(target), tmp_path / "df")
  save_dels_dir(_cfg(), _head(_cfg()), tmp_path / "head", base_drafter="../ls")
  conf = {"architectures": ["CombinedBlockDrafter"], "vocab_size": target.cfg.vocab_size, "longspark": "../ls",
          "dflash": "../df", "dels": "../head", "weights": {"longspark": 1.0, "dflash": 3.0}}
  (tmp_path / "combined").mkdir()
  (tmp_path / "combined" / "config.json").write_text(json.dumps(conf))
  return tmp_path / "combined"


def test_loader_parts_budget_and_bad_input(target, tmp_path):
  path = _save(target, tmp_path)
  d = load_drafter("combined", target, drafter_dir=path, budget=24)
  assert isinstance(d.spec, DeLSDrafter) and isinstance(d.spec.base, BlockEnsembleDrafter)
  assert d.spec.base.weights == (0.25, 0.75) and d.spec.base.parts[1].budget == 24
  prompts = _prompts(1, [50])
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=d, num_draft=4).tokens == ar
  alone = load_drafter("combined", target, drafter_dir=path, parts="dflash")
  assert isinstance(alone.spec, BlockEnsembleDrafter) and alone.spec.weights == (1.0,)
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=alone, num_draft=4).tokens == ar
  ls_dels = load_drafter("combined", target, drafter_dir=path, parts="dels+longspark")
  assert [p.name for p in ls_dels.spec.base.parts] == ["longspark"]
  with pytest.raises(ValueError, match="at least one of"):
    load_drafter("combined", target, drafter_dir=path, parts="dels")
  with pytest.raises(ValueError, match="parts must be distinct names"):
    parse_parts("longspark+eagle3")
  with pytest.raises(ValueError, match="--parts applies to combined"):
    load_drafter("dels", target, drafter_dir=tmp_path / "head", parts="dels")
  conf = json.loads((path / "config.json").read_text())
  del conf["dels"]
  (path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(ValueError, match=r"parts \['dels'\] are not named"):
    load_drafter("combined", target, drafter_dir=path, parts="longspark+dels")
  with pytest.raises(ValueError, match="one positive weight per part"):
    BlockEnsembleDrafter(parts=(d.spec.base.parts[0],), weights=(0.0,))
