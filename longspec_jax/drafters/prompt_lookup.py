"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's last n tokens and propose
the tokens that followed it. Static shapes: every candidate position is scored at once over the token buffer."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter, one_hot_probs
from longspec_jax.drafters.registry import DrafterEntry

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer

DRAFTERS = (DrafterEntry(name="prompt-lookup", loader="load_prompt_lookup"),)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(DrafterSpec):
  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  name: str = "prompt-lookup"
  taps: tuple = ()
  needs_target_kv: bool = False
  max_draft_tokens = None  # any K: the continuation repeats past the sequence end
  catch_up_in_propose = False  # no state: it reads the token buffer
  proposal_cost_scale = (0.0,)  # draft_length: a search of the token buffer, no model pass


  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  @property
  def draft_classes(self) -> int:
    """draft_length keeps one acceptance rate per matched n-gram length (0 = no match)."""
    return self.max_ngram + 1

  def draft_class(self, ctx: ProposeContext, params: Any = None) -> jax.Array:
    return self.lookup(ctx, 1)[1]

  def init_state(self, params: Any, prefill: PrefillResult, max_len: int) -> tuple[()]:
    return ()  # stateless: the token buffer is all it reads

  def propose(self, params: Any, state: tuple[()], ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, tuple[()]]:
    drafts, _ = self.lookup(ctx, num_draft)
    probs = one_hot_probs(drafts, self.vocab_size) if sample else None
    return drafts, probs, state

  def lookup(self, ctx: ProposeContext, num_draft: int) -> tuple[jax.Array, jax.Array]:
    """(drafts [B, K], matched n-gram length [B]; 0 = no match, drafts repeat the last token)."""
    tokens, n_tok = ctx.tokens, ctx.num_tokens
    b, s_max = tokens.shape
    j = jnp.arange(s_max)[None, :]  # candidate end position of an earlier n-gram occurrence
    best = jnp.full((b,), -1, jnp.int32)
    matched = jnp.zeros((b,), jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest n-gram wins
      match = (j >= n - 1) & (j < n_tok[:, None] - 1)  # strictly before the suffix itself
      for i in range(n):
        suffix_tok = jnp.take_along_axis(tokens, jnp.maximum(n_tok - 1 - i, 0)[:, None], axis=1)
        match &= jnp.roll(tokens, i, axis=1) == suffix_tok
      match &= (n_tok[:, None] >= n)
      latest = jnp.max(jnp.where(match, j, -1), axis=1)
      matched = jnp.where((best < 0) & (latest >= 0), n, matched)
      best = jnp.where(best >= 0, best, latest)
    # Continue after the match. A match that ends `period` tokens before the sequence end is a repeat with that
    # period, so past the sequence end the continuation keeps repeating it (draft i = draft i - period).
    period = jnp.maximum(n_tok - 1 - best, 1)[:, None]
    idx = best[:, None] + 1 + jnp.arange(num_draft)[None, :] % period
    last = jnp.take_along_axis(tokens, (n_tok - 1)[:, None], axis=1)
    cand = jnp.take_along_axis(tokens, jnp.clip(idx, 0, s_max - 1), axis=1)
    return jnp.where(best[:, None] >= 0, cand, last).astype(jnp.int32), matched

  def search(self, params: Any, ctx: ProposeContext, num_draft: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(drafts [B, K], matched n-gram length [B], draft class [B]: the same), as the suffix drafter's search."""
    drafts, matched = self.lookup(ctx, num_draft)
    return drafts, matched, matched

  def update(self, params: Any, state: tuple[()], verify: VerifyResult) -> tuple[()]:
    return state


def load_prompt_lookup(drafter_dir: str | os.PathLike | None, target: Transformer) -> LoadedDrafter:
  del drafter_dir  # no checkpoint: it reads only the token buffer
  return LoadedDrafter(PromptLookupDrafter(target.cfg.vocab_size))
