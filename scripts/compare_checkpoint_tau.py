"""Paired greedy tau per prompt of two checkpoints of one method, from one bench-suite run that ran both (the
second as `METHOD:...,drafter=DIR`): mean difference with a bootstrap 95% CI over the prompts, and how many prompts
gave exactly the same tau. Used to check that a storage change (e.g. int8 copies, scripts/quantize_checkpoint.py)
leaves a shipped drafter's acceptance unchanged:

  python scripts/compare_checkpoint_tau.py --results results/storage_int8/smollm2 --other-dir-prefix /tmp/q/
"""

import argparse
import json
from pathlib import Path

import numpy as np


def pairs(cells: list[dict], prefix: str):
  """(method, context, base cell, other cell) for every method label that has a `drafter=<prefix>...` twin."""
  by_key = {(c["method"], c["context"], c["temperature"]): c for c in cells}
  for (method, ctx, temp), c in sorted(by_key.items()):
    if "drafter=" in method:
      continue
    for (other, octx, otemp), o in sorted(by_key.items()):
      if (octx, otemp) == (ctx, temp) and other.startswith(method) and f"drafter={prefix}" in other:
        rest = other[len(method):].lstrip(":,")
        if rest.startswith("drafter="):  # the same options, only the checkpoint differs
          yield method, ctx, c, o


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--results", required=True, help="a bench-suite output folder (results.json)")
  p.add_argument("--other-dir-prefix", required=True, help="the other checkpoints' directory prefix in the labels")
  p.add_argument("--resamples", type=int, default=10000)
  a = p.parse_args()
  cells = json.loads((Path(a.results) / "results.json").read_text())["cells"]
  rng = np.random.default_rng(0)
  print("| method | context | tau (first) | tau (other) | paired diff [95% CI] | same tau | greedy = AR |")
  print("|---|---|---|---|---|---|---|")
  for method, ctx, c, o in pairs(cells, a.other_dir_prefix):
    x, y = np.asarray(c["tau_per_prompt"]), np.asarray(o["tau_per_prompt"])
    d = y - x
    boots = d[rng.integers(0, len(d), (a.resamples, len(d)))].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    print(f"| {method} | {ctx} | {x.mean():.3f} | {y.mean():.3f} | {d.mean():+.3f} [{lo:+.3f}, {hi:+.3f}] | "
          f"{int(np.isclose(x, y).sum())}/{len(d)} | {c['exact_match_ar']} / {o['exact_match_ar']} |")


if __name__ == "__main__":
  main()
