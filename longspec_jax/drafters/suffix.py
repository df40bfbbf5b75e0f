"""Suffix drafting with memory: the longest match of the sequence's suffix in the prompt and output (prompt
lookup's search, longer n-grams) and in a global n-gram index over a corpus and past outputs
(longspec_jax/suffix_index.py), the stronger candidate proposing.

The index travels as the drafter's parameters (a pytree of four [slots] arrays, traced: a new index of the same
size does not recompile), and is searched in-graph each step: per draft position one hash and one gather per
context order, the drafted tokens extending the context (a chain of most-frequent continuations). No host round
trip per step, so it stays inside the engine's one `while_loop` on an accelerator as on CPU.

Choice per sequence and step: the local match of m_l tokens scores m_l + local_bonus (a repeat in the same
document is worth more than a corpus n-gram of the same length); the index's longest context of m_g tokens whose
most frequent continuation has probability >= min_prob scores m_g; the higher score proposes. Draft classes (for
the per-step length rule, inference/draft_length.py): 0 = no match, 1..local_max = the local match length,
local_max + i = the index matched its i-th order; the rule then sizes drafts from each class's running acceptance.
Lossless: the proposal depends only on committed tokens and the index.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter, one_hot_probs
from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.suffix_index import CHECK_SEED, ORDER_STEP, PRIME, SLOT_SEED, SuffixIndex, load_index

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer

DRAFTERS = (DrafterEntry(name="suffix", loader="load_suffix", options=("suffix_index",)),)


def _mix(h: jax.Array) -> jax.Array:
  """suffix_index._mix in jnp (uint32 arithmetic wraps the same way)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def context_hashes(windows: jax.Array, order: int) -> tuple[jax.Array, jax.Array]:
  """suffix_index.context_hashes on device: (slot hash, check) of windows [..., order]."""
  w = windows.astype(jnp.uint32)
  h1 = jnp.full(w.shape[:-1], (SLOT_SEED + order * ORDER_STEP) % 2 ** 32, jnp.uint32)
  h2 = jnp.full(w.shape[:-1], (CHECK_SEED + order * ORDER_STEP) % 2 ** 32, jnp.uint32)
  for i in range(order):
    h1 = (h1 ^ w[..., i]) * jnp.uint32(PRIME)
    h2 = (h2 ^ w[..., i]) * jnp.uint32(PRIME)
  return _mix(h1), _mix(h2) | jnp.uint32(1)


