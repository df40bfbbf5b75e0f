"""Summarises scripts/budget_bench.py runs: mean tau per (context, variant) with a 95% bootstrap CI over prompts,
paired differences against the naive-sparse and full-cache drafters, decode speedup vs AR, draft ms, drafter state
bytes; writes summary.md / summary.json and a tau-vs-context plot per budget.

  python scripts/budget_report.py --runs results/budget/runs --out results/budget
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

N_BOOT = 10000


def boot_ci(x, seed=0):
  x = np.asarray(x, np.float64)
  means = np.random.default_rng(seed).choice(x, (N_BOOT, len(x))).mean(1)
  return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--runs", required=True)
  p.add_argument("--out", required=True)
  a = p.parse_args()
  runs = defaultdict(list)
  for f in sorted(Path(a.runs).glob("*.json")):
    r = json.loads(f.read_text())
    runs[r["context"], r["variant"]].append(r)
  rows = {}
  for (ctx, v), rs in sorted(runs.items()):
    rs = sorted(rs, key=lambda r: r["cut"])
    tau = [t for r in rs for t in r["tau"]]
    rows[ctx, v] = {
        "context": ctx, "variant": v, "n_prompts": len(tau), "cuts": [r["cut"] for r in rs], "tau": tau,
        "tau_mean": float(np.mean(tau)), "tau_ci95": boot_ci(tau),
        "speedup_decode": float(np.mean([r["speedup_decode"] for r in rs])),
        "draft_ms_per_step": float(np.mean([r["draft_ms_per_step"] for r in rs])),
        "drafter_state_bytes_per_seq": rs[0]["drafter_state_bytes_per_seq"],
        "exact_match_ar": all(all(r["exact_match_ar"]) for r in rs)}
  # Paired (same prompts) differences: BudgetDraft vs naive sparse at the same budget, and vs the full cache.
  for (ctx, v), row in rows.items():
    for ref_name, ref in (("naive", v.replace("budget-", "naive-")), ("full", "full")):
      if v.startswith("budget-") and (ctx, ref) in rows and rows[ctx, ref]["n_prompts"] == row["n_prompts"]:
        diff = np.asarray(row["tau"]) - np.asarray(rows[ctx, ref]["tau"])
        row[f"minus_{ref_name}"] = {"mean": float(diff.mean()), "ci95": boot_ci(diff),
                                    "ratio": row["tau_mean"] / rows[ctx, ref]["tau_mean"]}
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "summary.json").write_text(json.dumps(list(rows.values()), indent=2))

  lines = ["| context | variant | prompts | tau mean [95% CI] | vs naive (paired, CI) | / full tau | decode speedup "
           "vs AR | draft ms/step | drafter state B/seq | exact |", "|" + "---|" * 10]
  for (ctx, v), r in sorted(rows.items()):
    vs_naive = (f"{r['minus_naive']['mean']:+.2f} [{r['minus_naive']['ci95'][0]:+.2f}, "
                f"{r['minus_naive']['ci95'][1]:+.2f}]") if "minus_naive" in r else ""
    vs_full = f"{r['minus_full']['ratio']:.3f}" if "minus_full" in r else ""
    lines.append(f"| {ctx} | {v} | {r['n_prompts']} | {r['tau_mean']:.2f} [{r['tau_ci95'][0]:.2f}, "
                 f"{r['tau_ci95'][1]:.2f}] | {vs_naive} | {vs_full} | {r['speedup_decode']:.2f} | "
                 f"{r['draft_ms_per_step']:.1f} | {r['drafter_state_bytes_per_seq']:,} | {r['exact_match_ar']} |")
  (out / "summary.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  budgets = sorted({int(v.split("-")[1]) for _, v in rows if v.split("-")[0] in ("naive", "budget")})
  fig, axes = plt.subplots(1, max(len(budgets), 1), figsize=(5 * max(len(budgets), 1), 4), squeeze=False)
  ctxs = sorted({c for c, _ in rows})
  for ax, b in zip(axes[0], budgets):
    for v, style in (("full", "k-o"), ("trained-full", "k:s"), (f"naive-{b}", "C0-o"), (f"naive-{b}-drop", "C0:x"),
                     (f"budget-{b}", "C3-o"), (f"budget-{b}-drop", "C3:x")):
      pts = [(c, rows[c, v]) for c in ctxs if (c, v) in rows]
      if not pts:
        continue
      xs = [c for c, _ in pts]
      ys = [r["tau_mean"] for _, r in pts]
      err = np.asarray([[r["tau_mean"] - r["tau_ci95"][0], r["tau_ci95"][1] - r["tau_mean"]] for _, r in pts]).T
      ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=v)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("mean tau (95% CI)")
    ax.set_title(f"budget {b}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "tau_vs_context.png", dpi=120)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
