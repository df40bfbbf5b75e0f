"""LongSpark: a block drafter whose state and step cost do not depend on the prefix length.

One drafter decoder layer per selected target layer l (DFlash's evenly spaced layers). The block
[pending token x_t, MASK x (B-1)] at positions t..t+B-1 is embedded with the target's frozen embedding plus a
learned position embedding, concatenated with the *boundary state* (the selected layers' target outputs at the last
committed row t-1, projected L*H -> H -> H) and mixed by a small feed-forward. In drafter layer l the block's queries
(target RoPE at absolute positions) attend to three views, each with its own softmax, merged by log-sum-exp:
  1. Global: G learned keys per (layer, query head), no RoPE, whose values are an online-softmax summary of ALL
     committed target K/V rows of layer l as seen through those same keys (kept as normalised output + LSE, fp32).
     The prompt is scanned once at prefill; after each verification only the accepted rows are merged (`merge_rows`),
     rejected rows never touch it.
  2. Raw: a ring buffer of the W most recent committed target K/V rows of layer l (post k-norm and RoPE), slot =
     position mod W, filled from the rows the verify pass returns.
  3. Local: the block's own K/V, bidirectional.
Slot j's final hidden state goes through the target's frozen final norm and LM head and drafts x_{t+1+j}; an optional
low-rank Markov term w2(w1[previous token]) is added sequentially across the block (previous = x_t, then the drafts).
State per sequence: L x Hq x G x (D + 1) fp32 + L x W x Hkv x D x 2 + L x H, the same at every context length.

Checkpoints use the public LongSpark tensor names (draft_state_encoder.*, parallel_shifted_input.*,
parallel_qwen_layers.{i}.* with Qwen3 names, global16_raw256_reference.global_query_generator.learned_query
[L, Hq, G, D], parallel_markov_head.markov_w{1,2}); config.json is a Qwen3 config plus `longspark_config`.
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
from longspec_jax.drafters.frozen_target import (apply_final_norm, check_block_drafter, check_reads_target,
                                                 default_target_layer_ids, embed_tokens, head_logits, target_io,
                                                 taps_of, with_draft_vocab)
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.model import DecoderLayer, Linear, RMSNorm
from longspec_jax.rope import apply_rope, rope_frequencies
from longspec_jax.sampling import processed_log_probs
from longspec_jax.pallas_kernels.length_masked_attention import length_masked_attention, merge_attention_views

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer

ARCHITECTURE = "LongSparkDraftModel"
# The published checkpoints (Hehy/LongSpark-Qwen3-*, 65 bf16 tensors): the same tensor names, and the config of
# LongSpark's DraftFreeKVConfig (model_type "draftfreekv", flat keys), read by `from_public_dict`.
PUBLIC_ARCHITECTURE = "DraftFreeKVModel"
PUBLIC_MODEL_TYPE = "draftfreekv"
# DraftFreeKV settings that make a checkpoint the Global + Raw + Local drafter implemented here, with the public
# defaults a config may leave out; any other value is another DraftFreeKV variant.
_PUBLIC_SETTINGS = {"draft_mode": ("parallel_shifted_qwen", "markov"), "global16_raw256_enabled": (True, False),
                    "target_kv_memory_layout": ("direct", "direct"),
                    "parallel_markov_head_type": ("vanilla", "vanilla"), "global_query_mode": ("learned", "learned"),
                    "global_memory_source_window": ("full", "full")}
# Keys of the other DraftFreeKV variants and of training, meaningless for this drafter; read past. Window/memory
# keys that would change it must be unset (null).
_PUBLIC_IGNORED = ("target_model_name_or_path", "target_layer_policy", "target_kv_memory_query_rank", "adapter_rank",
                   "adapter_alpha", "transition_rank", "transition_alpha", "parallel_mixer_rank",
                   "parallel_mixer_alpha", "parallel_mixer_num_heads", "xpress_num_refinement_steps",
                   "xpress_early_stop", "xpress_activation", "qwen_gradient_checkpointing", "training_objective",
                   "memory_query_mode", "memory_external_key_mode", "memory_attention_backend",
                   "memory_anchor_policy", "global_checkpoint_compatibility", "global_query_equicorrelation",
                   "global_query_slot_mass_mode", "max_accepted_tokens", "qwen_initialize_from_target",
                   "_name_or_path", "_commit_hash", "architectures", "attn_implementation", "dtype", "model_type",
                   "torch_dtype", "transformers_version")
_PUBLIC_UNSET = ("target_kv_window_size", "memory_output_slots", "memory_source_window", "memory_query_residual_rank")
_PUBLIC_READ = ("target_layer_ids", "num_target_layers", "block_size", "local_draft_rows", "hidden_size",
                "num_key_value_heads", "head_dim", "vocab_size", "mask_token_id", "parallel_mixer_layers",
                "qwen_intermediate_size", "qwen_num_attention_heads", "qwen_rope_theta", "qwen_rms_norm_eps",
                "parallel_markov_rank", "global_memory_slots", "raw_target_rows")
LONGSPARK_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_global_slots", "raw_window",
                  "markov_rank")
PREFILL_CHUNK = 512  # rows per step of the prefill scan over the prompt's K/V
# Our parameter names -> the public checkpoint's (FeedForward is nn.Sequential(Linear, SiLU, Linear) there).
_RENAMES = ((".fc_in.", ".net.0."), (".fc_out.", ".net.2."))
DRAFTERS = (DrafterEntry(name="longspark", loader="load_longspark", checkpoint="longspark",
                         architectures=("LongSparkDraftModel", "DraftFreeKVModel"), diagnostics=True,
                         options=("draft_vocab",),
                         trainer="longspec_jax.training.train_longspark:LongSparkTrainConfig:train_longspark"),)


@dataclasses.dataclass(frozen=True)
class LongSparkConfig:
  arch: ModelConfig  # the drafter's layers (one per target layer read); width, heads, vocab and RoPE = target's
  target_layer_ids: tuple[int, ...]  # target layers whose OUTPUTS and K/V are read
  num_target_layers: int
  mask_token_id: int
  block_size: int = 7  # block rows = max drafts per step (slot j predicts the token after its position)
  num_global_slots: int = 16
  raw_window: int = 256
  markov_rank: int = 0  # 0 = no Markov correction

  def __post_init__(self):
    if self.block_size < 1 or self.num_global_slots < 1 or self.raw_window < 1 or self.markov_rank < 0:
      raise ValueError(f"LongSpark needs block_size, num_global_slots, raw_window >= 1 and markov_rank >= 0, got "
                       f"{self.block_size}, {self.num_global_slots}, {self.raw_window}, {self.markov_rank}")
    check_block_drafter("LongSpark", self.arch, self.target_layer_ids, self.num_target_layers, self.mask_token_id)
    if self.arch.num_hidden_layers != len(self.target_layer_ids):
      raise ValueError(f"LongSpark has one drafter layer per target layer read: {self.arch.num_hidden_layers} "
                       f"layers vs {len(self.target_layer_ids)} target_layer_ids")

  @property
  def taps(self) -> tuple[int, ...]:
    return taps_of(self.target_layer_ids)

  def to_hf_dict(self) -> dict:
    d = self.arch.to_hf_dict()
    d.update(architectures=[ARCHITECTURE], num_target_layers=self.num_target_layers,
             longspark_config={k: (list(v) if isinstance(v, tuple) else v)
                               for k in LONGSPARK_KEYS for v in [getattr(self, k)]})
    return d

  @classmethod
  def from_hf_dict(cls, d: dict) -> "LongSparkConfig":
    d = dict(d)
    if d.get("model_type") == PUBLIC_MODEL_TYPE:
      return cls.from_public_dict(d)
    archs = d.get("architectures") or []
    if ARCHITECTURE not in archs:
      raise ValueError(f"not a LongSpark drafter config: architectures {archs} (expected {ARCHITECTURE})")
    extra = dict(d.pop("longspark_config", None) or {})
    unknown = sorted(set(extra) - set(LONGSPARK_KEYS))
    if unknown:
      raise ValueError(f"unknown longspark_config keys {unknown}; known: {list(LONGSPARK_KEYS)}")
    missing = [k for k in ("target_layer_ids", "mask_token_id") if extra.get(k) is None]
    if missing:
      raise ValueError(f"LongSpark config lacks {missing} (expected under longspark_config)")
    ntl = d.pop("num_target_layers", None)
    if ntl is None:
      raise ValueError("LongSpark config lacks num_target_layers")
    d.setdefault("mask_token_id", extra["mask_token_id"])
    kw = {k: int(extra[k]) for k in ("block_size", "num_global_slots", "raw_window", "markov_rank") if k in extra}
    return cls(arch=ModelConfig.from_hf_dict(d), target_layer_ids=tuple(int(i) for i in extra["target_layer_ids"]),
               num_target_layers=int(ntl), mask_token_id=int(extra["mask_token_id"]), **kw)

  @classmethod
  def from_public_dict(cls, d: dict) -> "LongSparkConfig":
    """The config.json of a published LongSpark checkpoint (DraftFreeKVConfig, Global16 + Raw256 mode)."""
    where = "public LongSpark (DraftFreeKV) config"
    unknown = sorted(set(d) - set(_PUBLIC_SETTINGS) - set(_PUBLIC_IGNORED) - set(_PUBLIC_UNSET) - set(_PUBLIC_READ))
    if unknown:
      raise ValueError(f"{where}: unknown keys {unknown}")
    for key, (wanted, default) in _PUBLIC_SETTINGS.items():
      if d.get(key, default) != wanted:
        raise ValueError(f"{where}: {key} {d.get(key, default)!r} is another DraftFreeKV variant; only {key} "
                         f"{wanted!r} (LongSpark's Global + Raw + Local drafter) is implemented")
    set_keys = [k for k in _PUBLIC_UNSET if d.get(k) is not None]
    if set_keys:
      raise ValueError(f"{where}: {set_keys} must be null in the Global16 + Raw256 mode")
    required = ("target_layer_ids", "num_target_layers", "block_size", "hidden_size", "num_key_value_heads",
                "head_dim", "vocab_size", "mask_token_id", "qwen_intermediate_size", "qwen_num_attention_heads")
    missing = [k for k in required if d.get(k) is None]
    if missing:
      raise ValueError(f"{where} lacks {missing}")
    ids = tuple(int(i) for i in d["target_layer_ids"])
    block = int(d["block_size"])
    if int(d.get("parallel_mixer_layers", 5)) != len(ids):
      raise ValueError(f"{where}: parallel_mixer_layers {d.get('parallel_mixer_layers', 5)} vs {len(ids)} "
                       "target_layer_ids (one drafter layer per target layer read)")
    if int(d.get("local_draft_rows", 7)) != block:
      raise ValueError(f"{where}: local_draft_rows {d.get('local_draft_rows', 7)} vs block_size {block}")
    arch = ModelConfig.from_hf_dict({
        "model_type": "qwen3", "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
        "intermediate_size": d["qwen_intermediate_size"], "num_hidden_layers": len(ids),
        "num_attention_heads": d["qwen_num_attention_heads"], "num_key_value_heads": d["num_key_value_heads"],
        "head_dim": d["head_dim"], "rope_theta": d.get("qwen_rope_theta", 1e6),
        "rms_norm_eps": d.get("qwen_rms_norm_eps", 1e-6), "tie_word_embeddings": True,
        "mask_token_id": d["mask_token_id"]})
    slots = int(d.get("global_memory_slots", 16))
    # "baseline16" adds log(16 / slots) to the slot logits: zero at the 16 slots the public code fixes
    if d.get("global_query_slot_mass_mode", "system") != "system" and slots != 16:
      raise ValueError(f"{where}: global_query_slot_mass_mode {d['global_query_slot_mass_mode']!r} with {slots} "
                       "slots is not implemented (only 'system', or any mode at 16 slots)")
    return cls(arch=arch, target_layer_ids=ids, num_target_layers=int(d["num_target_layers"]),
               mask_token_id=int(d["mask_token_id"]), block_size=block, num_global_slots=slots,
               raw_window=int(d.get("raw_target_rows", 256)), markov_rank=int(d.get("parallel_markov_rank", 0)))

  def check_target(self, target: ModelConfig) -> None:
    """The drafter reads the target's hidden states and K/V, and uses its embedding, final norm and LM head."""
    check_reads_target("LongSpark", self.arch, self.num_target_layers, target,
                       ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"))


def longspark_config_for(target: ModelConfig, *, num_layers: int = 5, markov_rank: int = 0,
                         num_global_slots: int = 16, raw_window: int = 256, block_size: int = 7,
                         mask_token_id: int | None = None, **arch_overrides: Any) -> LongSparkConfig:
  """A LongSpark config for `target`: its width, heads, MLP width (or `intermediate_size=`), vocabulary and RoPE;
  `num_layers` target layers evenly spaced as in DFlash, one drafter layer each. mask_token_id: the block's mask
  token (default the target's; a target without one, e.g. SmolLM2, needs an id it never emits)."""
  mask_token_id = target.mask_token_id if mask_token_id is None else mask_token_id
  if mask_token_id is None:
    raise ValueError("the target config has no mask_token_id; LongSpark needs a reserved mask token (pass one)")
  arch = target.replace(num_hidden_layers=num_layers, family="qwen3", tie_word_embeddings=True,
                        attention_bias=False, mlp_bias=False, **arch_overrides)
  return LongSparkConfig(arch=arch, target_layer_ids=default_target_layer_ids(target.num_hidden_layers, num_layers),
                         num_target_layers=target.num_hidden_layers, mask_token_id=mask_token_id,
                         block_size=block_size, num_global_slots=num_global_slots, raw_window=raw_window,
                         markov_rank=markov_rank)


class FeedForward(nnx.Module):
  """Linear -> SiLU -> Linear, bias-free."""

  def __init__(self, din, dhidden, dout, *, rngs):
    self.fc_in = Linear(din, dhidden, ("embed", "mlp"), rngs=rngs)
    self.fc_out = Linear(dhidden, dout, ("mlp", "embed"), rngs=rngs)

  def __call__(self, x):
    return self.fc_out(jax.nn.silu(self.fc_in(x)))


class StateEncoder(nnx.Module):
  def __init__(self, num_layers, h, eps, *, rngs):
    self.proj = FeedForward(num_layers * h, h, h, rngs=rngs)
    self.norm = RMSNorm(h, eps, rngs=rngs)

  def __call__(self, hidden):
    """hidden [..., L, H] (the selected layers' outputs at the last committed row) -> boundary state [..., H]."""
    return self.norm(self.proj(hidden.reshape(hidden.shape[:-2] + (-1,))))


class ShiftedInput(nnx.Module):
  def __init__(self, h, block_size, eps, *, rngs):
    self.position_embedding = nnx.Embed(block_size, h, rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
    self.proj = FeedForward(2 * h, h, h, rngs=rngs)
    self.norm = RMSNorm(h, eps, rngs=rngs)

  def __call__(self, token_states, boundary):
    """token_states [..., B_s, H] (embedded block), boundary [..., H] -> block input [..., B_s, H]."""
    x = token_states + self.position_embedding.embedding[...].astype(token_states.dtype)
    b = jnp.broadcast_to(boundary[..., None, :], x.shape).astype(x.dtype)
    return self.norm(self.proj(jnp.concatenate([x, b], -1)))


class MarkovHead(nnx.Module):
  def __init__(self, vocab, rank, *, rngs):
    self.markov_w1 = nnx.Embed(vocab, rank, rngs=rngs, embedding_init=nnx.initializers.normal(0.02))
    self.markov_w2 = Linear(rank, vocab, ("mlp", "vocab"), rngs=rngs, std=0.0)  # starts as no correction

  def __call__(self, prev):
    """prev [...] token ids -> fp32 logit bias [..., V]."""
    return self.markov_w2(self.markov_w1.embedding[...][prev]).astype(jnp.float32)


class SlotKeys(nnx.Module):
  def __init__(self, n, hq, slots, d, *, rngs):
    # G ~ N(0, D^-1/2) as in the public code: slot scores G.k / sqrt(D) start at unit scale.
    self.learned_query = nnx.Param(jax.random.normal(rngs.params(), (n, hq, slots, d)) * d ** -0.25,
                                   logical_axes=(None, "q_heads", None, "head_dim"))


class GlobalSlots(nnx.Module):
  """Holds the learned slot keys under the public checkpoint's module path."""

  def __init__(self, n, hq, slots, d, *, rngs):
    self.global_query_generator = SlotKeys(n, hq, slots, d, rngs=rngs)


class LongSparkModel(nnx.Module):
  def __init__(self, cfg: LongSparkConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    a = cfg.arch
    h, n = a.hidden_size, len(cfg.target_layer_ids)
    self.draft_state_encoder = StateEncoder(n, h, a.rms_norm_eps, rngs=rngs)
    self.parallel_shifted_input = ShiftedInput(h, cfg.block_size, a.rms_norm_eps, rngs=rngs)
    self.parallel_qwen_layers = nnx.List([DecoderLayer(a, rngs=rngs) for _ in range(n)])
    self.global16_raw256_reference = GlobalSlots(n, a.num_attention_heads, cfg.num_global_slots, a.head_dim,
                                                 rngs=rngs)
    self.parallel_markov_head = MarkovHead(a.vocab_size, cfg.markov_rank, rngs=rngs) if cfg.markov_rank else None
    self.cfg = cfg
    self.dtype = dtype

  @property
  def learned_query(self) -> nnx.Param:
    """The Global slot keys [L, Hq, G, D]."""
    return self.global16_raw256_reference.global_query_generator.learned_query

  def slot_scores(self, k: jax.Array) -> jax.Array:
    """Target keys k [L, ..., R, Hkv, D] -> fp32 slot logits [..., L, Hkv, g, G, R] (1/sqrt(D) applied)."""
    a = self.cfg.arch
    hkv, g = a.num_key_value_heads, a.q_per_kv
    gq = self.learned_query[...].astype(jnp.float32).reshape(k.shape[0], hkv, g, self.cfg.num_global_slots, -1)
    s = jnp.einsum("lkgsd,l...rkd->...lkgsr", gq, k.astype(jnp.float32))
    return s * a.head_dim ** -0.5

  def block_input(self, io: dict, pending: jax.Array, boundary_hidden: jax.Array) -> jax.Array:
    """pending [...] token ids, boundary_hidden [..., L, H] -> the embedded block [..., B_s, H]."""
    cfg = self.cfg
    toks = jnp.concatenate([pending[..., None], jnp.full(pending.shape + (cfg.block_size - 1,), cfg.mask_token_id,
                                                         jnp.int32)], -1)
    boundary = self.draft_state_encoder(boundary_hidden.astype(self.dtype))
    return self.parallel_shifted_input(embed_tokens(io, toks, self.dtype), boundary)

  def block_hidden(self, x: jax.Array, positions: jax.Array,
                   attend: Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """x [B, T, H] at positions [B, T]; attend(layer, q, k, v) -> [B, T, Hq, D] merges the three views."""
    rope = rope_frequencies(self.cfg.arch, jnp.max(positions))
    for li, layer in enumerate(self.parallel_qwen_layers):
      q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), positions, rope)
      x = x + layer.self_attn.out(attend(li, q, k, v))
      x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x

  def markov_bias(self, prev: jax.Array) -> jax.Array | float:
    return self.parallel_markov_head(prev) if self.parallel_markov_head is not None else 0.0


def merge_rows(out: jax.Array, lse: jax.Array, scores: jax.Array, values: jax.Array,
               valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Online-softmax merge of R new rows into per-slot summaries (exact; rows with valid=False contribute nothing).

  out [..., S, D] fp32: normalised weighted value sums; lse [..., S] fp32 (-inf = empty); scores [..., S, R] fp32
  (slot-key logits of the new rows); values [..., R, D]; valid broadcastable to [..., R]. Returns (out, lse) over the
  union of the old and new rows. With no valid row the result is bit-identical to the input (z = 1)."""
  s = jnp.where(valid[..., None, :], scores, -jnp.inf)
  m = jnp.maximum(lse, jnp.max(s, axis=-1, initial=-jnp.inf))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_old = jnp.exp(lse - m)
  p = jnp.exp(s - m[..., None])
  z = w_old + jnp.sum(p, axis=-1)
  acc = out * w_old[..., None] + jnp.einsum("...sr,...rd->...sd", p, values.astype(jnp.float32))
  nonempty = z > 0
  z_safe = jnp.where(nonempty, z, 1.0)
  return acc / z_safe[..., None], jnp.where(nonempty, m + jnp.log(z_safe), -jnp.inf)


@flax.struct.dataclass
class LongSparkState:
  g_out: jax.Array  # [B, L, Hkv, g, G, D] fp32 Global slot values (normalised), query head h = (h // g, h % g)
  g_lse: jax.Array  # [B, L, Hkv, g, G] fp32 their log normalisers
  ring_k: jax.Array  # [L, B, W, Hkv, D] target K rows, slot = position mod W
  ring_v: jax.Array
  hidden: jax.Array  # [B, L, H] selected layers' target outputs at the last committed row
  length: jax.Array  # [B] committed rows (= position of the pending token)


@dataclasses.dataclass(frozen=True)
class LongSparkDrafter(ReadsItsConfig):
  graphdef: nnx.GraphDef
  cfg: LongSparkConfig
  name: str = "longspark"
  needs_target_kv: bool = True
  catch_up_in_propose = False  # update merges the verified rows into the views
  drafts_blocks = True

  @property
  def max_draft_tokens(self) -> int:
    return self.cfg.block_size

  def _model(self, params) -> LongSparkModel:
    return nnx.merge(self.graphdef, params["drafter"])

  def _layer_kv(self, new_kv):
    ids = jnp.asarray(self.cfg.target_layer_ids)
    return new_kv[0][ids], new_kv[1][ids]

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> LongSparkState:
    del max_len  # the state does not grow
    model, cfg = self._model(params), self.cfg
    a = cfg.arch
    k, v = self._layer_kv(prefill.new_kv)  # [L, B, T, Hkv, D]
    n, b, t = k.shape[:3]
    lens = prefill.prompt_lens.astype(jnp.int32)
    # Global: one scan over the prompt's rows in chunks, merged online.
    c = min(PREFILL_CHUNK, t)
    pad = -t % c
    kp, vp = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))
    nc = (t + pad) // c
    chunks = lambda x: jnp.moveaxis(x.reshape(n, b, nc, c, *x.shape[3:]), 2, 0)  # [nc, L, B, c, Hkv, D]

    def step(carry, xs):
      kc, vc, i = xs
      vals = vc.transpose(1, 0, 3, 2, 4)[:, :, :, None]  # [B, L, Hkv, 1, c, D]
      valid = (i * c + jnp.arange(c)[None, :] < lens[:, None])[:, None, None, None, :]
      return merge_rows(*carry, model.slot_scores(kc), vals, valid), None

    shape = (b, n, a.num_key_value_heads, a.q_per_kv, cfg.num_global_slots)
    init = (jnp.zeros(shape + (a.head_dim,), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))
    (g_out, g_lse), _ = jax.lax.scan(step, init, (chunks(kp), chunks(vp), jnp.arange(nc)))
    # Raw: slot i holds the newest prompt position p < P with p = i (mod W).
    w = cfg.raw_window
    p = (lens[:, None] - 1) - jnp.mod(lens[:, None] - 1 - jnp.arange(w)[None, :], w)  # [B, W]
    src = jnp.clip(p, 0, t - 1)
    keep = (p >= 0)[None, :, :, None, None]
    gather = lambda x: jnp.where(keep, jnp.take_along_axis(x, src[None, :, :, None, None], axis=2), 0)
    hidden = jnp.take_along_axis(prefill.taps, (lens - 1)[:, None, None, None], axis=1)[:, 0]
    return LongSparkState(g_out=g_out, g_lse=g_lse, ring_k=gather(k).astype(model.dtype),
                          ring_v=gather(v).astype(model.dtype), hidden=hidden.astype(jnp.float32), length=lens)

  def block_logits(self, params: dict, state: LongSparkState, pending: jax.Array, num_draft: int | None = None,
                   record: list | None = None) -> jax.Array:
    """Base logits [B, num_draft (default B_s), V] (before the Markov term) of the block anchored at `pending`
    (position length). `record`, a list, receives per layer the [B, B_s, Hq, 3] attention mass on (Global, Raw,
    Local)."""
    model, cfg = self._model(params), self.cfg
    a = cfg.arch
    b = pending.shape[0]
    bs, gs = cfg.block_size, cfg.num_global_slots
    pos = state.length[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]
    raw_len = jnp.minimum(state.length, cfg.raw_window)
    g_keys = model.learned_query[...].transpose(0, 2, 1, 3)  # [L, G, Hq, D]
    g_vals = state.g_out.reshape(b, -1, a.num_attention_heads, gs, a.head_dim).transpose(1, 0, 3, 2, 4)

    def attend(li, q, k, v):
      o_g, l_g = length_masked_attention(q, jnp.broadcast_to(g_keys[li], (b,) + g_keys.shape[1:]).astype(q.dtype),
                                         g_vals[li].astype(q.dtype), jnp.full((b,), gs, jnp.int32))
      o_r, l_r = length_masked_attention(q, state.ring_k[li].astype(q.dtype), state.ring_v[li].astype(q.dtype),
                                         raw_len)
      o_b, l_b = length_masked_attention(q, k, v, jnp.full((b,), bs, jnp.int32))
      out, lse = merge_attention_views([o_g, o_r, o_b], [l_g, l_r, l_b])
      if record is not None:
        record.append(jnp.exp(jnp.stack([l_g, l_r, l_b], -1) - lse[..., None]))
      return out

    x = model.block_input(params["io"], pending, state.hidden)
    h = model.block_hidden(x, pos, attend)[:, :num_draft]
    return head_logits(params["io"], apply_final_norm(params["io"], h))

  def diagnostics(self, params: dict, state: LongSparkState, ctx: ProposeContext) -> dict[str, jax.Array]:
    """Attention mass of the next block's queries on (Global, Raw, Local) per drafter layer, [L, 3] (mean over
    sequences, block rows and heads): how much each view carries at this context."""
    record = []
    self.block_logits(params, state, ctx.pending, 1, record=record)
    return {"view_mass_global_raw_local": jnp.stack([r.mean((0, 1, 2)) for r in record])}

  def propose(self, params: dict, state: LongSparkState, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, LongSparkState]:
    bs = self.cfg.block_size
    if not 1 <= num_draft <= bs:
      raise ValueError(f"num_draft {num_draft} is outside [1, {bs}] for a LongSpark block of {bs}")
    pending = ctx.pending
    base = self.block_logits(params, state, pending, num_draft)
    model = self._model(params)
    if model.parallel_markov_head is None:
      if not sample:
        return jnp.argmax(base, -1).astype(jnp.int32), None, state
      logq = processed_log_probs(base, ctx.sampling)  # slots independent: each draft is a draw from its own q
      return jax.random.categorical(key, logq, axis=-1).astype(jnp.int32), jnp.exp(logq), state

    # Markov: slot j's logits depend on the token drafted at slot j-1, so the block is decoded left to right and
    # q_j is the distribution draft j was actually drawn from.
    def step(prev, xs):
      logits, j = xs
      logits = logits + model.markov_bias(prev)
      if sample:
        logq = processed_log_probs(logits, ctx.sampling)
        tok = jax.random.categorical(jax.random.fold_in(key, j), logq, axis=-1).astype(jnp.int32)
        return tok, (tok, jnp.exp(logq))
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      return tok, (tok, None)

    _, (drafts, probs) = jax.lax.scan(step, pending, (jnp.moveaxis(base, 1, 0), jnp.arange(num_draft)))
    return drafts.T, (jnp.moveaxis(probs, 0, 1) if sample else None), state

  def update(self, params: dict, state: LongSparkState, verify: VerifyResult) -> LongSparkState:
    """Merges the committed rows (pending + accepted drafts) of the verify pass; the rest never enter."""
    model, cfg = self._model(params), self.cfg
    k, v = self._layer_kv(verify.new_kv)  # [L, B, K+1, Hkv, D]
    b, k1 = k.shape[1:3]
    n = verify.num_committed.astype(jnp.int32)
    valid = jnp.arange(k1)[None, :] < n[:, None]  # [B, K+1]
    vals = v.transpose(1, 0, 3, 2, 4)[:, :, :, None]  # [B, L, Hkv, 1, K+1, D]
    g_out, g_lse = merge_rows(state.g_out, state.g_lse, model.slot_scores(k), vals,
                              valid[:, None, None, None, :])
    slot = jnp.where(valid, jnp.mod(verify.start[:, None] + jnp.arange(k1)[None, :], cfg.raw_window),
                     cfg.raw_window)  # uncommitted rows are dropped
    rows = jnp.arange(b)[:, None]
    ring_k = state.ring_k.at[:, rows, slot].set(k.astype(state.ring_k.dtype), mode="drop")
    ring_v = state.ring_v.at[:, rows, slot].set(v.astype(state.ring_v.dtype), mode="drop")
    last = jnp.take_along_axis(verify.taps, jnp.maximum(n - 1, 0)[:, None, None, None], axis=1)[:, 0]
    hidden = jnp.where((n > 0)[:, None, None], last.astype(jnp.float32), state.hidden)
    return LongSparkState(g_out=g_out, g_lse=g_lse, ring_k=ring_k, ring_v=ring_v, hidden=hidden,
                          length=(verify.num_tokens - 1).astype(jnp.int32))


def longspark_from_model(model: LongSparkModel, target: Transformer) -> LoadedDrafter:
  """The drafter for `target`. Its block queries take the target's RoPE (e.g. YaRN when the target runs past its
  trained context), because they attend to the target's own rotated keys in the Raw window."""
  model.cfg.check_target(target.cfg)
  graphdef, state = nnx.split(model)
  if model.cfg.arch.rope != target.cfg.rope:
    arch = model.cfg.arch.replace(rope=target.cfg.rope, max_position_embeddings=target.cfg.max_position_embeddings)
    model = nnx.merge(graphdef, state)  # a copy: the caller's model keeps its config
    model.cfg = dataclasses.replace(model.cfg, arch=arch)
    graphdef, state = nnx.split(model)
  return LoadedDrafter(LongSparkDrafter(graphdef=graphdef, cfg=model.cfg),
                       {"drafter": state, "io": target_io(target, final_norm=True)})


def create_longspark(cfg: LongSparkConfig, seed: int = 0, dtype: jax.typing.DTypeLike = jnp.float32) -> LongSparkModel:
  return LongSparkModel(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


def _public_name(name: str) -> str:
  for ours, theirs in _RENAMES:
    name = name.replace(ours, theirs)
  return name


def _our_name(name: str) -> str:
  for ours, theirs in _RENAMES:
    name = name.replace(theirs, ours)
  return name


def save_longspark_dir(model: LongSparkModel, out_dir: str | os.PathLike,
                       dtype: jax.typing.DTypeLike = np.float32) -> Path:
  """config.json + model.safetensors with the public LongSpark tensor names (torch [out, in] layout)."""
  from longspec_jax.hf_io import save_drafter_dir, to_hf_tensors
  tensors = {_public_name(k): v for k, v in to_hf_tensors(model, np.float32, prefix="").items()}
  return save_drafter_dir(out_dir, model.cfg.to_hf_dict(), tensors, dtype)


def load_longspark_model(drafter_dir: str | os.PathLike, dtype: jax.typing.DTypeLike = jnp.float32) -> LongSparkModel:
  from longspec_jax.hf_io import load_drafter_weights
  cfg = LongSparkConfig.from_hf_dict(read_config_json(Path(drafter_dir) / "config.json", "LongSpark"))
  return load_drafter_weights(drafter_dir, lambda: LongSparkModel(cfg, rngs=nnx.Rngs(0), dtype=dtype), _our_name)


def load_longspark(drafter_dir: str | os.PathLike, target: Transformer,
                   draft_vocab: int | None = None) -> LoadedDrafter:
  """A LongSpark drafter directory (our export or the public layout) for `target`; `draft_vocab` cuts its LM
  head to the checkpoint's most frequent tokens (frozen_target.with_draft_vocab)."""
  return with_draft_vocab(longspark_from_model(load_longspark_model(drafter_dir), target), drafter_dir, draft_vocab)


# ---------------------------------------------------------------- the training-time forward (trainers and tests)

def anchor_summaries(model: LongSparkModel, pre_k: jax.Array, pre_v: jax.Array, pre_len: jax.Array,
                     slab_k: jax.Array, slab_v: jax.Array, slab_pos: jax.Array, anchors: jax.Array) -> jax.Array:
  """Global slot summaries of rows < anchor, per anchor: g_out [B, A, L, Hkv, g, G, D] fp32.

  pre_k/v [L, B, Cp, Hkv, D]: window rows 0..Cp-1, of which rows < pre_len [B] are summarised once for all anchors;
  slab_k/v [L, B, S, Hkv, D] at absolute positions slab_pos [B, S] (-1 = none): each anchor merges its rows in
  [pre_len, a)."""
  a = model.cfg.arch
  b, n = pre_k.shape[1], pre_k.shape[0]
  shape = (b, n, a.num_key_value_heads, a.q_per_kv, model.cfg.num_global_slots)
  empty = (jnp.zeros(shape + (a.head_dim,), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))
  pre_valid = (jnp.arange(pre_k.shape[2])[None, :] < pre_len[:, None])[:, None, None, None, :]
  out, lse = merge_rows(*empty, model.slot_scores(pre_k), pre_v.transpose(1, 0, 3, 2, 4)[:, :, :, None], pre_valid)
  tail = (slab_pos[:, None, :] >= pre_len[:, None, None]) & (slab_pos[:, None, :] < anchors[:, :, None])  # [B,A,S]
  out, _ = merge_rows(out[:, None], lse[:, None], model.slot_scores(slab_k)[:, None],
                      slab_v.transpose(1, 0, 3, 2, 4)[:, None, :, :, None], tail[:, :, None, None, None, :])
  return out


def longspark_train_logits(model: LongSparkModel, io: dict, boundary: jax.Array, anchors: jax.Array,
                           g_out: jax.Array, slab_k: jax.Array, slab_v: jax.Array, slab_pos: jax.Array,
                           prev: jax.Array, shift: jax.Array | None = None) -> jax.Array:
  """Logits [B, A, B_s, V] (Markov term included, teacher-forced on prev [B, A, B_s]; prev[..., 0] is the block's
  pending token x_a) of every anchor's block. boundary [B, A, L, H]: the selected layers' outputs at row a-1;
  g_out from `anchor_summaries`; slab as there. shift [B]: RoPE positions of the block are anchors + shift (the
  target keys must have been rotated by the same shift, `shift_window`)."""
  cfg = model.cfg
  a_cfg = cfg.arch
  b, na = anchors.shape
  bs, hq, d, gs = cfg.block_size, a_cfg.num_attention_heads, a_cfg.head_dim, cfg.num_global_slots
  x = model.block_input(io, prev[..., 0], boundary).reshape(b, na * bs, -1)
  pos = (anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, na * bs)
  if shift is not None:
    pos = pos + shift[:, None]
  q_anchor = jnp.repeat(anchors, bs, axis=1)
  sp = slab_pos[:, None, :]
  raw_visible = (sp >= 0) & (sp < q_anchor[:, :, None]) & (sp >= q_anchor[:, :, None] - cfg.raw_window)
  group = jnp.repeat(jnp.arange(na), bs)
  local_visible = jnp.broadcast_to(group[:, None] == group[None, :], (b, na * bs, na * bs))
  g_vals = g_out.reshape(b, na, -1, hq, gs, d)  # [B, A, L, Hq, G, D]

  def attend(li, q, k, v):
    qa = q.reshape(b, na, bs, hq, d)
    lg = jnp.einsum("bajhd,hsd->bajhs", qa, model.learned_query[...][li].astype(q.dtype),
                    preferred_element_type=jnp.float32) * d ** -0.5
    l_g = jax.nn.logsumexp(lg, axis=-1)
    o_g = jnp.einsum("bajhs,bahsd->bajhd", jnp.exp(lg - l_g[..., None]), g_vals[:, :, li])
    o_r, l_r = dense_masked_attention(q, slab_k[li].astype(q.dtype), slab_v[li].astype(q.dtype), raw_visible,
                                      return_lse=True)
    o_b, l_b = dense_masked_attention(q, k, v, local_visible, return_lse=True)
    o_g = o_g.reshape(b, na * bs, hq, d).astype(q.dtype)
    return merge_attention_views([o_g, o_r, o_b], [l_g.reshape(b, na * bs, hq), l_r, l_b])[0]

  h = model.block_hidden(x, pos, attend)
  logits = head_logits(io, apply_final_norm(io, h)).reshape(b, na, bs, -1)
  return logits + model.markov_bias(prev)


def window_summaries(model: LongSparkModel, batch: dict) -> jax.Array:
  """anchor_summaries of a training batch. The slab's first W rows lie before pre_len (see AnchorSampler): only the
  rows after them can enter the Global summaries of the anchors, so the per-anchor merge skips them."""
  w = model.cfg.raw_window
  return anchor_summaries(model, batch["pre_k"], batch["pre_v"], batch["pre_len"], batch["slab_k"][:, :, w:],
                          batch["slab_v"][:, :, w:], batch["slab_pos"][:, w:], batch["anchors"])


def shift_window(model: LongSparkModel, batch: dict) -> dict:
  """Moves every window to positions + shift [B]. The target's only position signal is RoPE, so the same text at
  later positions has the same hidden states and its keys rotated by R(shift) (RoPE rotations compose): this
  shows the drafter its one absolute-position-dependent score, block query . Global key (no RoPE on the keys), at
  positions beyond the window lengths, without long target forwards."""
  inv_freq, _ = rope_frequencies(model.cfg.arch, jnp.max(batch["shift"]))

  def rotate(k):  # [L, B, R, Hkv, D]
    n, b, r = k.shape[:3]
    flat = k.transpose(1, 0, 2, 3, 4).reshape(b, n * r, *k.shape[3:])
    pos = jnp.broadcast_to(batch["shift"][:, None], (b, n * r))
    return apply_rope(flat.astype(jnp.float32), pos, inv_freq, 1.0).reshape(b, n, r, *k.shape[3:]).transpose(
        1, 0, 2, 3, 4)
  return dict(batch, pre_k=rotate(batch["pre_k"]), slab_k=rotate(batch["slab_k"]))


def train_batch_logits(model: LongSparkModel, batch: dict) -> jax.Array:
  """Block logits [B, A, B_s, V] of a training batch (position shift and boundary scale applied when present)."""
  if "shift" in batch:
    batch = shift_window(model, batch)
  boundary = batch["boundary"]
  if "boundary_scale" in batch:
    boundary = boundary * batch["boundary_scale"]
  return longspark_train_logits(model, batch["io"], boundary, batch["anchors"], window_summaries(model, batch),
                                batch["slab_k"], batch["slab_v"], batch["slab_pos"], batch["prev"], batch.get("shift"))
