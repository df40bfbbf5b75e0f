"""The suffix drafter with memory: its global n-gram index (build, in-graph search, updates from past outputs, the
file's checks), greedy output equal to AR alone and in the hybrid, and the build-suffix-index / generate CLI."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import LoadedDrafter, ProposeContext
from longspec_jax.drafters.hybrid import HybridDrafter
from longspec_jax.drafters.suffix import SuffixDrafter, context_hashes, with_index
from longspec_jax.inference.generate import generate
from longspec_jax.model import create_model
from longspec_jax.sampling import SamplingParams
from longspec_jax.suffix_index import (SuffixIndexError, build_index, load_index, read_header, save_index,
                                       update_index)
from longspec_jax.suffix_index import context_hashes as host_hashes
from tests.test_cli import TEXT, model_dir  # noqa: F401  (the CLI tests' tiny model directory fixture)
from tests.test_draft_length import ConstantDrafter
from tests.test_hybrid import _replay_script

V = 128


def _ctx(rows: list[list[int]], width: int = 24) -> ProposeContext:
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return ProposeContext(tokens=jnp.asarray(tokens), num_tokens=jnp.asarray([len(r) for r in rows]),
                        sampling=SamplingParams.make(0.0))


def test_device_hash_equals_the_builders():
  windows = np.random.default_rng(0).integers(0, 50_000, (64, 6))
  for order in (1, 3, 6):
    host, device = host_hashes(windows[:, :order], order), context_hashes(jnp.asarray(windows[:, :order]), order)
    assert all(np.array_equal(h, np.asarray(d)) for h, d in zip(host, device))


def test_index_proposes_chained_continuations_and_the_stronger_source_wins():
  corpus = [[5, 6, 7, 8, 9, 10, 11] * 3, [20, 21, 22, 5, 6, 7, 8]]
  index = build_index(corpus, V, "tok", slots=256, orders=(1, 2, 3, 4))
  drafter = with_index(SuffixDrafter(V), index)
  search = jax.jit(lambda spec, params, ctx, k: spec.search(params, ctx, k), static_argnums=(0, 3))
  # row 0: "5 6" is in the corpus (order 2): the chain continues 7 8 9 10 11 5; row 1: nothing known
  ctx = _ctx([[30, 31, 5, 6], [40, 41, 42]])
  drafts, matched, cls = search(drafter.spec, drafter.params, ctx, 6)
  assert drafts[0].tolist() == [7, 8, 9, 10, 11, 5] and matched.tolist() == [2, 0]
  assert cls.tolist() == [drafter.spec.local_max + 2, 0] and drafter.spec.draft_classes == 1 + 8 + 4
  # a local repeat (3 tokens + the bonus) beats the index's order-2 match; the buffer's continuation proposes
  ctx = _ctx([[5, 6, 40, 41, 42, 43, 44, 5, 6]])
  assert search(drafter.spec, drafter.params, ctx, 3)[0].tolist() == [[40, 41, 42]]
  # past outputs: after update_index, row 1's context proposes what followed it there; the table did not grow
  updated = update_index(index, [[40, 41, 42, 43, 44]] * 2)
  assert updated.slots == index.slots and updated.used > index.used
  again = with_index(SuffixDrafter(V), updated)
  drafts, matched, _ = search(again.spec, again.params, _ctx([[30, 31, 5, 6], [40, 41, 42]]), 2)
  assert drafts[1].tolist() == [43, 44] and matched.tolist() == [2, 3]
  # memory from nothing (scripts/multi_file_workload.py): an empty index proposes nothing until outputs are added
  empty = build_index([], V, "tok", slots=256, orders=(1, 2, 3, 4))
  assert empty.used == 0
  grown = with_index(SuffixDrafter(V), update_index(empty, [[40, 41, 42, 43, 44]]))
  assert search(grown.spec, grown.params, _ctx([[40, 41, 42]]), 2)[0].tolist() == [[43, 44]]


@pytest.fixture(scope="module")
def memory(tiny_cfg):
  """A tiny target, AR outputs of four prompts, and an index of the first two prompts' outputs (past outputs)."""
  target = create_model(tiny_cfg, seed=0)
  prompts = [[3 + i, 9, 17 + i, 40, 41 + 2 * i] for i in range(4)]
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1).tokens
  index = build_index([p + a for p, a in zip(prompts[:2], ar[:2])], V, "tok", slots=1024, min_count=1)
  return target, prompts, ar, index


def test_suffix_alone_with_memory_equals_ar(memory):
  target, prompts, ar, index = memory
  suffix = with_index(SuffixDrafter(V), index)
  # the index holds the first two prompts' continuations: right after their prompts it proposes them
  first = _ctx([p + a[:1] for p, a in zip(prompts[:2], ar[:2])])
  assert jax.jit(suffix.spec.search, static_argnums=2)(suffix.params, first, 4)[0].tolist() == [a[1:5] for a in ar[:2]]
  fixed = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=suffix, num_draft=4)
  auto = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=suffix, num_draft=4, draft_length="auto")
  assert fixed.tokens == ar and auto.tokens == ar
  # scripts/compare_suffix_drafters.py's replay of the same drafter gives the tau the engine measured
  mod = _replay_script()
  steps = [mod.replay(p, a, mod.ours_suffix(V, 64, index), k=4)[1] for p, a in zip(prompts, ar)]
  assert sum(len(a) - 1 for a in ar) / sum(steps) == pytest.approx(fixed.stats["tau"])


