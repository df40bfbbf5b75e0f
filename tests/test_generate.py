"""AR generate(): exactness vs a naive loop, ragged batches, EOS, sampling params, recompilation counting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.inference.engine import bucket, decode_program, prefill_program
from longspec_jax.inference.generate import generate


def naive_greedy(model, prompt, n, width=64):
  """Full causal forward over the whole sequence each step (no cache), padded to one jitted shape."""
  graphdef, params = nnx.split(model)
  fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, mode="train").logits[0])
  seq = list(prompt)
  for _ in range(n):
    padded = jnp.asarray([seq + [0] * (width - len(seq))])
    seq.append(int(jnp.argmax(fwd(params, padded)[len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_matches_naive_loop_ragged_batch(tiny_model):
  prompts = [[5, 9, 33, 7, 100, 2, 45], [17, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
  res = generate(tiny_model, prompts, max_new_tokens=12, eos_id=-1)
  for p, got in zip(prompts, res.tokens):
    assert got == naive_greedy(tiny_model, p, 12)
  assert res.prompt_lengths == [7, 2, 11]


def test_stops_at_eos_per_sequence(tiny_model):
  prompts = [[5, 9, 33], [17, 3, 8, 8]]
  free = generate(tiny_model, prompts, max_new_tokens=10, eos_id=-1).tokens
  eos = free[0][3]  # make the 4th token of sequence 0 the EOS
  res = generate(tiny_model, prompts, max_new_tokens=10, eos_id=eos).tokens
  for got, ref in zip(res, free):
    cut = ref.index(eos) + 1 if eos in ref else 10
    assert got == ref[:cut]
  assert res[0][-1] == eos and len(res[0]) <= 4


def test_sampling_is_seeded_and_respects_top_k(tiny_model):
  p = [[5, 9, 33, 7]]
  a = generate(tiny_model, p, max_new_tokens=16, temperature=1.0, seed=3, eos_id=-1).tokens
  b = generate(tiny_model, p, max_new_tokens=16, temperature=1.0, seed=3, eos_id=-1).tokens
  c = generate(tiny_model, p, max_new_tokens=16, temperature=1.0, seed=4, eos_id=-1).tokens
  assert a == b and a != c
  # top_k=1 is greedy whatever the temperature.
  k1 = generate(tiny_model, p, max_new_tokens=16, temperature=2.0, top_k=1, seed=5, eos_id=-1).tokens
  assert k1 == generate(tiny_model, p, max_new_tokens=16, eos_id=-1).tokens


def _compiled_programs():
  return prefill_program._cache_size() + decode_program._cache_size()


def test_no_recompile_within_bucket(tiny_model):
  generate(tiny_model, [[1, 2, 3, 4, 5]], max_new_tokens=8)
  before = _compiled_programs()
  generate(tiny_model, [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]], max_new_tokens=8, temperature=0.7, seed=9)
  generate(tiny_model, [[7] * 40], max_new_tokens=5, top_p=0.5, temperature=1.0)
  assert _compiled_programs() == before
  generate(tiny_model, [[7] * 100], max_new_tokens=8)  # next prompt bucket: a new prefill and decode program
  assert _compiled_programs() == before + 2


def test_bucket_sizes():
  assert bucket(1) == 64 and bucket(64) == 64 and bucket(65) == 128
  assert bucket(16384 + 300) <= 1.125 * (16384 + 300)
  for n in range(1, 5000, 37):
    assert n <= bucket(n) <= max(1.125 * n, n + 64)


def _reference_log_probs(logits, temperature, top_k, top_p):
  """numpy: temperature, then top-k, then the smallest top-p prefix of the sorted distribution."""
  z = logits / (temperature if temperature > 0 else 1.0)
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(z.shape, bool)
  keep[order[:top_k if top_k else len(z)]] = True
  p = np.exp(z - z[keep].max()) * keep
  p /= p.sum()
  before = np.cumsum(p[order]) - p[order]
  keep[order[before >= top_p]] = False
  zk = np.where(keep, z, -np.inf)
  return zk - np.log(np.exp(zk - zk.max()).sum()) - zk.max()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 5, 1.0), (1.3, 0, 0.6),
                                                     (0.9, 7, 0.8)])
def test_processed_log_probs_vs_reference(temperature, top_k, top_p):
  from longspec_jax.sampling import SamplingParams, processed_log_probs
  logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32) * 3
  # One compiled function serves filtered and unfiltered settings (the filter is a runtime branch).
  fn = jax.jit(processed_log_probs)
  got = np.asarray(fn(jnp.asarray(logits), SamplingParams.make(temperature, top_k, top_p)))
  for row, g in zip(logits, got):
    ref = _reference_log_probs(row.astype(np.float64), temperature, top_k, top_p)
    np.testing.assert_array_equal(g < -1e29, np.isinf(ref))
    np.testing.assert_allclose(g[np.isfinite(ref)], ref[np.isfinite(ref)], atol=1e-5)
