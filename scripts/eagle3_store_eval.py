"""EAGLE-3 drafters of SmolLM2-135M against the distillation store's held-out windows (held-out tau_sim, the same
rows for every drafter), and optionally a copy with a smaller draft vocabulary:

  python scripts/eagle3_store_eval.py --store runs/distill_smollm2 --drafter shipped=longspec_jax/assets/drafters/eagle3-smollm2-135m \
      --drafter store=runs/drafter_eagle3_smollm2_store/final --shrink store=4096:runs/eagle3_store_v4096 --out F.json
"""

import argparse
import json
from pathlib import Path

from longspec_jax.drafters.eagle3 import load_eagle3
from longspec_jax.targets import load_target
from longspec_jax.training.distill_store import DistillStore
from longspec_jax.training.train_eagle3 import evaluate_on_store, shrink_draft_vocab


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--store", required=True)
  p.add_argument("--drafter", action="append", required=True, metavar="LABEL=DIR")
  p.add_argument("--shrink", action="append", default=[], metavar="LABEL=SIZE:OUT",
                 help="also write and evaluate a copy of drafter LABEL with SIZE draft tokens in OUT")
  p.add_argument("--val-windows", type=int, default=32)
  p.add_argument("--out", required=True)
  a = p.parse_args()
  store = DistillStore(a.store)
  target = load_target(store.settings["target"])
  drafters = dict(item.split("=", 1) for item in a.drafter)
  for item in a.shrink:
    label, spec = item.split("=", 1)
    size, out = spec.split(":", 1)
    drafters[f"{label}-v{size}"] = str(shrink_draft_vocab(drafters[label], target, a.store, int(size), out))
  res = {}
  for label, d in drafters.items():
    res[label] = {"dir": d, **evaluate_on_store(load_eagle3(d, target), target, a.store, val_windows=a.val_windows)}
    print(label, json.dumps(res[label]))
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps({"store": Path(a.store).name, "stored_tokens": store.index["stored_tokens"],
                                     "drafters": res}, indent=1))


if __name__ == "__main__":
  main()
