"""scripts/device_train.sh (drafter training on a lent accelerator) in its --dry-run mode on this CPU: the store,
both trainers under their time budgets, the int8 copies and their held-out scores, end to end on the shipped
target, so the script is known to work before a GPU is lent."""

import json
from pathlib import Path

import pytest

from tests.test_device_check import run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_train.sh"


def _run(*args, **kw):
  return run_script(SCRIPT, *args, **kw)


def test_bad_arguments_and_no_accelerator(tmp_path):
  bad = _run("--fast")
  assert bad.returncode == 2 and "unknown argument --fast" in bad.stderr
  assert "--minutes must be a positive number" in _run("--minutes", "0", "--out", str(tmp_path / "m")).stderr
  no_gpu = _run("--out", str(tmp_path / "x"), "--work", str(tmp_path / "w"))  # only --dry-run runs on a CPU
  assert no_gpu.returncode == 1 and "no accelerator found" in no_gpu.stderr


@pytest.mark.slow
def test_dry_run_trains_both_drafters_and_they_stay_lossless(tmp_path):
  out = tmp_path / "dt"
  res = _run("--dry-run", "--out", str(out), timeout=600)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["exit_code"] == 0 and summary["dry_run"]
  assert [s["stage"] for s in summary["stages"]] == ["corpus", "distill_store", "train_eagle3", "train_longspark",
                                                     "eval"]
  assert all(s["ok"] and s["seconds"] >= 0 for s in summary["stages"])
  index = json.loads((out / "work" / "store" / "index.json").read_text())
  assert 0 < summary["store"]["stored_tokens"] == index["stored_tokens"] <= 3072
  for kind, ttt in (("eagle3", 4), ("longspark", 7)):
    rec = summary[kind]
    budget = json.loads((out / "work" / kind / "budget.json").read_text())
    assert rec["budget"] == budget and budget["probe_steps"] == 5 and budget["step_s"] > 0
    # the step count the budget fitted is what trained and what the export records
    log = [json.loads(l) for l in (out / f"{kind}_train_log.jsonl").read_text().splitlines()]
    assert rec["steps"] == budget["steps"] == log[-1]["step"] >= 6
    assert 1.0 <= rec["held_out_tau_sim"]["new_int8"] <= 1.0 + ttt
    assert 1.0 <= rec["trainer_val_tau_sim_bf16"] <= 1.0 + ttt
    info = json.loads((out / kind / "drafter.json").read_text())
    assert info["weights_storage"]["min_size"] == 65536 and info["steps"] == budget["steps"]

  # The copies load as drafters of their methods and generate what AR does.
  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  target = load_target(None, show_progress=False)
  prompts = [[5, 9, 33, 7, 5, 9, 100, 41, 12, 5, 9, 33], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  for kind in ("eagle3", "longspark"):
    drafter = load_drafter(kind, target, out / kind)
    assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=drafter, num_draft=3).tokens == ar
