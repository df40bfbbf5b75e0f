"""The suite's outputs: `results.json` (everything), `results.md` (tables) and PNG plots. The plots need matplotlib
(an optional dependency, in the `test` extra): without it they are skipped with a one-line notice."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from longspec_jax.inference.benchmark.config import PROTOCOL, MethodSpec, SuiteConfig
from longspec_jax.inference.benchmark.statistics import cell_summary, paired_difference

if TYPE_CHECKING:
  from collections.abc import Sequence

  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

PLOTS = ("tau_vs_context", "speedup_vs_context", "draft_ms_vs_context", "state_bytes_vs_context")


def summarize(cfg: SuiteConfig, methods: list[MethodSpec], prompts: list[dict], target: dict, records: list[dict],
              runs: list[dict]) -> dict:
  """Everything results.json holds: the config's cells (from the per-prompt `records`), the paired tau differences
  between methods and against the reference context, the prompts and the runs that made the records."""
  wanted = {(m.text, c, float(t)) for m in methods for c in cfg.contexts for t in cfg.temperatures}
  by_cell: dict[tuple, list] = {}
  for r in records:
    key = (r["method"], r["context"], r["temperature"])
    if key in wanted and r["prompt"] < cfg.num_prompts:
      by_cell.setdefault(key, []).append(r)
  order = {m.text: i for i, m in enumerate(methods)}
  keys = sorted(by_cell, key=lambda k: (k[2], k[1], order[k[0]]))
  cells = {k: cell_summary(by_cell[k], cfg.bootstrap, cfg.ci) for k in keys}
  for k, c in cells.items():
    c["complete"] = c["n_prompts"] == cfg.num_prompts
  pairs = []
  for t in cfg.temperatures:
    for ctx in cfg.contexts:
      present = [m.text for m in methods if (m.text, ctx, float(t)) in cells]
      for i, a in enumerate(present):
        for b in present[i + 1:]:
          d = paired_difference(cells[a, ctx, float(t)], cells[b, ctx, float(t)], cfg.bootstrap, cfg.ci)
          if d:
            pairs.append({"temperature": float(t), "context": ctx, "a": a, "b": b, **d})
  trends = []
  ref = cfg.reference_context or min(cfg.contexts)
  for t in cfg.temperatures:
    for m in methods:
      if (m.text, ref, float(t)) not in cells:
        continue
      for c in sorted(cfg.contexts):
        d = (paired_difference(cells[m.text, c, float(t)], cells[m.text, ref, float(t)], cfg.bootstrap, cfg.ci)
             if c != ref and (m.text, c, float(t)) in cells else None)
        if d:
          trends.append({"temperature": float(t), "method": m.text, "context": c, "from_context": ref, **d})
  docs = sorted({p["doc"] for p in prompts})
  return {"config": dataclasses.asdict(cfg), "target": target, "prompts": prompts, "documents": docs,
          "protocol_met": cfg.num_prompts >= PROTOCOL[0] and len(docs) >= PROTOCOL[1], "runs": runs,
          "cells": list(cells.values()), "tau_differences": pairs, "tau_vs_reference_context": trends,
          "records": [r for k in keys for r in sorted(by_cell[k], key=lambda r: r["prompt"])]}


def _fmt(v, digits=3) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.{digits}g}"
  return str(v)


def _bytes(n) -> str:
  if not n:
    return "0"
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1024 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def markdown(results: dict, plots: tuple[str, ...] = PLOTS) -> str:
  """results.md: the run lines, the cell table, the paired differences, diagnostics and the `plots` drawn."""
  cfg = results["config"]
  md = [f"# Bench suite: {results['target']['model']}", ""]
  for run in (r for r in results["runs"] if r["todo"]):  # reruns that only re-summarized stay in results.json
    m = run["machine"]
    md.append(f"- run {run['run_id']}: `{run['command']}`; git {run['git']['commit']}"
              f"{' (dirty)' if run['git']['dirty'] else ''}; {m['cpu']} x{m['cpu_count']}, {m['jax_devices'][0]}; "
              f"load avg (1 min) {run['loadavg_1min_start']:.2f} at start, {run.get('loadavg_1min_end', 0):.2f} at "
              f"end (max {run.get('loadavg_1min_samples', {}).get('max', 0):.2f}); other processes used "
              f"{_fmt(run.get('other_processes_cpu_s'))} CPU-s during its {_fmt(run.get('wall_s'))} s "
              f"({run['todo']} runs)")
  docs = results["documents"]
  md += ["", f"Target `{results['target']['dir']}` (weights sha256 {results['target']['weights_sha256'][:12]}). "
         f"{cfg['num_prompts']} prompts per context from {len(docs)} documents ({', '.join(docs)}), cut points in "
         f"`results.json`; {cfg['new_tokens']} new tokens; AR timed on the same prompts in the same process. "
         f"{int(100 * cfg['ci'])}% CIs: percentile bootstrap over prompts ({cfg['bootstrap']} resamples)."]
  if not results["protocol_met"]:
    md += ["", f"**Below the measurement protocol** (>= {PROTOCOL[0]} prompts from >= {PROTOCOL[1]} documents)."]
  md += ["", "| method | T | context | prompts | tau [CI] | accept@1,2,3 | tok/s | AR tok/s | speedup [CI] | "
         "draft ms | verify ms | AR ms/step | drafter state | peak RSS | greedy = AR |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for c in results["cells"]:
    acc = ", ".join(f"{a:.2f}" for a in c["accept_per_position"][:3]) or "-"
    sp = (f"{c['speedup']:.2f} [{c['speedup_ci'][0]:.2f}, {c['speedup_ci'][1]:.2f}]" if c["speedup"] is not None
          else "-")
    md.append(f"| {c['method']} | {c['temperature']:g} | {c['context']} | {c['n_prompts']}"
              f"{'' if c['complete'] else ' (incomplete)'} | {c['tau_mean']:.2f} [{c['tau_ci'][0]:.2f}, "
              f"{c['tau_ci'][1]:.2f}] | {acc} | {_fmt(c['tokens_per_s'])} | {_fmt(c['ar_tokens_per_s'])} | {sp} | "
              f"{_fmt(c['draft_ms_per_step'])} | {_fmt(c['verify_ms_per_step'])} | {_fmt(c['ar_ms_per_step'])} | "
              f"{_bytes(c['drafter_state_bytes'])} | {_bytes(c['peak_rss_bytes'])} | "
              f"{_fmt(c['exact_match_ar_count'])} |")
  md += ["", "draft ms / verify ms: one draft pass and one verify pass (K+1 rows) at the prompt's context, timed "
         "apart as compiled executables, without jit dispatch (median over prompts). AR ms/step: AR decode time per "
         "token. Peak RSS: the process's peak so far (it only grows over a sweep).", "",
         "## Which tau and speedup differences exceed their confidence interval", "",
         "Paired bootstrap over the prompts both methods ran (same prompts, same cut points): the CI of the mean "
         "difference excludes 0. Speedup: each prompt's tokens/s over AR's on that prompt in the same process.", "",
         "| T | context | A | B | tau A - B [CI] | exceeds CI | speedup A - B [CI] | exceeds CI |",
         "|---|---|---|---|---|---|---|---|"]
  for d in results["tau_differences"]:
    speedup = (f"{d['speedup_diff']:+.2f} [{d['speedup_diff_ci'][0]:+.2f}, {d['speedup_diff_ci'][1]:+.2f}] | "
               f"{'yes' if d['speedup_exceeds_ci'] else 'no'}" if "speedup_diff" in d else "- | -")
    md.append(f"| {d['temperature']:g} | {d['context']} | {d['a']} | {d['b']} | {d['diff']:+.2f} "
              f"[{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}] | {'yes' if d['exceeds_ci'] else 'no'} | {speedup} |")
  md += ["", f"## tau change from the reference context ({cfg.get('reference_context') or min(cfg['contexts'])}; "
         "paired over the same cut points)", "",
         "| T | method | context | tau(context) - tau(ref) [CI] | difference exceeds CI "
         "| tau(context) / tau(ref) [CI] |",
         "|---|---|---|---|---|---|"]
  for d in results["tau_vs_reference_context"]:
    md.append(f"| {d['temperature']:g} | {d['method']} | {d['from_context']} -> {d['context']} | {d['diff']:+.2f} "
              f"[{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}] | {'yes' if d['exceeds_ci'] else 'no'} | {d['ratio']:.2f} "
              f"[{d['ratio_ci'][0]:.2f}, {d['ratio_ci'][1]:.2f}] |")
  diag = [c for c in results["cells"] if c.get("diagnostics")]
  if diag:
    md += ["", "## Drafter diagnostics (mean over prompts, at the prompt's end; per-layer values averaged)", "",
           "| method | T | context | diagnostic | value |", "|---|---|---|---|---|"]
    for c in diag:
      for k, v in c["diagnostics"].items():
        v = np.asarray(v)
        shown = v.reshape(-1, v.shape[-1]).mean(0) if v.ndim else v.reshape(1)
        md.append(f"| {c['method']} | {c['temperature']:g} | {c['context']} | {k} | "
                  f"{' '.join(f'{x:.3f}' for x in shown)} |")
  if plots:
    md += ["", "## Plots", ""] + [f"![{name}]({name}.png)" for name in plots]
  return "\n".join(md) + "\n"


def save_png(fig: Figure, path: Path) -> None:
  """Save a matplotlib figure as a 128-colour palette PNG: a quarter of the RGBA file's bytes for line plots with
  CI bands, with no visible change (committed result folders carry many of them)."""
  import io

  from PIL import Image  # matplotlib depends on pillow
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110)
  Image.open(buf).convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)


def context_axis(ax: Axes, contexts: Sequence[int], fontsize: float | str | None = None) -> None:
  """x = context on a log2 scale, ticked at the contexts run (4096 -> "4K"; 512 and 8000 as numbers)."""
  from matplotlib.ticker import NullLocator
  ax.set_xscale("log", base=2)
  ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c) for c in contexts],
                fontsize=fontsize)
  ax.xaxis.set_minor_locator(NullLocator())


def plot(results: dict, out: Path) -> list[Path]:
  """The PNG plots (matplotlib: raises ImportError without it)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = results["cells"]
  methods = list(dict.fromkeys(c["method"] for c in cells))
  temps = list(dict.fromkeys(c["temperature"] for c in cells))
  colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 8))
  markers = dict(zip(methods, "osD^vPX*<>" * 8))  # distinct, so coinciding lines stay visible
  styles = ["-", "--", ":", "-."]
  contexts = sorted({c["context"] for c in cells})
  specs = {"tau_vs_context": ("tau_mean", "tau_ci", "tau (tokens per target forward)", "linear"),
           "speedup_vs_context": ("speedup", "speedup_ci", "speedup vs AR (decode tokens/s)", "linear"),
           "draft_ms_vs_context": ("draft_ms_per_step", None, "draft ms per step", "log"),
           "state_bytes_vs_context": ("drafter_state_bytes", None, "drafter state bytes", "log")}
  paths = []
  for name in PLOTS:
    key, ci_key, ylabel, yscale = specs[name]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
      for ti, t in enumerate(temps):
        cs = sorted((c for c in cells if c["method"] == m and c["temperature"] == t and c[key] is not None
                     and not (yscale == "log" and c[key] <= 0)), key=lambda c: c["context"])
        if not cs:
          continue
        x = [c["context"] for c in cs]
        label = m if len(temps) == 1 else f"{m} T={t:g}"
        ax.plot(x, [c[key] for c in cs], styles[ti % 4], marker=markers[m], color=colors[m], label=label,
                markerfacecolor="none")
        if ci_key:
          ax.fill_between(x, [c[ci_key][0] for c in cs], [c[ci_key][1] for c in cs], color=colors[m], alpha=0.15)
    if name == "speedup_vs_context":
      ax.axhline(1.0, color="gray", lw=0.8)
    context_axis(ax, contexts)
    ax.set_yscale(yscale)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ci = f" ({int(100 * results['config']['ci'])}% CI bands)" if ci_key else ""
    ax.set_title(f"{results['target']['model']}: {ylabel}{ci}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out / f"{name}.png")
    plt.close(fig)
    paths.append(out / f"{name}.png")
  return paths


def write_outputs(results: dict, out: Path) -> None:
  """results.json (without the per-prompt records: they are in cells/*.jsonl beside it), results.md, then the plots
  if matplotlib is installed (else a notice on stderr)."""
  (out / "results.json").write_text(json.dumps({k: v for k, v in results.items() if k != "records"}, indent=1))
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    (out / "results.md").write_text(markdown(results, plots=()))
    print("bench-suite: plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return
  (out / "results.md").write_text(markdown(results))
  plot(results, out)