def index_params(index: SuffixIndex) -> dict[str, jax.Array]:
  """The drafter's parameters: the index's table on device."""
  return {name: jnp.asarray(a) for name, a in index.arrays().items()}


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(DrafterSpec):
  vocab_size: int
  orders: tuple[int, ...] = ()  # the index's context lengths (() = no index: the prompt and output only)
  local_max: int = 8  # the longest n-gram matched in the prompt and output
  local_bonus: int = 2  # added to a local match's length when it competes with the index's
  min_prob: float = 0.25  # an index continuation proposes when count / total reaches this
  name: str = "suffix"
  taps: tuple = ()
  needs_target_kv: bool = False
  max_draft_tokens = None
  catch_up_in_propose = False
  proposal_cost_scale = (0.0,)  # a search of the buffer and a few gathers per draft, no model pass

  def __post_init__(self):
    if self.local_max < 1 or self.local_bonus < 0 or not 0 <= self.min_prob <= 1:
      raise ValueError(f"need local_max >= 1, local_bonus >= 0, 0 <= min_prob <= 1; got {self.local_max}, "
                       f"{self.local_bonus}, {self.min_prob}")
    if list(self.orders) != sorted(set(self.orders)) or (self.orders and self.orders[0] < 1):
      raise ValueError(f"orders must be ascending distinct context lengths >= 1, got {self.orders}")

  @property
  def local(self) -> PromptLookupDrafter:
    return PromptLookupDrafter(self.vocab_size, max_ngram=self.local_max)

  @property
  def max_ngram(self) -> int:
    """The longest match length `search` reports (the hybrid's min_match ranges up to it)."""
    return max(self.local_max, *self.orders) if self.orders else self.local_max

  @property
  def draft_classes(self) -> int:
    return 1 + self.local_max + len(self.orders)

  def draft_class(self, ctx: ProposeContext, params: Any = None) -> jax.Array:
    return self.search(params, ctx, 1)[2]

  def init_state(self, params: Any, prefill: PrefillResult, max_len: int) -> tuple[()]:
    return ()

  def propose(self, params: Any, state: tuple[()], ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, tuple[()]]:
    drafts = self.search(params, ctx, num_draft)[0]
    return drafts, one_hot_probs(drafts, self.vocab_size) if sample else None, state

  def update(self, params: Any, state: tuple[()], verify: VerifyResult) -> tuple[()]:
    return state

  def search(self, params: Any, ctx: ProposeContext, num_draft: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(drafts [B, K], match length [B] of the proposing source (0 = none), draft class [B])."""
    drafts, m_local = self.local.lookup(ctx, num_draft)
    if not self.orders:
      return drafts, m_local, m_local
    g_drafts, g_order = self.index_chain(params, ctx.tokens, ctx.num_tokens, num_draft)
    m_global = jnp.asarray((0,) + self.orders, jnp.int32)[g_order]
    use_global = m_global > jnp.where(m_local > 0, m_local + self.local_bonus, 0)
    drafts = jnp.where(use_global[:, None], g_drafts, drafts)
    return (drafts, jnp.where(use_global, m_global, m_local),
            jnp.where(use_global, self.local_max + g_order, m_local))

  def index_chain(self, index: dict[str, jax.Array], tokens: jax.Array, num_tokens: jax.Array,
                  num_draft: int) -> tuple[jax.Array, jax.Array]:
    """(drafts [B, K] chained from the index, the order index (1-based, 0 = none) matched for the first draft)."""
    m = self.orders[-1]
    mask = jnp.uint32(index["check"].shape[0] - 1)
    pos = num_tokens[:, None] - m + jnp.arange(m)[None, :]
    window = jnp.take_along_axis(tokens, jnp.clip(pos, 0, tokens.shape[1] - 1), axis=1)

    def next_token(carry, _):
      window, avail = carry
      tok, found = window[:, -1], jnp.zeros(window.shape[:1], jnp.int32)
      for i, o in enumerate(self.orders):  # the longest context that hits wins
        slot, check = context_hashes(window[:, m - o:], o)
        slot = (slot & mask).astype(jnp.int32)
        total = index["total"][slot]
        hit = ((index["check"][slot] == check) & (avail >= o) & (total > 0)
               & (index["count"][slot].astype(jnp.float32) >= self.min_prob * total.astype(jnp.float32)))
        tok = jnp.where(hit, index["next"][slot], tok)
        found = jnp.where(hit, i + 1, found)
      window = jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)
      return (window, avail + 1), (tok, found)

    _, (toks, found) = jax.lax.scan(next_token, (window, num_tokens), None, length=num_draft)
    return toks.T.astype(jnp.int32), found[0]


def load_suffix(drafter_dir: str | os.PathLike | None, target: Transformer,
                suffix_index: str | os.PathLike | SuffixIndex | None = None) -> LoadedDrafter:
  """The suffix drafter for `target`; `suffix_index`: an index file (checked against the target's vocabulary
  size; `suffix_index.load_index(path, tokenizer=tok)` also checks the tokenizer) or a loaded SuffixIndex. None:
  the prompt and output only."""
  del drafter_dir  # no checkpoint
  return with_index(SuffixDrafter(target.cfg.vocab_size), suffix_index)


def with_index(spec: SuffixDrafter, suffix_index: str | os.PathLike | SuffixIndex | None) -> LoadedDrafter:
  """`spec` reading `suffix_index` (a file or a SuffixIndex; None: no index)."""
  if suffix_index is None:
    return LoadedDrafter(dataclasses.replace(spec, orders=()))
  index = suffix_index if isinstance(suffix_index, SuffixIndex) else load_index(suffix_index, spec.vocab_size)
  if index.vocab_size != spec.vocab_size:
    raise ValueError(f"the suffix index is for a vocabulary of {index.vocab_size} tokens, not {spec.vocab_size}")
  return LoadedDrafter(dataclasses.replace(spec, orders=index.orders), index_params(index))
