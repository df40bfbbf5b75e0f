"""EAGLE-3 drafter: greedy exactness and lossless sampling through the engine, the cache update rule, training-time
test == inference chains, the SharpDraft hook and attention logits, the public-layout loader, and the trainer
(8-device mesh, exact resume, export)."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.inference.generate import generate
from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
from longspec_jax.drafters.eagle3 import (create_eagle3_net, default_aux_layers, drafter_config, eagle3_from_net,
                                          load_eagle3, run_cached)
from longspec_jax.sampling import SamplingParams
from longspec_jax.sharpdraft import SharpDraft
from tests.test_speculative import (N_POS, V, _chi2_pvalues, _exact_marginals, _prompts, _sample,  # noqa: F401
                                    peaky_target, target)
from longspec_jax.drafters.eagle3 import ttt_forward

ARCH = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64)


def _eagle(model, seed=1, **kw):
  tc = model.cfg
  aux = default_aux_layers(tc.num_hidden_layers)
  return eagle3_from_net(create_eagle3_net(drafter_config(tc, **ARCH), tc, aux, seed=seed), model, aux, **kw)


@pytest.fixture(scope="module")
def eagle(target):
  return _eagle(target)


@pytest.mark.parametrize("batch,lengths", [(1, [5]), (4, [3, 40, 17, 90])])
def test_greedy_spec_equals_ar(target, eagle, batch, lengths):
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  for k in (1, 4):
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=eagle, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"


def _jit_target(target, fn, *args):
  """fn(target_model, *args) compiled as one program (op-by-op dispatch is slow on CPU)."""
  graphdef, state = nnx.split(target)
  return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a))(state, *args)


# Compiled helpers cached per static configuration, so tests with equal shapes share one compilation.
@functools.lru_cache(maxsize=None)
def _prefill_fn(graphdef, spec, max_len):
  def run(tstate, params, toks, buf, lens):
    m = nnx.merge(graphdef, tstate)
    out = m(toks, cache=m.init_cache(toks.shape[0], max_len), mode="prefill", taps=spec.taps, return_logits=False)
    cache = out.cache.replace(lengths=lens)
    pre = PrefillResult(prompt_tokens=toks, tokens=buf, prompt_lens=lens, taps=out.taps, new_kv=None,
                        target_cache=cache)
    return spec.init_state(params, pre, max_len), cache
  return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _verify_fn(graphdef, taps):
  return jax.jit(lambda s, blk, c: nnx.merge(graphdef, s)(blk, cache=c, mode="extend", taps=taps,
                                                          return_logits=False).taps)


@functools.lru_cache(maxsize=None)
def _propose_fn(spec, k, sample):
  return jax.jit(lambda *a: spec.propose(*a, k, sample))


@functools.lru_cache(maxsize=None)
def _update_fn(spec):
  return jax.jit(spec.update)


def _prefill(target, spec, params, prompts, pending, width=32, max_len=64):
  """Target prefill + drafter init for prompts (right-padded to `width`) whose pending token is `pending`."""
  b = len(prompts)
  toks = np.ones((b, width), np.int32)
  buf = np.zeros((b, max_len), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
    buf[i, :len(p) + 1] = list(p) + [pending[i]]
  lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
  graphdef, tstate = nnx.split(target)
  state, cache = _prefill_fn(graphdef, spec, max_len)(tstate, params, jnp.asarray(toks), jnp.asarray(buf), lens)
  return state, jnp.asarray(buf), cache


def _verify_taps(target, spec, block, cache):
  graphdef, tstate = nnx.split(target)
  return _verify_fn(graphdef, spec.taps)(tstate, block, cache)


def _propose(spec, params, state, ctx, key, k, sample=False):
  return _propose_fn(spec, k, sample)(params, state, ctx, key)


def test_update_equals_fresh_prefill(target, eagle):
  """After a verification that accepts a of K drafts, the drafter's state must be the one a fresh prefill of the
  longer prefix gives: its next proposals and hidden state match (a = 0, 2, K in one batch)."""
  spec, params = eagle.spec, eagle.params
  k, accepted = 4, [0, 2, 4]
  prompt = _prompts(1, [21])[0]
  b = len(accepted)
  state, buf, cache = _prefill(target, spec, params, [prompt] * b, [7] * b)
  n = jnp.full((b,), len(prompt) + 1, jnp.int32)
  sp = SamplingParams.make()
  drafts, _, state = _propose(spec, params, state, ProposeContext(buf, n, sp), jax.random.key(0), k)
  taps = _verify_taps(target, spec, jnp.concatenate([buf[:, len(prompt):len(prompt) + 1], drafts], 1), cache)
  acc = jnp.asarray(accepted)
  correction = jnp.asarray([11, 12, 13])
  committed = jnp.where(jnp.arange(k + 1)[None] < acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        correction[:, None])
  new_n = n + acc + 1
  new_buf = buf.at[jnp.arange(b)[:, None], n[:, None] + jnp.arange(k + 1)].set(committed)
  vr = VerifyResult(start=n - 1, num_accepted=acc, committed=committed, num_committed=acc + 1, taps=taps,
                    new_kv=None, tokens=new_buf, num_tokens=new_n)
  state = _update_fn(spec)(params, state, vr)
  next_drafts, _, _ = _propose(spec, params, state, ProposeContext(new_buf, new_n, sp), jax.random.key(1), k)

  new_buf = np.asarray(new_buf)
  prefixes = [new_buf[i, :int(new_n[i]) - 1].tolist() for i in range(b)]
  fresh, _, _ = _prefill(target, spec, params, prefixes, [int(new_buf[i, int(new_n[i]) - 1]) for i in range(b)])
  np.testing.assert_allclose(state.hidden, fresh.hidden, atol=1e-4)
  assert state.cache.lengths.tolist() == fresh.cache.lengths.tolist() == (new_n - 1).tolist()
  fresh_drafts, _, _ = _propose(spec, params, fresh, ProposeContext(jnp.asarray(new_buf), new_n, sp),
                                jax.random.key(1), k)
  assert next_drafts.tolist() == fresh_drafts.tolist()


def test_training_time_test_equals_inference_chains(target, eagle):
  """Step j, row p of the TTT pass must give the logits of the j-th speculative step of an inference chain that
  starts at row p and is fed the true tokens."""
  spec, params = eagle.spec, eagle.params
  w, steps = 24, 3
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (1, w)), jnp.int32)

  def ttt(m, params, toks):
    net = nnx.merge(spec.graphdef, params["net"])
    taps = m(toks, mode="train", taps=spec.taps, return_logits=False).taps
    return jnp.stack([net.logits(h)[0] for h, _ in ttt_forward(net, params["embed"], toks, taps, steps)])

  ttt_logits = np.asarray(_jit_target(target, ttt, params, toks))  # [steps, W-1, V]
  rows = [0, 5, 13, 20]
  t = toks[0].tolist()
  state, _, _ = _prefill(target, spec, params, [t[:p + 1] for p in rows], [t[p + 1] for p in rows])

  @jax.jit
  def chain(params, state, lens, teacher):
    net = nnx.merge(spec.graphdef, params["net"])
    h, cache, out = state.hidden, state.cache, []
    for j in range(steps):
      out.append(net.logits(h))
      o, cache = run_cached(net, spec._embed(params, teacher[:, j:j + 1]), h[:, None], (lens + j)[:, None],
                            cache, "extend")
      h = o[:, 0]
    return jnp.stack(out)

  teacher = jnp.asarray([[t[min(p + 2 + j, w - 1)] for j in range(steps)] for p in rows])
  logits = np.asarray(chain(params, state, jnp.asarray(rows) + 1, teacher))
  for j in range(steps):
    for i, p in enumerate(rows):
      np.testing.assert_allclose(logits[j, i], ttt_logits[j, p], atol=1e-4, err_msg=f"step {j} row {p}")


@dataclasses.dataclass(frozen=True)
class _LogScale:
  """A SharpDraft stand-in: query scale factor * (1 + 0.2 ln(num_keys)), the same for every head."""
  factor: float
  heads: int

  def query_scale(self, layer_index, num_keys):
    assert layer_index == 0
    s = self.factor * (1 + 0.2 * jnp.log(num_keys.astype(jnp.float32)))
    return jnp.broadcast_to(s[..., None], num_keys.shape + (self.heads,))

  scale_queries = SharpDraft.scale_queries  # the real hook, over this stand-in's query_scale


@pytest.mark.parametrize("factor", [None, 1.5])
def test_attention_logits_and_query_scale(target, eagle, factor):
  """The drafter's last-row hidden state after a prefill must be reproduced from `attention_logits` (scaled by
  the SharpDraft factor of N visible keys): the logits are exactly what the drafter's softmax reads."""
  spec, params = eagle.spec, eagle.params
  if factor is not None:
    spec = dataclasses.replace(spec, sharpdraft=_LogScale(factor, spec.cfg.num_attention_heads))
  n = 30
  toks = jnp.asarray(np.random.default_rng(2).integers(3, V, (2, n + 1)), jnp.int32)
  (logits,) = _jit_target(target, lambda m, p, t: spec.attention_logits(p, m, t), params, toks)
  assert logits.shape == (2, spec.cfg.num_attention_heads, 1, n)
  state, _, _ = _prefill(target, spec, params, np.asarray(toks[:, :n]).tolist(), np.asarray(toks[:, n]).tolist())
  scale = 1.0 if factor is None else factor * (1 + 0.2 * np.log(n))

  def rebuild(m, params, toks, logits):
    """Row N-1's output from the logits: softmax, values, o_proj, residual, MLP."""
    net = nnx.merge(spec.graphdef, params["net"])
    feat = net.feature(m(toks, mode="train", taps=spec.taps, return_logits=False).taps[:, :n])
    x, residual = net.midlayer.inputs(spec._embed(params, toks[:, 1:]), feat)
    _, _, v = net.midlayer.self_attn.qkv(x, jnp.broadcast_to(jnp.arange(n), (2, n)), (jnp.ones(6), 1.0))
    p = jax.nn.softmax(scale * logits[:, :, 0], axis=-1)  # [B, Hq, N]
    o = jnp.einsum("bhn,bnhd->bhd", p, jnp.repeat(v, spec.cfg.q_per_kv, axis=2))[:, None]
    return net.midlayer.out(residual[:, -1:], o)[:, 0]

  np.testing.assert_allclose(_jit_target(target, rebuild, params, toks, logits), state.hidden, atol=1e-4)


