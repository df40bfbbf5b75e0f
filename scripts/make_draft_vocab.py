"""A draft vocabulary from a distillation store: the target tokens ordered by how often they are the target's
argmax on the store's train windows (the held-out windows are the split every store trainer uses), written as the
draft_vocab.json that `--draft-vocab N` reads beside a DFlash or LongSpark checkpoint (the first N ids), written
into each checkpoint directory given (drafters trained from a store write their own):

  python scripts/make_draft_vocab.py --store runs/distill_smollm2 --size 16384 \
      --out longspec_jax/assets/drafters/dflash-smollm2-135m

It records the share of held-out argmax positions the first N ids cover, for a few N.
"""

import argparse
import json

import numpy as np

from longspec_jax.targets import load_target
from longspec_jax.training.distill_store import DistillStore, split_windows
from longspec_jax.training.drafter_common import write_draft_vocab


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--store", required=True)
  p.add_argument("--size", type=int, default=16384, help="ids written (most frequent first)")
  p.add_argument("--val-fraction", type=float, default=0.03)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", action="append", required=True,
                 help="checkpoint directory to write draft_vocab.json into (repeatable)")
  a = p.parse_args()
  store = DistillStore(a.store)
  vocab = load_target(store.settings["target"], show_progress=False).cfg.vocab_size
  train_w, val_w = split_windows(store, a.seed, a.val_fraction)
  counts = store.argmax_counts(train_w, vocab)
  held_out = store.argmax_counts(val_w, vocab)
  order = np.argsort(-counts, kind="stable")[:a.size]
  cover = {n: round(float(held_out[order[:n]].sum() / held_out.sum()), 4)
           for n in (1024, 2048, 4096, 8192, 16384) if n <= a.size}
  for directory in a.out:
    write_draft_vocab(directory, order, store, len(train_w), held_out_argmax_share=cover,
                      command=f"python scripts/make_draft_vocab.py --store STORE --size {a.size} --out DIR")
  print(json.dumps({"held_out_argmax_share": cover, "train_windows": len(train_w)}, indent=2))


if __name__ == "__main__":
  main()
