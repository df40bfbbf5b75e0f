"""DFlash drafter: lossless through the engine (greedy exact match, sampling statistics), training forward ==
inference forward, constant state shape, the public z-lab checkpoint layout, bad input, and the trainer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from longspec_jax.inference.generate import generate
from longspec_jax.drafters.base import LoadedDrafter, PrefillResult, ProposeContext, VerifyResult
from longspec_jax.drafters.dflash import (DFlashConfig, create_dflash, dflash_config_for, dflash_from_model,
                                          load_dflash, save_dflash_dir)
from longspec_jax.drafters.frozen_target import default_target_layer_ids, target_io
from longspec_jax.model import create_model
from longspec_jax.sampling import SamplingParams
from tests.compiled import compiled
from tests.test_speculative import (N_POS, V, _cfg, _chi2_pvalues, _exact_marginals, _prompts, _sample,
                                    peaky_target, target)  # noqa: F401  (fixtures)
from tests.test_train_drafter import env  # noqa: F401  (fixture: tiny target + target-generated data)
from longspec_jax.drafters.dflash import dflash_train_logits

BLOCK = 5


def _dflash(target_model, seed=1, block=BLOCK):
  return create_dflash(dflash_config_for(target_model.cfg, num_layers=2, num_target_taps=2, block_size=block),
                       seed=seed)


@pytest.fixture(scope="module")
def dflash(target):
  return dflash_from_model(_dflash(target), target)


def test_target_layer_ids_are_evenly_spaced():
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the public Qwen3-8B DFlash choice
  assert default_target_layer_ids(8, 5) == (1, 2, 3, 4, 5)
  assert default_target_layer_ids(2, 2) == (1, 1)


@pytest.mark.parametrize("batch,lengths", [(1, [5]), (1, [70]), (4, [3, 40, 17, 90])])
def test_greedy_dflash_equals_ar(target, dflash, batch, lengths):
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  for k in (1, BLOCK - 1):
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=dflash, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"
  if batch > 1:  # SharpDraft's query scaling changes DFlash's drafts, never the output
    from tests.test_sharpdraft import _sharp
    cfg = dflash.spec.cfg.arch
    sharp = LoadedDrafter(dataclasses.replace(dflash.spec, sharpdraft=_sharp("exact", cfg.num_hidden_layers,
                                                                             cfg.num_attention_heads)), dflash.params)
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=sharp, num_draft=BLOCK - 1)
    assert sp.tokens == ar.tokens, "SharpDraft"


def test_training_forward_matches_inference(target):
  """The trainer's many-anchor pass gives each anchor exactly the logits that inference computes for it."""
  model = _dflash(target, seed=4)
  d = dflash_from_model(model, target)
  b, t = 2, 40
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, t)), jnp.int32)
  taps = compiled(target, toks, mode="train", taps=d.spec.taps, return_logits=False).taps
  anchors = jnp.asarray([[5, 17, 30], [12, 3, 38]], jnp.int32)
  train_logits = compiled(dflash_train_logits, model, target_io(target), taps, toks, anchors)  # [B, A, BLOCK-1, V]
  for j in range(anchors.shape[1]):
    a = anchors[:, j]
    # Inference: context = features of positions < a; block anchored at token a.
    pre = PrefillResult(prompt_tokens=toks, tokens=toks, prompt_lens=a, taps=taps, new_kv=None,
                        target_cache=None)
    state = compiled(d.spec.init_state, d.params, pre, t + BLOCK)
    inf = compiled(d.spec.block_logits, d.params, state, toks[jnp.arange(b), a], BLOCK - 1)
    np.testing.assert_allclose(np.asarray(train_logits[:, j]), np.asarray(inf), atol=2e-4, rtol=2e-4)


def _fake_verify(tokens, num_tokens, k, cache, taps):
  b = tokens.shape[0]
  return VerifyResult(start=num_tokens - 1, num_accepted=jnp.ones((b,), jnp.int32),
                      committed=jnp.zeros((b, k + 1), jnp.int32), num_committed=jnp.full((b,), 2, jnp.int32),
                      taps=taps, new_kv=None, tokens=tokens, num_tokens=num_tokens + 2)


