"""DFlash: a block-diffusion drafter conditioned on the target's hidden states.

Context features = RMSNorm(fc(concat of the outputs of the target layers `target_layer_ids`)), one per position
the target has processed. In every drafter layer they enter only as extra keys/values, through that layer's own
k_proj / k_norm / v_proj (no query, no MLP), so each position's context K/V is computed once and cached: the
drafter state is a static [L_d, B, S_max, Hkv, D] cache that grows with the committed prefix (LongSpark later
replaces it by constant-size views). The block [last verified token, MASK x (B-1)] is embedded with the target's
frozen embedding at absolute positions, attends bidirectionally to itself and to every cached context row, and
slot j's final hidden state goes through the target's frozen LM head to draft the token at its own position, so
one forward drafts B-1 tokens.

Checkpoints use the layout of the public z-lab DFlash drafters: a Qwen3 `config.json` plus
`dflash_config: {block_size, mask_token_id, target_layer_ids}` and `num_target_layers`; tensors `fc.weight`,
`hidden_norm.weight`, `layers.{i}.*` (Qwen3 decoder layer names) and `norm.weight`; no embedding or LM head.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.attention import dense_masked_attention
from longspec_jax.config import ModelConfig, read_config_json
from longspec_jax.drafters.base import LoadedDrafter, ReadsItsConfig
from longspec_jax.drafters.frozen_target import (check_block_drafter, check_reads_target, default_target_layer_ids,
                                                 embed_tokens, head_logits, target_io, taps_of, with_draft_vocab)
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.model import DecoderLayer, Linear, RMSNorm
from longspec_jax.rope import apply_rope, rope_frequencies
from longspec_jax.sampling import processed_log_probs
from longspec_jax.pallas_kernels.length_masked_attention import length_masked_attention, merge_attention_views

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer
  from longspec_jax.sharpdraft import SharpDraft

ARCHITECTURE = "DFlashDraftModel"
DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids")
DRAFTERS = (DrafterEntry(name="dflash", loader="load_dflash", checkpoint="dflash", sharpdraft=True,
                         architectures=("DFlashDraftModel", "DFlashSpeculator"),
                         options=("draft_vocab",),
                         trainer="longspec_jax.training.train_dflash:DFlashTrainConfig:train_dflash"),)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  arch: ModelConfig  # the drafter's decoder layers; hidden size, vocabulary and RoPE are the target's
  block_size: int  # B: the block is [last verified token, MASK x (B-1)] and drafts B-1 tokens
  mask_token_id: int
  target_layer_ids: tuple[int, ...]  # target layers whose OUTPUTS are read (HF hidden_states[i + 1])
  num_target_layers: int

  def __post_init__(self):
    if self.block_size < 2:
      raise ValueError(f"DFlash block_size must be >= 2, got {self.block_size}")
    check_block_drafter("DFlash", self.arch, self.target_layer_ids, self.num_target_layers, self.mask_token_id)

  @property
  def taps(self) -> tuple[int, ...]:
    return taps_of(self.target_layer_ids)

  def to_hf_dict(self) -> dict:
    d = self.arch.to_hf_dict()
    d.update(architectures=[ARCHITECTURE], num_target_layers=self.num_target_layers, is_causal=False,
             dflash_config={"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                            "target_layer_ids": list(self.target_layer_ids)})
    return d

  @classmethod
  def from_hf_dict(cls, d: dict) -> "DFlashConfig":
    d = dict(d)
    archs = d.get("architectures") or []
    if archs and ARCHITECTURE not in archs:
      raise ValueError(f"not a DFlash drafter config: architectures {archs} (expected {ARCHITECTURE})")
    extra = dict(d.pop("dflash_config", None) or {})
    for k in DFLASH_KEYS:  # older configs keep them at top level
      if k in d:
        extra.setdefault(k, d.pop(k))
    missing = [k for k in ("target_layer_ids", "mask_token_id") if extra.get(k) is None]
    if missing:
      raise ValueError(f"DFlash config lacks {missing} (expected under dflash_config)")
    if d.pop("is_causal", False):
      raise ValueError("causal DFlash variants are not supported (is_causal: true)")
    if "sliding_attention" in (d.get("layer_types") or []):
      raise ValueError("DFlash variants with sliding-window layers are not supported")
    unsupported = sorted(k for k in extra if k not in DFLASH_KEYS)
    if unsupported:  # e.g. DFlash-2's candidate selector / convolutions
      raise ValueError(f"unsupported dflash_config keys {unsupported}: only plain DFlash is implemented")
    ntl = d.pop("num_target_layers", None)
    if ntl is None:
      raise ValueError("DFlash config lacks num_target_layers")
    d.setdefault("mask_token_id", extra["mask_token_id"])
    return cls(arch=ModelConfig.from_hf_dict(d), block_size=int(extra.get("block_size", 16)),
               mask_token_id=int(extra["mask_token_id"]),
               target_layer_ids=tuple(int(i) for i in extra["target_layer_ids"]), num_target_layers=int(ntl))

  def check_target(self, target: ModelConfig) -> None:
    check_reads_target("DFlash", self.arch, self.num_target_layers, target, ("hidden_size", "vocab_size"))


def dflash_config_for(target: ModelConfig, *, num_layers: int = 2, num_target_taps: int = 5,
                      block_size: int = 16, mask_token_id: int | None = None, **arch_overrides: Any) -> DFlashConfig:
  """A DFlash config sized for `target`: its hidden size, vocabulary, RoPE and special ids. mask_token_id: the
  block's mask token (default the target's; a target without one, e.g. SmolLM2, needs an id it never emits)."""
  mask_token_id = target.mask_token_id if mask_token_id is None else mask_token_id
  if mask_token_id is None:
    raise ValueError("the target config has no mask_token_id; DFlash needs a reserved mask token (pass one)")
  arch = target.replace(num_hidden_layers=num_layers, family="qwen3", tie_word_embeddings=True,
                        attention_bias=False, mlp_bias=False, **arch_overrides)
  return DFlashConfig(arch=arch, block_size=block_size, mask_token_id=mask_token_id,
                      target_layer_ids=default_target_layer_ids(target.num_hidden_layers, num_target_taps),
                      num_target_layers=target.num_hidden_layers)


class DFlashModel(nnx.Module):
  def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    a = cfg.arch
    h = a.hidden_size
    self.fc = Linear(len(cfg.target_layer_ids) * h, h, ("mlp", "embed"), rngs=rngs)
    self.hidden_norm = RMSNorm(h, a.rms_norm_eps, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(a, rngs=rngs) for _ in range(a.num_hidden_layers)])
    self.norm = RMSNorm(h, a.rms_norm_eps, rngs=rngs)
    self.cfg = cfg
    self.dtype = dtype

  def rope(self, positions: jax.Array) -> tuple[jax.Array, float]:
    return rope_frequencies(self.cfg.arch, jnp.max(positions))

  def context(self, taps: jax.Array) -> jax.Array:
    """Target taps [B, T, n, H] -> context features [B, T, H]."""
    b, t = taps.shape[:2]
    return self.hidden_norm(self.fc(taps.reshape(b, t, -1).astype(self.dtype)))

  def context_kv(self, feats: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Context features [B, T, H] at positions [B, T] -> per-layer (k, v), each [L_d, B, T, Hkv, D]."""
    a = self.cfg.arch
    b, t = feats.shape[:2]
    inv_freq, scaling = self.rope(positions)
    ks, vs = [], []
    for layer in self.layers:
      attn = layer.self_attn
      k = attn.k_norm(attn.k_proj(feats).reshape(b, t, a.num_key_value_heads, a.head_dim))
      ks.append(apply_rope(k, positions, inv_freq, scaling))
      vs.append(attn.v_proj(feats).reshape(b, t, a.num_key_value_heads, a.head_dim))
    return jnp.stack(ks), jnp.stack(vs)

  def block_hidden(self, x: jax.Array, positions: jax.Array,
                   attend: Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Runs the block x [B, T, H] (embedded) through the layers; attend(layer, q, k, v) -> [B, T, Hq, D] is
    the attention of the block's queries over the context view plus the block's own keys/values."""
    rope = self.rope(positions)
    for li, layer in enumerate(self.layers):
      q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, rope)
      x = x + layer.self_attn.out(attend(li, q, k, v))
      x = x + layer.mlp(layer.post_attention_layernorm(x))
    return self.norm(x)


@flax.struct.dataclass
class DFlashState:
  # Context keys / values, one [B, S_max, Hkv, D] buffer per drafter layer (rows >= length are stale): XLA:CPU
  # copies a layer's slice of a stacked buffer before a product reads it.
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  length: jax.Array  # [B] context rows = positions the target has processed and committed


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(ReadsItsConfig):
  graphdef: nnx.GraphDef
  cfg: DFlashConfig
  sharpdraft: object = None  # SharpDraft query scaling (longspec_jax.sharpdraft) or None
  name: str = "dflash"
  needs_target_kv: bool = False
  catch_up_in_propose = False  # update writes the verified rows' context K/V
  drafts_blocks = True

  @property
  def max_draft_tokens(self) -> int:
    return self.cfg.block_size - 1

  def _model(self, params) -> DFlashModel:
    return nnx.merge(self.graphdef, params["drafter"])

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> DFlashState:
    model = self._model(params)
    b, t = prefill.taps.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k, v = model.context_kv(model.context(prefill.taps), pos)
    shape = (b, max_len) + k.shape[3:]
    buffers = lambda x: tuple(jnp.zeros(shape, model.dtype).at[:, :t].set(xl.astype(model.dtype)) for xl in x)
    return DFlashState(k=buffers(k), v=buffers(v), length=prefill.prompt_lens.astype(jnp.int32))

  def block_logits(self, params: dict, state: DFlashState, pending: jax.Array, num_draft: int,
                   record: list | None = None) -> jax.Array:
    """Logits [B, num_draft, V] for the block anchored at the pending token (position state.length).
    `record`, a list, receives per-layer pre-softmax logits [B, Hq, B_s, n_ctx + B_s] (unscaled queries)."""
    bs = self.cfg.block_size
    if not 1 <= num_draft <= bs - 1:
      raise ValueError(f"num_draft {num_draft} is outside [1, {bs - 1}] for a DFlash block of {bs}")
    model = self._model(params)
    b = pending.shape[0]
    toks = jnp.concatenate([pending[:, None], jnp.full((b, bs - 1), self.cfg.mask_token_id, jnp.int32)], 1)
    pos = state.length[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]
    whole_block = jnp.full((b,), bs, jnp.int32)

    def attend(li, q, k, v):
      if record is not None:
        record.append(_logits_over(q, jnp.concatenate([state.k[li].astype(k.dtype), k], 1)))
      if self.sharpdraft is not None:  # every block query sees the context rows and the whole block
        q = self.sharpdraft.scale_queries(li, q, (state.length + bs)[:, None])
      views = self.context_views(li, q, state) + [length_masked_attention(q, k, v, whole_block)]
      return merge_attention_views([o for o, _ in views], [lse for _, lse in views])[0]

    h = model.block_hidden(embed_tokens(params["io"], toks, model.dtype), pos, attend)
    return head_logits(params["io"], h[:, 1:1 + num_draft])

  def context_views(self, li: int, q: jax.Array, state: DFlashState) -> list:
    """[(out, lse)] of the block queries q over drafter layer li's context rows: every committed row."""
    return [length_masked_attention(q, state.k[li].astype(q.dtype), state.v[li].astype(q.dtype), state.length)]

  def propose(self, params: dict, state: DFlashState, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, DFlashState]:
    return (*block_drafts(self.block_logits(params, state, ctx.pending, num_draft), ctx, key, sample), state)

  def verified_context_kv(self, params: dict, verify: VerifyResult) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(positions [B, K+1], per-layer context k, v [L_d, B, K+1, Hkv, D]) of every verified row."""
    model = self._model(params)
    k1 = verify.taps.shape[1]
    pos = verify.start[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    return (pos, *model.context_kv(model.context(verify.taps), pos))

  def update(self, params: dict, state: DFlashState, verify: VerifyResult) -> DFlashState:
    pos, k, v = self.verified_context_kv(params, verify)
    rows = jnp.arange(pos.shape[0])[:, None]
    # All K+1 verified rows are written; only the committed ones count (length), the rest get overwritten.
    write = lambda bufs, new: tuple(buf.at[rows, pos].set(x.astype(buf.dtype), mode="drop")
                                    for buf, x in zip(bufs, new))
    return DFlashState(k=write(state.k, k), v=write(state.v, v), length=(verify.num_tokens - 1).astype(jnp.int32))

  def attention_logits(self, params: dict, target: Transformer, tokens: jax.Array) -> list[jax.Array]:
    """Per drafter layer, pre-softmax logits [B, Hq, B_s, N] of the block anchored at the last token of `tokens`
    [B, T], whose queries see N = (T-1) context rows + the B_s block keys (SharpDraft calibration)."""
    from longspec_jax.drafters.base import PrefillResult
    b, t = tokens.shape
    out = target(tokens[:, :-1], cache=target.init_cache(b, t - 1), mode="prefill", taps=self.taps,
                 return_logits=False)
    pre = PrefillResult(prompt_tokens=tokens[:, :-1], tokens=tokens, prompt_lens=jnp.full((b,), t - 1),
                        taps=out.taps, new_kv=None, target_cache=None)
    state = self.init_state(params, pre, t - 1)
    record = []
    self.block_logits(params, state, tokens[:, -1], 1, record=record)
    return record


def block_drafts(logits: jax.Array, ctx: ProposeContext, key: jax.Array,
                 sample: bool) -> tuple[jax.Array, jax.Array | None]:
  """(drafts [B, K], q [B, K, V] or None) from a parallel block's logits: argmax, or, sampling, an independent
  draw per slot from its own processed distribution (returned as q for exact rejection sampling)."""
  if not sample:
    return jnp.argmax(logits, -1).astype(jnp.int32), None
  logq = processed_log_probs(logits, ctx.sampling)
  return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), jnp.exp(logq)


def _logits_over(q, k):
  """q [B, T, Hq, D], k [B, S, Hkv, D] -> [B, Hq, T, S] fp32 logits including 1/sqrt(D)."""
  hq, hkv = q.shape[2], k.shape[2]
  kk = jnp.repeat(k, hq // hkv, axis=2)
  return jnp.einsum("bthd,bshd->bhts", q, kk.astype(q.dtype), preferred_element_type=jnp.float32) * (
      q.shape[-1] ** -0.5)


def dflash_from_model(model: DFlashModel, target: Transformer, sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  model.cfg.check_target(target.cfg)
  graphdef, state = nnx.split(model)
  return LoadedDrafter(DFlashDrafter(graphdef=graphdef, cfg=model.cfg, sharpdraft=sharpdraft),
                       {"drafter": state, "io": target_io(target)})


def create_dflash(cfg: DFlashConfig, seed: int = 0, dtype: jax.typing.DTypeLike = jnp.float32) -> DFlashModel:
  return DFlashModel(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


def save_dflash_dir(model: DFlashModel, out_dir: str | os.PathLike, dtype: jax.typing.DTypeLike = np.float32) -> Path:
  """config.json + model.safetensors in the public DFlash layout (bare tensor names, torch [out, in])."""
  from longspec_jax.hf_io import save_drafter_dir, to_hf_tensors
  return save_drafter_dir(out_dir, model.cfg.to_hf_dict(), to_hf_tensors(model, np.float32, prefix=""), dtype)


def load_dflash_model(drafter_dir: str | os.PathLike, dtype: jax.typing.DTypeLike = jnp.float32,
                      num_target_layers: int | None = None) -> DFlashModel:
  """A DFlash directory in z-lab's (ours) or speculators' layout (hf_drafter_formats; the latter needs the target's
  `num_target_layers`)."""
  from longspec_jax.hf_drafter_formats import read_native
  from longspec_jax.hf_io import empty_model, load_params_into
  read_config_json(Path(drafter_dir) / "config.json", "DFlash")  # a missing config is named as a DFlash one
  d, tensors = read_native(drafter_dir, "dflash", num_target_layers)
  cfg = DFlashConfig.from_hf_dict(d)
  return load_params_into(empty_model(lambda: DFlashModel(cfg, rngs=nnx.Rngs(0), dtype=dtype)), tensors,
                          where=f" {drafter_dir}", prefix="")


def load_dflash(drafter_dir: str | os.PathLike, target: Transformer, sharpdraft: SharpDraft | None = None,
                draft_vocab: int | None = None) -> LoadedDrafter:
  """A DFlash drafter directory (our export or a public z-lab checkpoint) for `target`; `draft_vocab` cuts its
  LM head to the checkpoint's most frequent tokens (frozen_target.with_draft_vocab)."""
  model = load_dflash_model(drafter_dir, num_target_layers=target.cfg.num_hidden_layers)
  return with_draft_vocab(dflash_from_model(model, target, sharpdraft), drafter_dir, draft_vocab)


# ---------------------------------------------------------------- the training-time forward (trainers and tests)

def dflash_train_logits(model: DFlashModel, io: dict, taps: jax.Array, tokens: jax.Array, anchors: jax.Array,
                        tap_scale: jax.Array | None = None) -> jax.Array:
  """Logits [B, A, B_s-1, V] of every anchor's block in one pass: queries of anchor a see context rows < a and
  their own block (bidirectional). tap_scale [n, H]: multiplies the taps (see normalize_taps)."""
  ck, cv = train_context_kv(model, taps, tap_scale)
  return train_block_logits(model, io, ck, cv, tokens, anchors)


def train_context_kv(model: DFlashModel, taps: jax.Array,
                     tap_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Context keys / values [L_d, B, C, Hkv, D] of a window's rows (at positions 0..C-1) from its taps."""
  b, c = taps.shape[:2]
  if tap_scale is not None:
    taps = taps * tap_scale.astype(taps.dtype)
  return model.context_kv(model.context(taps), jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c)))


