"""Hybrid drafting: prompt lookup (or the suffix drafter with a global index) where the sequence repeats itself or
the index knows its context, a learned drafter elsewhere.

Per sequence and step, the n-gram match over the prompt and everything generated (prompt lookup's longest match,
up to `max_ngram` tokens; with `suffix_index=FILE` the suffix drafter's stronger match of the buffer and the index)
proposes when it matched at least `min_match` tokens; otherwise the learned drafter
(`learned=`: EAGLE-3 by default, or any drafter with a checkpoint; the shipped one or `drafter_dir`) proposes.
When every sequence in the batch has a match, the learned drafter's proposal is skipped altogether (`lax.cond`),
and with a draft-length rule so is its update: the engine holds the step's committed rows (its lookup classes
declare a proposal cost of 0: the proposal reads no drafter state) and the learned drafter reads them in one
update before it next proposes. Drafters that catch up only in `propose` (catch_up_in_propose) always propose.

The match is recomputed on device from the token buffer each step (no host-side suffix structure, so no host
round trip per step: it stays inside the engine's one `while_loop` on TPU as on CPU); its cost is one compare per
buffer position and n-gram length, small next to a target pass. Lossless: the choice depends only on committed
tokens, and each row's q is the proposing part's (one-hot for the lookup).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from longspec_jax.drafters.base import LoadedDrafter, ReadsLikeInner, one_hot_probs
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.drafters.suffix import SuffixDrafter, with_index

if TYPE_CHECKING:
  from longspec_jax.drafters.base import Drafter, PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer
  from longspec_jax.suffix_index import SuffixIndex

# checkpoint: the default learned drafter's (EAGLE-3); `learned=NAME` swaps in any drafter with a checkpoint.
DRAFTERS = (DrafterEntry(name="hybrid", loader="load_hybrid", checkpoint="eagle3",
                         options=("learned", "suffix_index"), architectures=("LlamaForCausalLMEagle3",)),)


@dataclasses.dataclass(frozen=True)
class HybridDrafter(ReadsLikeInner):
  lookup: PromptLookupDrafter | SuffixDrafter  # the first source (its `search`)
  learned: Any  # the learned drafter's spec
  min_match: int = 2  # the n-gram length from which the lookup proposes
  name: str = "hybrid"

  def __post_init__(self):
    if not 1 <= self.min_match <= self.lookup.max_ngram:
      raise ValueError(f"min_match must be in [1, {self.lookup.max_ngram}] (the lookup's longest n-gram), got "
                       f"{self.min_match}")

  @property
  def lookup_has_params(self) -> bool:
    """The params are (the lookup's index, the learned drafter's) when the lookup reads an index."""
    return bool(getattr(self.lookup, "orders", ()))

  def split_params(self, params: Any) -> tuple[Any, Any]:
    return params if self.lookup_has_params else (None, params)

  @property
  def inner(self) -> Drafter:
    return self.learned

  @property
  def catch_up_in_propose(self) -> bool:
    return self.learned.catch_up_in_propose

  @property
  def draft_classes(self) -> int:
    """draft_length rates: class 0 = the learned drafter proposes, n >= min_match = the lookup matched n tokens."""
    return self.lookup.draft_classes

  def draft_class(self, ctx: ProposeContext, params: Any = None) -> jax.Array:
    _, matched, cls = self.lookup.search(self.split_params(params)[0], ctx, 1)
    return jnp.where(matched >= self.min_match, cls, 0)

  @property
  def proposal_cost_scale(self) -> tuple[float, ...]:
    """Class 0 pays the learned pass; the lookup classes skip it unless the learned drafter must always propose."""
    return (1.0,) if self.learned.catch_up_in_propose else (1.0, 0.0)

  def init_state(self, params: Any, prefill: PrefillResult, max_len: int) -> Any:
    return self.learned.init_state(self.split_params(params)[1], prefill, max_len)

  def propose(self, params: Any, state: Any, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, Any]:
    lookup_params, params = self.split_params(params)
    found, matched, _ = self.lookup.search(lookup_params, ctx, num_draft)
    use_lookup = matched >= self.min_match  # [B]
    found_q = one_hot_probs(found, self.vocab_size) if sample else None

    def learned(_):
      return self.learned.propose(params, state, ctx, key, num_draft, sample)

    def lookup_only(_):
      return found, found_q, state

    if self.learned.catch_up_in_propose:
      drafts, q, state = learned(None)
    else:
      drafts, q, state = jax.lax.cond(jnp.all(use_lookup), lookup_only, learned, None)
    drafts = jnp.where(use_lookup[:, None], found, drafts)
    if sample:
      q = jnp.where(use_lookup[:, None, None], found_q, q)
    return drafts, q, state

  def update(self, params: Any, state: Any, verify: VerifyResult) -> Any:
    return self.learned.update(self.split_params(params)[1], state, verify)


def load_hybrid(drafter_dir: str | os.PathLike | None, target: Transformer, learned: str = "eagle3",
                suffix_index: str | os.PathLike | SuffixIndex | None = None) -> LoadedDrafter:
  """Prompt lookup + the `learned` method's drafter at `drafter_dir` (the one shipped for the target by default):
  EAGLE-3, or any block or chain drafter with a checkpoint (dflash, longspark, pard, dels, budget...). With
  `suffix_index` (a file or a SuffixIndex) the suffix drafter reading it replaces prompt lookup."""
  from longspec_jax.drafters import load_drafter
  part = load_drafter(learned, target, drafter_dir)
  if suffix_index is None:
    return LoadedDrafter(HybridDrafter(PromptLookupDrafter(target.cfg.vocab_size), part.spec), part.params)
  lookup = with_index(SuffixDrafter(target.cfg.vocab_size), suffix_index)
  return LoadedDrafter(HybridDrafter(lookup.spec, part.spec), (lookup.params, part.params))