def test_sampling_matches_target_distribution(peaky_target):
  sp = SamplingParams.make(1.0)
  pvals = _chi2_pvalues(_sample(peaky_target, _eagle(peaky_target), 1.0, 0, 1.0, seed=11),
                        _exact_marginals(peaky_target, sp))
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_sampling_with_a_draft_vocabulary_matches_target_distribution(peaky_target):
  """Drafts drawn among the draft vocabulary's logits only (q = 0 elsewhere), half the target's tokens: the output
  still follows the target, and the drafts come from the draft vocabulary."""
  tc = peaky_target.cfg
  aux = default_aux_layers(tc.num_hidden_layers)
  n = V // 2
  ids = np.sort(np.random.default_rng(0).choice(V, n, replace=False))
  net = create_eagle3_net(drafter_config(tc, **ARCH), tc, aux, draft_vocab=n, seed=1)
  drafter = eagle3_from_net(net, peaky_target, aux, d2t=ids - np.arange(n))
  sp = SamplingParams.make(1.0)
  pvals = _chi2_pvalues(_sample(peaky_target, drafter, 1.0, 0, 1.0, seed=11), _exact_marginals(peaky_target, sp))
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_drafter_state_shape_constant(target, eagle):
  spec, params = eagle.spec, eagle.params
  k = 3
  state0, buf, cache = _prefill(target, spec, params, [[5, 6, 7, 8], [9, 10]], [3, 4])
  n = jnp.asarray([5, 3])
  ctx = ProposeContext(tokens=buf, num_tokens=n, sampling=SamplingParams.make(1.0))
  drafts, probs, state1 = _propose(spec, params, state0, ctx, jax.random.key(0), k, sample=True)
  taps = _verify_taps(target, spec, jnp.concatenate([buf[jnp.arange(2), n - 1][:, None], drafts], 1), cache)
  vr = VerifyResult(start=n - 1, num_accepted=jnp.asarray([1, 0]), committed=jnp.zeros((2, k + 1), jnp.int32),
                    num_committed=jnp.asarray([2, 1]), taps=taps, new_kv=None, tokens=buf,
                    num_tokens=n + jnp.asarray([2, 1]))
  state2 = _update_fn(spec)(params, state1, vr)
  shape = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shape(state0) == shape(state1) == shape(state2)
  assert drafts.shape == (2, k) and probs.shape == (2, k, V)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-5)


