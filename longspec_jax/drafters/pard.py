"""Standalone drafter: a small LM of the target's tokenizer with its own static KV cache.

classic: K sequential single-token steps. pard: the last committed tokens followed by mask tokens, one forward
gives all K drafts (PARD; the drafter must be trained with the mask-group objective).

Every propose re-feeds the last K+1 committed tokens at their own positions. At most K+1 tokens are committed per
verification, so this rewrites every drafter cache row that held a draft or a mask: no update step is needed,
and the state is only the fixed-size drafter cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.kv_cache import KVCache
from longspec_jax.sampling import processed_log_probs
from longspec_jax.sharpdraft import SharpDraft

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.kv_cache import KVCache
  from longspec_jax.model import Transformer
  from longspec_jax.sampling import SamplingParams

MODES = ("classic", "pard")
DRAFTERS = (
    DrafterEntry(name="standalone", loader="load_classic", checkpoint="pard", sharpdraft=True,
                 architectures=("Qwen3ForCausalLM", "LlamaForCausalLM")),
    DrafterEntry(name="pard", loader="load_pard", checkpoint="pard", sharpdraft=True,
                 architectures=("Qwen3ForCausalLM", "LlamaForCausalLM"),
                 trainer="longspec_jax.training.train_pard:PardTrainConfig:train_pard"),
)


def pick_token(logits: jax.Array, key: jax.Array, sp: SamplingParams,
               sample: bool) -> tuple[jax.Array, jax.Array | None]:
  """Greedy draft (no probabilities), or a sample from the processed distribution with its probabilities q."""
  if not sample:
    return jnp.argmax(logits, -1).astype(jnp.int32), None
  logq = processed_log_probs(logits, sp)
  return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), jnp.exp(logq)


@dataclasses.dataclass(frozen=True)
class StandaloneDrafter(DrafterSpec):
  graphdef: nnx.GraphDef
  vocab_size: int
  mode: str = "classic"
  mask_token_id: int | None = None
  name: str = "standalone"
  taps: tuple = ()
  needs_target_kv: bool = False
  sharpdraft: SharpDraft | None = None
  max_draft_tokens = None  # any K: classic mode drafts one token per step, PARD appends K - 1 masks
  catch_up_in_propose = True  # propose re-reads the newest committed tokens; update does nothing

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"standalone drafter mode must be one of {MODES}, got {self.mode!r}")
    if self.mode == "pard" and self.mask_token_id is None:
      raise ValueError("PARD mode needs a mask_token_id")

  def init_state(self, params: nnx.State, prefill: PrefillResult, max_len: int) -> KVCache:
    model = nnx.merge(self.graphdef, params)
    b = prefill.tokens.shape[0]
    out = model(prefill.prompt_tokens, cache=model.init_cache(b, max_len), mode="prefill", return_logits=False,
                sharpdraft=self.sharpdraft)
    return out.cache

  def attention_logits(self, params: nnx.State, target: Transformer, tokens: jax.Array) -> list[jax.Array]:
    """Pre-softmax logits [B, Hq, 1, N] per drafter layer of the query that sees all N = T keys of `tokens`."""
    del target  # a standalone drafter reads only tokens
    return nnx.merge(self.graphdef, params).last_query_attention_logits(tokens)

  def _window(self, ctx, k, extra: int):
    """Last K+1 committed tokens (+ `extra` mask slots) at their own positions, clamped to start at 0."""
    n_tok = ctx.num_tokens
    start = jnp.maximum(n_tok - (k + 1), 0)
    pos = start[:, None] + jnp.arange(k + 1 + extra)[None, :]
    toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos, ctx.tokens.shape[1] - 1), axis=1)
    fill = self.mask_token_id if self.mode == "pard" else 0
    toks = jnp.where(pos < n_tok[:, None], toks, fill)
    return toks, pos, n_tok - 1 - start  # index of the newest committed token inside the window

  def propose(self, params: nnx.State, state: KVCache, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, KVCache]:
    model = nnx.merge(self.graphdef, params)
    k = num_draft
    keys = jax.random.split(key, k)
    if self.mode == "pard":
      toks, pos, last = self._window(ctx, k, extra=k - 1)
      out = model(toks, cache=state, positions=pos, mode="extend",
                  logits_at=last[:, None] + jnp.arange(k)[None, :], sharpdraft=self.sharpdraft)
      drafts, probs = [], []
      for i in range(k):
        d, q = pick_token(out.logits[:, i], keys[i], ctx.sampling, sample)
        drafts.append(d)
        probs.append(q)
      cache = out.cache
    else:
      toks, pos, last = self._window(ctx, k, extra=0)
      out = model(toks, cache=state, positions=pos, mode="extend", logits_at=last[:, None],
                  sharpdraft=self.sharpdraft)
      d, q = pick_token(out.logits[:, 0], keys[0], ctx.sampling, sample)
      drafts, probs, cache = [d], [q], out.cache
      for i in range(1, k):
        p = (ctx.num_tokens + i - 1)[:, None]
        out = model(drafts[-1][:, None], cache=cache, positions=p, mode="extend", sharpdraft=self.sharpdraft)
        d, q = pick_token(out.logits[:, 0], keys[i], ctx.sampling, sample)
        drafts.append(d)
        probs.append(q)
        cache = out.cache
    drafts = jnp.stack(drafts, axis=1)
    return drafts, (jnp.stack(probs, axis=1) if sample else None), cache

  def update(self, params: nnx.State, state: KVCache, verify: VerifyResult) -> KVCache:
    return state


def standalone_from_model(model: Transformer, mode: str = "classic", mask_token_id: int | None = None,
                          sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  graphdef, params = nnx.split(model)
  if sharpdraft is not None and sharpdraft.num_layers != model.cfg.num_hidden_layers:
    raise ValueError(f"SharpDraft is calibrated for {sharpdraft.num_layers} layers, the drafter has "
                     f"{model.cfg.num_hidden_layers}; recalibrate with `longspec calibrate-sharpdraft`")
  spec = StandaloneDrafter(graphdef=graphdef, vocab_size=model.cfg.vocab_size, mode=mode,
                           mask_token_id=mask_token_id if mask_token_id is not None else model.cfg.mask_token_id,
                           sharpdraft=sharpdraft)
  return LoadedDrafter(spec, params)


def load_standalone(drafter_dir: str | os.PathLike, mode: str = "classic",
                    sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  from longspec_jax.hf_io import load_model_dir
  drafter_dir = Path(drafter_dir)
  meta_path = drafter_dir / "drafter.json"
  meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
  model = load_model_dir(drafter_dir)
  return standalone_from_model(model, mode, meta.get("mask_token_id"), sharpdraft)


def _for_target(loaded: LoadedDrafter, drafter_dir: str | os.PathLike, target: Transformer | None) -> LoadedDrafter:
  """A standalone drafter reads only tokens: any HF Llama / Qwen3 checkpoint serves, given the target's vocabulary
  (said here, naming the checkpoint, rather than when generation starts)."""
  if target is not None and loaded.spec.vocab_size != target.cfg.vocab_size:
    raise ValueError(f"drafter checkpoint {drafter_dir} has a {loaded.spec.vocab_size}-token vocabulary, the target "
                     f"{target.cfg.vocab_size}: a standalone drafter must use the target's tokenizer")
  return loaded


def load_classic(drafter_dir: str | os.PathLike, target: Transformer,
                 sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  return _for_target(load_standalone(drafter_dir, "classic", sharpdraft), drafter_dir, target)


def load_pard(drafter_dir: str | os.PathLike, target: Transformer,
              sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  return _for_target(load_standalone(drafter_dir, "pard", sharpdraft), drafter_dir, target)


# ---------------------------------------------------------------- the training-time forward (trainers and tests)

def pard_forward(model: Transformer, batch: dict, num_masks: int, mask_id: int) -> tuple[jax.Array, jax.Array]:
  """(next-token logits [B, C, V], mask logits [B, A, K-1, V]) for a batch from WindowSampler."""
  toks, anchors = batch["tokens"], batch["anchors"]
  b, c = toks.shape[0], toks.shape[1] - 1
  a = anchors.shape[1]
  cache = model.init_cache(b, c + num_masks)
  out = model(toks[:, :c], cache=cache, mode="prefill")
  # One cache copy per anchor; its length a+1 hides every key after the anchor.
  rep = lambda bufs: tuple(jnp.repeat(x, a, axis=0) for x in bufs)
  group_cache = KVCache(k=rep(out.cache.k), v=rep(out.cache.v), lengths=(anchors + 1).reshape(b * a))
  masks = jnp.full((b * a, num_masks), mask_id, jnp.int32)
  mask_logits = model(masks, cache=group_cache, mode="extend").logits
  return out.logits, mask_logits.reshape(b, a, num_masks, -1)