def test_state_shape_constant_and_update_appends_context(target, dflash):
  spec, params = dflash.spec, dflash.params
  b, t, max_len, k = 2, 16, 64, 3
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, max_len)), jnp.int32)
  taps = compiled(target, toks, mode="train", taps=spec.taps, return_logits=False).taps
  pre = PrefillResult(prompt_tokens=toks[:, :t], tokens=toks, prompt_lens=jnp.asarray([16, 9]),
                      taps=taps[:, :t], new_kv=None, target_cache=None)
  s0 = compiled(spec.init_state, params, pre, max_len)
  ctx = ProposeContext(tokens=toks, num_tokens=jnp.asarray([17, 10]), sampling=SamplingParams.make(1.0))
  drafts, probs, s1 = compiled(spec.propose, params, s0, ctx, jax.random.key(0), k, True)
  start = ctx.num_tokens - 1
  vtaps = jnp.stack([taps[i, int(s):int(s) + k + 1] for i, s in enumerate(start)])
  s2 = compiled(spec.update, params, s1, _fake_verify(toks, ctx.num_tokens, k, None, vtaps))
  shape = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shape(s0) == shape(s1) == shape(s2)
  assert drafts.shape == (b, k) and probs.shape == (b, k, V)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-5)
  assert s2.length.tolist() == [18, 11]  # old context + pending + 1 accepted draft
  # The appended rows equal a fresh prefill over the longer prefix.
  pre_long = PrefillResult(prompt_tokens=toks[:, :20], tokens=toks, prompt_lens=jnp.asarray([18, 11]),
                           taps=taps[:, :20], new_kv=None, target_cache=None)
  ref = compiled(spec.init_state, params, pre_long, max_len)
  for i, n in enumerate([18, 11]):
    np.testing.assert_allclose(np.stack(s2.k)[:, i, :n], np.stack(ref.k)[:, i, :n], atol=1e-5)
    np.testing.assert_allclose(np.stack(s2.v)[:, i, :n], np.stack(ref.v)[:, i, :n], atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_dflash_sampling_matches_target_distribution(peaky_target, temperature, top_k, top_p):
  d = dflash_from_model(_dflash(peaky_target, seed=2), peaky_target)
  marg = _exact_marginals(peaky_target, SamplingParams.make(temperature, top_k, top_p))
  samples = _sample(peaky_target, d, temperature, top_k, top_p, seed=13)
  pvals = _chi2_pvalues(samples, marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def _zlab_checkpoint(path, cfg: DFlashConfig, rng):
  """A tiny checkpoint written the way the public z-lab DFlash drafters are: Qwen3 config + dflash_config, bare
  torch-layout tensor names, bf16. Built from the layout's names, not from our exporter."""
  a = cfg.arch
  h, hd, hq, hkv, f = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size
  t = {"fc.weight": (h, h * len(cfg.target_layer_ids)), "hidden_norm.weight": (h,), "norm.weight": (h,)}
  for i in range(a.num_hidden_layers):
    p = f"layers.{i}."
    t.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (hq * hd, h), p + "self_attn.k_proj.weight": (hkv * hd, h),
              p + "self_attn.v_proj.weight": (hkv * hd, h), p + "self_attn.o_proj.weight": (h, hq * hd),
              p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
              p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
  tensors = {k: (1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.05 * rng.standard_normal(s))
             .astype(np.float32) for k, s in t.items()}
  path.mkdir(parents=True)
  config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
            "hidden_size": h, "intermediate_size": f, "num_hidden_layers": a.num_hidden_layers,
            "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": hd, "hidden_act": "silu",
            "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope.theta, "vocab_size": a.vocab_size, "tie_word_embeddings": False,
            "num_target_layers": cfg.num_target_layers, "dtype": "bfloat16", "use_cache": False,
            "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                              "target_layer_ids": list(cfg.target_layer_ids)}}
  (path / "config.json").write_text(json.dumps(config))
  import ml_dtypes
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
  return tensors


def test_loads_public_dflash_layout_and_round_trips(target, tmp_path):
  cfg = dflash_config_for(target.cfg, num_layers=2, num_target_taps=2, block_size=BLOCK)
  tensors = _zlab_checkpoint(tmp_path / "zlab", cfg, np.random.default_rng(0))
  loaded = load_dflash(tmp_path / "zlab", target)
  assert loaded.spec.cfg.block_size == BLOCK and loaded.spec.cfg.target_layer_ids == cfg.target_layer_ids
  m = nnx.merge(loaded.spec.graphdef, loaded.params["drafter"])
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(m.fc.kernel[...]), bf16(tensors["fc.weight"]).T)
  np.testing.assert_array_equal(np.asarray(m.layers[1].self_attn.k_norm.scale[...]),
                                bf16(tensors["layers.1.self_attn.k_norm.weight"]))
  prompts = _prompts(2, [7, 33])
  ar = generate(target, prompts, max_new_tokens=10, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=10, eos_id=-1, drafter=loaded,
                  num_draft=3).tokens == ar
  # Our export writes the same layout back; reloading gives the same drafts.
  save_dflash_dir(m, tmp_path / "ours")
  again = load_dflash(tmp_path / "ours", target)
  ctx_prompt = jnp.asarray([[5, 6, 7, 8, 9, 10]], jnp.int32)
  taps = compiled(target, ctx_prompt, mode="train", taps=cfg.taps, return_logits=False).taps
  pre = PrefillResult(prompt_tokens=ctx_prompt, tokens=ctx_prompt, prompt_lens=jnp.asarray([5]), taps=taps,
                      new_kv=None, target_cache=None)
  logits = [compiled(d.spec.block_logits, d.params, compiled(d.spec.init_state, d.params, pre, 16), ctx_prompt[:, 5], 3)
            for d in (loaded, again)]
  np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), atol=1e-5)


