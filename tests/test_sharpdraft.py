"""SharpDraft: the exact and fixed-slope rules, calibration on synthetic scores from the score model, the model's
query-scale hook (per-sequence rho, untouched where n <= n0), greedy losslessness, and loading errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.inference.generate import generate
from longspec_jax.attention import causal_attention
from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import PrefillResult, ProposeContext
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.model import Transformer, create_model
from longspec_jax.sampling import SamplingParams
from longspec_jax.sharpdraft import (SHARPDRAFT_FILE, SharpDraft, calibrate, exact_rho, fitted_alpha,
                                     load_sharpdraft, tangent_alpha)
from tests.compiled import compiled

V = 96
N0 = 24  # tiny drafters below "were trained" on 24 keys


def _cfg(layers, vocab=V):
  return ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=2048,
                     rope=RopeConfig(theta=10000.0), bos_token_id=0, eos_token_id=0, pad_token_id=1,
                     mask_token_id=2)


def _sharp(rule, layers=1, heads=4):
  """Hand-set statistics, different per head (one head diffuse: k = 0 -> no scaling)."""
  delta = [[6.0, 4.0, 3.0, 0.0]] * layers
  sigma = [[1.0, 1.5, 0.5, 1.2]] * layers
  k = [[1, 2, 3, 0]] * layers
  return SharpDraft.from_stats(rule, N0, np.asarray(delta)[:, :heads], np.asarray(sigma)[:, :heads],
                               np.asarray(k)[:, :heads])


def _hidden(model, tokens, sharpdraft=None, prefill=False):
  """Final hidden states [B, T, H] of a jitted forward (train mode, or prefill into a fresh cache)."""
  graphdef, params = nnx.split(model)

  def fwd(p, t):
    m = nnx.merge(graphdef, p)
    cache = m.init_cache(t.shape[0], 128) if prefill else None
    return m(t, cache=cache, mode="prefill" if prefill else "train", sharpdraft=sharpdraft).hidden
  return np.asarray(jax.jit(fwd)(params, jnp.asarray(tokens)))


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, V, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def target():
  return create_model(_cfg(2), seed=0)


@pytest.fixture(scope="module")
def small():
  return create_model(_cfg(1), seed=7)


# ------------------------------------------------------------------------------------------------ rules


def test_exact_root_satisfies_its_equation():
  delta, sigma, k, n0 = np.meshgrid([2.0, 5.0, 9.0], [0.3, 1.0, 1.3], [1.0, 4.0], [64.0, 512.0], indexing="ij")
  ok = delta > sigma ** 2
  delta, sigma, k, n0 = delta[ok], sigma[ok], k[ok], n0[ok]
  for scale in (1.0001, 1.5, 4.0, 32.0):
    n = n0 * scale
    rho = np.asarray(exact_rho(n, n0, delta, sigma, k), np.float64)
    rhs = delta - sigma ** 2 / 2 + np.log((n - k) / (n0 - k))
    reachable = rhs <= delta ** 2 / (2 * sigma ** 2)
    assert reachable.sum() > 10
    lhs = rho * delta - rho ** 2 * sigma ** 2 / 2
    np.testing.assert_allclose(lhs[reachable], rhs[reachable], rtol=1e-5)
    assert np.all(rho[reachable] > 1) and np.all(rho[reachable] <= delta[reachable] / sigma[reachable] ** 2 + 1e-5)
    # No root: the mass-maximising rho* = Delta / sigma^2 instead.
    np.testing.assert_allclose(rho[~reachable], (delta / sigma ** 2)[~reachable], rtol=1e-5)
  for n in (n0, n0 - 1, np.ones_like(n0)):
    assert np.all(np.asarray(exact_rho(n, n0, delta, sigma, k)) == 1.0)


def test_exact_rule_degenerate_cases():
  # sigma = 0: the equation is linear, rho = 1 + ln((n-k)/(n0-k)) / Delta.
  np.testing.assert_allclose(exact_rho(1000.0, 100, 4.0, 0.0, 2), 1 + np.log(998 / 98) / 4, rtol=1e-6)
  # Delta <= sigma^2 (scaling up only lowers the top-k mass) and k = 0 (diffuse head): no scaling.
  assert float(exact_rho(10_000.0, 100, 1.0, 1.2, 2)) == 1.0
  assert float(exact_rho(10_000.0, 100, 5.0, 1.0, 0)) == 1.0


def test_fixed_slope_matches_exact_to_first_order():
  n0 = 512
  delta, sigma, k = np.array([6.0, 3.0, 7.0]), np.array([1.0, 1.2, 2.0]), np.array([1.0, 5.0, 2.0])
  alpha = tangent_alpha(n0, delta, sigma, k)
  assert np.all(alpha > 0)
  for eps in (1e-2, 1e-3):
    n = n0 * np.exp(eps)
    ex = np.asarray(exact_rho(n, n0, delta, sigma, k), np.float64)
    slope = (ex - 1) / eps
    np.testing.assert_allclose(slope, alpha, rtol=15 * eps)  # error O(eps): second order in rho
  sd = SharpDraft.from_stats("fixed", n0, delta[None], sigma[None], k[None])
  n = jnp.array([[100, 512, 2048]])
  rho = np.asarray(sd.query_scale(0, n))[0]
  np.testing.assert_allclose(rho, np.maximum(1, 1 + alpha[None] * np.log(np.array([100, 512, 2048]) / n0)[:, None]),
                             rtol=1e-6)


def test_fitted_alpha_follows_exact_over_the_range():
  n0, n_max = 512, 16384
  delta, sigma, k = np.array([[6.0]]), np.array([[1.5]]), np.array([[2.0]])
  grid = np.geomspace(n0, n_max, 50)
  ex = np.asarray(compiled(exact_rho, grid[:, None, None], n0, delta, sigma, k), np.float64)
  err = {}
  for name, a in (("tangent", tangent_alpha(n0, delta, sigma, k)), ("fit", fitted_alpha(n0, delta, sigma, k, n_max))):
    err[name] = np.max(np.abs(1 + a * np.log(grid / n0)[:, None, None] - ex))
  assert fitted_alpha(n0, delta, sigma, k, n_max)[0, 0] > tangent_alpha(n0, delta, sigma, k)[0, 0]  # convex rule
  assert err["fit"] < err["tangent"] / 2


# ------------------------------------------------------------------------------------------- calibration


def _synthetic_scores(rng, q, n, delta, sigma, k):
  """Score model: k relevant keys at mu + Delta (small jitter), n - k background keys ~ N(mu, sigma^2)."""
  mu = rng.normal(0.0, 2.0, (q, 1))  # the level moves from query to query; only margins matter
  s = mu + sigma * rng.standard_normal((q, n))
  s[:, :k] = mu + delta + 0.1 * rng.standard_normal((q, k))
  return rng.permuted(s, axis=1)


def test_calibration_recovers_known_alpha():
  rng = np.random.default_rng(0)
  n0, q = 512, 256
  truth = [(5.0, 1.0, 3), (7.0, 1.6, 1), (0.0, 1.0, 0)]  # the last head is pure background
  heads = [_synthetic_scores(rng, q, n0, *t) if t[2] else 1.0 * rng.standard_normal((q, n0)) for t in truth]
  res = calibrate([np.stack(heads, axis=1)], granularity="head")
  assert res["n0"] == n0
  a = res["applied"]
  for h, (delta, sigma, k) in enumerate(truth):
    assert a["k"][0][h] == k
    if k:
      assert a["delta"][0][h] == pytest.approx(delta, rel=0.02)
      assert a["sigma"][0][h] == pytest.approx(sigma, rel=0.02)
      assert a["alpha"][0][h] == pytest.approx(tangent_alpha(n0, delta, sigma, k), rel=0.05)
      assert res["heads"][0][h]["model_top_k_mass"] == pytest.approx(res["heads"][0][h]["top_k_mass"], rel=0.1)
    else:
      assert a["alpha"][0][h] == 0.0
  # Coarser granularities share one set of statistics across the pool.
  same = [np.stack([_synthetic_scores(rng, q, n0, 5.0, 1.0, 3) for _ in range(2)], axis=1)] * 2
  for g in ("layer", "drafter"):
    r = calibrate(same, granularity=g)
    assert len({x for layer in r["applied"]["alpha"] for x in layer}) == 1
    assert r["applied"]["alpha"][0][0] == pytest.approx(tangent_alpha(n0, 5.0, 1.0, 3), rel=0.05)


# ---------------------------------------------------------------------------------------------- the hook


def test_attention_logits_are_the_logits_attention_uses(small):
  """softmax(logits) @ V of layer 0 reproduces the model's own causal attention output of the last query."""
  tokens = jnp.asarray(_prompts([40, 40], seed=1))
  logits = compiled(Transformer.last_query_attention_logits, small, tokens)
  assert len(logits) == 1 and logits[0].shape == (2, 4, 1, 40)
  from longspec_jax.rope import rope_frequencies

  def attention_of_layer_0(model, tokens):
    layer = model.layers[0]
    pos = jnp.broadcast_to(jnp.arange(40)[None], (2, 40))
    q, k, v = layer.self_attn.qkv(layer.input_layernorm(model.embed(tokens)), pos, rope_frequencies(model.cfg, 39))
    return causal_attention(q, k, v)[:, -1], v  # [B, Hq, D]
  ref, v = compiled(attention_of_layer_0, small, tokens)
  got = jnp.einsum("bhk,bkhd->bhd", jax.nn.softmax(logits[0][:, :, 0], -1), jnp.repeat(v, 2, axis=2))
  np.testing.assert_allclose(got, ref, atol=1e-5)


