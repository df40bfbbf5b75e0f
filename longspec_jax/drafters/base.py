"""The drafter protocol every method implements, and the records the engine passes to it.

A drafter is a hashable, static object (its config and graph); its parameters travel separately as a pytree, and
its per-sequence state is an explicit fixed-shape pytree carried through the engine's `lax.while_loop`:

  state = drafter.init_state(params, prefill)                      # after the target's prefill
  tokens, probs, state = drafter.propose(params, state, ctx, key)  # K drafts (+ [B, K, V] probs when sampling)
  state = drafter.update(params, state, verify)                    # after the target verified them
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from longspec_jax.drafters.registry import DEFAULT_NUM_DRAFT
from longspec_jax.sampling import SamplingParams


@flax.struct.dataclass
class PrefillResult:
  prompt_tokens: jax.Array  # [B, T] right-padded prompts as the target prefilled them
  tokens: jax.Array  # [B, S_max] token buffer; prompt b occupies [0, prompt_lens[b]) and tokens[b, len] = pending
  prompt_lens: jax.Array  # [B]
  taps: jax.Array | None  # [B, T, n_taps, H] target residual stream at the drafter's requested taps
  new_kv: tuple | None  # target (k, v) rows written by prefill, [L, B, T, Hkv, D] each
  target_cache: Any  # the target KVCache after prefill (lengths = prompt_lens)


@flax.struct.dataclass
class ProposeContext:
  tokens: jax.Array  # [B, S_max] committed tokens
  num_tokens: jax.Array  # [B] committed tokens; tokens[b, num_tokens[b]-1] is the newest (not yet in target KV)
  sampling: SamplingParams

  @property
  def pending(self) -> jax.Array:
    """[B] the newest committed token of each sequence (the one a block drafter anchors its block on)."""
    return jnp.take_along_axis(self.tokens, (self.num_tokens - 1)[:, None], axis=1)[:, 0]


@flax.struct.dataclass
class VerifyResult:
  start: jax.Array  # [B] position of the first verified row (= target cache length before the pass)
  num_accepted: jax.Array  # [B] drafts accepted (0..K)
  committed: jax.Array  # [B, K+1] accepted drafts then the target's bonus/correction token, junk after
  num_committed: jax.Array  # [B] = num_accepted + 1 (0 for sequences already done)
  taps: jax.Array | None  # [B, K+1, n_taps, H] target residual stream at the verified rows
  new_kv: tuple | None  # target (k, v) for the verified rows, [L, B, K+1, Hkv, D] each
  tokens: jax.Array  # [B, S_max] token buffer after the commit
  num_tokens: jax.Array  # [B] committed tokens after the commit


class Drafter(Protocol):
  name: str
  taps: tuple[int, ...]  # target residual-stream indices the drafter reads (() = none)
  needs_target_kv: bool  # whether verify/prefill results must carry the target's written K/V
  vocab_size: int
  max_draft_tokens: int | None  # the most drafts one proposal can hold (a block drafter's block); None: unbounded
  # True when the state catches up on committed tokens only in propose (update is a no-op): a step that verifies
  # no drafts must still call propose (for one draft, discarded). False: update alone keeps the state current.
  catch_up_in_propose: bool
  # Optional abilities: those of a model are declared by the method's registry entry (registry.DrafterEntry):
  # `diagnostics(params, state, ctx) -> dict[str, Array]` (entry.diagnostics; e.g. LongSpark's attention mass per
  # view, recorded by the bench suite) and `attention_logits(params, target, tokens)` (entry.sharpdraft; SharpDraft
  # calibration); those of the engine's use by the spec's class attributes, with DrafterSpec's defaults.

  def init_state(self, params: Any, prefill: PrefillResult, max_len: int) -> Any: ...

  def propose(self, params: Any, state: Any, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, Any]: ...

  def update(self, params: Any, state: Any, verify: VerifyResult) -> Any: ...


class DrafterSpec:
  """The base of every drafter spec: the optional abilities the engine asks a drafter about, declared as class
  attributes (a spec overrides those it has), so nothing is found by probing for methods."""
  # The per-step draft length (inference/draft_length.py): classes whose acceptance differs, known before proposing
  # (`draft_class(ctx, params) -> [B] int32` when more than 1: prompt lookup's matched n-gram length; params are
  # the drafter's, e.g. the suffix drafter's index), and the proposal's
  # cost per class relative to a learned drafter's pass (the last entry repeating). A scale of 0 also declares that
  # the class's proposal reads no drafter state: a step whose active sequences all have such classes (or that
  # drafts nothing) holds its committed rows, and `update` reads them in one call before the next proposal that
  # reads the state (engine.DeferredRows); `update` must therefore accept any number of rows, all committed.
  draft_classes: int = 1
  proposal_cost_scale: tuple[float, ...] = (1.0,)
  # Greedy tree drafting: `propose_tree(params, state, ctx, tree) -> (node tokens [B, N], state)` (EAGLE-3).
  drafts_trees: bool = False
  # One pass over a mask-filled block: `block_logits(params, state, pending, num_draft)` (DFlash, LongSpark, their
  # ensemble), what DeLS corrects.
  drafts_blocks: bool = False


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
  """A drafter's static spec (hashable; a jit static argument) with its parameter pytree (traced)."""
  spec: Drafter
  params: Any = None


def _of_inner(name: str) -> property:
  return property(lambda self: getattr(self.inner, name, None), doc=f"the inner drafter's {name}")


class ReadsLikeInner(DrafterSpec):
  """For a drafter built around another (`inner`): the target reads it asks for are its inner drafter's (taps, K/V
  rows), over the same vocabulary and block limit (None where the inner drafter has none)."""
  taps = _of_inner("taps")
  needs_target_kv = _of_inner("needs_target_kv")
  vocab_size = _of_inner("vocab_size")
  max_draft_tokens = _of_inner("max_draft_tokens")


class ReadsItsConfig(DrafterSpec):
  """For a drafter whose `cfg` names the target taps it reads (`cfg.taps`) and its architecture (`cfg.arch`, whose
  vocabulary it drafts over): DFlash, LongSpark."""

  @property
  def taps(self) -> tuple[int, ...]:
    return self.cfg.taps

  @property
  def vocab_size(self) -> int:
    return self.cfg.arch.vocab_size


def default_num_draft(spec: Drafter) -> int:
  """K when the caller gives none: 8, or the drafter's block limit if smaller (LongSpark drafts at most 7)."""
  limit = max_draft_tokens(spec)
  return DEFAULT_NUM_DRAFT if limit is None else min(DEFAULT_NUM_DRAFT, limit)


def max_draft_tokens(spec: Drafter) -> int | None:
  """The most drafts one proposal of `spec` can hold (its declared `max_draft_tokens`); None = unbounded."""
  return spec.max_draft_tokens


def state_nbytes(state: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)))


def one_hot_probs(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """Deterministic drafters sample from a point mass: q = one-hot."""
  return jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32)