# ---- public checkpoint layout ---------------------------------------------------------------------------------

def _write_public(path: Path, target_cfg, draft_vocab=48, **config_overrides):
  """A random EAGLE-3 checkpoint written name by name in the public layout (torch [out, in] weights), with a
  reduced draft vocabulary mapped by d2t. Returns the tensors."""
  rng = np.random.default_rng(5)
  h, hd, hq, hkv, f = target_cfg.hidden_size, 12, 4, 2, 64
  shapes = {
      "fc.weight": (h, 3 * h), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
      "midlayer.self_attn.q_proj.weight": (hq * hd, 2 * h), "midlayer.self_attn.k_proj.weight": (hkv * hd, 2 * h),
      "midlayer.self_attn.v_proj.weight": (hkv * hd, 2 * h), "midlayer.self_attn.o_proj.weight": (h, hq * hd),
      "midlayer.self_attn.q_norm.weight": (hd,), "midlayer.self_attn.k_norm.weight": (hd,),
      "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (f, h),
      "midlayer.mlp.up_proj.weight": (f, h), "midlayer.mlp.down_proj.weight": (h, f), "norm.weight": (h,),
      "lm_head.weight": (draft_vocab, h)}
  tensors = {k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.2 * rng.standard_normal(s))
             .astype(np.float32) for k, s in shapes.items()}
  used = np.sort(rng.choice(np.arange(3, target_cfg.vocab_size), draft_vocab, replace=False))
  tensors["d2t"] = (used - np.arange(draft_vocab)).astype(np.int64)
  tensors["t2d"] = np.isin(np.arange(target_cfg.vocab_size), used)
  config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
            "intermediate_size": f, "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": hd,
            "num_hidden_layers": 1, "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab,
            "target_hidden_size": h, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": None, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
            "eagle_aux_hidden_state_layer_ids": [1, 1, 0]}
  config.update(config_overrides)
  from safetensors.numpy import save_file
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(path / "model.safetensors"))
  return tensors


