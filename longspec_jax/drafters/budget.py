"""BudgetDraft: a drafter that reads a sparse KV cache under a fixed budget; a standalone drafter (classic mode,
`budget`) or a DFlash block drafter over its context K/V (`dflash-budget`, see DFlashBudgetDrafter).

After its own full-attention prefill of the prompt, the drafter keeps, per layer and KV head, `budget // 8` chunks
of 8 prompt keys: chunk 0 (the attention sink), optionally the most recent chunk, and the chunks whose mean key
scores highest against the last prompt token's key. Kept keys keep their original RoPE. Rows at positions >= the
prompt length (the pending token, committed tokens, drafts) go to a dense tail. The target keeps its full cache.

Selection is made once, after prefill (as in the BudgetDraft code). A prompt no longer than the budget is kept
whole. `keep_recent=True` always keeps the chunk holding the newest prompt key, partial or not (the issue's
recommendation); `keep_recent=False` is the paper's rule: the incomplete last chunk is dropped and every full
chunk but the sink competes on score.

The tail is a ring of `tail_tokens` rows (slot = position mod tail_tokens, each slot records its position), so
the state has one fixed shape whatever the prompt and generation lengths: budget + tail rows per layer. While
fewer than tail_tokens - 2K tokens have been generated it is exactly a dense tail; past that the drafter sees
the most recent generated rows only.

Like `StandaloneDrafter`, every propose re-feeds the last K+1 committed tokens (from the prompt length on) at their
own positions, which rewrites every tail row that held a draft: `update` is a no-op.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.attention import causal_attention, dense_masked_attention
from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
from longspec_jax.drafters.dflash import DFlashDrafter, DFlashModel, train_block_logits, train_context_kv
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.drafters.pard import pick_token
from longspec_jax.rope import rope_frequencies
from longspec_jax.pallas_kernels.length_masked_attention import (length_masked_attention, merge_attention_views,
                                                                 select_chunks)
from longspec_jax.pallas_kernels.length_masked_attention.reference import chunk_key_mask
from longspec_jax.pallas_kernels.sparse_kv_gather import chunk_positions, gather_kv_chunks

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer

CHUNK = 8  # tokens per selectable chunk (the paper's chunk size)
_LAST = 2 ** 30  # sorts empty slots (-1) after every real chunk index
# `--drafter assets/drafters/pard` runs the same rule on the untrained (not multi-view) drafter. `dflash-budget`
# reads the shipped DFlash checkpoint (naive sparse) unless `--drafter` names a multi-view fine-tune.
DRAFTERS = (DrafterEntry(name="budget", loader="load_for_target", checkpoint="budget", options=("budget",),
                         architectures=("Qwen3ForCausalLM", "LlamaForCausalLM"),
                         trainer="longspec_jax.training.train_budget:BudgetTrainConfig:train_budget"),
            DrafterEntry(name="dflash-budget", loader="load_dflash_budget", checkpoint="dflash",
                         architectures=("DFlashDraftModel",),
                         options=("budget", "draft_vocab"),
                         trainer="longspec_jax.training.train_dflash_budget:DFlashBudgetTrainConfig:"
                                 "train_dflash_budget"),)


@flax.struct.dataclass
class BudgetState:
  k_sel: jax.Array  # [L, B, budget, Hkv, D] selected prompt keys, ascending positions; valid rows form a prefix
  v_sel: jax.Array  # [L, B, budget, Hkv, D]
  num_sel: jax.Array  # [B] valid rows of k_sel/v_sel (the same for every layer and KV head)
  k_tail: jax.Array  # [L, B, W, Hkv, D] rows at positions >= prompt_lens, slot = position % W
  v_tail: jax.Array  # [L, B, W, Hkv, D]
  tail_pos: jax.Array  # [B, W] position each tail slot holds (-1 = empty)
  prompt_lens: jax.Array  # [B]


def check_budget(budget: int) -> None:
  if not isinstance(budget, int) or budget < 2 * CHUNK or budget % CHUNK:
    raise ValueError(f"budget must be a multiple of {CHUNK} and >= {2 * CHUNK} (the sink chunk plus at least one "
                     f"more), got {budget!r}")


def selection_lengths(prompt_lens: jax.Array, budget: int | jax.Array, keep_recent: bool) -> jax.Array:
  """Prompt keys the selection may draw from: all of them, or (paper rule, prompt over budget) full chunks only."""
  if keep_recent:
    return prompt_lens
  return jnp.where(prompt_lens <= budget, prompt_lens, prompt_lens // CHUNK * CHUNK)


def select_budget_chunks(k: jax.Array, prompt_lens: jax.Array, budget: int, keep_recent: bool = True,
                         num_chunks: jax.Array | None = None) -> jax.Array:
  """Chunk indices kept for one layer: [B, Hkv, budget // 8] int32 in rank order (sink, recent chunk, then the
  best-scoring first), -1 = empty. k [B, S, Hkv, D] are the layer's prompt keys (S a multiple of 8).

  score(c) = k[P-1] . mean(k over the valid keys of chunk c) per KV head; the proxy is the last prompt token's key
  even when the paper rule drops its (partial) chunk. Prompts up to the budget keep every chunk. `num_chunks` [B]
  (<= budget // 8, traced) keeps only that many slots: training draws the budget per step under one compile, and
  the top-n of a ranking is the prefix of its top-m."""
  b, s, hkv, _ = k.shape
  n_sel = budget // CHUNK
  used = jnp.full((b,), n_sel, jnp.int32) if num_chunks is None else num_chunks
  window = 1 if keep_recent else 0
  top_k = max(0, min(n_sel - 1 - window, s // CHUNK - 1))
  proxy = jnp.take_along_axis(k, (prompt_lens - 1)[:, None, None, None], axis=1)  # [B, 1, Hkv, D]
  # select_chunks scores chunks by the mean query of a KV group: one query per KV head = the proxy key itself.
  idx = select_chunks(proxy, k, selection_lengths(prompt_lens, used * CHUNK, keep_recent), chunk_size=CHUNK,
                      top_k=top_k, window_chunks=window)
  idx = jnp.pad(idx, ((0, 0), (0, 0), (0, n_sel - idx.shape[-1])), constant_values=-1)
  return jnp.where(jnp.arange(n_sel) < used[:, None, None], idx, -1)


def sorted_chunks(idx: jax.Array) -> jax.Array:
  """Ascending chunk order with empty slots last, so the valid rows of a gathered buffer form a prefix."""
  s = jnp.sort(jnp.where(idx < 0, _LAST, idx), axis=-1)
  return jnp.where(s == _LAST, -1, s)


def sparse_prompt_view(ks: Sequence[jax.Array], vs: Sequence[jax.Array], prompt_lens: jax.Array, budget: int,
                       keep_recent: bool) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
  """Per layer, the prompt keys / values [B, S, Hkv, D] (S a multiple of 8) cut to the chunks the budget keeps:
  (k_sel list, v_sel list, num_sel [B]), each k_sel [B, budget, Hkv, D] with its valid rows a prefix."""
  k_sel, v_sel = [], []
  for k_layer, v_layer in zip(ks, vs):
    idx = sorted_chunks(select_budget_chunks(k_layer, prompt_lens, budget, keep_recent))
    k, v = gather_kv_chunks(k_layer, v_layer, idx, chunk_size=CHUNK)
    k_sel.append(k)
    v_sel.append(v)
  pos = chunk_positions(idx, CHUNK)[:, 0]  # identical counts on every layer and head
  sel_len = selection_lengths(prompt_lens, budget, keep_recent)
  return k_sel, v_sel, jnp.sum((pos >= 0) & (pos < sel_len[:, None]), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class BudgetDrafter(DrafterSpec):
  graphdef: nnx.GraphDef
  vocab_size: int
  budget: int = 256
  keep_recent: bool = True
  tail_tokens: int = 256
  name: str = "budget"
  taps: tuple = ()
  needs_target_kv: bool = False
  max_draft_tokens = None  # any K: one token per step
  catch_up_in_propose = True  # propose re-reads the newest committed tokens; update does nothing

  def __post_init__(self):
    check_budget(self.budget)
    if self.tail_tokens < 1:
      raise ValueError(f"tail_tokens must be >= 1, got {self.tail_tokens}")

  def init_state(self, params: nnx.State, prefill: PrefillResult, max_len: int) -> BudgetState:
    del max_len  # the state's size depends on the budget and the tail, never on the sequence length
    model = nnx.merge(self.graphdef, params)
    toks, lens = prefill.prompt_tokens, prefill.prompt_lens
    b, t = toks.shape
    t8 = -(-t // CHUNK) * CHUNK
    toks = jnp.pad(toks, ((0, 0), (0, t8 - t)))  # pad rows sit after every prompt: no real query sees them
    # Its own copy of the prompt's K/V, in the activations' dtype (sparse_prompt_view reads float rows).
    cache = model(toks, cache=model.init_cache(b, t8, model.dtype), mode="prefill", return_logits=False).cache
    ks, vs, num_sel = sparse_prompt_view([x.transpose(0, 2, 1, 3) for x in cache.k],  # -> [B, S, Hkv, D], once
                                         [x.transpose(0, 2, 1, 3) for x in cache.v], lens, self.budget,
                                         self.keep_recent)
    cfg = model.cfg
    tail = (cfg.num_hidden_layers, b, self.tail_tokens, cfg.num_key_value_heads, cfg.head_dim)
    return BudgetState(k_sel=jnp.stack(ks), v_sel=jnp.stack(vs), num_sel=num_sel,
                       k_tail=jnp.zeros(tail, cache.k[0].dtype), v_tail=jnp.zeros(tail, cache.v[0].dtype),
                       tail_pos=jnp.full((b, self.tail_tokens), -1, jnp.int32), prompt_lens=lens)

  def forward(self, params: nnx.State, state: BudgetState, tokens: jax.Array, positions: jax.Array, write: jax.Array,
              logits_at: jax.Array | None = None) -> tuple[jax.Array, BudgetState]:
    """Runs `tokens` [B, T] at `positions` [B, T] against the sparse prompt view and the tail; rows with
    write[b, t] False are neither stored nor seen. Returns (logits [B, T or P, V], new state)."""
    model = nnx.merge(self.graphdef, params)
    b = tokens.shape[0]
    w = self.tail_tokens
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(write, positions % w, w)  # w = out of range: dropped
    tail_pos = state.tail_pos.at[rows, slot].set(positions, mode="drop")
    visible = ((tail_pos[:, None, :] >= state.prompt_lens[:, None, None])
               & (tail_pos[:, None, :] <= positions[:, :, None]))  # [B, T, W]
    rope = rope_frequencies(model.cfg, jnp.max(positions))
    x = model.embed(tokens)
    kt, vt = state.k_tail, state.v_tail
    for li, layer in enumerate(model.layers):
      q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, rope)
      kt = kt.at[li, rows, slot].set(k.astype(kt.dtype), mode="drop")
      vt = vt.at[li, rows, slot].set(v.astype(vt.dtype), mode="drop")
      o_sel, lse_sel = length_masked_attention(q, state.k_sel[li].astype(q.dtype), state.v_sel[li].astype(q.dtype),
                                               state.num_sel)
      o_tail, lse_tail = dense_masked_attention(q, kt[li].astype(q.dtype), vt[li].astype(q.dtype), visible,
                                                return_lse=True)
      o, _ = merge_attention_views([o_sel, o_tail], [lse_sel, lse_tail])
      x = x + layer.self_attn.out(o)
      x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = model.norm(x)
    if logits_at is not None:
      h = jnp.take_along_axis(h, logits_at[..., None], axis=1)
    return model.logits_from_hidden(h), state.replace(k_tail=kt, v_tail=vt, tail_pos=tail_pos)

  def propose(self, params: nnx.State, state: BudgetState, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, BudgetState]:
    k = num_draft
    keys = jax.random.split(key, k)
    n_tok = ctx.num_tokens
    # The last K+1 committed tokens, from the prompt length on: prompt rows live only in the sparse view.
    start = jnp.maximum(n_tok - (k + 1), state.prompt_lens)
    pos = start[:, None] + jnp.arange(k + 1)[None, :]
    toks = jnp.take_along_axis(ctx.tokens, jnp.minimum(pos, ctx.tokens.shape[1] - 1), axis=1)
    logits, state = self.forward(params, state, toks, pos, pos < n_tok[:, None],
                                 logits_at=(n_tok - 1 - start)[:, None])
    d, q = pick_token(logits[:, 0], keys[0], ctx.sampling, sample)
    drafts, probs = [d], [q]
    for i in range(1, k):
      p = (n_tok + i - 1)[:, None]
      logits, state = self.forward(params, state, drafts[-1][:, None], p, jnp.ones_like(p, bool))
      d, q = pick_token(logits[:, 0], keys[i], ctx.sampling, sample)
      drafts.append(d)
      probs.append(q)
    return jnp.stack(drafts, axis=1), (jnp.stack(probs, axis=1) if sample else None), state

  def update(self, params: nnx.State, state: BudgetState, verify: VerifyResult) -> BudgetState:
    return state


def budget_from_model(model: Transformer, budget: int = 256, keep_recent: bool = True,
                      tail_tokens: int = 256) -> LoadedDrafter:
  graphdef, params = nnx.split(model)
  spec = BudgetDrafter(graphdef=graphdef, vocab_size=model.cfg.vocab_size, budget=budget, keep_recent=keep_recent,
                       tail_tokens=tail_tokens)
  return LoadedDrafter(spec, params)


def load_budget(drafter_dir: str | os.PathLike, budget: int = 256, keep_recent: bool | None = None) -> LoadedDrafter:
  """keep_recent None: the rule the checkpoint was trained with (drafter.json), else keep the recent chunk."""
  from longspec_jax.hf_io import load_model_dir
  if keep_recent is None:
    keep_recent = trained_keep_recent(drafter_dir)
  return budget_from_model(load_model_dir(drafter_dir), budget, keep_recent)


def trained_keep_recent(drafter_dir: str | os.PathLike) -> bool:
  """The selection rule a checkpoint was trained with (drafter.json's budget_keep_recent; True when absent)."""
  meta_path = Path(drafter_dir) / "drafter.json"
  return json.loads(meta_path.read_text()).get("budget_keep_recent", True) if meta_path.exists() else True


def load_for_target(drafter_dir: str | os.PathLike, target: Transformer, budget: int = 256) -> LoadedDrafter:
  del target  # the drafter reads only tokens
  return load_budget(drafter_dir, budget)


@flax.struct.dataclass
class DFlashBudgetState:
  k_sel: tuple[jax.Array, ...]  # per drafter layer [B, budget, Hkv, D]: the kept prompt context rows
  v_sel: tuple[jax.Array, ...]
  num_sel: jax.Array  # [B] valid rows of k_sel / v_sel
  k_tail: tuple[jax.Array, ...]  # per drafter layer [B, W, Hkv, D]: rows at positions >= prompt_lens, slot = pos % W
  v_tail: tuple[jax.Array, ...]
  tail_pos: jax.Array  # [B, W] position each tail slot holds (-1 = empty)
  prompt_lens: jax.Array  # [B]
  length: jax.Array  # [B] context rows committed (the pending token's position)


@dataclasses.dataclass(frozen=True)
class DFlashBudgetDrafter(DFlashDrafter):
  """DFlash whose block queries see, instead of every context row, the prompt rows the budget keeps (chosen once
  after prefill, per drafter layer and KV head, from the context keys: sink + newest chunk + best-scoring chunks
  against the last prompt row's key) and a ring of the newest `tail_tokens` committed rows after the prompt. The
  state has one shape whatever the context: (budget + tail_tokens) rows per layer."""
  budget: int = 256
  keep_recent: bool = True
  tail_tokens: int = 256
  name: str = "dflash-budget"

  def __post_init__(self):
    check_budget(self.budget)
    if self.tail_tokens <= self.cfg.block_size:  # a verify pass writes block_size rows into the ring
      raise ValueError(f"tail_tokens must exceed the block size {self.cfg.block_size}, got {self.tail_tokens}")

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> DFlashBudgetState:
    del max_len  # the state's size depends on the budget and the tail, never on the sequence length
    model = self._model(params)
    taps, lens = prefill.taps, prefill.prompt_lens
    b, t = taps.shape[:2]
    t8 = -(-t // CHUNK) * CHUNK
    taps = jnp.pad(taps, ((0, 0), (0, t8 - t), (0, 0), (0, 0)))  # pad rows lie past every prompt: never kept
    k, v = model.context_kv(model.context(taps), jnp.broadcast_to(jnp.arange(t8, dtype=jnp.int32), (b, t8)))
    k_sel, v_sel, num_sel = sparse_prompt_view(list(k), list(v), lens, self.budget, self.keep_recent)
    tail = jnp.zeros((b, self.tail_tokens) + k.shape[3:], model.dtype)
    n = len(k_sel)
    return DFlashBudgetState(k_sel=tuple(x.astype(model.dtype) for x in k_sel),
                             v_sel=tuple(x.astype(model.dtype) for x in v_sel), num_sel=num_sel,
                             k_tail=(tail,) * n, v_tail=(tail,) * n,
                             tail_pos=jnp.full((b, self.tail_tokens), -1, jnp.int32), prompt_lens=lens,
                             length=lens.astype(jnp.int32))

  def context_views(self, li: int, q: jax.Array, state: DFlashBudgetState) -> list:
    t = q.shape[1]
    seen = (state.tail_pos >= state.prompt_lens[:, None]) & (state.tail_pos < state.length[:, None])  # [B, W]
    return [length_masked_attention(q, state.k_sel[li].astype(q.dtype), state.v_sel[li].astype(q.dtype),
                                    state.num_sel),
            dense_masked_attention(q, state.k_tail[li].astype(q.dtype), state.v_tail[li].astype(q.dtype),
                                   jnp.broadcast_to(seen[:, None], (q.shape[0], t, seen.shape[1])),
                                   return_lse=True)]

  def block_logits(self, params: dict, state: DFlashBudgetState, pending: jax.Array, num_draft: int,
                   record: list | None = None) -> jax.Array:
    if record is not None:
      raise ValueError("attention logits are recorded for the full-context DFlash only (SharpDraft calibration)")
    return super().block_logits(params, state, pending, num_draft)

  def update(self, params: dict, state: DFlashBudgetState, verify: VerifyResult) -> DFlashBudgetState:
    pos, k, v = self.verified_context_kv(params, verify)
    rows = jnp.arange(pos.shape[0])[:, None]
    slot = pos % self.tail_tokens
    # All K+1 verified rows are written; only those below the new length are seen, the rest get overwritten.
    write = lambda bufs, new: tuple(buf.at[rows, slot].set(x.astype(buf.dtype)) for buf, x in zip(bufs, new))
    return state.replace(k_tail=write(state.k_tail, k), v_tail=write(state.v_tail, v),
                         tail_pos=state.tail_pos.at[rows, slot].set(pos),
                         length=(verify.num_tokens - 1).astype(jnp.int32))


def load_dflash_budget(drafter_dir: str | os.PathLike, target: Transformer, budget: int = 256,
                       draft_vocab: int | None = None) -> LoadedDrafter:
  """A DFlash checkpoint (multi-view fine-tuned, or any: naive sparse) drafting over a sparse context view."""
  from longspec_jax.drafters.dflash import load_dflash
  loaded = load_dflash(drafter_dir, target, draft_vocab=draft_vocab)
  spec = DFlashBudgetDrafter(graphdef=loaded.spec.graphdef, cfg=loaded.spec.cfg, budget=budget,
                             keep_recent=trained_keep_recent(drafter_dir))
  return dataclasses.replace(loaded, spec=spec)


# ---------------------------------------------------------------- the training-time forward (trainers and tests)

def multiview_forward(model: Transformer, batch: dict, max_budget: int,
                      keep_recent: bool) -> tuple[jax.Array, jax.Array]:
  """(full-branch logits, sparse-branch logits), each [B, C, V] at the continuation rows."""
  cfg = model.cfg
  prompt, lens, cont = batch["prompt"], batch["prompt_lens"], batch["cont"]
  b, p = prompt.shape
  c = cont.shape[1]
  pos_p = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
  pos_c = lens[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
  rope = rope_frequencies(cfg, jnp.max(pos_c))
  causal = jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]  # [C, C]
  prompt_valid = jnp.arange(p)[None, :] < lens[:, None]  # [B, P]
  full_vis = jnp.concatenate([jnp.broadcast_to(prompt_valid[:, None], (b, c, p)),
                              jnp.broadcast_to(causal[None], (b, c, c))], axis=-1)  # [B, C, P + C]
  sel_len = selection_lengths(lens, batch["num_chunks"] * CHUNK, keep_recent)
  x_p = model.embed(prompt)
  x_f = x_s = model.embed(cont)
  for li, layer in enumerate(model.layers):
    attn = layer.self_attn
    q_p, k_p, v_p = attn.qkv(layer.input_layernorm(x_p), pos_p, rope)
    idx = jax.lax.stop_gradient(select_budget_chunks(k_p, lens, max_budget, keep_recent, batch["num_chunks"]))
    kept = chunk_key_mask(idx, sel_len, CHUNK, p)  # [B, Hkv, P]
    sparse_vis = jnp.concatenate([jnp.broadcast_to(kept[:, :, None], (b, kept.shape[1], c, p)),
                                  jnp.broadcast_to(causal[None, None], (b, kept.shape[1], c, c))], axis=-1)
    branches = []
    for x_c, vis in ((x_f, full_vis), (x_s, sparse_vis)):
      q_c, k_c, v_c = attn.qkv(layer.input_layernorm(x_c), pos_c, rope)
      k = jnp.concatenate([k_p, k_c], axis=1)
      v = jnp.concatenate([v_p, v_c], axis=1)
      x_c = x_c + attn.out(dense_masked_attention(q_c, k, v, vis))
      branches.append(x_c + layer.mlp(layer.post_attention_layernorm(x_c)))
    x_f, x_s = branches
    if li + 1 < len(model.layers):  # the last layer's prompt outputs feed nothing
      x_p = x_p + attn.out(causal_attention(q_p, k_p, v_p, block=model.attn_block))
      x_p = x_p + layer.mlp(layer.post_attention_layernorm(x_p))
  return model.logits_from_hidden(model.norm(x_f)), model.logits_from_hidden(model.norm(x_s))


# DFlash over the budget view: both branches' block logits in training

def dflash_multiview_logits(model: DFlashModel, batch: dict, max_budget: int,
                     keep_recent: bool) -> tuple[jax.Array, jax.Array]:
  """(full-branch, sparse-branch) block logits, each [B, A, B_s-1, V]."""
  ck, cv = train_context_kv(model, batch["taps"])
  c = batch["tokens"].shape[1]
  lens = batch["prompt_lens"]
  sel_len = selection_lengths(lens, batch["num_chunks"] * CHUNK, keep_recent)
  after_prompt = jnp.arange(c)[None, None, :] >= lens[:, None, None]  # [B, 1, C]

  def kept(li):
    idx = jax.lax.stop_gradient(select_budget_chunks(ck[li], lens, max_budget, keep_recent, batch["num_chunks"]))
    return chunk_key_mask(idx, sel_len, CHUNK, c) | after_prompt

  args = (model, batch["io"], ck, cv, batch["tokens"], batch["anchors"])
  return train_block_logits(*args), train_block_logits(*args, context_kept=kept)
