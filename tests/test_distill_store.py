"""The distillation store on a tiny target made here: soft labels and features equal a direct target forward, the
shard index adds up, a killed build resumes to the same bytes, fp8 round trip, on-policy windows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.hf_io import save_model_dir
from longspec_jax.model import create_model
from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
from longspec_jax.training import distill_store as ds
from longspec_jax.training.distill_store import DistillStore, DistillStoreConfig, build_distill_store
from tests.compiled import compiled

DOCS = [f"def function_{i}(x, y):\n    return x * {i} + y - {i % 7}\n" * (3 + i % 5) for i in range(40)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  import datasets
  root = tmp_path_factory.mktemp("distill")
  tok = train_bpe(DOCS, vocab_size=300)
  cfg = ModelConfig(family="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                    rope=RopeConfig(), bos_token_id=0, eos_token_id=0, pad_token_id=1, mask_token_id=2)
  model_dir = root / "target"
  save_model_dir(create_model(cfg, seed=0), model_dir)
  save_hf_tokenizer(tok, model_dir)
  corpus = root / "corpus"
  datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS, "path": [f"{i}.py" for i in range(40)]})}
                       ).save_to_disk(str(corpus))
  return root, model_dir, corpus


def _cfg(setup, out, **kw):
  root, model_dir, corpus = setup
  base = dict(target=str(model_dir), corpus_dir=str(corpus), out_dir=str(root / out), max_tokens=100_000,
              window_tokens=200, taps=(1, 2), kv_layers=(0,), topk=5, shard_tokens=500)
  return DistillStoreConfig(**{**base, **kw})


def test_store_matches_a_direct_forward(setup):
  from longspec_jax.targets import load_target
  cfg = _cfg(setup, "plain")
  out = build_distill_store(cfg, show_progress=False)
  store = DistillStore(out)
  index = json.loads((out / "index.json").read_text())
  assert index["stored_tokens"] == sum(s["tokens"] for s in index["shards"]) == sum(
      w["length"] for _, w in store.windows)
  assert len(index["shards"]) > 1 and index["bytes"] > 0
  model = load_target(cfg.target)
  for i in (0, len(store.windows) - 1):
    rows = store.read_window(i)
    out_ = compiled(model, jnp.asarray(rows["tokens"])[None], mode="train", taps=(1, 2), return_kv=True)
    lp = jax.nn.log_softmax(out_.logits[0].astype(jnp.float32), axis=-1)
    vals, ids = jax.lax.top_k(lp, 5)
    np.testing.assert_array_equal(rows["topk_ids"], np.asarray(ids))
    np.testing.assert_allclose(rows["topk_logprobs"], np.asarray(vals), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(rows["taps"], np.asarray(out_.taps[0]), rtol=1e-2, atol=1e-2)
    k0 = np.asarray(out_.new_kv[0][0, 0])  # layer 0's K rows [T, Hkv, D]
    np.testing.assert_allclose(rows["kv"][:, 0, 0], k0, rtol=1e-2, atol=1e-2)
    assert rows["generated_from"] == -1


def test_killed_build_resumes_to_the_same_store(setup, monkeypatch):
  whole = build_distill_store(_cfg(setup, "whole"), show_progress=False)
  calls = {"n": 0}
  real = ds._write_shard

  def dies_after_two(*args):
    if calls["n"] == 2:
      raise KeyboardInterrupt("killed")
    calls["n"] += 1
    return real(*args)

  monkeypatch.setattr(ds, "_write_shard", dies_after_two)
  with pytest.raises(KeyboardInterrupt):
    build_distill_store(_cfg(setup, "resumed"), show_progress=False)
  partial = json.loads((setup[0] / "resumed" / "index.json").read_text())
  assert len(partial["shards"]) == 2
  monkeypatch.setattr(ds, "_write_shard", real)
  resumed = build_distill_store(_cfg(setup, "resumed"), show_progress=False)
  a, b = json.loads((whole / "index.json").read_text()), json.loads((resumed / "index.json").read_text())
  assert a["shards"] == b["shards"]
  for shard in a["shards"]:
    for f in sorted((whole / shard["name"]).iterdir()):
      assert f.read_bytes() == (resumed / shard["name"] / f.name).read_bytes(), f
  with pytest.raises(ValueError, match="other settings .*topk"):
    build_distill_store(_cfg(setup, "resumed", topk=7), show_progress=False)


def test_max_tokens_stops_and_a_rerun_extends(setup):
  small = build_distill_store(_cfg(setup, "grow", max_tokens=450), show_progress=False)
  n = json.loads((small / "index.json").read_text())["stored_tokens"]
  assert 450 <= n < 650
  grown = json.loads((build_distill_store(_cfg(setup, "grow", max_tokens=1200), show_progress=False)
                      / "index.json").read_text())
  assert grown["stored_tokens"] >= 1200 and grown["shards"][0]["tokens"] == n


def test_fp8_round_trip_keeps_large_activations():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(50, 3, 64)).astype(np.float32)
  x[:, 1, 5] = 3000.0  # a massive activation, far past fp8's 448
  enc = ds.encode_features(x, "fp8")
  y = ds.decode_features(enc["bits"], "fp8", enc["scale"])
  assert enc["bits"].dtype == np.uint8 and enc["scale"].shape == (50, 3)
  rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
  assert rel.max() < 0.07
  b = ds.decode_features(ds.encode_features(x, "bf16")["bits"], "bf16")
  assert (np.linalg.norm(b - x, axis=-1) / np.linalg.norm(x, axis=-1)).max() < 0.01


def test_device_encoding_and_decoding_equal_numpys_bit_for_bit():
  """The store's forward encodes on the device and the EAGLE-3 trainer decodes there: the bytes and values must be
  those the numpy encoder and decoder give (a store or a batch does not depend on where it was made)."""
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(40, 3, 2, 64)) * np.exp(rng.normal(size=(40, 3, 1, 1)) * 4)).astype(np.float32)
  x[5, 1, 0, :8] = [1e-30, -1e-35, 3e-39, 0.0, -0.0, 1e-8, 4.5e5, 1e-3]  # subnormal, zero and huge entries
  x[7, 2] = 0.0  # an all-zero group
  for dtype in ds.FEATURE_DTYPES:
    host = ds.encode_features(x, dtype)
    dev = jax.jit(lambda a, d=dtype: ds.encode_on_device(a, d))(x)
    assert sorted(dev) == sorted(host)
    for k in host:
      assert np.array_equal(np.asarray(dev[k]).view(np.uint8), host[k].view(np.uint8)), (dtype, k)
    rows = {"taps": host["bits"], **({"taps_scale": host["scale"]} if "scale" in host else {})}
    want = ds.decode_features(host["bits"], dtype, host.get("scale"))
    for out_dtype in (jnp.float32, jnp.bfloat16):
      got = jax.jit(lambda r, d=dtype, o=out_dtype: ds.decode_on_device(r, "taps", d, o))(rows)["taps"]
      assert np.array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(jnp.asarray(want).astype(out_dtype)
                                                                            .astype(jnp.float32)))


def test_on_policy_windows_hold_the_targets_own_continuation(setup):
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  cfg = _cfg(setup, "onpolicy", on_policy_fraction=1.0, on_policy_new_tokens=16, max_tokens=400, kv_layers=())
  store = DistillStore(build_distill_store(cfg, show_progress=False))
  rows = store.read_window(0)  # window 0 is greedy
  cut = rows["generated_from"]
  assert cut == len(rows["tokens"]) - 16
  want = generate(load_target(cfg.target), [rows["tokens"][:cut].tolist()], max_new_tokens=16, eos_id=-1).tokens[0]
  assert rows["tokens"][cut:].tolist() == want
  assert "kv" not in rows


def test_bad_settings(setup):
  with pytest.raises(ValueError, match="feature_dtype"):
    build_distill_store(_cfg(setup, "bad", feature_dtype="fp4"), show_progress=False)
  with pytest.raises(ValueError, match="taps must be in"):
    build_distill_store(_cfg(setup, "bad", taps=(9,)), show_progress=False)


def test_read_rows_windows_and_a_stable_split(setup):
  store = DistillStore(build_distill_store(_cfg(setup, "plain"), show_progress=False))
  whole = store.read_window(1)
  part = store.read_rows(1, 10, 30, taps=[1], features=("taps",))
  np.testing.assert_array_equal(part["tokens"], whole["tokens"][10:40])
  np.testing.assert_array_equal(part["taps"], whole["taps"][10:40, 1:2])
  assert "kv" not in part and store.tap_positions([2]) == [1]
  with pytest.raises(ValueError, match="not \\[0\\]"):
    store.tap_positions([0])
  sampler = ds.StoreWindows(store, np.arange(len(store.windows)), 64, (1, 2), pad_id=1, seed=0)
  b = sampler.batch(3, 4)
  assert b["tokens"].shape == (4, 64) and b["taps"].shape == (4, 64, 2, 32) and b["topk_ids"].shape == (4, 64, 5)
  again = sampler.batch(3, 4, slice(2, 4))  # a resumed run, or another process's rows, draws the same windows
  np.testing.assert_array_equal(again["tokens"], b["tokens"][2:])
  last = store.read_rows(len(store.windows) - 1, 0, 256)  # shorter than 256 rows: padded, valid says how far
  padded = ds.pad_rows([last], 256, pad_id=1)
  assert padded["valid"][0] == len(last["tokens"]) < 256 and (padded["tokens"][0, len(last["tokens"]):] == 1).all()
  # The held-out side of a window depends on its window number alone: a grown store keeps every held-out window.
  small = DistillStore(build_distill_store(_cfg(setup, "split", max_tokens=800), show_progress=False))
  _, val_small = ds.split_windows(small, 0, 0.3)
  _, val_big = ds.split_windows(store, 0, 0.3)
  ids = lambda s, v: {s.windows[i][1]["window"] for i in v}
  assert ids(small, val_small) <= ids(store, val_big)
  with pytest.raises(ValueError, match="leaves no training"):
    ds.split_windows(small, 0, 1.0)
  # max_train_tokens: the grown store's run trains on the small store's train windows, no more and no fewer.
  train_small, _ = ds.split_windows(small, 0, 0.3)
  cap = int(small.window_lengths()[train_small].sum())
  train_capped, val_capped = ds.split_windows(store, 0, 0.3, max_train_tokens=cap)
  assert ids(store, train_capped) == ids(small, train_small) and list(val_capped) == list(val_big)
  assert len(ds.split_windows(store, 0, 0.3)[0]) > len(train_capped)
  with pytest.raises(ValueError, match="smaller than the store's first train window"):
    ds.split_windows(store, 0, 0.3, max_train_tokens=1)
  # held_out_within_tokens: the grown store scores the small store's held-out windows, and only those.
  _, val_pinned = ds.split_windows(store, 0, 0.3, held_out_within_tokens=small.index["stored_tokens"])
  assert ids(store, val_pinned) == ids(small, val_small) and len(val_pinned) < len(val_big)
  with pytest.raises(ValueError, match="no held-out window ends within"):
    ds.split_windows(store, 0, 0.3, held_out_within_tokens=1)
  from longspec_jax.training.train_eagle3 import Eagle3TrainConfig
  with pytest.raises(ValueError, match="held_out_within_tokens needs store_dir"):
    Eagle3TrainConfig(held_out_within_tokens=1000)
  with pytest.raises(ValueError, match="max_train_tokens must be >= 0"):
    Eagle3TrainConfig(store_dir="s", max_train_tokens=-1)


def test_eagle3_trains_from_the_store_and_stays_lossless(setup, tmp_path):
  """EAGLE-3 from the store with soft labels: the log carries held-out tau_sim, the export records the store, and
  the drafter is lossless against the target."""
  from longspec_jax.drafters.eagle3 import load_eagle3
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  from longspec_jax.training.drafter_common import tau_sim
  from longspec_jax.training.train_eagle3 import Eagle3TrainConfig, train_eagle3
  from longspec_jax.yaml_config import from_dict
  root, model_dir, _ = setup
  store = build_distill_store(_cfg(setup, "plain"), show_progress=False)
  cfg = from_dict(Eagle3TrainConfig, dict(
      store_dir=str(store), distill="kl", out_dir=str(tmp_path / "e3"), aux_layers=[1, 2], draft_vocab_size=64,
      model=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64),
      context_len=32, ttt_steps=2, batch_size=2, steps=4, eval_every=2, optim=dict(lr=0.02, warmup_steps=1),
      val_fraction=0.3, val_windows=2, compute_dtype="float32", attn_block=32, log_every=1,
      checkpoint_every_minutes=100.0))
  final = train_eagle3(cfg)
  log = [json.loads(l) for l in (tmp_path / "e3" / "train_log.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log if "val_tau_sim" in r] == [2, 4]
  acc = [log[-1]["val_acc_0"], log[-1]["val_acc_1"]]
  assert log[-1]["val_tau_sim"] == pytest.approx(tau_sim(acc), abs=1e-3)
  info = json.loads((final / "drafter.json").read_text())
  assert info["loss"] == "kl" and info["draft_vocab_size"] == 64 and info["data"][0]["train_windows"] > 0
  assert str(root) not in json.dumps(info)  # no absolute machine paths
  target = load_target(model_dir)
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  ar = generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=load_eagle3(final, target),
                  num_draft=3).tokens == ar
  with pytest.raises(ValueError, match="needs store_dir"):
    from_dict(Eagle3TrainConfig, dict(distill="kl"))
  # Evaluated on the same held-out windows afterwards, it scores what its last log says; a copy with a smaller
  # draft vocabulary keeps the most frequent target argmax tokens and stays lossless.
  from longspec_jax.training.train_eagle3 import evaluate_on_store, shrink_draft_vocab
  again = evaluate_on_store(load_eagle3(final, target), target, store, context_len=32, ttt_steps=2,
                            val_windows=2, val_fraction=0.3)
  assert again["val_tau_sim"] == pytest.approx(log[-1]["val_tau_sim"], abs=0.02)
  small = shrink_draft_vocab(final, target, store, 16, tmp_path / "small", val_fraction=0.3)
  info = json.loads((small / "drafter.json").read_text())
  assert info["draft_vocab_size"] == 16 and info["draft_vocab_shrunk_from"] == 64
  assert 0 < info["argmax_share_kept"]["train"] <= info["argmax_share_kept"]["before_train"] <= 1
  shrunk = load_eagle3(small, target)
  assert shrunk.spec.draft_vocab_size == 16
  kept = set((np.arange(16) + np.asarray(shrunk.params["d2t"])).tolist())
  assert kept <= set((np.arange(64) + np.asarray(load_eagle3(final, target).params["d2t"])).tolist())
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=shrunk, num_draft=3).tokens == ar
  with pytest.raises(ValueError, match="size must be in"):
    shrink_draft_vocab(final, target, store, 64, tmp_path / "same")


def test_tau_sim_by_hand():
  from longspec_jax.training.drafter_common import tau_sim
  assert tau_sim([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
  assert tau_sim([1.0, 0.0, 1.0]) == pytest.approx(2.0)


def _check_export(setup, store, final, log, load, rescore, num_slots: int) -> None:
  """A block drafter exported from a store run: drafter.json records the run and no machine path, the drafter
  drafts over the 64 tokens most often the target's argmax on the train windows (what it was trained on), greedy
  equals AR, and `rescore(target)` (the export scored again on the same held-out blocks: bf16 weights, input scale
  folded in) gets what the run's last log says."""
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  root, model_dir, _ = setup
  info = json.loads((final / "drafter.json").read_text())
  assert info["loss"] == "kl" and info["draft_vocab_size"] == 64 and info["data"][0]["train_windows"] > 0
  assert len(info["val_top1_per_slot"]) == num_slots and str(root) not in json.dumps(info)
  target = load_target(model_dir)
  drafter = load(final, target)
  counts = store.argmax_counts(ds.split_windows(store, 0, 0.3)[0], target.cfg.vocab_size)
  assert set(np.asarray(drafter.params["io"]["draft_ids"]).tolist()) == set(
      np.argsort(-counts, kind="stable")[:64].tolist())
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  ar = generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar
  again = rescore(target)
  assert again["val_tau_sim"] == pytest.approx(log[-1]["val_tau_sim"], abs=0.05)
  assert again["val_acc_0"] == pytest.approx(log[-1]["val_acc_0"], abs=0.15)


