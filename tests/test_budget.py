"""BudgetDraft: lossless with a budget on (greedy exactness, chi-square sampling), fixed state size past the budget,
chunk selection against a numpy reference of the scoring rule, full budget == standalone drafter, and the
multi-view training forward == the inference forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.inference.generate import generate
from longspec_jax.attention import dense_masked_attention
from longspec_jax.drafters.base import PrefillResult, state_nbytes
from longspec_jax.drafters.budget import CHUNK, budget_from_model, select_budget_chunks
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.model import create_model
from tests import test_speculative as ts
from tests.compiled import compiled
from tests.test_speculative import _cfg, _prompts, peaky_target  # noqa: F401  (fixture)

V = ts.V


@pytest.fixture(scope="module")
def target():
  return create_model(_cfg(), seed=0)


@pytest.fixture(scope="module")
def small_drafter():
  return create_model(_cfg(layers=1), seed=7)


@pytest.mark.parametrize("keep_recent", [True, False])
def test_greedy_spec_equals_ar_with_budget(target, small_drafter, keep_recent):
  prompts = _prompts(3, [70, 149, 37])  # over the budget, partial last chunks, one prompt under it
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  for k in (1, 4):
    d = budget_from_model(small_drafter, budget=40, keep_recent=keep_recent, tail_tokens=16)  # tail wraps
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=d, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"


def test_self_drafting_with_full_budget_accepts_everything(target):
  # Budget over the prompt = the drafter's full cache: the target drafting for itself is always right.
  d = budget_from_model(target, budget=256, tail_tokens=64)
  sp = generate(target, _prompts(1, [70]), max_new_tokens=20, eos_id=-1, drafter=d, num_draft=4)
  assert sp.stats["accept_per_position"] == [1.0] * 4


LONG_PREFIX = np.random.default_rng(5).integers(3, V, 45).tolist()


@pytest.mark.parametrize("keep_recent", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_sampling_matches_target_distribution_with_budget(peaky_target, small_drafter, monkeypatch,
                                                          keep_recent):
  monkeypatch.setattr(ts, "PREFIX", LONG_PREFIX)  # 45 tokens: the 16-token budget drops most of the prompt
  sp = ts.SamplingParams.make(1.0, 0, 1.0)
  marg = ts._exact_marginals(peaky_target, sp)
  d = budget_from_model(small_drafter, budget=16, keep_recent=keep_recent)
  samples = ts._sample(peaky_target, d, 1.0, 0, 1.0, seed=11)
  pvals = ts._chi2_pvalues(samples, marg)
  assert min(pvals) > 0.01 / ts.N_POS, f"chi-square p-values {pvals}"


def _prefill(tokens, lens):
  return PrefillResult(prompt_tokens=tokens, tokens=tokens, prompt_lens=lens, taps=None, new_kv=None,
                       target_cache=None)


def test_state_bytes_flat_past_budget(small_drafter):
  d = budget_from_model(small_drafter, budget=32, tail_tokens=24)
  full = standalone_from_model(small_drafter)
  sizes, full_sizes = [], []
  for t in (40, 200, 600):
    toks = jnp.asarray(np.random.default_rng(t).integers(3, V, (2, t)), jnp.int32)
    pre = _prefill(toks, jnp.asarray([t, t - 5]))
    # Shapes only (no compute): the state's size is a function of its shapes.
    sizes.append(state_nbytes(jax.eval_shape(lambda p: d.spec.init_state(p, pre, t + 64), d.params)))
    full_sizes.append(state_nbytes(jax.eval_shape(lambda p: full.spec.init_state(p, pre, t + 64), full.params)))
  assert sizes[0] == sizes[1] == sizes[2]
  assert full_sizes[2] > 10 * sizes[2]


def _numpy_selection(k, lens, budget, keep_recent):
  """Per (b, kv head): the set of kept chunk indices, from the rule written out directly."""
  b, _, hkv, _ = k.shape
  out = {}
  for bi in range(b):
    p = int(lens[bi])
    n_full, n_all = p // CHUNK, -(-p // CHUNK)
    for h in range(hkv):
      if p <= budget:
        out[bi, h] = set(range(n_all))
        continue
      proxy = k[bi, p - 1, h].astype(np.float64)
      keep = {0}
      if keep_recent:
        keep.add(n_all - 1)
        cands = range(1, n_all - 1)
        n_top = budget // CHUNK - 2
      else:
        cands = range(1, n_full)
        n_top = budget // CHUNK - 1
      scores = {c: proxy @ k[bi, c * CHUNK:(c + 1) * CHUNK, h].astype(np.float64).mean(0) for c in cands}
      keep |= set(sorted(scores, key=lambda c: -scores[c])[:n_top])
      out[bi, h] = keep
  return out


@pytest.mark.parametrize("keep_recent", [True, False])
def test_selection_matches_numpy_reference(keep_recent):
  rng = np.random.default_rng(1)
  k = rng.standard_normal((3, 160, 2, 8)).astype(np.float32)
  lens = np.asarray([157, 160, 30])  # partial last chunk, full chunks only, under the budget
  idx = np.asarray(compiled(select_budget_chunks, jnp.asarray(k), jnp.asarray(lens), 64, keep_recent))
  ref = _numpy_selection(k, lens, 64, keep_recent)
  for (bi, h), want in ref.items():
    got = idx[bi, h][idx[bi, h] >= 0]
    assert len(set(got.tolist())) == len(got) and set(got.tolist()) == want, (bi, h)
  # A smaller traced budget keeps the prefix of the ranking: the training draw == a smaller static budget.
  part = np.asarray(compiled(select_budget_chunks, jnp.asarray(k), jnp.asarray(lens), 64, keep_recent,
                            num_chunks=jnp.full((3,), 4, jnp.int32)))
  small = _numpy_selection(k, lens, 32, keep_recent)
  for (bi, h), want in small.items():
    assert set(part[bi, h][part[bi, h] >= 0].tolist()) == want, (bi, h)


def _teacher_forced(spec, params, prompt, lens, cont):
  """Inference path: prefill + sparsify, then the continuation fed one token at a time (as drafting does)."""
  state = jax.jit(spec.init_state, static_argnums=2)(params, _prefill(prompt, lens), 0)
  forward = jax.jit(spec.forward)
  logits = []
  for r in range(cont.shape[1]):
    pos = (lens + r)[:, None]
    lg, state = forward(params, state, cont[:, r:r + 1], pos, jnp.ones_like(pos, bool))
    logits.append(lg[:, 0])
  return jnp.stack(logits, axis=1)


@pytest.mark.parametrize("keep_recent", [True, False])
def test_training_forward_equals_inference_forward(keep_recent):
  from longspec_jax.drafters.budget import multiview_forward
  cfg = _cfg(layers=2)
  model = create_model(cfg, seed=4)
  rng = np.random.default_rng(2)
  lens = jnp.asarray([117, 88])
  prompt = jnp.asarray(rng.integers(3, V, (2, 120)), jnp.int32)
  cont = jnp.asarray(rng.integers(3, V, (2, 6)), jnp.int32)
  batch = {"prompt": prompt, "prompt_lens": lens, "cont": cont, "num_chunks": jnp.full((2,), 4, jnp.int32)}
  full, sparse = jax.jit(multiview_forward, static_argnums=(2, 3))(model, batch, 64, keep_recent)
  d = budget_from_model(model, budget=32, keep_recent=keep_recent)
  np.testing.assert_allclose(sparse, _teacher_forced(d.spec, d.params, prompt, lens, cont), atol=2e-4, rtol=2e-4)
  d_full = budget_from_model(model, budget=128, keep_recent=keep_recent)  # over every prompt: the full cache
  np.testing.assert_allclose(full, _teacher_forced(d_full.spec, d_full.params, prompt, lens, cont), atol=2e-4,
                             rtol=2e-4)
  seq = jnp.concatenate([prompt[:1, :117], cont[:1]], axis=1)
  np.testing.assert_allclose(full[0], compiled(model, seq, mode="train").logits[0, 117:], atol=2e-4, rtol=2e-4)
  assert np.abs(np.asarray(full - sparse)).max() > 1e-3  # the budget does drop keys here


def test_dense_masked_attention_per_kv_head_mask():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 10, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 10, 2, 8)), jnp.float32)
  vis = jnp.asarray(rng.random((2, 2, 3, 10)) < 0.6).at[..., 0].set(True)
  out = compiled(dense_masked_attention, q, k, v, vis)
  for h in range(2):  # KV head h serves q heads 2h, 2h+1
    ref = compiled(dense_masked_attention, q[:, :, 2 * h:2 * h + 2], k[:, :, h:h + 1], v[:, :, h:h + 1], vis[:, h])
    np.testing.assert_allclose(out[:, :, 2 * h:2 * h + 2], ref, atol=1e-6)


def test_bad_budget_is_one_clear_error(small_drafter):
  for bad in (12, 8, 100):
    with pytest.raises(ValueError, match="budget must be a multiple of 8"):
      budget_from_model(small_drafter, budget=bad)


def test_budget_flag_only_for_budget_methods(target):
  from longspec_jax.drafters import load_drafter
  with pytest.raises(ValueError, match="--budget applies to budget"):
    load_drafter("standalone", target, budget=256)
  with pytest.raises(ValueError, match="SharpDraft scales drafter attention"):
    load_drafter("budget", target, sharpdraft="fixed")


def test_shipped_budget_drafter_loads():
  from longspec_jax import default_target_dir
  from longspec_jax.drafters import load_drafter
  from longspec_jax.hf_io import load_model_dir
  target = load_model_dir(default_target_dir())
  d = load_drafter("budget", target, budget=64)
  assert d.spec.budget == 64 and d.spec.keep_recent and d.spec.vocab_size == target.cfg.vocab_size