def test_hybrid_with_memory_equals_ar(memory):
  target, prompts, ar, index = memory
  suffix = with_index(SuffixDrafter(V), index)
  learned = ConstantDrafter(V, token=2)
  hybrid = LoadedDrafter(HybridDrafter(suffix.spec, learned), (suffix.params, None))
  assert hybrid.spec.draft_classes == suffix.spec.draft_classes and hybrid.spec.proposal_cost_scale == (1.0, 0.0)
  for draft_length in ("fixed", "auto"):
    out = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=hybrid, num_draft=4,
                   draft_length=draft_length)
    assert out.tokens == ar


def test_load_drafter_reads_an_index_file_and_refuses_it_elsewhere(tiny_model, tmp_path):
  path = save_index(build_index([[1, 2, 3, 4] * 4], V, "tok", slots=64), tmp_path / "i.idx")
  loaded = load_drafter("suffix", tiny_model, suffix_index=path)
  assert loaded.spec.orders == (1, 2, 3, 4, 6, 8, 12, 16) and loaded.params["check"].shape == (64,)
  assert load_drafter("suffix", tiny_model).spec.orders == ()  # no index: the prompt and output only
  with pytest.raises(ValueError, match="--suffix-index applies to hybrid, suffix"):
    load_drafter("prompt-lookup", tiny_model, suffix_index=path)
  with pytest.raises(FileNotFoundError, match="no suffix index at"):
    load_drafter("suffix", tiny_model, suffix_index=tmp_path / "missing.idx")
  with pytest.raises(SuffixIndexError, match="vocabulary of 256 tokens, not this target's 128"):
    load_drafter("suffix", tiny_model, suffix_index=save_index(build_index([[1, 2] * 4], 256, "tok", 64),
                                                               tmp_path / "v.idx"))


def test_index_file_round_trip_and_each_bad_file_gives_one_clear_error(tmp_path, monkeypatch):
  index = build_index([[1, 2, 3, 4, 5] * 5, [7, 8, 9] * 3], V, "sha-a", slots=128)
  path = save_index(index, tmp_path / "a.idx", cap_bytes=4096)
  back = load_index(path, V, "sha-a")
  assert back.orders == index.orders and all(np.array_equal(a, b) for a, b in
                                             zip(back.arrays().values(), index.arrays().values()))
  assert read_header(path)["used_slots"] == index.used > 0
  data = path.read_bytes()
  (tmp_path / "t.idx").write_bytes(data[:-100])
  with pytest.raises(SuffixIndexError, match="truncated: .* its header says"):
    load_index(tmp_path / "t.idx")
  (tmp_path / "h.idx").write_bytes(data[:20])
  with pytest.raises(SuffixIndexError, match="corrupt or truncated header"):
    load_index(tmp_path / "h.idx")
  flipped = bytearray(data)
  flipped[-1] ^= 0xFF
  (tmp_path / "c.idx").write_bytes(bytes(flipped))
  with pytest.raises(SuffixIndexError, match="corrupt: its data does not match"):
    load_index(tmp_path / "c.idx")
  with pytest.raises(SuffixIndexError, match="built with another tokenizer"):
    load_index(path, V, "sha-b")
  with pytest.raises(SuffixIndexError, match="2,048 bytes, over the cap of 1,000 bytes"):
    load_index(path, max_bytes=1000)
  with pytest.raises(SuffixIndexError, match="over the cap of 1,024 bytes"):
    save_index(index, tmp_path / "big.idx", cap_bytes=1024)
  assert not (tmp_path / "big.idx").exists()
  # a write that fails part way leaves the old file whole and no temporary file
  bigger = update_index(index, [[11, 12, 13, 14] * 3])

  def fail(*args):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", fail)
  with pytest.raises(OSError, match="No space left"):
    save_index(bigger, path, cap_bytes=4096)
  assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp") == []


def test_build_suffix_index_then_generate_with_it_and_update_it(model_dir, tmp_path, capsys):
  from longspec_jax.inference.cli import main
  code = tmp_path / "code"
  code.mkdir()
  (code / "a.py").write_text(TEXT[:4000])
  (code / "b.py").write_text(TEXT[4000:8000])
  out = tmp_path / "code.idx"
  assert main(["build-suffix-index", "--corpus", str(code), "--model", str(model_dir), "--out", str(out),
               "--slots", "4096", "--quiet"]) == 0
  assert "slots used" in capsys.readouterr().out
  before = read_header(out)
  res = tmp_path / "g.json"
  assert main(["generate", "--model", str(model_dir), "--prompt", TEXT[8000:8300], "--max-new-tokens", "16",
               "--method", "suffix", "--suffix-index", str(out), "--suffix-index-update", "--compare-ar",
               "--json", str(res), "--quiet"]) == 0
  assert json.loads(res.read_text())["exact_match_ar"] is True
  after = read_header(out)
  assert after["slots"] == before["slots"] and after["data_sha256"] != before["data_sha256"]
  for flags, message in (
      (["--method", "suffix", "--suffix-index-update"], "--suffix-index-update adds this generation"),
      (["--method", "prompt-lookup", "--suffix-index", str(out)], "--suffix-index applies to hybrid, suffix"),
      (["--method", "suffix", "--suffix-index", str(tmp_path / "none.idx")], "no suffix index at")):
    assert main(["generate", "--model", str(model_dir), "--prompt", "def f", *flags]) == 2
    assert message in capsys.readouterr().err
  assert main(["build-suffix-index", "--corpus", str(code), "--model", str(model_dir), "--out", str(out),
               "--slots", "131072", "--max-mb", "1"]) == 2
  assert "--slots 131,072 needs 2 MiB, over --max-mb 1" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # argparse refuses the value itself
    main(["build-suffix-index", "--corpus", str(code), "--model", str(model_dir), "--out", str(out),
          "--slots", "1000"])
  assert "must be a power of two" in capsys.readouterr().err
