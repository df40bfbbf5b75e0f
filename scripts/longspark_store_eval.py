"""Held-out per-slot top-1 agreement with the target's argmax and tau_sim of LongSpark drafters on a distillation
store's held-out windows, the same anchors for every drafter (`evaluate_longspark_on_store`):

  python scripts/longspark_store_eval.py --store runs/distill_smollm2 --drafter new=runs/drafter_longspark_smollm2_store/final \\
      --drafter shipped=longspec_jax/assets/drafters/longspark-smollm2-135m --draws 64 --out results/scaling/x.json

A drafter trained without a draft vocabulary is scored over the whole vocabulary."""

import argparse
import json
from pathlib import Path

from longspec_jax.targets import load_target
from longspec_jax.training.distill_store import DistillStore
from longspec_jax.training.train_longspark import evaluate_longspark_on_store


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--store", required=True)
  p.add_argument("--drafter", action="append", required=True, metavar="LABEL=DIR")
  p.add_argument("--draws", type=int, default=64, help="held-out windows drawn (32 anchors each)")
  p.add_argument("--val-fraction", type=float, default=0.03)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="write the results as JSON here")
  a = p.parse_args()
  store = DistillStore(a.store)
  target = load_target(store.settings["target"], show_progress=False)
  out = {"store": store.dir.name, "stored_tokens": store.index["stored_tokens"], "draws": a.draws,
         "val_fraction": a.val_fraction, "drafters": {}}
  for item in a.drafter:
    label, _, path = item.partition("=")
    res = evaluate_longspark_on_store(path, target, a.store, draws=a.draws, val_fraction=a.val_fraction,
                                      seed=a.seed)
    out["drafters"][label] = {"dir": path, **res}
    acc = [res[k] for k in sorted((k for k in res if k.startswith("val_acc_")), key=lambda k: int(k[8:]))]
    print(f"{label}: tau_sim {res['val_tau_sim']:.3f}  top-1 per slot {acc}", flush=True)
  if a.out:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