def test_load_public_layout(target, tmp_path):
  tensors = _write_public(tmp_path / "e3", target.cfg)
  loaded = load_eagle3(tmp_path / "e3", target)
  assert loaded.spec.taps == (1, 1, 0) and loaded.spec.draft_vocab_size == 48
  # The same weights set by hand on a directly built drafter.
  tc = target.cfg
  net = create_eagle3_net(drafter_config(tc, **ARCH), tc, (1, 1, 0), draft_vocab=48)
  state = nnx.state(net, nnx.Param)

  def fill(path, node):
    if isinstance(node, dict):
      return {k: fill(path + (k,), v) for k, v in node.items()}
    t = tensors[".".join(path[:-1]) + ".weight"]
    return jnp.asarray(t.T if path[-1] == "kernel" else t)
  nnx.replace_by_pure_dict(state, fill((), nnx.to_pure_dict(state)))
  nnx.update(net, state)
  direct = eagle3_from_net(net, target, (1, 1, 0), d2t=tensors["d2t"])
  ar_prompts = _prompts(1, [5])  # the AR program of test_greedy_spec_equals_ar is reused
  ar = generate(target, ar_prompts, max_new_tokens=24, eos_id=-1)
  assert generate(target, ar_prompts, max_new_tokens=24, eos_id=-1, drafter=loaded, num_draft=3).tokens \
      == ar.tokens
  prompts = _prompts(2, [9, 30], seed=4)
  state, buf, _ = _prefill(target, loaded.spec, loaded.params, prompts, [5, 6])
  ctx = ProposeContext(buf, jnp.asarray([10, 31]), SamplingParams.make(0.7))
  d1, q1, _ = _propose(loaded.spec, loaded.params, state, ctx, jax.random.key(3), 3, sample=True)
  d2, q2, _ = _propose(direct.spec, direct.params, state, ctx, jax.random.key(3), 3, sample=True)
  assert d1.tolist() == d2.tolist()
  np.testing.assert_allclose(q1, q2, atol=1e-6)
  allowed = np.flatnonzero(tensors["t2d"])
  assert set(np.asarray(d1).ravel()) <= set(allowed)  # drafts only from the draft vocabulary
  assert np.all(np.asarray(q1)[..., np.setdiff1d(np.arange(V), allowed)] == 0)


