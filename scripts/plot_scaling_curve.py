"""The data-scaling curve of drafters trained from the distillation store: held-out tau_sim (and top-1 agreement per
drafting step or block slot) against training positions seen, from each run's train_log.jsonl (the eval_every
records): the log's own "tokens", a window row read (EAGLE-3: a token predicted in every chain step; DFlash: a
context row, batch x context_len per step) or a block anchor predicting B_s slots (LongSpark).

  python scripts/plot_scaling_curve.py --run eagle3=runs/drafter_eagle3_smollm2_store --out results/scaling/smollm2

writes OUT.json (the points) and OUT.png (needs matplotlib). A run may also be a curve this script wrote before,
`LABEL=FILE.json#RUN` (RUN: its label there), so a committed curve whose run directory is gone can be drawn beside
new runs."""

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[dict]:
  points = []
  for line in (run_dir / "train_log.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if "val_tau_sim" in rec:
      acc = [rec[k] for k in sorted((k for k in rec if k.startswith("val_acc_")), key=lambda k: int(k[8:]))]
      points.append({"step": rec["step"], "tokens": rec["tokens"], "tau_sim": rec["val_tau_sim"], "val_acc": acc})
  return points


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="a training run to plot")
  p.add_argument("--out", required=True, help="output path without extension")
  a = p.parse_args()
  runs = {}
  for item in a.run:
    label, _, path = item.partition("=")
    if "#" in path:
      file, _, name = path.partition("#")
      runs[label] = json.loads(Path(file).read_text())[name]
      continue
    cfg = json.loads((Path(path) / "train_config.json").read_text())
    runs[label] = {"run_dir": path, "store_dir": cfg.get("store_dir"), "distill": cfg.get("distill"),
                   "max_train_tokens": cfg.get("max_train_tokens", 0),
                   "held_out_within_tokens": cfg.get("held_out_within_tokens", 0),
                   "batch_tokens": cfg["batch_size"] * (cfg.get("context_len") or cfg["anchors_per_window"]),
                   "unit": "positions" if cfg.get("context_len") else "anchors", "points": curve(Path(path))}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: wrote the JSON only")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  for label, r in runs.items():
    xs = [pt["tokens"] / 1e6 for pt in r["points"]]
    unit = r.get("unit", "positions")
    ax.plot(xs, [pt["tau_sim"] for pt in r["points"]], marker="o", ms=3, label=f"{label} ({unit})")
  ax.set_xlabel("training positions seen (millions)")
  ax.set_ylabel("held-out tau_sim = 1 + sum_k prod_{i<=k} acc_i")
  ax.set_title("Data scaling of store-trained drafters (SmolLM2-135M)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out.with_suffix(".png"), dpi=120)
  print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
