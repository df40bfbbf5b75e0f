"""SharpDraft report from `longspec bench-suite` results: tau vs context per (method, SharpDraft variant), the
fraction of each method's long-context tau drop that each rule recovers, and (optionally) the attention-mass
dilution plot. The runs, the tau table with CIs and the tau-vs-context plot are the suite's; this adds the
SharpDraft-specific figures.

  longspec bench-suite --config configs/bench/sharpdraft.yaml --out results/bench_suite/sharpdraft
  python scripts/sharpdraft_report.py --results results/bench_suite/sharpdraft --out results/sharpdraft \
      [--dilution pard,dflash,eagle3]

--results: a suite output directory (its results.json; methods written `NAME` or `NAME:sharpdraft=RULE`),
greedy cells unless --temperature. Recovery of a rule at the longest context L against the drafter's n0, on the
prompts measured in all three cells (the suite uses the same cut points at every context):
    (tau_rule(L) - tau_off(L)) / (tau_off(n0) - tau_off(L)).
The dilution plot measures, on the held-out long documents, the drafter's attention mass on its top-k keys (k per
head from sharpdraft.json; heads with k = 0 left out) for the query that sees all n keys, from `attention_logits`
on windows of n tokens, unscaled and with each rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("off", "fixed", "exact")
STYLES = {"off": "-", "fixed": "--", "exact": ":"}
MARKERS = {"off": "o", "fixed": "s", "exact": "^"}  # distinct, so overlapping lines stay visible


def load_runs(results_dir: Path, temperature: float = 0.0) -> dict:
  """(method, variant, context) -> {prompt index: tau} from a bench-suite results.json."""
  path = results_dir / "results.json"
  if not path.exists():
    raise SystemExit(f"error: no bench-suite results.json in {results_dir} (run `longspec bench-suite` first)")
  runs = defaultdict(dict)
  for c in json.loads(path.read_text())["cells"]:
    if c["temperature"] != temperature:
      continue
    variant = c["options"].get("sharpdraft", "off")
    if variant not in VARIANTS:
      raise SystemExit(f"error: {path}: {c['method']} has sharpdraft = {variant!r}, expected one of {VARIANTS}")
    runs[(c["name"], variant, int(c["context"]))] = dict(zip(c["prompts"], c["tau_per_prompt"]))
  if not runs:
    raise SystemExit(f"error: no cells at temperature {temperature} in {path}")
  return runs


def method_n0(method: str, overrides: dict) -> int | None:
  if method in overrides:
    return overrides[method]
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, drafter_entry
  meta = SHIPPED_DRAFTERS_DIR / drafter_entry(method).checkpoint / "drafter.json"
  return json.loads(meta.read_text()).get("n0") if meta.exists() else None


def _mean_over(runs, keys):
  """Mean tau of each key over the prompts all keys share: (means, prompts) or (None, [])."""
  prompts = set.intersection(*(set(runs.get(k, {})) for k in keys))
  if not prompts:
    return None, []
  return [float(np.mean([runs[k][i] for i in prompts])) for k in keys], sorted(prompts)


def recovery(runs, method: str, n0: int | None) -> dict:
  """Per rule: the recovered fraction of the tau drop from n0 (or the shortest context >= n0) to the longest."""
  off = sorted(c for (m, v, c) in runs if m == method and v == "off")
  if n0 is None or not off:
    return {}
  lo = min((c for c in off if c >= n0), default=None)
  if lo is None:
    return {}
  out = {}
  for rule in ("fixed", "exact"):
    hi = max((c for (m, v, c) in runs if m == method and v == rule and c in off and c > lo), default=None)
    if hi is None:
      continue
    means, prompts = _mean_over(runs, [(method, "off", lo), (method, "off", hi), (method, rule, hi)])
    if means is None:
      continue
    t_lo, t_hi, t_rule = means
    drop = t_lo - t_hi
    out[rule] = {"short": lo, "long": hi, "tau_off_short": t_lo, "tau_off_long": t_hi, "tau_rule_long": t_rule,
                 "recovered": (t_rule - t_hi) / drop if drop > 0 else None, "prompts": len(prompts)}
  return out


def tau_table(runs) -> list[str]:
  contexts = sorted({c for (_, _, c) in runs})
  lines = ["| method | sharpdraft | " + " | ".join(str(c) for c in contexts) + " |",
           "|---|---|" + "---|" * len(contexts)]
  for method, variant in sorted({(m, v) for (m, v, _) in runs}, key=lambda mv: (mv[0], VARIANTS.index(mv[1]))):
    cells = []
    for c in contexts:
      taus = runs.get((method, variant, c))
      cells.append(f"{np.mean(list(taus.values())):.3f} ({len(taus)})" if taus else "")
    lines.append(f"| {method} | {variant} | " + " | ".join(cells) + " |")
  return lines


def recovery_table(rec: dict) -> list[str]:
  lines = ["| method | rule | n0 ctx | long ctx | tau off n0 | tau off long | tau rule long | recovered | prompts |",
           "|---|---|---|---|---|---|---|---|---|"]
  for method, rules in sorted(rec.items()):
    for rule, r in rules.items():
      frac = "no drop" if r["recovered"] is None else f"{100 * r['recovered']:.0f}%"
      lines.append(f"| {method} | {rule} | {r['short']} | {r['long']} | {r['tau_off_short']:.3f} | "
                   f"{r['tau_off_long']:.3f} | {r['tau_rule_long']:.3f} | {frac} | {r['prompts']} |")
  return lines


def measure_dilution(method: str, contexts: list[int], num_docs: int) -> dict:
  """Mean top-k attention mass (over heads with k > 0 and documents) at each n, per variant."""
  import jax
  from flax import nnx

  from longspec_jax import default_target_dir, long_doc_paths
  from longspec_jax.drafters import load_drafter, drafter_path
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.sharpdraft import SHARPDRAFT_FILE, load_sharpdraft, scaled_logits, top_k_mass
  from longspec_jax.tokenizer import load_tokenizer

  target = load_model_dir(default_target_dir())
  tok = load_tokenizer(default_target_dir())
  path = drafter_path(method)
  calib = json.loads((path / SHARPDRAFT_FILE).read_text())
  k = np.asarray(calib["applied"]["k"])  # [L, Hq]
  if not (k > 0).any():
    print(f"{method}: no head has relevant keys (k = 0 everywhere), so SharpDraft leaves it unchanged and there "
          "is no top-k mass to follow; skipped", file=sys.stderr)
    return None
  rules = {v: (load_sharpdraft(path, v) if v != "off" else None) for v in VARIANTS}
  loaded = load_drafter(method, target)
  graphdef, tparams = nnx.split(target)
  fn = jax.jit(lambda dp, tp, toks: loaded.spec.attention_logits(dp, nnx.merge(graphdef, tp), toks))
  bos = target.cfg.bos_token_id
  docs = [([bos] if bos is not None else []) + tok.encode(p.read_text()).ids for p in long_doc_paths()[:num_docs]]
  out = {v: [] for v in VARIANTS}
  keys = []
  for n in contexts:
    masses = {v: [] for v in VARIANTS}
    for doc in docs:
      logits = fn(loaded.params, tparams, np.asarray([doc[:n]], np.int32))
      for v, sd in rules.items():
        m = [top_k_mass(np.asarray(scaled_logits(sd, li, x))[0, :, -1], k[li]) for li, x in enumerate(logits)]
        masses[v].append(np.stack(m)[k > 0])
    keys.append(int(logits[0].shape[-1]))
    for v in VARIANTS:
      out[v].append(float(np.mean(masses[v])))
  return {"contexts": contexts, "keys": keys, "docs": len(docs), "top_k_mass": out,
          "heads": int((k > 0).sum()), "source": "attention_logits on held-out long documents (prefix of n tokens)"}


def plot_dilution(dil: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(dil), figsize=(4.5 * len(dil), 4), squeeze=False)
  for ax, (method, d) in zip(axes[0], dil.items()):
    for v in VARIANTS:
      ax.plot(d["keys"], d["top_k_mass"][v], STYLES[v], marker=MARKERS[v], label=v)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("keys visible n")
    ax.set_ylabel("top-k attention mass")
    ax.set_title(f"{method}: dilution ({d['heads']} heads, {d['docs']} docs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--results", required=True, help="a bench-suite output directory (results.json)")
  p.add_argument("--temperature", type=float, default=0.0, help="which of the suite's temperatures to report")
  p.add_argument("--out", required=True)
  p.add_argument("--n0", default="", help="METHOD=N,... (default: n0 in the shipped drafter.json)")
  p.add_argument("--dilution", default="", help="comma-separated drafter methods to measure dilution for")
  p.add_argument("--dilution-contexts", default="512,1024,2048,4096,8192,16384")
  p.add_argument("--dilution-docs", type=int, default=6, help="held-out long documents per context")
  a = p.parse_args(argv)
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  runs = load_runs(Path(a.results), a.temperature)
  overrides = {m: int(n) for m, n in (kv.split("=") for kv in a.n0.split(",") if kv)}
  rec = {m: recovery(runs, m, method_n0(m, overrides)) for m in sorted({m for (m, _, _) in runs})}
  rec = {m: r for m, r in rec.items() if r}
  md = ["# SharpDraft: tau vs context", "", f"Command: `python scripts/sharpdraft_report.py {' '.join(sys.argv[1:])}`",
        "", f"tau per (method, SharpDraft variant) and context at temperature {a.temperature:g}, from "
        f"`{a.results}/results.json`; (n) = prompts averaged. CIs, speedups and the tau plot with CI bands: "
        f"`{a.results}/results.md`.", ""]
  md += tau_table(runs)
  md += ["", "## Recovered fraction of the tau drop (n0 -> longest context)", ""]
  md += recovery_table(rec) if rec else ["(needs off runs at n0 and at a longer context, and rule runs there)"]
  summary = {"recovery": rec}
  if a.dilution:
    contexts = [int(c) for c in a.dilution_contexts.split(",")]
    dil = {m: measure_dilution(m, contexts, a.dilution_docs) for m in a.dilution.split(",")}
    skipped = [m for m, d in dil.items() if d is None]
    dil = {m: d for m, d in dil.items() if d is not None}
    if dil:
      plot_dilution(dil, out / "sharpdraft_dilution.png")
    summary["dilution"] = dil
    md += ["", "## Attention-mass dilution", "",
           "Mean mass on each head's calibrated top-k keys (heads with k > 0) for the query that sees n keys, "
           "measured with `attention_logits` on the first n tokens of held-out long documents.", "",
           "| method | variant | " + " | ".join(str(c) for c in contexts) + " |",
           "|---|---|" + "---|" * len(contexts)]
    for m, d in dil.items():
      for v in VARIANTS:
        md.append(f"| {m} | {v} | " + " | ".join(f"{x:.3f}" for x in d["top_k_mass"][v]) + " |")
    for m in skipped:
      md += ["", f"{m}: every head calibrated diffuse (k = 0): SharpDraft is the identity, nothing to plot."]
    md += ["", "![dilution](sharpdraft_dilution.png)"] if dil else []
  (out / "sharpdraft_report.md").write_text("\n".join(md) + "\n")
  (out / "sharpdraft_report.json").write_text(json.dumps(summary, indent=1))
  print("\n".join(md))
  return 0


if __name__ == "__main__":
  sys.exit(main())
