"""Prompts from text: cut points in held-out documents (the suite) and a file's first tokens (`longspec bench`)."""

from __future__ import annotations

import numpy as np

BATCH_STRIDE = 64  # `bench`: batch element b starts b * BATCH_STRIDE tokens into the file


def select_cuts(doc_lens: list[int], num_prompts: int, min_docs: int, cut_min: int, seed: int) -> list[tuple]:
  """(doc index, end token) per prompt: documents taken round-robin in a seeded order (so >= min_docs of them
  when there are enough), each end uniform in [cut_min, doc length], distinct within a document. The list is
  prefix-stable: asking for more prompts keeps the first ones."""
  eligible = [i for i, n in enumerate(doc_lens) if n >= cut_min]
  if len(eligible) < min_docs:
    raise ValueError(f"only {len(eligible)} document(s) have at least cut_min_tokens = {cut_min} tokens (lengths "
                     f"{doc_lens}); min_docs = {min_docs}")
  rng = np.random.default_rng(seed)
  order = [eligible[i] for i in rng.permutation(len(eligible))]
  cuts, used = [], set()
  for i in range(num_prompts):
    doc = order[i % len(order)]
    if doc_lens[doc] - cut_min + 1 <= sum(d == doc for d, _ in used):
      raise ValueError(f"document {doc} has too few cut points for {num_prompts} prompts")
    while (doc, end := int(rng.integers(cut_min, doc_lens[doc] + 1))) in used:
      pass
    used.add((doc, end))
    cuts.append((doc, end))
  return cuts


def prompt_ids(doc_ids: list[int], end: int, context: int, bos: int | None) -> list[int]:
  """The prompt of `context` tokens (BOS included) that ends at token `end` of a document."""
  head = [bos] if bos is not None else []
  return head + doc_ids[end - (context - len(head)):end]


def bench_prompts(ids: list[int], context: int, batch: int, bos: int | None) -> list[list[int]]:
  """`batch` prompts of `context` tokens (BOS included) from the start of a text, BATCH_STRIDE tokens apart."""
  need = context - (bos is not None) + (batch - 1) * BATCH_STRIDE
  if len(ids) < need:
    raise ValueError(f"the text has {len(ids)} tokens; context {context} with batch {batch} needs {need}")
  head = [bos] if bos is not None else []
  return [head + ids[b * BATCH_STRIDE: b * BATCH_STRIDE + context - len(head)] for b in range(batch)]


def spread_ends(total: int, length: int, count: int) -> list[int]:
  """End positions of up to `count` windows of `length` tokens spread evenly over `total` tokens (the first ends
  at `length`, the last at `total`; windows overlap when the text is short; no duplicates)."""
  if total <= length or count == 1:
    return [min(length, total)]
  return sorted({round(length + (total - length) * i / (count - 1)) for i in range(count)})
