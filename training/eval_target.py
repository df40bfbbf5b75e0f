"""`longspec eval-target`: mean next-token loss per position bucket on long documents, with a unigram baseline."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from longspec_jax.training.losses import per_token_nll

if TYPE_CHECKING:
  from longspec_jax.model import Transformer

BUCKETS = (("0-1K", 0, 1024), ("1-2K", 1024, 2048), ("2-4K", 2048, 4096), ("4-8K", 4096, 8192),
           ("8-16K", 8192, 16384))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _nll(graphdef, params, tokens):
  model = nnx.merge(graphdef, params)
  logits = model(tokens[:, :-1], mode="train").logits
  return per_token_nll(logits, tokens[:, 1:])


def unigram_log_probs(token_arrays: Iterable[Sequence[int] | np.ndarray], vocab_size: int) -> np.ndarray:
  """Add-one smoothed unigram log-probabilities."""
  counts = np.ones(vocab_size, np.float64)
  for ids in token_arrays:
    np.add.at(counts, np.asarray(ids), 1)
  return np.log(counts / counts.sum()).astype(np.float32)


def evaluate_position_buckets(model: Transformer, docs: list[list[int]], unigram: np.ndarray,
                              max_len: int = 16384) -> dict:
  """docs: token lists (BOS included). Each doc is cut to max_len+1 tokens and scored in one causal pass."""
  graphdef, params = nnx.split(model)
  sums = {name: 0.0 for name, *_ in BUCKETS}
  counts = {name: 0 for name, *_ in BUCKETS}
  uni_sum, uni_n = 0.0, 0
  for ids in tqdm(docs, desc="eval-target", dynamic_ncols=True):
    ids = np.asarray(ids[:max_len + 1], np.int32)
    n = len(ids) - 1
    length = 1 << max(int(n - 1).bit_length(), 10)  # bucket shapes so docs share compiled programs
    padded = np.zeros(length + 1, np.int32)
    padded[:n + 1] = ids
    nll = np.asarray(_nll(graphdef, params, jnp.asarray(padded[None])))[0, :n]
    for name, lo, hi in BUCKETS:
      seg = nll[lo:min(hi, n)]
      sums[name] += float(seg.sum())
      counts[name] += int(seg.size)
    uni_sum += float(-unigram[ids[1:]].sum())
    uni_n += n
  result = {name: (sums[name] / counts[name] if counts[name] else None) for name, *_ in BUCKETS}
  result["unigram"] = uni_sum / max(uni_n, 1)
  result["mean"] = sum(sums.values()) / max(sum(counts.values()), 1)
  result["tokens_per_bucket"] = counts
  return result


def load_unigram(model_dir: Path, vocab_size: int) -> np.ndarray | None:
  path = Path(model_dir) / "unigram.npy"
  if not path.exists():
    return None
  u = np.load(path)
  if u.shape != (vocab_size,):
    raise ValueError(f"{path} has shape {u.shape}, expected ({vocab_size},)")
  return u
