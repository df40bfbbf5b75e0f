"""`longspec bench-suite` on a tiny random target made here: outputs, the bootstrap CI against scipy, resume, the
shared prefill (a tap-reading drafter gives what `generate` gives), and config errors."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from longspec_jax.inference.benchmark.config import SuiteConfig, load_config, parse_method
from longspec_jax.inference.benchmark.prompts import prompt_ids, select_cuts, spread_ends
from longspec_jax.inference.benchmark.provenance import (cpu_snapshot, drafter_checkpoint, other_cpu_s,
                                                         target_with_provenance)
from longspec_jax.inference.benchmark.statistics import bootstrap_ci, cell_summary, paired_difference, ratio_of_rates
from longspec_jax.inference.benchmark.suite import run_suite
from longspec_jax.inference.cli import main
from longspec_jax.config import ModelConfig, RopeConfig
from longspec_jax.hf_io import save_model_dir
from longspec_jax.model import create_model
from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe

TEXT = "".join(f"def function_{i}(x, y):\n    return x * {i} + y - {i % 7}\n\n" for i in range(300))
CONTEXTS = (48, 96)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A tiny target directory, four documents and a tiny DFlash checkpoint (reads target taps)."""
  from longspec_jax.drafters.dflash import create_dflash, dflash_config_for, save_dflash_dir
  d = tmp_path_factory.mktemp("suite")
  tok = train_bpe([TEXT], vocab_size=300)
  cfg = ModelConfig(family="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                    rope=RopeConfig(), bos_token_id=0, eos_token_id=None, pad_token_id=1, mask_token_id=2)
  target = create_model(cfg, seed=0)
  save_model_dir(target, d / "target")
  save_hf_tokenizer(tok, d / "target")
  docs = []
  for i in range(4):
    docs.append(d / f"doc{i}.txt")
    docs[-1].write_text(TEXT[i * 2000:i * 2000 + 6000])
  dcfg = dflash_config_for(cfg, num_layers=1, num_target_taps=2, block_size=4)
  save_dflash_dir(create_dflash(dcfg, seed=1), d / "dflash")
  return d, [str(p) for p in docs]


def _config(env, tmp_path, **kw) -> str:
  d, docs = env
  raw = dict(model=str(d / "target"), methods=["ar", "prompt-lookup"], contexts=list(CONTEXTS), temperatures=[0.0],
             num_prompts=8, min_docs=4, docs=docs, cut_min_tokens=128, new_tokens=8, num_draft=3, bootstrap=2000)
  raw.update(kw)
  path = tmp_path / "suite.yaml"
  path.write_text(yaml.safe_dump(raw))
  return str(path)


def test_suite_outputs_and_resume(env, tmp_path, capsys, monkeypatch):
  out = tmp_path / "out"
  cleared, clear_caches = [], jax.clear_caches
  monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), clear_caches())[1])
  assert main(["bench-suite", "--config", _config(env, tmp_path), "--out", str(out)]) == 0
  assert len(cleared) == len(CONTEXTS)  # compiled programs dropped after each context (bounded memory mappings)
  res = json.loads((out / "results.json").read_text())
  assert len(res["prompts"]) == 8 and len(res["documents"]) == 4 and res["protocol_met"]
  assert {(c["method"], c["context"]) for c in res["cells"]} == {(m, c) for m in ("ar", "prompt-lookup")
                                                                  for c in CONTEXTS}
  for c in res["cells"]:
    assert c["n_prompts"] == 8 and c["complete"] and c["exact_match_ar"] is True
    assert c["tau_ci"][0] <= c["tau_mean"] <= c["tau_ci"][1]
    assert c["speedup"] > 0 and c["speedup_ci"][0] <= c["speedup"] <= c["speedup_ci"][1]
    assert c["peak_rss_bytes"] > 0 and c["tokens_per_s"] > 0 and c["ar_tokens_per_s"] > 0
    if c["method"] == "ar":
      assert c["tau_mean"] == 1.0 and c["drafter_state_bytes"] == 0
    else:
      assert len(c["accept_per_position"]) == 3 and c["verify_ms_per_step"] > 0
      assert 1.0 <= c["tau_mean"] <= 4.0
  run = res["runs"][0]
  assert run["todo"] == 32 and run["git"]["commit"] and run["machine"]["versions"]["jax"]
  assert "loadavg_1min_start" in run and "loadavg_1min_end" in run and run["failed"] == {}
  md = (out / "results.md").read_text()
  assert "| prompt-lookup | 0 | 96 | 8 |" in md and "exceeds CI" in md
  # tau at 96 against the reference context (the shortest, 48): the ratio of the two cells' means, inside its CI.
  (trend,) = [d for d in res["tau_vs_reference_context"] if d["method"] == "prompt-lookup"]
  by_ctx = {c["context"]: c["tau_mean"] for c in res["cells"] if c["method"] == "prompt-lookup"}
  assert (trend["from_context"], trend["context"]) == (48, 96)
  assert trend["ratio"] == pytest.approx(by_ctx[96] / by_ctx[48])
  assert trend["ratio_ci"][0] <= trend["ratio"] <= trend["ratio_ci"][1]
  assert trend["diff"] == pytest.approx(by_ctx[96] - by_ctx[48])
  for name in ("tau_vs_context", "speedup_vs_context", "draft_ms_vs_context", "state_bytes_vs_context"):
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  cells = sorted((out / "cells").glob("*.jsonl"))
  stamps = {p: p.stat().st_mtime_ns for p in cells}
  # Rerun: every cell is on disk, nothing runs again.
  assert main(["bench-suite", "--config", _config(env, tmp_path), "--out", str(out)]) == 0
  res2 = json.loads((out / "results.json").read_text())
  assert res2["runs"][-1]["todo"] == 0 and len(res2["runs"]) == 2
  assert {p: p.stat().st_mtime_ns for p in cells} == stamps
  assert [c["tau_per_prompt"] for c in res2["cells"]] == [c["tau_per_prompt"] for c in res["cells"]]
  # More prompts: the first 8 cut points stay, only the new one runs; a changed setting in the same directory is
  # refused.
  res3 = run_suite(load_config(_config(env, tmp_path, num_prompts=9)), out, progress=False)
  assert res3["runs"][-1]["todo"] == 4 and res3["prompts"][:8] == res["prompts"]
  assert all(c["n_prompts"] == 9 for c in res3["cells"])
  with pytest.raises(ValueError, match="different configuration"):
    run_suite(load_config(_config(env, tmp_path, new_tokens=9)), out, progress=False)


