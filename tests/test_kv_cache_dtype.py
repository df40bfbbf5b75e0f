"""The target's KV cache dtype (float32, bfloat16, int8 with a scale per token and KV head): the int8 round trip's
error bound and idempotence, the cache's bytes, a verify pass reading its own new rows as a later decode step
reads them from the cache, greedy speculative output equal to AR over the same cache dtype (prompt lookup and
LongSpark, which reads the target's rows), and the one error for a bad dtype."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.drafters.base import LoadedDrafter
from longspec_jax.drafters.longspark import create_longspark, longspark_config_for, longspark_from_model
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.inference.benchmark.config import SuiteConfig, validate
from longspec_jax.inference.cli import main
from longspec_jax.inference.generate import generate
from longspec_jax.kv_cache import dequantize_kv, kv_round_trip, quantize_kv
from longspec_jax.model import create_model

KV = ("int8", "bfloat16")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tiny_cfg):
  """A tiny target with its weights scaled up, so that greedy decoding is not stuck on one token."""
  graphdef, state = nnx.split(create_model(tiny_cfg, seed=3))
  return graphdef, jax.tree.map(lambda x: x * 3.0, state)


def _target(base, kv_dtype):
  return nnx.merge(*base).with_kv_dtype(kv_dtype)


def _prompts(vocab, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for n in (37, 90):
    motif = rng.integers(3, vocab, 9).tolist()
    out.append((motif * 12)[:n])  # repeats: prompt lookup finds matches
  return out


def test_int8_round_trip_error_bound_and_idempotence():
  x = jax.random.normal(jax.random.key(0), (3, 5, 2, 64)) * jnp.exp(jax.random.normal(jax.random.key(1), (3, 5, 2, 1)))
  x = x.at[0, 0, 0].set(0.0)  # an all-zero row
  values, scale = quantize_kv(x)
  assert values.dtype == jnp.int8 and scale.shape == x.shape[:-1]
  row_max = jnp.max(jnp.abs(x), -1)
  # Each entry within half a step of a scale at most max|row| / 127 (rounded up in its 17th bit).
  assert bool(jnp.all(scale <= jnp.where(row_max > 0, row_max, 127.0) / 127.0 * (1 + 2.0 ** -16)))
  err = jnp.abs(dequantize_kv(values, scale) - x)
  assert bool(jnp.all(err <= 0.5 * scale[..., None] * (1 + 1e-6)))
  assert float(jnp.max(err / jnp.maximum(row_max, 1e-30)[..., None])) <= 0.5 / 127 * (1 + 1e-4)
  # Writing the dequantized rows again stores the same bytes (a pass's rows read as they will be stored).
  v2, s2 = quantize_kv(dequantize_kv(values, scale))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(values))
  np.testing.assert_array_equal(np.asarray(s2), np.asarray(scale))
  rt = kv_round_trip(x, "int8")
  np.testing.assert_array_equal(np.asarray(kv_round_trip(rt, "int8")), np.asarray(rt))
  assert kv_round_trip(x, "float32") is x
  bf = kv_round_trip(x, "bfloat16")
  assert bf.dtype == x.dtype and float(jnp.max(jnp.abs(bf - x) / jnp.maximum(jnp.abs(x), 1e-30))) <= 2.0 ** -8


def test_cache_dtype_and_bytes(base):
  caches = {kv: _target(base, kv).init_cache(2, 256) for kv in ("float32",) + KV}
  assert {kv: c.k[0].dtype for kv, c in caches.items()} == {"float32": jnp.float32, "int8": jnp.int8,
                                                              "bfloat16": jnp.bfloat16}
  assert caches["float32"].k_scale is None and caches["int8"].k_scale[0].shape == (2, 2, 256)
  kv_bytes = {kv: c.nbytes - c.lengths.nbytes for kv, c in caches.items()}
  d = caches["float32"].k[0].shape[-1]
  assert kv_bytes["bfloat16"] * 2 == kv_bytes["float32"]
  assert kv_bytes["int8"] * 4 * d == kv_bytes["float32"] * (d + 4)  # one byte per entry + a fp32 scale per row


def _passes(model, tokens, p, k1):
  """(logits of one pass over tokens[p:p+k1] after a prefill of tokens[:p], the same rows' logits from k1
  one-row steps); tokens [n, L] runs each row as its own batch of one (one compiled program)."""
  graphdef, state = nnx.split(model)

  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    cache = m(tokens[:, :p], cache=m.init_cache(1, 64), mode="prefill").cache.replace(lengths=jnp.array([p]))
    block = m(tokens[:, p:p + k1], cache=cache, mode="extend").logits[0]
    steps = []
    for i in range(k1):
      out = m(tokens[:, p + i:p + i + 1], cache=cache, mode="extend")
      cache = out.cache.replace(lengths=cache.lengths + 1)
      steps.append(out.logits[0, 0])
    return block, jnp.stack(steps)

  compiled = jax.jit(run).lower(state, tokens[:1]).compile()
  outs = [compiled(state, tokens[i:i + 1]) for i in range(tokens.shape[0])]
  return tuple(jnp.stack(x) if tokens.shape[0] > 1 else x[0] for x in zip(*outs))


# Over float weights a one-row and a many-row projection differ by ~1e-7 float noise, and a quantized cache
# turns that into a step wherever an entry sits on a rounding boundary: bf16 rounds each entry on its own relative
# grid, so some near-zero entry flips in most passes (logits ~3e-3 apart here); int8's grid is 1/127 of the row's
# largest entry, so flips are rarer (none in this tiny test; SmolLM2-135M at 1K: ~1e-2 in the logits).
TOLERANCE = {"float32": 2e-5, "int8": 2e-5, "bfloat16": 5e-3}


@pytest.mark.parametrize("kv_dtype", ("float32",) + KV)
def test_verify_pass_reads_its_rows_as_decode_steps_read_the_cache(base, kv_dtype):
  """One K+1-row pass over a cache vs K+1 one-row steps: the same logits, to float noise (bf16: see TOLERANCE);
  reading the new rows unquantized would differ by the quantization (checked: the fp32 cache's logits differ)."""
  model = _target(base, kv_dtype)
  tokens = jnp.asarray([_prompts(model.cfg.vocab_size)[1][:60]], jnp.int32)
  block, steps = _passes(model, tokens, 50, 6)
  np.testing.assert_allclose(np.asarray(block), np.asarray(steps), atol=TOLERANCE[kv_dtype], rtol=0)
  if kv_dtype != "float32":
    fp_block, _ = _passes(_target(base, "float32"), tokens, 50, 6)
    assert float(jnp.max(jnp.abs(fp_block - block))) > 2 * TOLERANCE[kv_dtype]  # the dtype changes what it reads


def int8_verify_vs_decode_differences() -> list[float]:
  """Max |logit difference| between a K+1-row verify pass and K+1 one-row decode steps, int8 weights over an int8
  cache, on the tiny target (its weights scaled as `base` scales them) for 2 prompts x 2 (prefix, K+1)."""
  from tests.tiny_target import tiny_model_config
  graphdef, state = nnx.split(create_model(tiny_model_config(), seed=3))
  model = _target((graphdef, jax.tree.map(lambda x: x * 3.0, state)), "int8").quantize_int8()
  tokens = jnp.asarray([_prompts(model.cfg.vocab_size, seed=seed)[1][:60] for seed in (0, 1)], jnp.int32)
  return [float(jnp.max(jnp.abs(block - steps))) for p, k1 in ((50, 6), (37, 8))
          for block, steps in zip(*_passes(model, tokens, p, k1))]


def test_int8_weights_and_int8_cache_verify_equals_decode_bit_for_bit():
  """With int8 weights over an int8 cache every product is an integer product, every sum has a fixed order and no
  rounding product shares an XLA fusion with a sum (`attention.materialize`), so a K+1-row verify pass and K+1
  one-row decode steps give the same logits bit for bit. Without that, SmolLM2-135M's logits differed by ~1e-2 and
  a 16K greedy run parted from AR. Run in a subprocess compiled as users compile: this suite lowers XLA's backend
  optimisation for speed (conftest), and at that level the tiny target still differs in one row of four passes."""
  from tests.conftest import SPEED_XLA_FLAGS  # here, not at the top: the subprocess must not import conftest
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in SPEED_XLA_FLAGS]
  env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
  code = "import json, tests.test_kv_cache_dtype as t; print(json.dumps(t.int8_verify_vs_decode_differences()))"
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
  assert json.loads(out.stdout.splitlines()[-1]) == [0.0] * 4


