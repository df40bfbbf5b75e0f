"""Combine per-document `longspec eval-target --json` results into one table (token-weighted bucket means).

  python scripts/combine_eval.py runs/eval_per_doc/*_yarn.json --out runs/eval_target_yarn2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BUCKETS = ("0-1K", "1-2K", "2-4K", "4-8K", "8-16K")


def combine(results: list[dict]) -> dict:
  out = {}
  for b in BUCKETS:
    n = sum(r["tokens_per_bucket"][b] for r in results)
    out[b] = sum((r[b] or 0.0) * r["tokens_per_bucket"][b] for r in results) / n if n else None
  out["tokens_per_bucket"] = {b: sum(r["tokens_per_bucket"][b] for r in results) for b in BUCKETS}
  out["files"] = [f for r in results for f in r["files"]]
  out["per_file"] = {r["files"][0]: {b: r[b] for b in BUCKETS} for r in results}
  out["rope_scaling"] = sorted({str(r.get("rope_scaling")) for r in results})
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("jsons", nargs="+")
  p.add_argument("--out")
  a = p.parse_args()
  res = combine([json.loads(Path(f).read_text()) for f in a.jsons])
  print("| " + " | ".join(BUCKETS) + " | files |")
  print("|" + "---|" * (len(BUCKETS) + 1))
  print("| " + " | ".join("-" if res[b] is None else f"{res[b]:.3f}" for b in BUCKETS) + f" | {len(res['files'])} |")
  if a.out:
    Path(a.out).write_text(json.dumps(res, indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