def test_shared_prefill_matches_generate(env, tmp_path):
  """A drafter that reads target taps, started from the suite's shared prefill, decodes exactly as generate()."""
  from longspec_jax.inference.generate import generate
  from longspec_jax.drafters import load_drafter
  d, docs = env
  drafter = f"dflash:drafter={d / 'dflash'}"
  cfg = load_config(_config(env, tmp_path, methods=[drafter], contexts=[64], num_prompts=4,
                            temperatures=[0.0, 1.0]))
  res = run_suite(cfg, tmp_path / "out", progress=False)
  recs = [json.loads(ln) for p in sorted((tmp_path / "out" / "cells").glob("dflash*t0.jsonl"))
          for ln in p.read_text().splitlines()]
  model, tok, _ = target_with_provenance(str(d / "target"))
  ids = [tok.encode(open(p).read()).ids for p in docs]
  cut = res["prompts"][0]
  prompt = prompt_ids(ids[[p.endswith(cut["doc"]) for p in docs].index(True)], cut["end_token"], 64, 0)
  loaded = load_drafter("dflash", model, d / "dflash")
  want = generate(model, [prompt], max_new_tokens=8, drafter=loaded, num_draft=3, seed=0)
  rec = next(r for r in recs if r["prompt"] == 0)
  assert rec["tokens"] == want.tokens[0] and rec["tau"] == pytest.approx(want.stats["tau"])
  assert rec["exact_match_ar"] and rec["drafter_state_bytes"] > 0
  sampled = [c for c in res["cells"] if c["temperature"] == 1.0]
  assert len(sampled) == 1 and all(c["exact_match_ar"] is None for c in sampled)


