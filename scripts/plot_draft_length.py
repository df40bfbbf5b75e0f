"""Speedup vs context for every method with K fixed and with the draft length chosen per step (issue 30), from
bench-suite result folders: one panel per method, each cell's speedup an in-process ratio to AR with its CI band.

  python scripts/plot_draft_length.py                 # the committed SmolLM2 suites, greedy
  python scripts/plot_draft_length.py --fixed DIR ... --adaptive DIR ... --out FILE.png

Prints the table it draws (markdown). Needs matplotlib (the `test` extra)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SUITES = Path("results/bench_suite")
FIXED = [SUITES / "smollm2_fixed_k", SUITES / "smollm2_fixed_k_16k"]
ADAPTIVE = [SUITES / "smollm2_adaptive_512_2k", SUITES / "smollm2_adaptive", SUITES / "smollm2_adaptive_16k"]


def base_method(text: str) -> str:
  """The method without its draft-length option: `eagle3:num_draft=7,draft_length=x.json` -> `eagle3:num_draft=7`."""
  name, _, opts = text.partition(":")
  kept = [o for o in opts.split(",") if o and not o.startswith("draft_length=")]
  return name + (":" + ",".join(kept) if kept else "")


def load_cells(dirs: list[Path], temperature: float, adaptive: bool) -> dict[tuple[str, int], dict]:
  """(base method, context) -> cell of the methods with (`adaptive`) or without a draft-length rule; the first
  folder that has the cell wins. AR and the llama.cpp peers are left out. A missing folder is an error."""
  cells: dict[tuple[str, int], dict] = {}
  for d in dirs:
    path = d / "results.json"
    if not path.is_file():
      raise SystemExit(f"plot_draft_length: {path} not found (run its bench-suite first)")
    for c in json.loads(path.read_text())["cells"]:
      wanted = ("draft_length=" in c["method"]) == adaptive and not c["method"].startswith(("ar", "llama.cpp"))
      if wanted and c["temperature"] == temperature and c["complete"]:
        cells.setdefault((base_method(c["method"]), c["context"]), c)
  return cells


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--fixed", nargs="+", type=Path, default=FIXED, help="suite folders with K fixed")
  p.add_argument("--adaptive", nargs="+", type=Path, default=ADAPTIVE, help="suite folders with draft_length rules")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--out", type=Path, default=SUITES / "draft_length_speedup_vs_context.png")
  a = p.parse_args(argv)
  fixed, adaptive = load_cells(a.fixed, a.temperature, False), load_cells(a.adaptive, a.temperature, True)
  methods = list(dict.fromkeys(m for m, _ in [*adaptive, *fixed]))
  contexts = sorted({c for _, c in [*adaptive, *fixed]})

  def fmt(c):
    return f"{c['speedup']:.2f} [{c['speedup_ci'][0]:.2f}, {c['speedup_ci'][1]:.2f}]" if c else "-"

  print("| method | " + " | ".join(f"{c} fixed / adaptive" for c in contexts) + " |")
  print("|---" * (len(contexts) + 1) + "|")
  for m in methods:
    print(f"| {m} | " + " | ".join(f"{fmt(fixed.get((m, c)))} / {fmt(adaptive.get((m, c)))}" for c in contexts)
          + " |")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from longspec_jax.inference.benchmark.report import context_axis, save_png

  fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.6), sharey=True, squeeze=False)
  for ax, m in zip(axes[0], methods):
    for cells, label, style, color in ((fixed, "K fixed", "--", "C0"), (adaptive, "adaptive length", "-", "C1")):
      cs = sorted((v for (mm, _), v in cells.items() if mm == m), key=lambda v: v["context"])
      if not cs:
        continue
      x = [v["context"] for v in cs]
      ax.plot(x, [v["speedup"] for v in cs], style, marker="o", markerfacecolor="none", label=label, color=color)
      ax.fill_between(x, [v["speedup_ci"][0] for v in cs], [v["speedup_ci"][1] for v in cs], alpha=0.15,
                      color=color)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="gray", lw=0.8, ls=":")
    context_axis(ax, contexts, fontsize=7)
    ax.set_title(re.sub(r":.*", "", m) + f" (K={m.split('num_draft=')[1]})" if "num_draft=" in m else m,
                 fontsize=9)
    ax.set_xlabel("context (tokens)", fontsize=8)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel(f"speedup vs AR, T={a.temperature:g} (95% CI)", fontsize=8)
  max(axes[0], key=lambda ax: len(ax.get_legend_handles_labels()[0])).legend(fontsize=7)
  fig.tight_layout()
  a.out.parent.mkdir(parents=True, exist_ok=True)
  save_png(fig, a.out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
