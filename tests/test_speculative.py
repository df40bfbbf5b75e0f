"""Speculative decoding engine: greedy exactness vs AR for every drafter, a statistical test of lossless
sampling (with a negative control), recompilation counting, fixed-shape drafter state, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from longspec_jax.inference import engine
from longspec_jax.inference.generate import generate
from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.drafters.base import LoadedDrafter, PrefillResult, ProposeContext, VerifyResult
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.model import create_model
from longspec_jax.sampling import SamplingParams, processed_log_probs
from tests.compiled import compiled

V = 96


def _cfg(layers=2, vocab=V):
  return ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=48, intermediate_size=96,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                     max_position_embeddings=2048, rope=RopeConfig(theta=10000.0), bos_token_id=0,
                     eos_token_id=0, pad_token_id=1, mask_token_id=2)


@pytest.fixture(scope="module")
def target():
  return create_model(_cfg(), seed=0)


@pytest.fixture(scope="module")
def drafters(target):
  other = create_model(_cfg(layers=1), seed=7)
  return {
      "prompt-lookup": LoadedDrafter(PromptLookupDrafter(V)),
      "standalone": standalone_from_model(other, "classic"),
      "pard": standalone_from_model(other, "pard"),
      "self": standalone_from_model(target, "classic"),  # drafts = target: every draft accepted
  }


def _prompts(batch, lengths, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(batch):
    n = lengths[i % len(lengths)]
    base = rng.integers(3, V, max(2, n // 3)).tolist()
    out.append((base * 4)[:n])  # repetition gives prompt lookup something to find
  return out


@pytest.mark.parametrize("name", ["prompt-lookup", "standalone", "pard", "self"])
@pytest.mark.parametrize("batch,lengths", [(1, [5]), (1, [70]), (4, [3, 40, 17, 90])])
def test_greedy_spec_equals_ar(target, drafters, name, batch, lengths):
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  # K = 1 (a single draft row) on the shortest prompt and the ragged batch; the 70-token prompt at K = 4 only
  for k in (1, 4) if lengths != [70] else (4,):
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=drafters[name], num_draft=k)
    assert sp.tokens == ar.tokens, f"{name} K={k}"
    assert all(len(t) == 24 for t in sp.tokens)
  if name == "self":
    assert sp.stats["accept_per_position"] == [1.0] * 4


def test_eos_stops_each_sequence_in_spec(target, drafters):
  prompts = _prompts(3, [6, 30, 12], seed=3)
  free = generate(target, prompts, max_new_tokens=20, eos_id=-1).tokens
  eos = free[1][5]
  ar = generate(target, prompts, max_new_tokens=20, eos_id=eos).tokens
  sp = generate(target, prompts, max_new_tokens=20, eos_id=eos, drafter=drafters["self"], num_draft=4)
  assert sp.tokens == ar
  assert len(sp.tokens[1]) <= 6 and sp.tokens[1][-1] == eos


def test_no_recompile_within_bucket(target, drafters):
  d = drafters["pard"]
  generate(target, _prompts(2, [10, 20]), max_new_tokens=16, drafter=d, num_draft=3)
  # Greedy and sampling are two decode programs (sampling also carries draft probabilities).
  generate(target, _prompts(2, [10, 20]), max_new_tokens=16, drafter=d, num_draft=3, temperature=0.9)
  compiled = lambda: engine.prefill_program._cache_size() + engine.decode_program._cache_size()
  n = compiled()
  generate(target, _prompts(2, [33, 7], seed=5), max_new_tokens=16, drafter=d, num_draft=3, seed=4)
  generate(target, _prompts(2, [12, 9], seed=6), max_new_tokens=16, drafter=d, num_draft=3, temperature=0.5,
           top_p=0.8)
  assert compiled() == n


def _fake_verify(tokens, num_tokens, k, cache):
  b = tokens.shape[0]
  return VerifyResult(start=num_tokens - 1, num_accepted=jnp.ones((b,), jnp.int32),
                      committed=jnp.zeros((b, k + 1), jnp.int32), num_committed=jnp.full((b,), 2, jnp.int32),
                      taps=None, new_kv=None, tokens=tokens, num_tokens=num_tokens + 2)


@pytest.mark.parametrize("name", ["prompt-lookup", "standalone", "pard"])
def test_drafter_state_shape_constant(target, drafters, name):
  d = drafters[name]
  b, t, max_len, k = 2, 16, 64, 3
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, max_len)), jnp.int32)
  cache = target.init_cache(b, max_len)
  pre = PrefillResult(prompt_tokens=toks[:, :t], tokens=toks, prompt_lens=jnp.asarray([16, 9]), taps=None,
                      new_kv=None, target_cache=cache)
  s0 = compiled(d.spec.init_state, d.params, pre, max_len)
  ctx = ProposeContext(tokens=toks, num_tokens=jnp.asarray([17, 10]), sampling=SamplingParams.make(1.0))
  drafts, probs, s1 = compiled(d.spec.propose, d.params, s0, ctx, jax.random.key(0), k, True)
  s2 = compiled(d.spec.update, d.params, s1, _fake_verify(toks, ctx.num_tokens, k, cache))
  shape = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shape(s0) == shape(s1) == shape(s2)
  assert drafts.shape == (b, k) and probs.shape == (b, k, V)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-5)


# ---- Statistical test of lossless sampling -------------------------------------------------------------------

PREFIX = [5, 17, 33, 8]
N_SAMPLES = 2000
N_POS = 3


def _exact_marginals(model, sp):
  """Exact marginal distribution of new tokens 1..N_POS under the processed target distribution."""
  from flax import nnx
  graphdef, params = nnx.split(model)
  fwd = jax.jit(lambda p, t: processed_log_probs(nnx.merge(graphdef, p)(t, mode="train").logits[:, -1], sp))

  def cond(seqs):
    seqs = np.asarray(seqs)
    rows = -(-len(seqs) // 512) * 512  # one padded shape per prefix length
    padded = np.concatenate([seqs, np.repeat(seqs[:1], rows - len(seqs), 0)])
    return np.exp(np.asarray(fwd(params, jnp.asarray(padded)), np.float64))[:len(seqs)]

  marg = []
  p1 = cond([PREFIX])[0]
  marg.append(p1)
  seqs, w = [PREFIX + [a] for a in range(V)], p1
  p2 = cond(seqs)  # [V, V]
  marg.append((w[:, None] * p2).sum(0))
  joint = (w[:, None] * p2).reshape(-1)
  keep = np.flatnonzero(joint > 1e-7)  # negligible pairs dropped; their mass goes into the tolerance below
  seqs3 = [PREFIX + [int(i // V), int(i % V)] for i in keep]
  p3 = np.concatenate([cond(seqs3[i:i + 512]) for i in range(0, len(seqs3), 512)])
  marg.append((joint[keep][:, None] * p3).sum(0))
  return marg


def _chi2_pvalues(samples, marginals):
  """Chi-square goodness of fit per position; bins with expected count < 5 are pooled."""
  pvals = []
  for pos in range(N_POS):
    counts = np.bincount([s[pos] for s in samples], minlength=V).astype(np.float64)
    expected = marginals[pos] / marginals[pos].sum() * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a tiny remainder into the smallest kept bin
      i = np.argmin(exp[:-1])
      obs[i] += obs[-1]
      exp[i] += exp[-1]
      obs, exp = obs[:-1], exp[:-1]
    pvals.append(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
  return pvals


def _sample(target, drafter, temperature, top_k, top_p, seed):
  prompts = [PREFIX] * N_SAMPLES
  kw = dict(max_new_tokens=N_POS, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=-1)
  if drafter is None:
    return generate(target, prompts, **kw).tokens
  return generate(target, prompts, drafter=drafter, num_draft=2, **kw).tokens


def peaky_model():
  """Larger logits than a fresh init, so the distribution is neither flat nor one-hot."""
  model = create_model(_cfg(), seed=3)
  from flax import nnx
  state = nnx.state(model, nnx.Param)
  emb = state["embed_tokens"]["embedding"]
  emb[...] = emb[...] * 3.0
  nnx.update(model, state)
  return model


@pytest.fixture(scope="module")
def peaky_target():
  return peaky_model()


@pytest.mark.parametrize("drafter_name,temperature,top_k,top_p", [
    (None, 1.0, 0, 1.0),
    ("standalone", 1.0, 0, 1.0),
    ("standalone", 0.8, 20, 0.9),
    ("pard", 1.0, 0, 1.0),
    ("prompt-lookup", 1.0, 0, 1.0),
])
def test_sampling_matches_target_distribution(peaky_target, drafters, drafter_name, temperature, top_k, top_p):
  sp = SamplingParams.make(temperature, top_k, top_p)
  marg = _exact_marginals(peaky_target, sp)
  samples = _sample(peaky_target, drafters.get(drafter_name), temperature, top_k, top_p, seed=11)
  pvals = _chi2_pvalues(samples, marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"  # Bonferroni over positions


def test_broken_sampler_is_detected(peaky_target, drafters, monkeypatch):
  """Negative control: accepting every draft (no rejection step) samples q, not p, and the test must see it."""
  def accept_all(key, target_logits, drafts, draft_probs, sp):
    b, k1 = target_logits.shape[:2]
    bonus = jax.random.categorical(key, processed_log_probs(target_logits[:, -1], sp))
    return jnp.full((b,), k1 - 1, jnp.int32), jnp.concatenate([drafts, bonus[:, None].astype(jnp.int32)], 1)

  jax.clear_caches()
  monkeypatch.setattr(engine, "verify_sampling", accept_all)
  sp = SamplingParams.make(1.0)
  samples = _sample(peaky_target, drafters["standalone"], 1.0, 0, 1.0, seed=11)
  jax.clear_caches()
  assert min(_chi2_pvalues(samples, _exact_marginals(peaky_target, sp))) < 1e-4


def test_bad_input(target, drafters):
  wrong_vocab = standalone_from_model(create_model(_cfg(layers=1, vocab=V + 8), seed=1))
  with pytest.raises(ValueError, match="vocabulary"):
    generate(target, [[3, 4, 5]], drafter=wrong_vocab, num_draft=2)
  with pytest.raises(ValueError, match=r"num_draft must be in 1\.\.64"):
    generate(target, [[3, 4, 5]], drafter=drafters["pard"], num_draft=0)
  with pytest.raises(ValueError, match="exceeds the model's maximum context"):
    generate(target, [[3] * 2000], max_new_tokens=40, drafter=drafters["pard"], num_draft=16)
  with pytest.raises(ValueError, match="mode must be one of"):
    standalone_from_model(target, "turbo")


def test_prompt_lookup_proposals():
  d = PromptLookupDrafter(V, max_ngram=3)
  toks = np.zeros((2, 32), np.int32)
  toks[0, :10] = [9, 4, 5, 6, 7, 4, 5, 6, 7, 4]  # period-4 repeat: continues 5 6 7 4 5 6 ...
  toks[1, :6] = [10, 11, 12, 13, 14, 15]  # no earlier match: repeats the last token
  ctx = ProposeContext(tokens=jnp.asarray(toks), num_tokens=jnp.asarray([10, 6]),
                       sampling=SamplingParams.make())
  drafts, probs, _ = d.propose(None, (), ctx, jax.random.key(0), 6, False)
  assert drafts.tolist() == [[5, 6, 7, 4, 5, 6], [15] * 6] and probs is None