def test_step_halves_are_timed_through_executables_compiled_once(env):
  """step_costs times the draft and verify halves through ahead-of-time compiled executables (no jit dispatch in
  the timing): one compilation per program and shape, and they compute what the jitted programs compute."""
  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference import engine
  from longspec_jax.inference.benchmark import measure
  d, docs = env
  model, tok, _ = target_with_provenance(str(d / "target"))
  prompt = tok.encode(open(docs[0]).read()).ids[:48]
  config, params, inputs = engine.prepare(model, [prompt], 8, drafter=load_drafter("dflash", model, d / "dflash"),
                                          num_draft=3)
  timer = measure.Timer()
  shared = measure.shared_prefill(timer, config.graphdef, params.target, inputs, config.max_len, [config.drafter])
  state = measure.start_state(config, params, inputs, shared)
  for _ in range(2):
    draft_ms, verify_ms = measure.step_costs(timer, config, params, inputs, state, repeats=2)
    assert draft_ms > 0 and verify_ms > 0
  assert len(timer.executables) == 2  # the draft and the verify program, compiled once for both calls
  draft_key = next(k for k in timer.executables if k[0] == "draft")
  np.testing.assert_array_equal(timer.executables[draft_key](params, inputs, state),
                                measure.draft_program(config, params, inputs, state))


def test_bootstrap_ci_against_scipy():
  from scipy.stats import bootstrap
  x = np.random.default_rng(3).gamma(2.0, 1.5, size=12)
  lo, hi = bootstrap_ci(x, n_boot=20000, ci=0.95, seed=1)
  ref = bootstrap((x,), np.mean, n_resamples=20000, confidence_level=0.95, method="percentile",
                  random_state=np.random.default_rng(2)).confidence_interval
  sd = x.std(ddof=1) / np.sqrt(len(x))
  assert abs(lo - ref.low) < 0.05 * sd * 4 and abs(hi - ref.high) < 0.05 * sd * 4
  assert lo < x.mean() < hi
  assert bootstrap_ci(np.full(8, 2.5)) == (2.5, 2.5)
  # The speedup CI: ratio of summed rates, resampled by prompt.
  rates = np.stack([np.full(6, 10.0), np.linspace(1, 2, 6), np.full(6, 10.0), np.linspace(2, 4, 6)], axis=1)
  assert ratio_of_rates(rates) == pytest.approx(2.0)
  assert bootstrap_ci(rates, 500, stat=ratio_of_rates) == pytest.approx((2.0, 2.0))


def test_paired_speedup_difference_by_hand():
  """Per-prompt speedups (tokens/s over AR's on the same prompt) compared over the prompts two cells share."""
  def rec(prompt, decode_s, ar_decode_s, tau):
    return {"method": "m", "name": "m", "options": {}, "num_draft": 4, "context": 64, "temperature": 0.0,
            "prompt": prompt, "tau": tau, "new_tokens": 11, "decode_s": decode_s, "ar_new_tokens": 11,
            "ar_decode_s": ar_decode_s, "accept_hist": [], "exact_match_ar": True, "target_forwards": 5,
            "ar_target_forwards": 10, "draft_ms_per_step": 1.0, "verify_ms_per_step": 2.0, "prefill_ms": 3.0,
            "drafter_state_bytes": 0, "peak_rss_bytes": 1, "run_id": "r"}
  a = cell_summary([rec(0, 1.0, 2.0, 2.0), rec(1, 1.0, 3.0, 3.0), rec(2, 2.0, 2.0, 1.0)], 2000, 0.95)
  b = cell_summary([rec(0, 2.0, 2.0, 1.0), rec(1, 1.0, 2.0, 2.0)], 2000, 0.95)
  assert a["speedup_per_prompt"] == pytest.approx([2.0, 3.0, 1.0])
  d = paired_difference(a, b, 2000, 0.95)
  assert d["prompts"] == 2 and d["speedup_diff"] == pytest.approx(((2 - 1) + (3 - 2)) / 2)
  assert d["speedup_diff_ci"] == pytest.approx([1.0, 1.0]) and d["speedup_exceeds_ci"]
  assert d["diff"] == pytest.approx(1.0)  # tau: (2 - 1 + 3 - 2) / 2