def test_int8_storage_reads_back_within_one_step_and_stays_lossless(target, tmp_path):
  """hf_io.write_int8_copy: matrices stored int8 with a scale per output row read back within half a quantization
  step of the original, everything else unchanged; the copy loads and drafts losslessly; bad copies are errors."""
  from safetensors.numpy import save_file

  from longspec_jax.hf_io import _read_tensors, write_int8_copy
  tensors = _write_public(tmp_path / "e3", target.cfg)
  stats = write_int8_copy(tmp_path / "e3", tmp_path / "i8", min_size=0)
  assert stats["int8_tensors"] == sum(t.ndim == 2 for t in tensors.values())
  assert stats["bytes_after"] < 0.4 * stats["bytes_before"]  # fp32 -> int8 plus one fp32 scale per row
  back = _read_tensors(tmp_path / "i8")
  assert sorted(back) == sorted(tensors)
  assert json.loads((tmp_path / "i8" / "config.json").read_text())["quantization_config"]["bits"] == 8
  for name, t in tensors.items():
    b = np.asarray(back[name])
    if t.ndim == 2:
      step = np.abs(t).max(axis=1, keepdims=True) / 127
      assert np.all(np.abs(b - t) <= step / 2 + 1e-7), name
    else:
      np.testing.assert_array_equal(b, t)
  ar_prompts = _prompts(1, [5])
  ar = generate(target, ar_prompts, max_new_tokens=24, eos_id=-1)
  drafter = load_eagle3(tmp_path / "i8", target)
  assert generate(target, ar_prompts, max_new_tokens=24, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar.tokens
  with pytest.raises(FileExistsError, match="exists"):
    write_int8_copy(tmp_path / "e3", tmp_path / "i8")
  save_file({"fc.weight": np.ones((4, 8), np.int8)}, str(tmp_path / "i8" / "model.safetensors"))
  with pytest.raises(ValueError, match=r"int8 tensor fc.weight \(4, 8\) needs a scale fc.weight_scale"):
    load_eagle3(tmp_path / "i8", target)


@pytest.mark.parametrize("overrides,match", [
    ({"vocab_size": V + 8}, "vocabulary"),
    ({"hidden_size": 64}, "hidden size"),
    ({"target_hidden_size": 64}, "hidden size"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 5, 0]}, r"eagle_aux_hidden_state_layer_ids \[5\] out of range"),
    ({"num_hidden_layers": 2}, "single-layer"),
    ({"head_dim": 16}, "shape mismatches"),
    ({"draft_vocab_size": 40}, "d2t must map"),
])
def test_load_bad_checkpoints(target, tmp_path, overrides, match):
  _write_public(tmp_path / "bad", target.cfg, **overrides)
  with pytest.raises(ValueError, match=match):
    load_eagle3(tmp_path / "bad", target)