class _Constant:
  """A SharpDraft stand-in whose scale is `rho` for every query, applied by the real hook."""

  def __init__(self, rho):
    self.rho = rho

  def query_scale(self, layer, num_keys):
    return jnp.full(num_keys.shape + (4,), self.rho, jnp.float32)

  scale_queries = SharpDraft.scale_queries


def test_default_hook_is_bit_identical(small):
  tokens = _prompts([50], seed=2)
  base = _hidden(small, tokens)
  assert np.array_equal(_hidden(small, tokens, _Constant(1.0)), base)
  assert not np.allclose(_hidden(small, tokens, _Constant(2.0)), base, atol=1e-3)


LENGTHS = [10, N0 - 4, 60]


@pytest.mark.parametrize("rule", ["fixed", "exact"])
def test_mixed_lengths_get_per_sequence_rho(rule):
  sd = _sharp(rule)
  n = jnp.asarray(LENGTHS)[:, None]
  rho = np.asarray(sd.query_scale(0, n))[:, 0]  # [B, Hq] at each sequence's own count
  assert np.all(rho[:2] == 1.0)
  assert np.all(rho[2, :3] > 1.0) and rho[2, 3] == 1.0  # head 3 is diffuse (k = 0)
  if rule == "fixed":
    np.testing.assert_allclose(rho[2], 1 + np.asarray(sd.alpha[0]) * np.log(60 / N0), rtol=1e-6)
  else:
    np.testing.assert_allclose(rho[2], exact_rho(60, N0, sd.delta[0], sd.sigma[0], sd.k[0]), rtol=1e-6)


