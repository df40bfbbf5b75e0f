"""BudgetDraft over DFlash (`dflash-budget`): lossless (greedy == AR at batch 1 and 2 with the tail ring wrapping,
chi-square sampling), the state's shape independent of the context, a budget covering the prompt == full DFlash,
the multi-view training forward == the inference forward, and the store fine-tune exporting a loadable drafter."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.drafters.base import PrefillResult, VerifyResult, state_nbytes
from longspec_jax.drafters.budget import CHUNK, DFlashBudgetDrafter
from longspec_jax.drafters.dflash import dflash_from_model
from longspec_jax.drafters.frozen_target import target_io
from longspec_jax.inference.generate import generate
from longspec_jax.sampling import SamplingParams
from tests.compiled import compiled
from tests.test_dflash import BLOCK, _dflash
from tests.test_distill_store import setup  # noqa: F401  (fixture: a tiny target and corpus)
from tests.test_speculative import (N_POS, V, _chi2_pvalues, _exact_marginals, _prompts, _sample,  # noqa: F401
                                    peaky_target, target)


def _budget(loaded, budget=16, tail_tokens=24, keep_recent=True):
  spec = DFlashBudgetDrafter(graphdef=loaded.spec.graphdef, cfg=loaded.spec.cfg, budget=budget,
                             keep_recent=keep_recent, tail_tokens=tail_tokens)
  return type(loaded)(spec, loaded.params)


@pytest.fixture(scope="module")
def dflash(target):
  return dflash_from_model(_dflash(target, seed=3), target)


@pytest.mark.parametrize("keep_recent", [True, False])
@pytest.mark.parametrize("lengths", [[70], [45, 13]])
def test_greedy_equals_ar(target, dflash, lengths, keep_recent):
  prompts = _prompts(len(lengths), lengths)
  ar = generate(target, prompts, max_new_tokens=40, eos_id=-1)
  for k in (1, BLOCK - 1):  # 40 new tokens through a 24-row ring: it wraps
    sp = generate(target, prompts, max_new_tokens=40, eos_id=-1, drafter=_budget(dflash, keep_recent=keep_recent),
                  num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"


def _prefill(target, spec, toks, lens):
  taps = compiled(target, toks, mode="train", taps=spec.taps, return_logits=False).taps
  return taps, PrefillResult(prompt_tokens=toks, tokens=toks, prompt_lens=jnp.asarray(lens), taps=taps,
                             new_kv=None, target_cache=None)


def _verify(start, num_tokens, taps):
  b, k1 = taps.shape[:2]
  return VerifyResult(start=jnp.asarray(start), num_accepted=jnp.zeros((b,), jnp.int32),
                      committed=jnp.zeros((b, k1), jnp.int32), num_committed=jnp.ones((b,), jnp.int32), taps=taps,
                      new_kv=None, tokens=None, num_tokens=jnp.asarray(num_tokens))


def test_budget_over_the_prompt_is_full_dflash_and_state_is_flat(target, dflash):
  """With the budget covering the prompt and the ring every generated row, the block logits are full DFlash's,
  after updates too; the state's bytes do not grow with the prompt."""
  rng = np.random.default_rng(1)
  toks = jnp.asarray(rng.integers(3, V, (2, 60)), jnp.int32)
  lens, verified = [30, 21], 6
  taps, pre = _prefill(target, dflash.spec, toks[:, :30], lens)
  all_taps = compiled(target, toks, mode="train", taps=dflash.spec.taps, return_logits=False).taps
  wide = _budget(dflash, budget=32, tail_tokens=24)
  states = [compiled(d.spec.init_state, d.params, pre, 64) for d in (dflash, wide)]
  vtaps = jnp.stack([all_taps[i, n:n + verified] for i, n in enumerate(lens)])
  num_tokens = [n + verified for n in lens]  # every verified row committed, one more pending
  states = [compiled(d.spec.update, d.params, s, _verify(lens, num_tokens, vtaps))
            for d, s in zip((dflash, wide), states)]
  pending = toks[jnp.arange(2), jnp.asarray(num_tokens) - 1]
  full, sparse = (compiled(d.spec.block_logits, d.params, s, pending, BLOCK - 1)
                  for d, s in zip((dflash, wide), states))
  np.testing.assert_allclose(np.asarray(sparse), np.asarray(full), atol=2e-4, rtol=2e-4)
  small = _budget(dflash, budget=16)
  nbytes = [state_nbytes(compiled(small.spec.init_state, small.params,
                                   _prefill(target, dflash.spec, toks[:, :n], [n, n])[1], 64)) for n in (24, 56)]
  assert nbytes[0] == nbytes[1]


