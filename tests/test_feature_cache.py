"""The offline feature cache (make-drafter-data --cache-taps): cached taps/K/V equal the target's forward, a killed
build resumes to the same bytes, stale caches are refused, and DFlash / EAGLE-3 train from it without running the
target (EAGLE-3 with a reduced draft vocabulary)."""

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests.compiled import compiled
from tests.test_train_drafter import env  # noqa: F401  (tiny target + make-drafter-data output)
from longspec_jax.training import feature_cache as fc
from longspec_jax.training.drafter_data import load_drafter_data, weights_sha256

TAPS = (1, 2)


def _copy_data(data_cfg, dest):
  import shutil
  shutil.copytree(data_cfg.out_dir, dest)
  return dest


def _target(tmp):
  from longspec_jax.hf_io import load_model_dir
  return load_model_dir(tmp / "target")


def test_cached_features_equal_the_target_forward(env, tmp_path):
  tmp, data_cfg = env
  data = _copy_data(data_cfg, tmp_path / "data")
  target = _target(tmp)
  sha = weights_sha256(tmp / "target")
  fc.build_feature_cache(data, target, TAPS, kv_layers=(1, 0), weights_id=sha, tokens_per_batch=512,
                         show_progress=False)
  ds, _ = load_drafter_data(data)
  rows = fc.data_rows(ds)
  cache = fc.FeatureCache.open(data, taps=TAPS, weights_id=sha, num_rows=len(rows))
  for i in (0, 3, len(rows) - 1):
    out = compiled(target, jnp.asarray([rows[i]]), mode="train", taps=TAPS, return_kv=True, return_logits=False)
    got = cache.window_taps(i, 0, len(rows[i]) + 5, TAPS[::-1])  # any order, zero past the row's end
    np.testing.assert_allclose(got[:len(rows[i])].astype(np.float32), np.asarray(out.taps[0][:, ::-1]),
                               rtol=2e-3, atol=2e-3)
    assert not got[len(rows[i]):].any()
    k, v = out.new_kv  # [L, 1, T, Hkv, D]
    kv = np.asarray(cache.kv[cache.off[i]:cache.off[i + 1]], np.float32)  # [T, 2 layers, 2, Hkv, D]
    np.testing.assert_allclose(kv[:, :, 0], np.asarray(k[:, 0]).transpose(1, 0, 2, 3), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(kv[:, :, 1], np.asarray(v[:, 0]).transpose(1, 0, 2, 3), rtol=2e-3, atol=2e-3)
  # Windows from a later start are the same rows of the same cache; rows before the row's start are zero.
  np.testing.assert_array_equal(cache.window_taps(3, 4, 6, TAPS), cache.window_taps(3, 0, 10, TAPS)[4:10])
  np.testing.assert_array_equal(cache.taps_at(3, [5, 2], (2,)), cache.window_taps(3, 0, 10, (2,))[[5, 2]])
  k, v = cache.window_kv(3, -2, 5, (1,))
  assert k.shape == v.shape == (1, 5, target.cfg.num_key_value_heads, target.cfg.head_dim)
  assert not k[:, :2].any() and not v[:, :2].any()
  np.testing.assert_array_equal(k[0, 2:], cache.kv[cache.off[3]:cache.off[3] + 3, 1, 0])


def test_killed_build_resumes_to_the_same_bytes_and_stale_caches_are_refused(env, tmp_path, monkeypatch):
  tmp, data_cfg = env
  target = _target(tmp)
  sha = weights_sha256(tmp / "target")
  whole = _copy_data(data_cfg, tmp_path / "whole")
  fc.build_feature_cache(whole, target, TAPS, weights_id=sha, tokens_per_batch=256, show_progress=False)
  part = _copy_data(data_cfg, tmp_path / "part")
  real_write = fc.Path.write_text
  writes = []

  def crash_on_second_index(self, text, *a, **kw):
    if self.name == fc.INDEX:
      writes.append(text)
      if len(writes) == 2:
        raise KeyboardInterrupt("killed")
    return real_write(self, text, *a, **kw)

  monkeypatch.setattr(fc.Path, "write_text", crash_on_second_index)
  with pytest.raises(KeyboardInterrupt):
    fc.build_feature_cache(part, target, TAPS, weights_id=sha, tokens_per_batch=256, show_progress=False)
  monkeypatch.undo()
  assert json.loads((part / "features" / fc.INDEX).read_text())["done"] == 2
  n = len(load_drafter_data(part)[0])
  with pytest.raises(ValueError, match="unfinished"):
    fc.FeatureCache.open(part, taps=TAPS, weights_id=sha, num_rows=n)
  assert fc.FeatureCache.open(part, taps=TAPS, weights_id=sha, num_rows=n, use_rows=2) is not None  # a prefix
  fc.build_feature_cache(part, target, TAPS, weights_id=sha, tokens_per_batch=256, show_progress=False)
  assert (part / "features" / "taps.f16").read_bytes() == (whole / "features" / "taps.f16").read_bytes()

  assert fc.FeatureCache.open(tmp_path, taps=TAPS, weights_id=sha, num_rows=n) is None  # no cache there
  with pytest.raises(ValueError, match=r"no taps \[3\]"):
    fc.FeatureCache.open(whole, taps=(1, 3), weights_id=sha, num_rows=n)
  with pytest.raises(ValueError, match="other target weights"):
    fc.FeatureCache.open(whole, taps=TAPS, weights_id="0" * 64, num_rows=n)
  with pytest.raises(ValueError, match="other rows, taps"):
    fc.build_feature_cache(whole, target, (1,), weights_id=sha, show_progress=False)
  with pytest.raises(ValueError, match="cache taps must be"):
    fc.build_feature_cache(tmp_path / "x", target, (99,), weights_id=sha, show_progress=False)
  with pytest.raises(FileNotFoundError, match="no feature cache"):
    fc.open_row_taps([tmp_path], [range(n)], taps=TAPS, weights_id=sha, mode="require")
  assert fc.open_row_taps([tmp_path], [range(n)], taps=TAPS, weights_id=sha, mode="auto") is None


def test_cache_taps_spec():
  from longspec_jax.training.feature_cache import cache_tap_indices
  cfg = types.SimpleNamespace(num_hidden_layers=30)
  assert cache_tap_indices("dflash,eagle3", cfg) == (2, 9, 15, 21, 27, 28)
  assert cache_tap_indices("4,2,4", cfg) == (2, 4)
  with pytest.raises(ValueError, match="neither a tap index"):
    cache_tap_indices("dflsh", cfg)


def test_dflash_and_eagle3_train_from_the_cache(env, tmp_path):
  """A batch's cached taps equal the target's taps of the same windows, and both trainers run from the cache
  (features=require) and export drafters lossless against the target; EAGLE-3 with a 64-token draft vocab."""
  from longspec_jax.drafters.dflash import load_dflash
  from longspec_jax.drafters.eagle3 import load_eagle3
  from longspec_jax.inference.generate import generate
  from longspec_jax.training import train_dflash as tdf
  from longspec_jax.training.train_eagle3 import Eagle3TrainConfig, train_eagle3
  from longspec_jax.yaml_config import from_dict
  tmp, data_cfg = env
  target = _target(tmp)
  data = _copy_data(data_cfg, tmp_path / "data")
  dcfg = from_dict(tdf.DFlashTrainConfig, dict(
      data_dirs=[str(data)], out_dir=str(tmp_path / "dflash"), num_layers=1, num_target_taps=2, block_size=4,
      context_len=32, anchors_per_window=3, batch_size=2, steps=4, optim=dict(lr=0.02, warmup_steps=1),
      val_fraction=0.2, val_windows=2, compute_dtype="float32", log_every=1, checkpoint_every_minutes=100.0,
      features="require"))
  with pytest.raises(FileNotFoundError, match="no feature cache"):
    tdf.train_dflash(dcfg)
  taps = tuple(sorted({*tdf.dflash_config_for(target.cfg, num_layers=1, num_target_taps=2).taps, 2, 1}))
  fc.build_feature_cache(data, target, taps, weights_id=weights_sha256(tmp / "target"), show_progress=False)

  train_rows, _, _, _, _, datasets = tdf._load_rows(dcfg)
  sampler = tdf.BlockSampler(train_rows, dcfg, 0, seed=0)
  cached = fc.open_row_taps([data], datasets, taps=(2,), weights_id=weights_sha256(tmp / "target"), mode="auto")
  batch = fc.with_taps(sampler.batch(0, 2), cached, (2,), np.float32)
  assert "row" not in batch and batch["taps"].shape == (2, 32, 1, 32)
  full = np.asarray(compiled(target, jnp.asarray(batch["tokens"]), mode="train", taps=(2,), return_logits=False).taps)
  real = batch["tokens"] != 0  # pad id 0; windows start at their row's start here (rows are < 32 tokens)
  np.testing.assert_allclose(batch["taps"][real], full[real], rtol=2e-3, atol=2e-3)

  final = tdf.train_dflash(dcfg)
  info = json.loads((final / "drafter.json").read_text())
  assert info["target_taps_from"] == "feature cache" and len(info["val_top1_per_slot"]) == 3
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  ar = generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=load_dflash(final, target),
                  num_draft=3).tokens == ar

  ecfg = from_dict(Eagle3TrainConfig, dict(
      data_dirs=[str(data)], out_dir=str(tmp_path / "eagle3"), aux_layers=[2, 1, 2], draft_vocab_size=64,
      model=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64),
      context_len=16, ttt_steps=2, batch_size=2, steps=4, optim=dict(lr=0.02, warmup_steps=1), val_fraction=0.2,
      val_windows=2, compute_dtype="float32", attn_block=16, log_every=1, checkpoint_every_minutes=100.0,
      features="require"))
  final = train_eagle3(ecfg)
  info = json.loads((final / "drafter.json").read_text())
  assert info["target_taps_from"] == "feature cache" and info["draft_vocab_size"] == 64
  from safetensors.numpy import load_file
  t = load_file(str(final / "model.safetensors"))
  assert t["lm_head.weight"].shape == (64, 32) and t["t2d"].sum() == 64
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=load_eagle3(final, target),
                  num_draft=3).tokens == ar