def test_mixed_batch_changes_only_beyond_n0(small):
  sd, lengths, t = _sharp("exact"), LENGTHS, 64
  tokens = np.full((3, t), 1, np.int32)
  for i, p in enumerate(_prompts(lengths, seed=3)):
    tokens[i, :len(p)] = p

  # Prefill: hidden states are bit-identical where the query saw <= n0 keys and differ beyond.
  plain = _hidden(small, tokens, prefill=True)
  scaled = _hidden(small, tokens, sd, prefill=True)
  same = np.all(plain == scaled, axis=-1)  # [B, T]
  assert same[:, :N0].all() and not same[:, N0:].any()

  # PARD proposals (sampling probs) in one batch: unchanged for the sequences that stay within n0.
  drafts = {}
  for name, s in (("off", None), ("on", sd)):
    d = standalone_from_model(small, "pard", sharpdraft=s)
    buf = jnp.zeros((3, 128), jnp.int32).at[:, :t].set(tokens)
    pre = PrefillResult(prompt_tokens=jnp.asarray(tokens), tokens=buf, prompt_lens=jnp.asarray(lengths), taps=None,
                        new_kv=None, target_cache=None)
    state = jax.jit(d.spec.init_state, static_argnums=2)(d.params, pre, 128)
    ctx = ProposeContext(tokens=buf, num_tokens=jnp.asarray(lengths), sampling=SamplingParams.make(1.0, 0, 1.0))
    propose = jax.jit(d.spec.propose, static_argnums=(4, 5))
    drafts[name] = np.asarray(propose(d.params, state, ctx, jax.random.key(0), 4, True)[1])
  # Sequence 1 ends at N0 - 4 keys, its 3 mask queries reach N0 - 1: still unscaled.
  np.testing.assert_array_equal(drafts["on"][:2], drafts["off"][:2])
  assert np.abs(drafts["on"][2] - drafts["off"][2]).max() > 1e-4


