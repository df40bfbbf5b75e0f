"""Greedy tau and tokens per prompt, this run against the committed `shipped_full/` run (same prompts, methods and
contexts). Prints one line per (method, context) and a total; exit 1 if any prompt differs.

  python results/bench_suite/shipped_full_engine_check/compare.py > results/bench_suite/shipped_full_engine_check/comparison.txt
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEFORE = HERE.parent / "shipped_full"


def greedy_records(run: Path) -> dict:
  """(method, context, prompt) -> record, greedy cells only."""
  recs = {}
  for path in sorted((run / "cells").glob("*__t0.jsonl")):
    for line in path.read_text().splitlines():
      r = json.loads(line)
      recs[r["method"], r["context"], r["prompt"]] = r
  return recs


def main() -> int:
  before, after = greedy_records(BEFORE), greedy_records(HERE)
  cells = sorted({(m, c) for m, c, _ in after}, key=lambda mc: (mc[1], mc[0]))
  equal_tau = equal_tokens = total = 0
  for method, ctx in cells:
    prompts = sorted(p for m, c, p in after if (m, c) == (method, ctx))
    diffs = []
    for p in prompts:
      a, b = after[method, ctx, p], before.get((method, ctx, p))
      if b is None:
        diffs.append(f"prompt {p}: not in shipped_full")
        continue
      total += 1
      same_tau, same_tokens = a["tau"] == b["tau"], a["tokens"] == b["tokens"]
      equal_tau += same_tau
      equal_tokens += same_tokens
      if not (same_tau and same_tokens):
        diffs.append(f"prompt {p}: tau {b['tau']:.4f} -> {a['tau']:.4f}, tokens {'equal' if same_tokens else 'differ'}")
    taus = " ".join(f"{after[method, ctx, p]['tau']:.3f}" for p in prompts)
    print(f"{method:24s} ctx {ctx:5d}: {len(prompts) - len(diffs)}/{len(prompts)} prompts equal (tau {taus})"
          + "".join(f"\n    {d}" for d in diffs))
  print(f"\ntotal: {equal_tau}/{total} (method, context, prompt) with equal greedy tau, {equal_tokens}/{total} with "
        "equal tokens")
  return 0 if equal_tau == equal_tokens == total else 1


if __name__ == "__main__":
  sys.exit(main())
