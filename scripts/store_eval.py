"""Held-out per-slot (per-step) top-1 agreement with the target's argmax and tau_sim of exported drafters (DFlash,
LongSpark, EAGLE-3) on a distillation store's held-out windows: drafters of one kind are scored on the same
blocks, whatever data they were trained on, over the draft vocabulary each drafts with (the kind is read from
drafter.json):

  python scripts/store_eval.py --store runs/distill_smollm2 --drafter new=runs/drafter_dflash_smollm2_store/final \\
      --drafter shipped=longspec_jax/assets/drafters/dflash-smollm2-135m --draws 32 --out results/scaling/x.json

EAGLE-3 only: `--shrink LABEL=SIZE:OUT` also writes and scores a copy of drafter LABEL whose draft vocabulary keeps
its SIZE tokens most often the target's argmax.
"""

import argparse
import json
from pathlib import Path

from longspec_jax.targets import load_target
from longspec_jax.training.distill_store import DistillStore


def evaluate(kind: str, path: str, target, a) -> dict:
  if kind == "dflash":
    from longspec_jax.training.train_dflash import evaluate_dflash_on_store
    return evaluate_dflash_on_store(path, target, a.store, draws=a.draws, val_fraction=a.val_fraction, seed=a.seed,
                                    held_out_within_tokens=a.held_out_within_tokens)
  if kind == "longspark":
    from longspec_jax.training.train_longspark import evaluate_longspark_on_store
    return evaluate_longspark_on_store(path, target, a.store, draws=a.draws, val_fraction=a.val_fraction,
                                       seed=a.seed, held_out_within_tokens=a.held_out_within_tokens)
  if kind == "eagle3":
    from longspec_jax.drafters.eagle3 import load_eagle3
    from longspec_jax.training.train_eagle3 import evaluate_on_store
    return evaluate_on_store(load_eagle3(path, target), target, a.store, val_windows=a.draws,
                             val_fraction=a.val_fraction, seed=a.seed,
                             held_out_within_tokens=a.held_out_within_tokens)
  raise SystemExit(f"{path}: no store evaluation for drafter kind {kind!r} (dflash, longspark, eagle3)")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--store", required=True)
  p.add_argument("--drafter", action="append", required=True, metavar="LABEL=DIR")
  p.add_argument("--shrink", action="append", default=[], metavar="LABEL=SIZE:OUT")
  p.add_argument("--draws", type=int, default=32, help="held-out windows drawn")
  p.add_argument("--val-fraction", type=float, default=0.03)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--held-out-within-tokens", type=int, default=0,
                 help="score only the held-out windows within the store's first N tokens (0 = all): the same "
                      "windows as runs started when the store was that size")
  p.add_argument("--out", help="write the results as JSON here")
  a = p.parse_args()
  store = DistillStore(a.store)
  target = load_target(store.settings["target"], show_progress=False)
  drafters = dict(item.split("=", 1) for item in a.drafter)
  for item in a.shrink:
    from longspec_jax.training.train_eagle3 import shrink_draft_vocab
    label, spec = item.split("=", 1)
    size, out = spec.split(":", 1)
    drafters[f"{label}-v{size}"] = str(shrink_draft_vocab(drafters[label], target, a.store, int(size), out,
                                                          val_fraction=a.val_fraction, seed=a.seed))
  out = {"store": store.dir.name, "stored_tokens": store.index["stored_tokens"], "draws": a.draws,
         "val_fraction": a.val_fraction, "held_out_within_tokens": a.held_out_within_tokens, "drafters": {}}
  for label, path in drafters.items():
    kind = json.loads((Path(path) / "drafter.json").read_text())["kind"]
    res = evaluate(kind, path, target, a)
    out["drafters"][label] = {"dir": path, "kind": kind, **res}
    acc = [res[k] for k in sorted((k for k in res if k.startswith("val_acc_")), key=lambda k: int(k[8:]))]
    print(f"{label} ({kind}): tau_sim {res['val_tau_sim']:.3f}  top-1 per slot {acc}", flush=True)
  if a.out:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