@pytest.mark.parametrize("mode,rule", [("pard", "fixed"), ("pard", "exact"), ("classic", "exact")])
def test_greedy_spec_with_sharpdraft_equals_ar(target, small, rule, mode):
  prompts = _prompts([5, 40, 90, 17], seed=4)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  drafter = standalone_from_model(small, mode, sharpdraft=_sharp(rule))
  sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=drafter, num_draft=4)
  assert sp.tokens == ar.tokens


# ------------------------------------------------------------------------------------------------ loading


def test_loading_from_drafter_dir(tmp_path, target, small):
  from longspec_jax.hf_io import save_model_dir
  save_model_dir(small, tmp_path)
  (tmp_path / "drafter.json").write_text(json.dumps({"mode": "pard", "mask_token_id": 2, "n0": N0}))
  with pytest.raises(FileNotFoundError, match="calibrate-sharpdraft --drafter pard"):
    load_drafter("pard", target, tmp_path, sharpdraft="fixed")
  assert load_drafter("pard", target, tmp_path).spec.sharpdraft is None

  rng = np.random.default_rng(0)
  scores = np.stack([_synthetic_scores(rng, 64, N0, 5.0, 1.0, 2) for _ in range(4)], axis=1)
  (tmp_path / SHARPDRAFT_FILE).write_text(json.dumps(calibrate([scores])))
  for rule in ("fixed", "exact"):
    sd = load_drafter("pard", target, tmp_path, sharpdraft=rule).spec.sharpdraft
    assert sd == load_sharpdraft(tmp_path, rule) and sd.rule == rule and sd.n0 == N0
    hash(sd)  # a static jit argument
  with pytest.raises(ValueError, match="has none"):
    load_drafter("prompt-lookup", target, tmp_path, sharpdraft="exact")
  with pytest.raises(ValueError, match="sharpdraft must be one of"):
    load_drafter("pard", target, tmp_path, sharpdraft="on")
  with pytest.raises(ValueError, match="2 layers"):
    standalone_from_model(small, "pard", sharpdraft=_sharp("fixed", layers=2))


