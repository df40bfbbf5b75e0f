"""scripts/device_check.sh (the accelerator check) in its --dry-run mode on this CPU: every step runs on tiny shapes
and the shipped target and writes its JSON and markdown, so the script is known to work before a GPU is lent."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def run_script(script: Path, *args, **kw) -> subprocess.CompletedProcess:
  env = dict(os.environ)  # the suite's compilation cache (conftest)
  return subprocess.run(["bash", str(script), *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)


def _run(*args, **kw):
  return run_script(SCRIPT, *args, **kw)


def test_bad_arguments_and_no_accelerator(tmp_path):
  bad = _run("--fast")
  assert bad.returncode == 2 and "unknown argument --fast" in bad.stderr
  no_gpu = _run("--out", str(tmp_path / "x"))  # this CPU has no accelerator: only --dry-run runs here
  assert no_gpu.returncode == 1 and "no accelerator found" in no_gpu.stderr


@pytest.mark.slow
def test_dry_run_writes_every_result(tmp_path):
  out = tmp_path / "dc"
  res = _run("--dry-run", "--out", str(out), timeout=900)
  assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
  kernels = json.loads((out / "kernels.json").read_text())
  assert kernels["backend"] == "cpu" and len(kernels["interpret_errors"]) == 8
  assert max(kernels["interpret_errors"].values()) < 1e-4
  verify = json.loads((out / "verify.json").read_text())
  assert verify  # the pass-cost table
  suite = json.loads((out / "suite" / "results.json").read_text())
  methods = {c["method"] for c in suite["cells"]}
  assert methods == {"ar", "eagle3:draft_length=auto"}
  records = [json.loads(l) for f in (out / "suite" / "cells").glob("*.jsonl") for l in f.read_text().splitlines()]
  assert records and all(r["exact_match_ar"] for r in records)
  summary = (out / "SUMMARY.md").read_text()
  assert "## Kernels" in summary and "## Target pass cost" in summary and "## Bench suite: suite" in summary


def test_summary_only_rewrites_the_summary_from_what_a_stopped_run_left(tmp_path):
  out = tmp_path / "dc"
  out.mkdir()
  (out / "kernels.json").write_text(json.dumps({"backend": "gpu"}))
  (out / "kernels.txt").write_text("qsa_dense 4096 64 0.138 0.105 1.32 1.95e-03\n")
  res = _run("--summary-only", "--out", str(out))
  assert res.returncode == 0, res.stderr
  summary = (out / "SUMMARY.md").read_text()
  assert "backend gpu" in summary and "qsa_dense 4096 64" in summary
  assert "## Bench suite" not in summary  # no suite ran: none is made up
