"""Corpus building (real text a fresh machine can get from its package registries) and training batches.

The corpus is the CPython standard library's own source (``.py`` files of the running interpreter, PSF
licence). Documents are whole files, split train/validation/test by a hash of their path, and the longest
files (kept whole) form a `long_test` split that training never sees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  import datasets
  from tokenizers import Tokenizer

SPLITS = ("train", "validation", "test", "long_test")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  """How the corpus is cut. Defaults are what the shipped target was trained on."""

  min_chars: int = 200  # tiny files (empty __init__.py, etc.) carry no signal
  long_min_chars: int = 100_000  # ~25K tokens of Python under our BPE: long enough for 16K contexts
  num_long_docs: int = 12
  validation_fraction: float = 0.02
  test_fraction: float = 0.02


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def _split_of(rel_path: str, cfg: CorpusConfig) -> str:
  # Stable across machines and Python hash seeds.
  u = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
  if u < cfg.validation_fraction:
    return "validation"
  if u < cfg.validation_fraction + cfg.test_fraction:
    return "test"
  return "train"


def collect_stdlib_documents(cfg: CorpusConfig, root: Path | None = None) -> dict[str, list[dict]]:
  """Reads every UTF-8 ``.py`` file of the stdlib (no site-packages) into split -> list of documents."""
  root = root or stdlib_root()
  if not root.is_dir():
    raise FileNotFoundError(f"standard library source not found at {root}")
  docs = []
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel.startswith(("site-packages/", "dist-packages/")):
      continue
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue
    if len(text) < cfg.min_chars:
      continue
    docs.append({"path": rel, "text": text, "sha256": hashlib.sha256(text.encode()).hexdigest()})
  if not docs:
    raise ValueError(f"no usable .py documents under {root}")

  # Long held-out documents: the longest files outside the test-suite data dirs, chosen deterministically.
  long_candidates = sorted(
      (d for d in docs if len(d["text"]) >= cfg.long_min_chars and not d["path"].startswith("test/")),
      key=lambda d: (hashlib.sha256(d["path"].encode()).hexdigest()),
  )
  long_paths = {d["path"] for d in long_candidates[: cfg.num_long_docs]}
  out: dict[str, list[dict]] = {s: [] for s in SPLITS}
  for d in docs:
    out["long_test" if d["path"] in long_paths else _split_of(d["path"], cfg)].append(d)
  empty = [s for s, v in out.items() if not v]
  if empty:
    raise ValueError(f"corpus splits {empty} would be empty ({len(docs)} documents); adjust the CorpusConfig")
  return out


def build_corpus(out_dir: str | os.PathLike, cfg: CorpusConfig = CorpusConfig(), root: Path | None = None) -> Path:
  """Builds the corpus as a `datasets.DatasetDict` saved to ``out_dir`` (Arrow) plus a manifest."""
  import datasets

  out_dir = Path(out_dir)
  splits = collect_stdlib_documents(cfg, root)
  features = datasets.Features({k: datasets.Value("string") for k in ("path", "text", "sha256")})
  dd = datasets.DatasetDict({
      name: datasets.Dataset.from_dict({k: [d[k] for d in docs] for k in features}, features=features)
      for name, docs in splits.items()
  })
  dd.save_to_disk(str(out_dir))
  manifest = {
      "source": "CPython standard library source (.py files)",
      "source_root": str(root or stdlib_root()),
      "python_version": platform.python_version(),
      "python_implementation": sys.implementation.name,
      "licence": "Python Software Foundation License Version 2 (PSF-2.0)",
      "config": dataclasses.asdict(cfg),
      "splits": {name: {"documents": len(docs), "chars": sum(len(d["text"]) for d in docs)}
                 for name, docs in splits.items()},
      "long_test_paths": [d["path"] for d in splits["long_test"]],
  }
  (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
  return out_dir


def load_corpus(corpus_dir: str | os.PathLike) -> datasets.DatasetDict:
  import datasets

  corpus_dir = Path(corpus_dir)
  if not (corpus_dir / "dataset_dict.json").exists():
    raise FileNotFoundError(
        f"no corpus at {corpus_dir} (expected a datasets.DatasetDict saved there); build it with "
        f"`longspec corpus --out {corpus_dir}`")
  return datasets.load_from_disk(str(corpus_dir))


def tokenize_split(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
  """Concatenates documents into one token stream, each followed by EOS (uint16 when the vocab fits)."""
  ids = []
  for enc in tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else map(tokenizer.encode, texts):
    ids.extend(enc.ids if hasattr(enc, "ids") else enc)
    ids.append(eos_id)
  dtype = np.uint16 if tokenizer.get_vocab_size() <= 65535 else np.int32
  return np.asarray(ids, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """Random fixed-length windows of a token stream; batch for step s depends only on (seed, s), so a resumed
  run sees exactly the batches an uninterrupted one would."""

  tokens: np.ndarray
  seed: int = 0

  def batch(self, step: int, batch_size: int, seq_len: int, rows: slice = slice(None)) -> np.ndarray:
    """Rows `rows` of step `step`'s [batch_size, seq_len + 1] batch (a process builds only its own)."""
    n = len(self.tokens) - seq_len - 1
    if n <= 0:
      raise ValueError(f"token stream of {len(self.tokens)} tokens is shorter than seq_len+1={seq_len + 1}")
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, n, size=batch_size)[rows]
    return np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)