def test_report_recovery_fraction(tmp_path):
  from scripts.sharpdraft_report import main
  taus = {("off", 512): 3.0, ("off", 16384): 2.0, ("fixed", 16384): 2.5, ("exact", 16384): 2.75,
          ("fixed", 512): 3.0}
  cells = [{"method": "pard" if variant == "off" else f"pard:sharpdraft={variant}", "name": "pard",
            "options": {} if variant == "off" else {"sharpdraft": variant}, "context": ctx, "temperature": 0.0,
            "prompts": [0, 1], "tau_per_prompt": [tau, tau + 0.2]}  # the same drop on a second prompt
           for (variant, ctx), tau in taus.items()]
  (tmp_path / "results.json").write_text(json.dumps({"cells": cells}))  # as `longspec bench-suite` writes it
  out = tmp_path / "report"
  assert main(["--results", str(tmp_path), "--out", str(out), "--n0", "pard=512"]) == 0
  rec = json.loads((out / "sharpdraft_report.json").read_text())["recovery"]["pard"]
  assert rec["fixed"]["recovered"] == pytest.approx(0.5) and rec["exact"]["recovered"] == pytest.approx(0.75)
  assert rec["fixed"]["prompts"] == 2 and rec["fixed"]["long"] == 16384
  assert "| pard | fixed | 3.100 (2) | 2.600 (2) |" in (out / "sharpdraft_report.md").read_text()


def test_calibrate_cli_writes_sharpdraft_json(tmp_path, capsys):
  import datasets

  from longspec_jax.inference.cli import main
  from longspec_jax.hf_io import save_model_dir
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe

  docs = [" ".join(f"value_{d}_{i} = compute({i}, {d})" for i in range(120)) for d in range(6)]
  target_dir, drafter_dir, corpus = tmp_path / "target", tmp_path / "drafter", tmp_path / "corpus"
  save_model_dir(create_model(_cfg(2, vocab=320), seed=0), target_dir)
  save_hf_tokenizer(train_bpe(docs, vocab_size=320), target_dir)
  save_model_dir(create_model(_cfg(1, vocab=320), seed=7), drafter_dir)
  (drafter_dir / "drafter.json").write_text(json.dumps({"mode": "pard", "mask_token_id": 2, "n0": 64}))
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(corpus))
  argv = ["calibrate-sharpdraft", "--drafter", "pard", "--drafter-dir", str(drafter_dir), "--model",
          str(target_dir), "--corpus", str(corpus), "--num-windows", "16", "--granularity", "layer"]
  assert main(argv) == 0
  res = json.loads((drafter_dir / SHARPDRAFT_FILE).read_text())
  assert res["n0"] == 64 and res["num_windows"] == 16 and res["granularity"] == "layer"
  assert res["text_source"].startswith("corpus train split") and len(res["heads"][0]) == 4
  assert np.shape(res["applied"]["alpha"]) == (1, 4)
  assert load_sharpdraft(drafter_dir, "exact").n0 == 64
  save_model_dir(create_model(_cfg(1, vocab=320), seed=8), drafter_dir)  # retrained: calibration is stale
  with pytest.raises(ValueError, match="other weights"):
    load_sharpdraft(drafter_dir, "exact")

  # Without a corpus: the drafter's own training rows (drafter.json data.dir), or a clear error.
  rows = [{"prompt": list(range(3, 40)), "continuation": list(range(40, 90))}] * 4
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "rows" / "dataset"))
  (drafter_dir / "drafter.json").write_text(json.dumps({"n0": 64, "data": {"dir": str(tmp_path / "rows")}}))
  assert main(argv[:-6] + ["--corpus", str(tmp_path / "none"), "--num-windows", "4"]) == 0
  assert json.loads((drafter_dir / SHARPDRAFT_FILE).read_text())["text_source"].startswith("drafter training rows")
  (drafter_dir / "drafter.json").write_text(json.dumps({"n0": 64}))
  assert main(argv[:-6] + ["--corpus", str(tmp_path / "none")]) == 2
  assert "no corpus" in capsys.readouterr().err