def test_bad_checkpoints_and_targets(target, tmp_path):
  cfg = dflash_config_for(target.cfg, num_layers=1, num_target_taps=2, block_size=BLOCK)
  _zlab_checkpoint(tmp_path / "ok", cfg, np.random.default_rng(1))
  other = create_model(_cfg(layers=3), seed=0)
  with pytest.raises(ValueError, match="does not match the target.*3"):
    load_dflash(tmp_path / "ok", other)
  wide = create_model(_cfg().replace(vocab_size=V + 8), seed=0)
  with pytest.raises(ValueError, match="vocab_size"):
    load_dflash(tmp_path / "ok", wide)
  conf = json.loads((tmp_path / "ok" / "config.json").read_text())
  for change, msg in [({"dflash_config": {"block_size": 4}}, "lacks"),
                      ({"dflash_config": {**conf["dflash_config"], "target_layer_ids": [0, 7]}}, "outside"),
                      ({"dflash_config": {**conf["dflash_config"], "selector_top_k": 4}}, "unsupported"),
                      ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash")]:
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(ValueError, match=msg):
      load_dflash(tmp_path / "ok", target)
  (tmp_path / "ok" / "config.json").write_text(json.dumps(conf))
  (tmp_path / "ok" / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    load_dflash(tmp_path / "ok", target)
  d = dflash_from_model(_dflash(target), target)
  with pytest.raises(ValueError, match="proposes at most 4 tokens per step"):
    generate(target, [[3, 4, 5]], max_new_tokens=4, drafter=d, num_draft=5)


def test_train_dflash_exports_and_resumes_exactly(env, tmp_path):
  """Trainer on tiny target-generated data: the loss falls, a stopped + resumed run ends bit-identical, and the
  export loads as a drafter that is lossless against its target."""
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.yaml_config import from_dict
  from longspec_jax.training.train_dflash import DFlashTrainConfig, train_dflash
  tmp, data_cfg = env

  def cfg(out, **kw):
    return from_dict(DFlashTrainConfig, dict(
        data_dirs=[data_cfg.out_dir], out_dir=str(tmp_path / out), num_layers=1, num_target_taps=2,
        block_size=4, context_len=32, anchors_per_window=3, batch_size=2, steps=12,
        optim=dict(lr=0.02, warmup_steps=2), val_fraction=0.2, val_windows=2, compute_dtype="float32",
        log_every=1, checkpoint_every_minutes=100.0, **kw))

  final = train_dflash(cfg("a"))
  log = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  assert len(log) == 12 and np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
  info = json.loads((final / "drafter.json").read_text())
  assert info["kind"] == "dflash" and info["n0"] == 32 and info["block_size"] == 4
  assert len(info["val_top1_per_slot"]) == 3
  assert str(train_dflash(cfg("b", stop_after_steps=5))).endswith("checkpoints")
  with pytest.raises(ValueError, match=r"other settings \(gamma\)"):  # would silently mix two runs
    train_dflash(cfg("b", gamma=2.0))
  resumed = train_dflash(cfg("b"))
  log_b = [json.loads(l) for l in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
  assert log_b[-1] == {**log[-1], "elapsed_s": log_b[-1]["elapsed_s"]}
  assert (final / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
  target = load_model_dir(tmp / "target")
  d = load_dflash(final, target)
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=d, num_draft=3).tokens == \
      generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens


def test_block_sampler_anchors_anywhere_and_dirs_in_turns():
  """anywhere_fraction 1: anchors follow a cut anywhere in the window (most inside the prompt), spanning no more rows
  than the continuation has, and label the window's next tokens; fraction 0 keeps them in the continuation.
  dir_turns: one sampler per data dir, padded to that dir's longest row rounded up to 128."""
  from longspec_jax.training.train_dflash import BlockSampler, DFlashTrainConfig, block_samplers
  lens, cont = [300, 200, 90, 120], 20
  rows = [(list(range(1000 * i, 1000 * i + n)), n - cont, i) for i, n in enumerate(lens)]  # token = 1000 i + row
  for fraction in (0.0, 1.0):
    cfg = DFlashTrainConfig(context_len=320, block_size=4, anchors_per_window=6, anywhere_fraction=fraction)
    sampler, in_prompt = BlockSampler(rows, cfg, pad_id=-1, seed=0), []
    for step in range(20):
      b = sampler.batch(step, 3)
      for j, i in enumerate(b["row"]):
        anc = b["anchors"][j]
        assert 1 <= anc.min() and anc.max() <= lens[i] - 2 and anc.max() - anc.min() <= cont
        np.testing.assert_array_equal(b["labels"][j, :, 0], 1000 * i + anc + 1)
        np.testing.assert_array_equal(b["tokens"][j, :lens[i]], rows[i][0])
        in_prompt.append(anc < lens[i] - cont - 1)
    assert np.mean(in_prompt) > 0.5 if fraction else not np.any(in_prompt)
  turns = block_samplers(rows, DFlashTrainConfig(data_dirs=("a", "b"), context_len=320, dir_turns=True), -1,
                         dir_ends=[2, 4])
  assert [s.cfg.context_len for s in turns] == [320, 128]
  assert [sorted(s.row_ids) for s in turns] == [[0, 1], [2, 3]]
  assert turns[1].batch(0, 2)["tokens"].shape == (2, 128)