def test_draft_vocabulary_is_the_most_frequent_tokens():
  from longspec_jax.training.train_eagle3 import draft_vocab_ids, frozen_inputs
  rows = [[5, 5, 5, 2, 2, 9], [9, 9, 9, 9, 1]]
  assert draft_vocab_ids(rows, 12, 2).tolist() == [5, 9]  # ascending ids, so d2t offsets are non-negative
  assert draft_vocab_ids(rows, 12, 0).tolist() == list(range(12))
  target = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=12),
                                 embed_tokens=types.SimpleNamespace(embedding=np.zeros((12, 4))))
  t2d = frozen_inputs(target, None, np.asarray([5, 9]), with_target=False)["t2d"]
  assert t2d[5] == 0 and t2d[9] == 1 and (np.delete(t2d, [5, 9]) == -1).all()


def test_dflash_tap_scale_folds_into_fc(env):
  """normalize_taps trains on taps * scale; folding the scale into fc gives the same logits from raw taps, so the
  exported drafter (public layout) reads the target's taps unchanged."""
  from longspec_jax.drafters.dflash import create_dflash, dflash_config_for
  from longspec_jax.drafters.frozen_target import target_io
  from longspec_jax.training.drafter_common import fold_input_scale
  from longspec_jax.drafters.dflash import dflash_train_logits
  tmp, _ = env
  target = _target(tmp)
  dcfg = dflash_config_for(target.cfg, num_layers=1, num_target_taps=2, block_size=4)
  model = create_dflash(dcfg, seed=1)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 300, (2, 24)), jnp.int32)
  taps = compiled(target, tokens, mode="train", taps=dcfg.taps, return_logits=False).taps
  scale = jnp.asarray(rng.uniform(0.01, 3.0, taps.shape[2:]), jnp.float32)
  anchors = jnp.asarray([[3, 9], [5, 17]], jnp.int32)
  io = target_io(target)
  scaled = compiled(dflash_train_logits, model, io, taps, tokens, anchors, scale)
  fold_input_scale(model.fc, np.asarray(scale))
  np.testing.assert_allclose(np.asarray(compiled(dflash_train_logits, model, io, taps, tokens, anchors)),
                             np.asarray(scaled), rtol=1e-4, atol=1e-4)
