"""scripts/seeds_report.py on hand-made suite results: merged folders, paired differences and ratios, errors."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "seeds_report.py"


def _script():
  spec = importlib.util.spec_from_file_location("seeds_report", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _cell(method, context, taus):
  taus = list(map(float, taus))
  return {"method": method, "context": context, "temperature": 1.0, "prompts": list(range(len(taus))),
          "tau_per_prompt": taus, "tau_mean": float(np.mean(taus)), "tau_ci": [min(taus), max(taus)],
          "speedup": 1.0, "speedup_ci": [1.0, 1.0], "draft_ms_per_step": 2.0, "drafter_state_bytes": 2 ** 20}


def _suite(folder: Path, cells) -> Path:
  folder.mkdir()
  (folder / "results.json").write_text(json.dumps({"target": {"model": "tiny"}, "cells": cells}))
  return folder


def test_pairs_and_ratios_over_two_folders(tmp_path):
  sparse = "sparse:budget=256"
  short = _suite(tmp_path / "short", [_cell("full", 1024, [1, 1, 2, 2]), _cell(sparse, 1024, [2, 2, 3, 3])])
  long = _suite(tmp_path / "long", [_cell("full", 4096, [1, 1, 1, 1]), _cell(sparse, 4096, [1.5, 1.5, 1.5, 1.5])])
  out = tmp_path / "report"
  _script().main(["--results", str(short), str(long), "--out", str(out), "--label", "sparse:budget=256=view",
                  "--pair", "view|full", "--ratio", "full", "--ref-context", "1024"])
  res = json.loads((out / "report.json").read_text())
  by_ctx = {p["context"]: p for p in res["pairs"]}
  # 1024: every prompt +1 (ratio of means 2.5 / 1.5); 4096: every prompt +0.5 (ratio 1.5): constant differences
  # give point CIs of the difference (and at 4096 of the ratio too)
  assert by_ctx[1024]["diff"] == pytest.approx(1.0) and by_ctx[1024]["ratio"] == pytest.approx(2.5 / 1.5)
  assert by_ctx[4096]["ratio"] == pytest.approx(1.5) and by_ctx[4096]["ratio_ci"] == pytest.approx([1.5, 1.5])
  assert res["ratios"][0]["context"] == 4096 and res["ratios"][0]["ratio"] == pytest.approx(1 / 1.5)
  md = (out / "report.md").read_text()
  assert "| view - full | +1.00 [+1.00, +1.00]* | +0.50 [+0.50, +0.50]* |" in md
  ratio_row = next(line for line in md.splitlines() if line.startswith("| view / full | "))
  assert ratio_row.startswith("| view / full | 1.67 [") and ratio_row.endswith("| 1.50 [1.50, 1.50] |")
  assert all((out / f"{name}.png").stat().st_size > 0 for name in ("tau_vs_context", "state_bytes_vs_context"))


def test_a_cell_in_two_folders_and_an_unknown_method_are_errors(tmp_path):
  a = _suite(tmp_path / "a", [_cell("full", 1024, [1, 2])])
  b = _suite(tmp_path / "b", [_cell("full", 1024, [1, 2])])
  with pytest.raises(ValueError, match="more than one run folder"):
    _script().main(["--results", str(a), str(b), "--out", str(tmp_path / "o")])
  with pytest.raises(SystemExit):
    _script().main(["--results", str(a), "--out", str(tmp_path / "o"), "--pair", "full|missing"])