@pytest.mark.parametrize("keep_recent", [True, False])
def test_training_forward_equals_inference(target, dflash, keep_recent):
  """The multi-view trainer's sparse branch gives each anchor the logits the inference drafter computes after a
  prefill of the prompt and the rows from the prompt to the anchor verified; its full branch is DFlash's."""
  from longspec_jax.drafters.budget import dflash_multiview_logits
  from longspec_jax.drafters.dflash import dflash_train_logits
  from flax import nnx
  model = nnx.merge(dflash.spec.graphdef, dflash.params["drafter"])
  rng = np.random.default_rng(2)
  b, c, budget = 2, 64, 16
  toks = jnp.asarray(rng.integers(3, V, (b, c)), jnp.int32)
  taps = compiled(target, toks, mode="train", taps=dflash.spec.taps, return_logits=False).taps
  lens = np.asarray([37, 44], np.int32)
  anchors = jnp.asarray([[37, 41, 50], [44, 52, 58]], jnp.int32)
  batch = {"io": target_io(target), "taps": taps, "tokens": toks, "anchors": anchors, "prompt_lens": jnp.asarray(lens),
           "num_chunks": jnp.full((b,), budget // CHUNK, jnp.int32)}
  full, sparse = compiled(dflash_multiview_logits, model, batch, 32, keep_recent)  # max_budget 32, batch's budget 16
  np.testing.assert_allclose(np.asarray(full),
                             np.asarray(compiled(dflash_train_logits, model, batch["io"], taps, toks, anchors)),
                             atol=1e-5)
  d = _budget(dflash, budget=budget, tail_tokens=32, keep_recent=keep_recent)
  _, pre = _prefill(target, d.spec, toks[:, :44], lens)
  for j in range(anchors.shape[1]):
    a = np.asarray(anchors[:, j])
    state = compiled(d.spec.init_state, d.params, pre, c)
    n = int((a - lens).max())
    if n:  # rows P .. a-1 written by one verify (rows past a-1 are not seen: length = a)
      vtaps = jnp.stack([taps[i, lens[i]:lens[i] + n] for i in range(b)])
      state = compiled(d.spec.update, d.params, state, _verify(lens, a + 1, vtaps))
    inf = compiled(d.spec.block_logits, d.params, state, toks[jnp.arange(b), a], BLOCK - 1)
    np.testing.assert_allclose(np.asarray(sparse[:, j]), np.asarray(inf), atol=2e-4, rtol=2e-4)


def test_sampling_matches_target_distribution(peaky_target):
  d = _budget(dflash_from_model(_dflash(peaky_target, seed=2), peaky_target), budget=16, tail_tokens=16)
  marg = _exact_marginals(peaky_target, SamplingParams.make(1.0, 0, 1.0))
  pvals = _chi2_pvalues(_sample(peaky_target, d, 1.0, 0, 1.0, seed=13), marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_bad_settings(dflash):
  with pytest.raises(ValueError, match="budget must be a multiple of 8"):
    _budget(dflash, budget=20)
  with pytest.raises(ValueError, match="tail_tokens must exceed the block size"):
    _budget(dflash, tail_tokens=BLOCK)
  st = _budget(dflash).spec
  with pytest.raises(ValueError, match="full-context DFlash only"):
    st.block_logits(dflash.params, None, jnp.zeros((1,), jnp.int32), 1, record=[])
  from longspec_jax.training.train_dflash_budget import DFlashBudgetTrainConfig
  with pytest.raises(ValueError, match="min_prompt"):
    DFlashBudgetTrainConfig(context_len=512, min_prompt=400, continuation_len=256)
  with pytest.raises(ValueError, match="one non-negative probability per budget"):
    DFlashBudgetTrainConfig(budgets=(64, 128), budget_probs=(1.0,))
  with pytest.raises(ValueError, match="distill must be one of"):  # the store fields' checks (StoreRunConfig)
    DFlashBudgetTrainConfig(distill="ce")
  with pytest.raises(ValueError, match="held_out_within_tokens must be >= 0"):
    DFlashBudgetTrainConfig(held_out_within_tokens=-1)


@pytest.mark.slow
def test_fine_tune_from_a_store_exports_a_lossless_drafter(setup, tmp_path):
  """A DFlash trained on a tiny store, fine-tuned multi-view on it: the prompt split lies in [min_prompt, ...]
  with anchors after it, drafter.json records both branches' held-out tau_sim before and after, and the export
  loads as `dflash-budget` (its draft vocabulary kept) and is lossless."""
  from longspec_jax.drafters import load_drafter
  from longspec_jax.targets import load_target
  from longspec_jax.training.distill_store import DistillStore, build_distill_store
  from longspec_jax.training.train_dflash_budget import DFlashBudgetTrainConfig, train_dflash_budget
  from longspec_jax.training.train_dflash import DFlashTrainConfig, train_dflash
  from longspec_jax.yaml_config import from_dict
  from tests.test_distill_store import _cfg
  store_dir = build_distill_store(_cfg(setup, "store"), show_progress=False)
  common = dict(store_dir=str(store_dir), batch_size=2, steps=3, optim=dict(lr=0.01, warmup_steps=1), val_fraction=0.3,
                val_windows=2, compute_dtype="float32", log_every=1, checkpoint_every_minutes=100.0)
  base = train_dflash(from_dict(DFlashTrainConfig, dict(
      common, distill="kl", out_dir=str(tmp_path / "df"), num_layers=1, num_target_taps=1, model=dict(
          intermediate_size=32), block_size=4, context_len=48, anchors_per_window=5, draft_vocab_size=64)))
  cfg = from_dict(DFlashBudgetTrainConfig, dict(common, init_dir=str(base), out_dir=str(tmp_path / "bd"),
                                                 budgets=[16, 24], budget_probs=[0.5, 0.5], context_len=96,
                                                 min_prompt=40, continuation_len=24, anchors_per_window=4))
  from longspec_jax.training.distill_store import StoreWindows
  from longspec_jax.training.train_dflash_budget import PromptSplitSampler
  from types import SimpleNamespace
  store = DistillStore(store_dir)
  sampler = PromptSplitSampler(StoreWindows(store, np.arange(len(store.windows)), 96, (2,), 1, 0), SimpleNamespace(
      **{**{k: getattr(cfg, k) for k in ("budgets", "budget_probs", "min_prompt", "continuation_len", "context_len",
                                         "anchors_per_window")}, "gamma": 1e9, "block_size": 4}))
  from longspec_jax.training.drafter_common import draw_windows
  checked = 0
  for step in range(3):
    bt = sampler.batch(step, 2)
    assert bt["num_chunks"][0] * CHUNK in (16, 24)
    _, picks, offs, _ = draw_windows(store.window_lengths(), 0, step, 2, 96, slice(None))
    for r, (i, off) in enumerate(zip(picks, offs)):
      valid = min(store.window_lengths()[i] - off, 96)
      if valid > 40 + 24 + 2:
        assert 40 <= bt["prompt_lens"][r] and (bt["anchors"][r] >= bt["prompt_lens"][r]).all()
        assert (bt["anchors"][r] < bt["prompt_lens"][r] + 24).all() and (bt["anchors"][r] <= valid - 2).all()
        checked += 1
  assert checked
  final = train_dflash_budget(cfg)
  info = json.loads((final / "drafter.json").read_text())
  assert set(info["val_tau_sim"]["trained"]) == {"full", "sparse_16", "sparse_24"}
  assert info["kind"] == "dflash-budget" and info["draft_vocab_size"] == 64 and str(tmp_path) not in json.dumps(info)
  root, model_dir, _ = setup
  tgt = load_target(model_dir)
  drafter = load_drafter("dflash-budget", tgt, final, budget=16)
  assert drafter.spec.budget == 16 and drafter.params["io"]["draft_ids"].shape == (64,)
  prompts = [list(range(3, 60)), [0, 40, 41]]
  ar = generate(tgt, prompts, max_new_tokens=8, eos_id=-1).tokens
  assert generate(tgt, prompts, max_new_tokens=8, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar
