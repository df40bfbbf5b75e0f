"""The pure generation function a user jits: same tokens as generate(), two calls one compile, jax.export, and
in/out shardings on 8 forced host devices (data parallel and tensor parallel) giving the unsharded tokens."""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from longspec_jax.inference.engine import GenerationOutput, generate_arrays, output_stats, output_tokens, prepare
from longspec_jax.inference.generate import generate
from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.kv_cache import COMPILER_OPTIONS
from longspec_jax.model import create_model

ROOT = Path(__file__).resolve().parents[1]
V = 96
XLA_COMPILES = []  # one entry per XLA compilation in this process
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: XLA_COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration"
    else None)


@pytest.fixture
def no_persistent_cache():
  """XLA compilations are counted below; the suite's persistent cache would answer a program another test compiled."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)


def _call_counting(fn, *args):
  """(result, jit cache entries added, XLA compilations) of one call."""
  entries, compiles = fn._cache_size(), len(XLA_COMPILES)
  out = jax.block_until_ready(fn(*args))
  return out, fn._cache_size() - entries, len(XLA_COMPILES) - compiles


def _cfg(layers=2):
  return ModelConfig(family="qwen3", vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=2048,
                     rope=RopeConfig(theta=10000.0), bos_token_id=0, eos_token_id=0, pad_token_id=1,
                     mask_token_id=2)


@pytest.fixture(scope="module")
def target():
  return create_model(_cfg(), seed=0)


@pytest.fixture(scope="module")
def drafter():
  return standalone_from_model(create_model(_cfg(layers=1), seed=7), "pard")


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  return [(rng.integers(3, V, max(2, n // 3)).tolist() * 4)[:n] for n in lengths]


def test_user_jit_twice_one_compile_ar(target, no_persistent_cache):
  gen = jax.jit(generate_arrays, static_argnums=0, compiler_options=COMPILER_OPTIONS)
  kw = dict(max_new_tokens=12, eos_id=-1)
  calls = [(_prompts([7, 20], 0), dict()), (_prompts([30, 3], 1), dict(temperature=0.8, top_p=0.9, seed=5))]
  counts = []
  for prompts, sampling in calls:
    config, params, inputs = prepare(target, prompts, **kw, **sampling)
    out, *count = _call_counting(gen, config, params, inputs)
    counts.append(tuple(count))
    assert output_tokens(out, inputs) == generate(target, prompts, **kw, **sampling).tokens
  print(f"AR user-jitted, (jit cache entries, XLA compiles) per call: {counts}")
  assert counts == [(1, 1), (0, 0)]  # the second call (new prompts, seed and sampling values) did not compile


def test_user_jit_twice_one_compile_speculative(target, drafter, no_persistent_cache):
  gen = jax.jit(generate_arrays, static_argnums=0, compiler_options=COMPILER_OPTIONS)
  kw = dict(max_new_tokens=16, eos_id=-1, drafter=drafter, num_draft=3)
  counts = []
  # Greedy twice, then sampled twice: sampling verification is another program (static `sample`).
  for seed, lengths, temperature in ((0, [10, 25], 0.0), (1, [40, 6], 0.0), (2, [12, 30], 0.9), (3, [5, 50], 0.9)):
    prompts = _prompts(lengths, seed)
    config, params, inputs = prepare(target, prompts, **kw, temperature=temperature, seed=seed)
    out, *count = _call_counting(gen, config, params, inputs)
    counts.append(tuple(count))
    ref = generate(target, prompts, **kw, temperature=temperature, seed=seed)
    assert output_tokens(out, inputs) == ref.tokens and output_stats(out) == ref.stats
    if temperature == 0:
      assert ref.tokens == generate(target, prompts, max_new_tokens=16, eos_id=-1).tokens  # lossless
  print(f"speculative user-jitted, (jit cache entries, XLA compiles) per call: {counts}")
  assert counts == [(1, 1), (0, 0), (1, 1), (0, 0)]


def test_export_and_call(target, drafter):
  for kw in (dict(), dict(drafter=drafter, num_draft=3)):
    config, params, inputs = prepare(target, _prompts([9, 17], 3), max_new_tokens=10, eos_id=-1, **kw)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, inputs))
    exp = jax.export.export(jax.jit(functools.partial(generate_arrays, config)))(*shapes)
    assert "while" in exp.mlir_module()
    out = exp.call(params, inputs)
    assert isinstance(out, GenerationOutput)
    assert output_tokens(out, inputs) == generate(target, _prompts([9, 17], 3), max_new_tokens=10, eos_id=-1,
                                                  **kw).tokens


SHARDED_SCRIPT = textwrap.dedent("""
  import json
  import jax, numpy as np
  from longspec_jax.inference.engine import output_tokens, prepare
  from longspec_jax.inference.functional import place_generation
  from longspec_jax.inference.generate import generate
  from longspec_jax import sharding as shd
  from longspec_jax.drafters.pard import standalone_from_model
  from longspec_jax.model import create_model
  from tests.test_functional import _cfg, _prompts

  assert len(jax.devices()) == 8, jax.devices()
  target = create_model(_cfg(), seed=0)
  drafter = standalone_from_model(create_model(_cfg(layers=1), seed=7), "pard")
  report = {}
  for mesh_shape, rules, rules_name in (((8, 1), shd.DATA_PARALLEL_RULES, "data-parallel"),
                                        ((4, 2), shd.TENSOR_PARALLEL_RULES, "tensor-parallel")):
    mesh = shd.make_mesh(*mesh_shape)
    for method, kw in (("ar", {}), ("pard", dict(drafter=drafter, num_draft=3))):
      fns, same = {}, []
      for seed in (0, 1):
        prompts = _prompts([5, 9, 30, 14, 22, 7, 40, 11], seed)
        config, params, inputs = prepare(target, prompts, max_new_tokens=12, eos_id=-1, **kw)
        fn, params, inputs = place_generation(mesh, config, params, inputs, rules)
        fn = fns.setdefault(config, fn)  # the second call reuses the first call's jitted function
        out = fn(params, inputs)
        assert out.tokens.sharding.spec == jax.sharding.PartitionSpec("data"), out.tokens.sharding
        if rules_name == "tensor-parallel":  # the target's wide weights really are split over "model"
          q = params.target["layers"][0]["self_attn"]["q_proj"]["kernel"]
          assert "model" in str(q.sharding.spec), q.sharding
        same.append(output_tokens(out, inputs) == generate(target, prompts, max_new_tokens=12, eos_id=-1,
                                                           **kw).tokens)
      report[f"{rules_name} mesh {mesh_shape} {method}"] = {
          "sharded_equals_unsharded": same, "compiles_for_2_calls": sum(f._cache_size() for f in fns.values())}
  print("REPORT", json.dumps(report))
""")


@pytest.mark.slow
def test_sharded_8_host_devices_equal_unsharded():
  env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"]
             + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  report = json.loads(r.stdout.split("REPORT ", 1)[1])
  print(json.dumps(report, indent=1))
  assert len(report) == 4
  for name, row in report.items():
    assert row["sharded_equals_unsharded"] == [True, True], name
    assert row["compiles_for_2_calls"] == 1, name
