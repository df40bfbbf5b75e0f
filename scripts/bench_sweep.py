"""Runs `longspec bench` for several methods x contexts x documents (one process per run, as a user would) and
writes all JSON results plus a markdown table.

  python scripts/bench_sweep.py --methods prompt-lookup,pard --contexts 1024,4096,16384 --new-tokens 128 \
      --docs longspec_jax/assets/long_docs/inspect.py.txt --out results/bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

COLUMNS = ("method", "doc", "context", "temperature", "tau", "speedup", "tokens_per_s", "ar_tokens_per_s",
           "draft_ms_per_step", "verify_ms_per_step", "drafter_state_bytes", "exact_match_ar")


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--methods", required=True)
  p.add_argument("--contexts", required=True)
  p.add_argument("--docs", required=True, help="comma-separated text files")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--num-draft", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", required=True)
  a = p.parse_args()
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for doc in a.docs.split(","):
    for ctx in map(int, a.contexts.split(",")):
      for method in a.methods.split(","):
        path = out / f"{Path(doc).stem}_{ctx}_{method}_t{a.temperature}.json"
        if not path.exists():  # resumable: finished runs are kept
          cmd = [sys.executable, "-m", "inference.cli", "bench", "--method", method, "--text-file", doc,
                 "--context", str(ctx), "--new-tokens", str(a.new_tokens), "--temperature", str(a.temperature),
                 "--num-draft", str(a.num_draft), "--repeats", str(a.repeats), "--json", str(path)]
          print(" ".join(cmd), flush=True)
          if subprocess.run(cmd).returncode != 0:
            print(f"FAILED: {method} {ctx} {doc}", flush=True)
            continue
        r = json.loads(path.read_text())
        r["doc"] = Path(doc).stem
        rows.append(r)
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  table += ["| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
  (out / "table.md").write_text("\n".join(table) + "\n")
  print("\n".join(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