def test_cuts_are_seeded_prefix_stable_and_spread():
  cuts = select_cuts([500, 800, 300, 900, 50], 8, 4, 200, seed=0)
  assert cuts == select_cuts([500, 800, 300, 900, 50], 8, 4, 200, seed=0)
  assert select_cuts([500, 800, 300, 900, 50], 10, 4, 200, seed=0)[:8] == cuts
  assert len({d for d, _ in cuts}) == 4 and 4 not in {d for d, _ in cuts}  # doc 4 is too short
  assert len(set(cuts)) == 8 and all(200 <= e <= [500, 800, 300, 900][d] for d, e in cuts)
  with pytest.raises(ValueError, match="min_docs = 4"):
    select_cuts([500, 800, 50, 60], 8, 4, 200, seed=0)


def test_spread_ends_cover_the_text_evenly():
  assert spread_ends(100, 30, 4) == [30, 53, 77, 100]  # first window at the start, last at the end
  assert spread_ends(31, 30, 8) == [30, 31]  # short text: overlapping windows, no duplicates
  assert spread_ends(20, 30, 8) == [20] and spread_ends(100, 30, 1) == [30]


def test_method_options_and_config_errors(env, tmp_path):
  m = parse_method("pard:sharpdraft=fixed,num_draft=5", 8)
  assert (m.name, m.num_draft, m.options, m.drafter_dir) == ("pard", 5, (("sharpdraft", "fixed"),), None)
  assert parse_method("dflash:drafter=/x/y", 8).drafter_dir == "/x/y" and m.slug == "pard__sharpdraft-fixed_num_draft-5"
  assert parse_method("pard", 8).draft_length == "fixed"
  assert parse_method("prompt-lookup:draft_length=auto", 8).draft_length == "auto"
  bad = {"methods=[nosuch]": "unknown method 'nosuch'", "methods=[pard:colour=red]": "unknown option 'colour'",
         "methods=[pard:sharpdraft]": "not of the form key=value", "methods=[ar:drafter=x]": "ar takes no",
         "methods=[pard:num_draft=0]": "num_draft must be an integer", "methods=[ar,ar]": "duplicates",
         "contexts=[]": "contexts must be", "contexts=[256]": "exceeds cut_min_tokens", "num_prompts=1": "num_prompts",
         "temperatures=[-1]": "temperatures", "docs=[/no/such.txt]": "not found", "ci=1.5": "ci must be",
         "colour=red": "unknown config keys", "rope_scaling=yarn": "TYPE:FACTOR", "dtype=fp16": "dtype must be one of",
         "reference_context=64": "reference_context 64 is not one of the contexts",
         "methods=[pard:draft_length=sometimes]": "draft_length must be fixed, auto or a rule JSON"}
  for override, msg in bad.items():
    with pytest.raises(ValueError, match=msg):
      load_config(_config(env, tmp_path), [override])
  with pytest.raises(ValueError, match="maximum context"):
    run_suite(load_config(_config(env, tmp_path), ["new_tokens=2000"]), tmp_path / "o", progress=False)
  assert SuiteConfig().model == ""  # the shipped default target


def test_checkpoint_identity_counts_sharpdraft_json_only_when_used(tmp_path):
  """A drafter's identity (the resume fingerprint) covers its weights and config, and sharpdraft.json only for a
  method that turns SharpDraft on: calibrating a drafter later must not invalidate its SharpDraft-off results."""
  (tmp_path / "model.safetensors").write_bytes(b"w")
  (tmp_path / "config.json").write_text("{}")
  off, on = (parse_method(f"pard:drafter={tmp_path}{opt}", 8) for opt in ("", ",sharpdraft=exact"))
  before = drafter_checkpoint(off)
  (tmp_path / "sharpdraft.json").write_text("{}")
  assert drafter_checkpoint(off) == before and drafter_checkpoint(on) != before
  on_before = drafter_checkpoint(on)
  (tmp_path / "sharpdraft.json").write_text('{"n0": 1}')
  assert drafter_checkpoint(on) != on_before
  (tmp_path / "config.json").write_text('{"a": 1}')
  assert drafter_checkpoint(off) != before