@pytest.mark.parametrize("kv_dtype", KV)
def test_greedy_spec_equals_ar_of_the_same_cache_dtype(base, tiny_cfg, kv_dtype):
  model = _target(base, kv_dtype)
  prompts = _prompts(tiny_cfg.vocab_size)
  ar = generate(model, prompts, max_new_tokens=24, eos_id=-1)
  assert min(len(set(t)) for t in ar.tokens) > 3  # not one repeated token
  longspark = longspark_from_model(create_longspark(longspark_config_for(
      tiny_cfg, num_layers=2, markov_rank=8, raw_window=16, num_global_slots=4), seed=1), model)
  for name, drafter in (("prompt-lookup", LoadedDrafter(PromptLookupDrafter(tiny_cfg.vocab_size))),
                        ("longspark", longspark)):
    sp = generate(model, prompts, max_new_tokens=24, eos_id=-1, drafter=drafter, num_draft=4)
    assert sp.tokens == ar.tokens, f"{name} over a {kv_dtype} cache"


def test_bad_kv_dtype_is_one_clear_error(tiny_cfg, capsys):
  with pytest.raises(ValueError, match="KV cache dtype must be one of float32, bfloat16, int8, got 'int4'"):
    create_model(tiny_cfg, kv_dtype="int4")
  with pytest.raises(SystemExit) as e:
    main(["generate", "--prompt", "x", "--kv-dtype", "int4"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "argument --kv-dtype: invalid choice: 'int4'" in err
  assert len(err.strip().splitlines()) == 1, err
  with pytest.raises(ValueError, match="bench-suite config: kv_dtype must be one of float32, bfloat16, int8"):
    validate(SuiteConfig(kv_dtype="int4"))
  assert validate(SuiteConfig(kv_dtype="int8"))  # and a good one passes


def test_speculative_over_a_quantized_cache_warns_unless_bit_exact(base, tiny_cfg):
  from longspec_jax.inference.engine import prepare
  drafter = LoadedDrafter(PromptLookupDrafter(tiny_cfg.vocab_size))
  prompts = _prompts(tiny_cfg.vocab_size)
  for kv in KV:
    with pytest.warns(UserWarning, match=f"a {kv} KV cache under float weights"):
      prepare(_target(base, kv), prompts, drafter=drafter, num_draft=4)
  with pytest.warns(UserWarning, match="a bfloat16 KV cache under int8 weights"):
    prepare(_target(base, "bfloat16").quantize_int8(), prompts, drafter=drafter, num_draft=4)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    prepare(_target(base, "int8").quantize_int8(), prompts, drafter=drafter, num_draft=4)
    prepare(_target(base, "float32"), prompts, drafter=drafter, num_draft=4)
    prepare(_target(base, "int8"), prompts)  # AR alone: nothing to part from
