"""`longspec build-suffix-index`: the suffix drafter's global n-gram index from a corpus (the project's `longspec
corpus` split, or any folder of text files such as your own code base)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.argtypes import add_command, ascending_lengths, checked, positive_int
from longspec_jax.inference.cli.flags import add_output_flags, check_output_file, model_dir, progress

if TYPE_CHECKING:
  import argparse

power_of_two = checked(positive_int, lambda v: v & (v - 1) == 0, "a power of two")


def corpus_texts(corpus: str, split: str, glob: str) -> list[str]:
  """The documents of `corpus`: a `longspec corpus` DatasetDict's `split`, or every file matching `glob` under a
  folder (read as UTF-8; files that are not are skipped)."""
  root = Path(corpus)
  if (root / "dataset_dict.json").exists():
    from longspec_jax.training.data import load_corpus
    dd = load_corpus(root)
    if split not in dd:
      raise ValueError(f"corpus {root} has no split {split!r} (it has {', '.join(dd)})")
    return list(dd[split]["text"])
  if not root.is_dir():
    raise FileNotFoundError(f"--corpus {root} is neither a `longspec corpus` folder nor a folder of text files")
  texts = []
  for path in sorted(p for p in root.rglob(glob) if p.is_file()):
    try:
      texts.append(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, OSError):
      continue
  if not texts:
    raise ValueError(f"no UTF-8 files matching {glob!r} under {root}")
  return texts


def cmd_build_suffix_index(a: argparse.Namespace) -> int:
  import numpy as np
  from tqdm import tqdm

  from longspec_jax.config import ModelConfig
  from longspec_jax.suffix_index import BYTES_PER_SLOT, DEFAULT_ORDERS, build_index, save_index, tokenizer_sha256
  from longspec_jax.tokenizer import load_tokenizer

  cap = a.max_mb * 2 ** 20
  if a.slots * BYTES_PER_SLOT > cap:
    raise ValueError(f"--slots {a.slots:,} needs {a.slots * BYTES_PER_SLOT / 2 ** 20:,.0f} MiB, over --max-mb "
                     f"{a.max_mb}")
  check_output_file(a.out, "--out")
  log = progress(a)
  texts = corpus_texts(a.corpus, a.split, a.glob)
  target_dir = model_dir(a.model)
  tok = load_tokenizer(target_dir)
  vocab = ModelConfig.from_json_file(target_dir / "config.json").vocab_size
  docs = [np.asarray(tok.encode(t).ids, np.int32)
          for t in tqdm(texts, desc="tokenize", unit="doc", disable=a.quiet)]
  log(f"{len(docs):,} documents, {sum(map(len, docs)):,} tokens; counting contexts")
  orders = a.orders or DEFAULT_ORDERS
  index = build_index(docs, vocab, tokenizer_sha256(tok), a.slots, orders, a.min_count, progress=log)
  save_index(index, a.out, cap)
  print(f"wrote {a.out}: {index.used:,} of {index.slots:,} slots used, {index.nbytes / 2 ** 20:.0f} MiB, orders "
        f"{list(index.orders)}")
  return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
  c = add_command(sub, "build-suffix-index", "the suffix drafter's global n-gram index from a corpus",
      "Count the n-gram contexts of a corpus (a `longspec corpus` folder's split, or every\n"
      "file matching --glob under a folder) and keep each context's most frequent next\n"
      "token in a fixed-size hashed table (16 bytes per slot), for --method suffix/hybrid\n"
      "--suffix-index FILE. The file records the tokenizer and is written whole or not at all.")
  c.add_argument("--corpus", required=True, help="a `longspec corpus` folder, or a folder of text files")
  c.add_argument("--split", default="train", help="the corpus split to index (a `longspec corpus` folder)")
  c.add_argument("--glob", default="*.py", help="the files to index under a plain folder")
  c.add_argument("--out", required=True, help="the index file to write")
  c.add_argument("--model", help="the target whose tokenizer the index is for (default: the shipped target)")
  c.add_argument("--slots", type=power_of_two, default=2 ** 21, help="table slots, a power of two (16 B each)")
  c.add_argument("--max-mb", type=positive_int, default=256, help="the cap on the table's size, recorded in the "
                 "file (a reader refuses a file over its cap)")
  c.add_argument("--orders", type=ascending_lengths, metavar="N,N,...",
                 help="the context lengths indexed, comma-separated (default: 1,2,3,4,6,8,12,16)")
  c.add_argument("--min-count", type=positive_int, default=2, help="contexts seen fewer times are left out")
  add_output_flags(c, json_help="")
  c.set_defaults(fn=cmd_build_suffix_index)