def test_drafter_diagnostics_are_recorded(env, tmp_path):
  """A drafter with `diagnostics` (LongSpark: attention mass per view) gets it recorded per prompt and averaged per
  cell; the three view masses of every layer sum to 1."""
  from longspec_jax.drafters.longspark import create_longspark, longspark_config_for, save_longspark_dir
  d, _ = env
  model, _, _ = target_with_provenance(str(d / "target"))
  save_longspark_dir(create_longspark(longspark_config_for(model.cfg, num_layers=2, raw_window=16), seed=3),
                     tmp_path / "ls")
  # No num_draft anywhere: the drafter's default K, here LongSpark's block of 7 (a fixed 8 would be refused).
  res = run_suite(load_config(_config(env, tmp_path, methods=[f"longspark:drafter={tmp_path / 'ls'}"], contexts=[64],
                                      num_prompts=2, min_docs=2, num_draft=None)), tmp_path / "out", progress=False)
  (cell,) = res["cells"]
  assert cell["num_draft"] == 7 and len(cell["accept_per_position"]) == 7
  mass = np.asarray(cell["diagnostics"]["view_mass_global_raw_local"])
  assert mass.shape == (2, 3) and np.allclose(mass.sum(-1), 1.0, atol=1e-3) and (mass > 0).all()
  assert all(len(r["diagnostics"]["view_mass_global_raw_local"]) == 2 for r in res["records"])
  assert "view_mass_global_raw_local" in (tmp_path / "out" / "results.md").read_text()


def test_plots_are_optional(env, tmp_path, capsys, monkeypatch):
  """Without matplotlib the sweep still ends well: tables written, one line on stderr, exit 0, no plots."""
  import sys
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
  out = tmp_path / "out"
  config = _config(env, tmp_path, methods=["prompt-lookup"], contexts=[48], num_prompts=2, min_docs=2)
  assert main(["bench-suite", "--config", config, "--out", str(out), "--quiet"]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert [line for line in err if "matplotlib" in line] == [
      "bench-suite: plots skipped: matplotlib is not installed (pip install matplotlib)"]
  assert (out / "results.json").exists() and not list(out.glob("*.png"))
  md = (out / "results.md").read_text()
  assert "| prompt-lookup | 0 | 48 | 2 |" in md and "## Plots" not in md


def test_suite_runs_a_method_with_draft_length_auto(env, tmp_path):
  out = tmp_path / "out"
  config = _config(env, tmp_path, methods=["prompt-lookup:draft_length=auto"], contexts=[48], num_prompts=2,
                   min_docs=2)
  assert main(["bench-suite", "--config", config, "--out", str(out), "--quiet"]) == 0
  records = [json.loads(l) for f in (out / "cells").glob("*.jsonl") for l in f.read_text().splitlines()]
  assert len(records) == 2
  for r in records:
    assert r["exact_match_ar"] is True and r["draft_sizes"] == [0, 1, 3]  # K = 3 (the config's num_draft)
    assert sum(r["size_share"]) == pytest.approx(1.0, abs=1e-3)


def _alive_ticks() -> dict[int, int]:
  """utime + stime (clock ticks) of every process alive now, by pid."""
  out = {}
  for d in Path("/proc").glob("[0-9]*"):
    try:
      fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
      out[int(d.name)] = int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
      continue
  return out


def test_other_cpu_counts_a_process_that_ended_before_the_run(tmp_path):
  """The load a suite run records counts another process's CPU time even when that process ends before the run
  does (the test suite's workers beside a bench): a detached process (not this one's child) burns 2 s and exits,
  and what the record counts beyond the processes alive at both ends covers most of
  it (the two clocks differ a little)."""
  import os
  import subprocess
  import sys
  import time
  done = tmp_path / "done"
  burn = f"import time\nt = time.process_time()\nwhile time.process_time() - t < 2.0: pass\nopen({str(done)!r}, 'w')"
  before, alive0 = cpu_snapshot(), _alive_ticks()
  # `sh -c '... &'` exits at once: the burner is reparented, so its time never reaches this process's children.
  subprocess.run(["sh", "-c", f'{sys.executable} -c "$0" &', burn], check=True)
  deadline = time.time() + 60
  while not done.exists() and time.time() < deadline:
    time.sleep(0.05)
  time.sleep(0.2)  # let it exit
  other, alive1 = other_cpu_s(before, cpu_snapshot()), _alive_ticks()
  assert done.exists()
  survivors = sum(t - alive0[pid] for pid, t in alive1.items() if pid in alive0 and pid != os.getpid())
  assert other - survivors / os.sysconf("SC_CLK_TCK") >= 1.2, (other, survivors)