def train_block_logits(model: DFlashModel, io: dict, ck: jax.Array, cv: jax.Array, tokens: jax.Array,
                       anchors: jax.Array, context_kept: Callable[[int], jax.Array] | None = None) -> jax.Array:
  """Block logits [B, A, B_s-1, V] of every anchor over the context K/V ck / cv [L_d, B, C, Hkv, D]: anchor a's
  queries see context rows < a and their own block. context_kept(layer) -> [B, Hkv, C] bool, when given, further
  limits the context rows each KV head of that layer sees (BudgetDraft's sparse view)."""
  cfg = model.cfg
  b, c = tokens.shape
  a, bs = anchors.shape[1], cfg.block_size
  anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
  blk = jnp.concatenate([anchor_tok[..., None], jnp.full((b, a, bs - 1), cfg.mask_token_id, jnp.int32)], -1)
  pos = (anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, a * bs)
  q_anchor = jnp.repeat(anchors, bs, axis=1)  # [B, A*B_s]
  group = jnp.repeat(jnp.arange(a), bs)
  before = jnp.arange(c)[None, None, :] < q_anchor[:, :, None]  # [B, A*B_s, C]
  own_block = jnp.broadcast_to(group[:, None] == group[None, :], (b, a * bs, a * bs))
  visible = jnp.concatenate([before, own_block], axis=-1)

  def attend(li, q, k, v):
    mask = visible
    if context_kept is not None:
      ctx = before[:, None] & context_kept(li)[:, :, None]  # [B, Hkv, A*B_s, C]
      mask = jnp.concatenate([ctx, jnp.broadcast_to(own_block[:, None], (b, ctx.shape[1]) + own_block.shape[1:])],
                             axis=-1)
    return dense_masked_attention(q, jnp.concatenate([ck[li].astype(k.dtype), k], 1),
                                  jnp.concatenate([cv[li].astype(v.dtype), v], 1), mask)

  h = model.block_hidden(embed_tokens(io, blk.reshape(b, a * bs), model.dtype), pos, attend)
  return head_logits(io, h.reshape(b, a, bs, -1)[:, :, 1:])


def train_batch_logits(model: DFlashModel, batch: dict) -> jax.Array:
  """Block logits of a training batch (the tap scale applied when present)."""
  return dflash_train_logits(model, batch["io"], batch["taps"], batch["tokens"], batch["anchors"],
                             batch.get("tap_scale"))