def test_load_missing(target, tmp_path):
  with pytest.raises(FileNotFoundError, match="missing EAGLE-3 config"):
    load_eagle3(tmp_path, target)
  _write_public(tmp_path / "e3", target.cfg)
  (tmp_path / "e3" / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_eagle3(tmp_path / "e3", target)


# ---- trainer ----------------------------------------------------------------------------------------------------

TRAIN_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from longspec_jax.yaml_config import from_dict
    from longspec_jax.training.train_eagle3 import Eagle3TrainConfig, train_eagle3
    assert len(jax.devices()) == 8, jax.devices()
    base = json.loads(sys.argv[1])
    straight = train_eagle3(from_dict(Eagle3TrainConfig, {**base, "out_dir": sys.argv[2] + "/a"}))
    cfg_b = from_dict(Eagle3TrainConfig, {**base, "out_dir": sys.argv[2] + "/b", "stop_after_steps": 3})
    print("STOPPED", train_eagle3(cfg_b))
    resumed = train_eagle3(from_dict(Eagle3TrainConfig, {**base, "out_dir": sys.argv[2] + "/b"}))
    print("RESULT", json.dumps({"straight": str(straight), "resumed": str(resumed)}))
""")


@pytest.fixture(scope="module")
def train_env(tmp_path_factory):
  """A tiny saved target and drafter data in the make-drafter-data layout (rows with learnable structure)."""
  import datasets

  from longspec_jax.hf_io import save_model_dir
  from longspec_jax.model import create_model, default_target_config
  from longspec_jax.training.drafter_data import weights_sha256

  tmp = tmp_path_factory.mktemp("eagle3_train")
  cfg = default_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
  save_model_dir(create_model(cfg, seed=3), tmp / "target")
  rng = np.random.default_rng(0)
  rows = []
  for i in range(24):
    period = rng.integers(2, 6)
    base = rng.integers(3, 64, period).tolist()
    rows.append((base * 20)[:int(rng.integers(20, 40))])
  ds = datasets.Dataset.from_dict({"prompt": [r[:8] for r in rows], "continuation": [r[8:] for r in rows]})
  ds.save_to_disk(str(tmp / "data" / "dataset"))
  manifest = {"target_dir": str(tmp / "target"),
              "target": {"vocab_size": 64, "mask_token_id": cfg.mask_token_id,
                         "weights_sha256": weights_sha256(tmp / "target")},
              "counts": {"sequences": 24}, "settings": {"temperature": 0.0, "greedy_fraction": 1.0}}
  (tmp / "data" / "manifest.json").write_text(json.dumps(manifest))
  return tmp


@pytest.mark.slow
def test_train_eagle3_sharded_resumes_exactly_and_exports(train_env, tmp_path):
  from longspec_jax.hf_io import load_model_dir

  base = dict(data_dirs=[str(train_env / "data"), str(train_env / "missing")], out_dir="", context_len=16,
              model=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64),
              ttt_steps=3, batch_size=8, steps=8, optim=dict(lr=0.02, warmup_steps=2), val_fraction=0.2,
              val_windows=8, compute_dtype="float32", attn_block=16, log_every=1, checkpoint_every_minutes=100.0)
  env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"]
             + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, json.dumps(base), str(tmp_path)],
                     cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "skipping incomplete drafter data dirs" in p.stdout
  assert any(l.startswith("STOPPED") and l.endswith("checkpoints") for l in p.stdout.splitlines())
  res = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT")][-1][len("RESULT "):])

  log_a = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  log_b = [json.loads(l) for l in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
  assert len(log_a) == len(log_b) == 8
  assert log_a[-1]["loss"] < log_a[0]["loss"] - 0.3
  for ra, rb in zip(log_a, log_b):
    assert ra == {**rb, "elapsed_s": ra["elapsed_s"]}  # same losses / grad norms bit for bit
  from safetensors.numpy import load_file
  ta, tb = (load_file(str(Path(res[k]) / "model.safetensors")) for k in ("straight", "resumed"))
  assert sorted(ta) == sorted(tb) and all(np.array_equal(ta[k], tb[k]) for k in ta)
  assert "embed_tokens.weight" not in ta and ta["fc.weight"].shape == (32, 96)

  final = Path(res["straight"])
  cfg = json.loads((final / "config.json").read_text())
  info = json.loads((final / "drafter.json").read_text())
  # taps [2, 2, 1] are layer inputs (top level, as vLLM reads them); eagle_config holds SpecForge's layer outputs
  assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1] and cfg["n0"] == 16
  assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
  assert info["n0"] == 16 and info["ttt_steps"] == 3 and len(info["val_top1_per_step"]) == 3
  assert info["final_loss"] == log_a[-1]["loss"]
  target = load_model_dir(train_env / "target")
  drafter = load_eagle3(final, target)
  prompts = [[5, 9, 5, 9, 5, 9, 5], [7, 8, 9, 7, 8, 9]]
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1)
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=drafter, num_draft=3).tokens == \
      ar.tokens
