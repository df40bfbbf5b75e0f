"""Standalone / PARD drafter training: target-generated data (datasets, resumable), the mask-group objective,
the trainer run with exact resume, and the exported HF directory + drafter.json."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from tests.test_corpus_tokenizer import _fake_stdlib
from longspec_jax.training.drafter_data import DrafterDataConfig, load_drafter_data, make_drafter_data
from longspec_jax.drafters.pard import pard_forward
from longspec_jax.training.train_pard import PardTrainConfig, WindowSampler, drafter_model_config, train_pard

VOCAB = 320
TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  from longspec_jax.hf_io import save_model_dir
  from longspec_jax.model import create_model, default_target_config
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  from longspec_jax.training.data import CorpusConfig, build_corpus, load_corpus

  tmp = tmp_path_factory.mktemp("drafter")
  _fake_stdlib(tmp / "lib")
  build_corpus(tmp / "corpus", CorpusConfig(min_chars=50, long_min_chars=3000, num_long_docs=1), root=tmp / "lib")
  save_hf_tokenizer(train_bpe(load_corpus(tmp / "corpus")["train"]["text"], VOCAB), tmp / "tok")
  target = create_model(default_target_config(vocab_size=VOCAB, max_position_embeddings=512, **TINY), seed=3)
  save_model_dir(target, tmp / "target", tokenizer_dir=tmp / "tok")
  data_cfg = DrafterDataConfig(target_dir=str(tmp / "target"), corpus_dir=str(tmp / "corpus"),
                               out_dir=str(tmp / "data"), num_prompts=6, new_tokens=12, batch=3,
                               temperature=0.8, greedy_fraction=0.5, min_prompt_tokens=8, max_prompt_tokens=20)
  make_drafter_data(data_cfg)
  return tmp, data_cfg


def test_drafter_data_is_what_generate_gives(env):
  from longspec_jax.inference.generate import generate
  from longspec_jax.hf_io import load_model_dir

  tmp, data_cfg = env
  ds, manifest = load_drafter_data(data_cfg.out_dir)
  assert len(ds) == 6 and manifest["counts"]["sequences"] == 6
  assert manifest["counts"]["generated_tokens"] == sum(len(c) for c in ds["continuation"]) > 0
  assert sorted(set(ds["temperature"])) == [0.0, pytest.approx(0.8)]  # one greedy batch, one sampled
  assert all(8 <= len(p) - b <= 20 for p, b in zip(ds["prompt"], ds["bos"]))
  assert all(p[0] == 0 for p, b in zip(ds["prompt"], ds["bos"]) if b)  # BOS when the window starts a doc
  target = load_model_dir(tmp / "target")
  for k in range(2):
    rows = ds.filter(lambda r: r["batch"] == k)
    res = generate(target, list(rows["prompt"]), max_new_tokens=12, temperature=rows["temperature"][0],
                   seed=rows["gen_seed"][0])
    assert res.tokens == list(rows["continuation"])
  # A finished directory is recognised; different settings for it are refused.
  make_drafter_data(data_cfg)
  with pytest.raises(ValueError, match="different settings"):
    make_drafter_data(dataclasses.replace(data_cfg, seed=1))


def test_drafter_data_resumes_after_a_crash(env, monkeypatch):
  import longspec_jax.inference.generate as gen_mod

  tmp, data_cfg = env
  real, calls = gen_mod.generate, []

  def crash_on_second(*a, **kw):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("killed")
    return real(*a, **kw)

  cfg = dataclasses.replace(data_cfg, out_dir=str(tmp / "data_resumed"))
  monkeypatch.setattr(gen_mod, "generate", crash_on_second)
  with pytest.raises(RuntimeError, match="killed"):
    make_drafter_data(cfg)
  make_drafter_data(cfg)
  assert len(calls) == 3  # the rerun generated only the missing batch
  a, b = load_drafter_data(data_cfg.out_dir)[0], load_drafter_data(cfg.out_dir)[0]
  assert a.to_dict() == b.to_dict()


def test_bad_inputs(env, tmp_path):
  import datasets

  from longspec_jax.config import ModelConfig

  tmp, data_cfg = env
  with pytest.raises(FileNotFoundError, match="no target model"):
    make_drafter_data(dataclasses.replace(data_cfg, target_dir=str(tmp_path / "nope"),
                                          out_dir=str(tmp_path / "x")))
  with pytest.raises(FileNotFoundError, match="no finished drafter data"):
    load_drafter_data(tmp_path)
  datasets.Dataset.from_dict({"prompt": [], "continuation": []}).save_to_disk(str(tmp_path / "empty" / "dataset"))
  (tmp_path / "empty" / "manifest.json").write_text("{}")
  with pytest.raises(ValueError, match="empty"):
    load_drafter_data(tmp_path / "empty")
  target_cfg = ModelConfig.from_json_file(tmp / "target" / "config.json")
  with pytest.raises(ValueError, match="does not match the target"):
    drafter_model_config(target_cfg, {"vocab_size": VOCAB + 64})
  with pytest.raises(ValueError, match="unknown drafter model keys"):
    drafter_model_config(target_cfg, {"hidden": 3})
  # A target whose vocabulary differs from the one that generated the data.
  other = json.loads((tmp / "target" / "config.json").read_text())
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "config.json").write_text(json.dumps({**other, "vocab_size": VOCAB * 2}))
  with pytest.raises(ValueError, match="generated by a target with vocab_size"):
    train_pard(PardTrainConfig(data_dir=data_cfg.out_dir, target_dir=str(tmp_path / "other"),
                                                out_dir=str(tmp_path / "run")))


def test_mask_groups_match_a_plain_causal_forward(env):
  """Training reads mask logits from a cache copy per anchor; that must equal running [x_0..x_a, MASK x (K-1)]
  causally from scratch, which is what PARD drafting does at inference."""
  from longspec_jax.config import ModelConfig
  from longspec_jax.model import create_model

  tmp, _ = env
  target_cfg = ModelConfig.from_json_file(tmp / "target" / "config.json")
  model = create_model(drafter_model_config(target_cfg, TINY), seed=1)
  cfg = PardTrainConfig(context_len=16, num_masks=3, anchors_per_window=4)
  rows = [list(np.random.default_rng(i).integers(3, VOCAB, size=n)) for i, n in enumerate((30, 9, 17))]
  batch = WindowSampler(rows, cfg, pad_id=1, seed=0).batch(0, 3)
  graphdef, params = nnx.split(model)
  fwd = jax.jit(lambda p, b: pard_forward(nnx.merge(graphdef, p), b, 3, target_cfg.mask_token_id))
  ntp_logits, mask_logits = fwd(params, batch)
  assert ntp_logits.shape == (3, 16, VOCAB) and mask_logits.shape == (3, 4, 3, VOCAB)
  # References: each [x_0..x_a, MASK x 3] run causally, right-padded to one length (causal: padding after a
  # sequence cannot change its logits) so a single compiled call covers every anchor.
  refs = np.ones((3, 4, 16 + 3), np.int32)
  for b in range(3):
    for j, a in enumerate(batch["anchors"][b]):
      refs[b, j, :a + 4] = np.concatenate([batch["tokens"][b, :a + 1], [target_cfg.mask_token_id] * 3])
  ref = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, mode="train").logits)(params, refs.reshape(12, -1))
  ref = np.asarray(ref).reshape(3, 4, 19, VOCAB)
  for b in range(3):
    for j, a in enumerate(batch["anchors"][b]):
      np.testing.assert_allclose(mask_logits[b, j], ref[b, j, a + 1:a + 4], atol=2e-4)
      np.testing.assert_allclose(ntp_logits[b, a], ref[b, j, a], atol=2e-4)


def _train_cfg(env, out, **kw):
  _, data_cfg = env
  base = dict(data_dir=data_cfg.out_dir, out_dir=str(out), model=TINY, context_len=24, num_masks=3,
              anchors_per_window=4, batch_size=4, steps=16,
              optim=dict(lr=0.02, warmup_steps=2), val_fraction=0.2, val_windows=4, compute_dtype="float32",
              attn_block=16, log_every=1, checkpoint_every_minutes=100.0)
  from longspec_jax.yaml_config import from_dict
  return from_dict(PardTrainConfig, {**base, **kw})


def test_train_drafter_exports_and_resumes_exactly(env, tmp_path):
  from longspec_jax.hf_io import load_model_dir

  final = train_pard(_train_cfg(env, tmp_path / "a"))
  log = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  assert len(log) == 16
  assert np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]]) - 0.3
  drafter = load_model_dir(final)
  info = json.loads((final / "drafter.json").read_text())
  assert drafter.cfg.vocab_size == VOCAB and drafter.cfg.mask_token_id == info["mask_token_id"] == 2
  assert info["kind"] == "standalone" and info["num_mask_tokens_trained"] == 3 and info["steps"] == 16
  assert info["train_max_len"] == 27 and info["n0"] == 24 and info["target"] == "target"
  assert info["final_loss"] == log[-1]["loss"] and len(info["val_top1_per_position"]) == 4
  assert (final / "tokenizer.json").exists()

  assert str(train_pard(_train_cfg(env, tmp_path / "b", stop_after_steps=7))).endswith("checkpoints")
  resumed = train_pard(_train_cfg(env, tmp_path / "b"))
  log_b = [json.loads(l) for l in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
  assert log_b[-1] == {**log[-1], "elapsed_s": log_b[-1]["elapsed_s"]}  # same loss / grad norm bit for bit
  a_params = jax.tree.leaves(nnx.state(drafter, nnx.Param))
  b_params = jax.tree.leaves(nnx.state(load_model_dir(resumed), nnx.Param))
  assert all(np.array_equal(x, y) for x, y in zip(a_params, b_params))