def test_longspark_trains_from_the_store_and_stays_lossless(setup, tmp_path):
  """LongSpark from the store: a batch holds the store's own rows (K/V slab, boundary taps, slot j's soft label =
  the target's distribution at row a + j), the log carries held-out tau_sim, the export records the store and its
  draft vocabulary (drafted with by default) and the drafter is lossless against the target."""
  from longspec_jax.drafters.longspark import load_longspark
  from longspec_jax.training.drafter_common import tau_sim
  from longspec_jax.training.train_longspark import (AnchorSampler, LongSparkTrainConfig, StoreLongSparkRows,
                                                     decode_kv_batch, train_longspark)
  from longspec_jax.yaml_config import from_dict
  store_dir = build_distill_store(_cfg(setup, "kv01", kv_layers=(0, 1)), show_progress=False)
  cfg = from_dict(LongSparkTrainConfig, dict(
      store_dir=str(store_dir), distill="kl", out_dir=str(tmp_path / "ls"), num_layers=1, block_size=3,
      raw_window=16, num_global_slots=4, markov_rank=0, draft_vocab_size=64, anchors_per_window=4, tail_rows=16,
      anywhere_fraction=0.8, batch_size=2, steps=4, eval_every=2, optim=dict(lr=0.02, warmup_steps=1),
      val_fraction=0.3, val_windows=2, compute_dtype="float32", log_every=1, checkpoint_every_minutes=100.0,
      normalize_boundary=True))

  store = DistillStore(store_dir)
  rows = StoreLongSparkRows(store, (1,))
  sampler = AnchorSampler(rows, np.arange(len(store.windows)), cfg, 0, tail=cfg.tail_rows)
  b = sampler.batch(5, 2)
  win = np.random.default_rng([0, 5]).integers(0, len(store.windows), size=2)  # the sampler's first draw
  for r, i in enumerate(win):
    whole = store.read_window(int(i))
    for a, anchor in enumerate(b["anchors"][r]):
      for j in range(3):
        if b["label_w"][r, a, j] > 0:
          np.testing.assert_array_equal(b["topk_ids"][r, a, j], whole["topk_ids"][anchor + j])
          np.testing.assert_array_equal(b["topk_logprobs"][r, a, j], whole["topk_logprobs"][anchor + j])
          assert b["labels"][r, a, j] == whole["tokens"][anchor + 1 + j]
      np.testing.assert_array_equal(b["boundary"][r, a], whole["taps"][anchor - 1, 1:2])  # tap 2 = layer 1's out
    for s, pos in enumerate(b["slab_pos"][r]):
      expect = whole["kv"][pos, 1, 0] if pos >= 0 else 0.0
      np.testing.assert_array_equal(b["slab_k"][0, r, s], expect)
  # training batches carry the K/V as stored (bf16 bits here) and are decoded in the step: to these, bit for bit
  raw = AnchorSampler(StoreLongSparkRows(store, (1,), decode=False), np.arange(len(store.windows)), cfg, 0,
                      tail=cfg.tail_rows).batch(5, 2)
  assert "pre_k" not in raw and raw["pre_kv"].dtype == np.uint16
  dec = jax.jit(lambda x: decode_kv_batch(x, store.settings["feature_dtype"]))(raw)
  assert sorted(dec) == sorted(b) and all(np.array_equal(np.asarray(dec[k]), b[k]) for k in b)
  with pytest.raises(ValueError, match="K/V of layers \\[0\\], not \\[1\\]"):
    StoreLongSparkRows(DistillStore(build_distill_store(_cfg(setup, "plain"), show_progress=False)), (1,))

  final = train_longspark(cfg)
  log = [json.loads(l) for l in (tmp_path / "ls" / "train_log.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log if "val_tau_sim" in r] == [2, 4]
  assert log[-1]["val_tau_sim"] == pytest.approx(tau_sim([log[-1][f"val_acc_{j}"] for j in range(3)]), abs=1e-3)
  kept = json.loads((tmp_path / "ls" / "store_run.json").read_text())  # what a resumed run keeps as the store grows
  held_out = ds.split_windows(store, 0, 0.3)[1]
  assert kept["held_out_windows"] == [store.windows[i][1]["window"] for i in held_out]
  assert np.asarray(kept["input_scale"]).shape == (1, 32)
  from longspec_jax.training.train_longspark import evaluate_longspark_on_store
  _check_export(setup, store, final, log, load_longspark, lambda target: evaluate_longspark_on_store(
      final, target, store_dir, draws=2, val_fraction=0.3, tail_rows=16, anchors_per_window=4,
      anywhere_fraction=0.8), num_slots=3)
  with pytest.raises(ValueError, match="needs? store_dir"):
    from_dict(LongSparkTrainConfig, dict(draft_vocab_size=64))
  with pytest.raises(ValueError, match="markov_rank 0"):
    from_dict(LongSparkTrainConfig, dict(store_dir="s", draft_vocab_size=64, markov_rank=8))


def test_dflash_trains_from_the_store_and_stays_lossless(setup, tmp_path):
  """DFlash from the store: a batch holds the store's rows (taps of the window, slot k's soft label = the target's
  distribution at row a + k - 1), the log carries held-out tau_sim, a resumed run keeps its held-out windows and
  tap scale, the export drafts over its draft vocabulary by default and is lossless against the target."""
  from longspec_jax.drafters.dflash import load_dflash
  from longspec_jax.training.distill_store import StoreWindows
  from longspec_jax.training.drafter_common import draw_windows, tau_sim
  from longspec_jax.training.train_dflash import DFlashTrainConfig, StoreBlockSampler, train_dflash
  from longspec_jax.yaml_config import from_dict
  store_dir = build_distill_store(_cfg(setup, "plain"), show_progress=False)
  store = DistillStore(store_dir)
  cfg = from_dict(DFlashTrainConfig, dict(
      store_dir=str(store_dir), distill="kl", out_dir=str(tmp_path / "df"), num_layers=1, num_target_taps=1,
      model=dict(intermediate_size=32), block_size=4, context_len=48, anchors_per_window=5, draft_vocab_size=64,
      normalize_taps=True, init_from_target=True, batch_size=2, steps=4, eval_every=2,
      optim=dict(lr=0.02, warmup_steps=1), val_fraction=0.3, val_windows=2, compute_dtype="float32", log_every=1,
      checkpoint_every_minutes=100.0))

  windows = np.arange(len(store.windows))
  sampler = StoreBlockSampler(StoreWindows(store, windows, 48, (2,), 1, 0), cfg)
  b = sampler.batch(3, 2)
  _, picks, offs, _ = draw_windows(store.window_lengths(), 0, 3, 2, 48, slice(None))
  checked = 0
  for r, (i, off) in enumerate(zip(picks, offs)):
    whole = store.read_window(int(windows[i]))
    n = min(len(whole["tokens"]) - off, 48)
    np.testing.assert_array_equal(b["taps"][r, :n], whole["taps"][off:off + n, 1:2])  # tap 2 = the last layer's out
    for a, anchor in enumerate(b["anchors"][r]):
      assert 1 <= anchor <= n - 2
      for k in range(3):  # slot k predicts x_{a+k+1}
        if b["label_w"][r, a, k] > 0:
          assert b["labels"][r, a, k] == whole["tokens"][off + anchor + k + 1]
          np.testing.assert_array_equal(b["topk_ids"][r, a, k], whole["topk_ids"][off + anchor + k])
          np.testing.assert_array_equal(b["topk_logprobs"][r, a, k], whole["topk_logprobs"][off + anchor + k])
          checked += 1
  assert checked > 0

  final = train_dflash(cfg)
  log = [json.loads(l) for l in (tmp_path / "df" / "train_log.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log if "val_tau_sim" in r] == [2, 4]
  assert log[-1]["val_tau_sim"] == pytest.approx(tau_sim([log[-1][f"val_acc_{j}"] for j in range(3)]), abs=1e-3)
  kept = json.loads((tmp_path / "df" / "store_run.json").read_text())
  assert kept["held_out_windows"] == [store.windows[i][1]["window"] for i in ds.split_windows(store, 0, 0.3)[1]]
  assert np.asarray(kept["input_scale"]).shape == (1, 32)
  assert json.loads((final / "drafter.json").read_text())["init_from_target"]
  from longspec_jax.training.train_dflash import evaluate_dflash_on_store
  _check_export(setup, store, final, log, load_dflash, lambda target: evaluate_dflash_on_store(
      final, target, store_dir, draws=2, val_fraction=0.3, context_len=48, anchors_per_window=5, batch_size=2),
      num_slots=3)
  for bad, match in ((dict(draft_vocab_size=64), "needs? store_dir"), (dict(store_dir="s", distill="ce"), "distill")):
    with pytest.raises(ValueError, match=match):
      from_dict(DFlashTrainConfig, bad)


def test_soft_label_stats_with_a_draft_vocabulary_by_hand():
  """Block logits over a draft vocabulary: teacher ids map through t2d, ids outside it go to the rest bucket (kl)
  or take the slot out of the loss (hard), per-slot sums and hits as computed by hand."""
  from longspec_jax.training.losses import topk_distillation
  from longspec_jax.training.drafter_common import soft_label_stats
  rng = np.random.default_rng(0)
  t2d = np.asarray([-1, 0, 1, -1, 2], np.int32)  # target vocab 5, draft vocab = target ids 1, 2, 4
  logits = jnp.asarray(rng.normal(size=(1, 2, 2, 3)), jnp.float32)  # [B, A, B_s, draft vocab]
  ids = np.asarray([[[[1, 3], [0, 2]], [[4, 1], [2, 4]]]], np.int32)  # [B, A, B_s, k=2]
  lp = np.log(np.asarray([[[[0.6, 0.3], [0.5, 0.2]], [[0.7, 0.1], [0.4, 0.4]]]], np.float32))
  w = np.asarray([[[1.0, 0.5], [1.0, 0.5]]], np.float32)
  batch = {"topk_ids": jnp.asarray(ids), "topk_logprobs": jnp.asarray(lp), "label_w": jnp.asarray(w),
           "t2d": jnp.asarray(t2d)}
  sums, hit, weights = soft_label_stats(logits, batch, "kl")
  for j in range(2):
    mapped = t2d[ids[..., j, :]]
    mean, total = topk_distillation(logits[..., j, :], np.maximum(mapped, 0), lp[..., j, :], "kl", w[..., j],
                                    mapped >= 0)
    assert float(sums[j]) == pytest.approx(float(mean * total), rel=1e-5)
  # slot 0 of anchor 0: teacher argmax 1 -> column 0; slot 1 of anchor 0: argmax 0 is outside -> never a hit
  expect_hit = (np.argmax(np.asarray(logits), -1) == np.maximum(t2d[ids[..., 0]], 0)) & (t2d[ids[..., 0]] >= 0)
  np.testing.assert_array_equal(np.asarray(hit), expect_hit)
  _, _, hard_w = soft_label_stats(logits, batch, "hard")
  np.testing.assert_array_equal(np.asarray(hard_w), w * (t2d[ids[..., 0]] >= 0))


def test_dels_trains_from_the_store_over_store_dflash_and_longspark(setup, tmp_path):
  """DeLS's local head from the store over a store-trained DFlash with a draft vocabulary: the grid's (0, 0) cell is
  DFlash's own top-1 agreement with the target's argmax on the held-out blocks, the run resumes, the export (the
  head as projections of the target's tables) records the store and drafts losslessly at batch 1 and 2; the same
  head retuned (head_from) over a store-trained LongSpark is `longspark-dels`, lossless too."""
  from longspec_jax.drafters.dels import load_dels
  from longspec_jax.hf_io import _read_tensors
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  from longspec_jax.drafters.frozen_target import target_io
  from longspec_jax.training.train_dels import (DeLSTrainConfig, read_head_factors, shipped_head, store_base,
                                                store_val_hits, train_dels)
  from longspec_jax.drafters.dflash import train_batch_logits
  from longspec_jax.training.train_dflash import DFlashTrainConfig, train_dflash
  from longspec_jax.training.train_longspark import LongSparkTrainConfig, train_longspark
  from longspec_jax.yaml_config import from_dict
  store_dir = build_distill_store(_cfg(setup, "kv01", kv_layers=(0, 1)), show_progress=False)
  store = DistillStore(store_dir)
  common = dict(store_dir=str(store_dir), distill="kl", batch_size=2, val_fraction=0.3, val_windows=2, log_every=1,
                checkpoint_every_minutes=100.0, optim=dict(lr=0.02, warmup_steps=1))
  dflash = train_dflash(from_dict(DFlashTrainConfig, dict(
      common, out_dir=str(tmp_path / "df"), num_layers=1, num_target_taps=1, model=dict(intermediate_size=32),
      block_size=4, context_len=48, anchors_per_window=5, draft_vocab_size=64, steps=2, compute_dtype="float32")))
  longspark = train_longspark(from_dict(LongSparkTrainConfig, dict(
      common, out_dir=str(tmp_path / "ls"), num_layers=1, block_size=3, raw_window=16, num_global_slots=4,
      markov_rank=0, draft_vocab_size=32, anchors_per_window=4, tail_rows=16, anywhere_fraction=0.8, steps=2,
      compute_dtype="float32")))
  cfg = lambda out, **kw: from_dict(DeLSTrainConfig, dict(
      common, out_dir=str(tmp_path / out), embed_dim=8, gru_hidden_dim=16, low_rank_dim=4, context_len=48,
      anchors_per_window=5, val_anchors=6, steps=4, alpha_grid=(0.0, 0.5), beta_grid=(0.0, 0.1), **kw))
  assert str(train_dels(cfg("b", base=str(dflash), stop_after_steps=2))).endswith("checkpoints")
  final = train_dels(cfg("b", base=str(dflash)))
  log = [json.loads(l) for l in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
  assert [r["step"] for r in log if "loss" in r][-1] == 4 and all(np.isfinite(r["loss"]) for r in log if "loss" in r)
  info = json.loads((final / "drafter.json").read_text())
  assert info["loss"] == "kl" and info["data"][0]["distill_store"] == store_dir.name
  assert info["held_out_greedy_blocks"] > 0 and "argmax" in info["unigram_prior"]
  assert str(setup[0]) not in json.dumps(info)  # the store by name (the base is recorded as given)
  assert set(_read_tensors(final)) == {"embed_down_proj.weight", "rank_to_hidden.weight", "prefix_gru.weight_ih_l0",
                                       "prefix_gru.weight_hh_l0", "rank_proj.weight", "log_prior"}

  # The grid's (0, 0) cell against DFlash scored directly on the same held-out blocks.
  target = load_target(setup[1])
  drafter = load_dels(final, target)
  _, head = shipped_head(read_head_factors(final, cfg("b")), target_io(target), _read_tensors(final)["log_prior"])
  base = store_base(dflash, target, store, ds.split_windows(store, 0, 0.3)[1], cfg("b"))
  v = store_val_hits(cfg("b"), drafter.spec.cfg, head, base)
  batch = {n: jnp.asarray(x) for n, x in base.sampler.batch(0, 2).items()}
  ids = base.draft_ids
  logits = np.asarray(compiled(train_batch_logits, base.model, {**batch, "io": base.head_io["io"]}))
  logits = logits.reshape(-1, 3, len(ids))
  label = np.asarray(base.head_io["t2d"])[np.asarray(batch["topk_ids"][..., 0])].reshape(-1, 3)
  full = np.all(np.asarray(batch["label_w"]) > 0, -1).reshape(-1)
  assert full.sum() > 0
  np.testing.assert_array_equal(v["grid"][0][0], (np.argmax(logits, -1) == label)[full])  # grid 0 = (0, 0)

  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  ar = generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar
  assert generate(target, prompts[:1], max_new_tokens=8, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar[:1]

  over_ls = train_dels(cfg("c", base=str(longspark), head_from=str(final)))
  ls_info = json.loads((over_ls / "drafter.json").read_text())
  assert ls_info["data"][0]["head_from"] == "b/final" and len(ls_info["alpha"]) == 3  # LongSpark drafts 3
  np.testing.assert_array_equal(_read_tensors(over_ls)["rank_proj.weight"], _read_tensors(final)["rank_proj.weight"])
  combined = load_dels(over_ls, target)
  assert combined.spec.name == "longspark-dels" and combined.spec.needs_target_kv
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=combined, num_draft=3).tokens == ar
  for bad in (dict(distill="kl"), dict(head_from="b/final"), dict(max_train_tokens=4096)):
    with pytest.raises(ValueError, match=f"{next(iter(bad))} needs store_dir"):
      from_dict(DeLSTrainConfig, bad)
