"""EAGLE-3 drafter: one decoder layer over [norm(embed(token)); norm(feature)], chain-drafting K tokens.

Row convention. Drafter row p (RoPE position p) pairs the target's feature at position p with the token at
position p+1 and predicts the token at p+2. The feature of a real row is fc(concat of the target's residual
stream at the aux layers, i.e. the inputs of layers ~2, L/2, L-3); a speculative row takes the drafter's own
output hidden state (pre-norm) of the row before it instead (EAGLE-3's training-time-test convention).

In the engine, with n committed tokens (x_{n-1} pending, not yet in the target cache), rows 0..n-2 are real and
already in the drafter's KV cache, and the state holds the output hidden state of row n-2. propose() reads draft
1 from that hidden state, then runs speculative rows n-1, n, ... (one token each) for drafts 2..K, whose K/V stay
local to the chain (the cache is only read). update() runs the K+1 verified rows (taps of [pending, drafts] at
positions n-1..n+K-1, tokens = the committed block) into the cache and keeps the hidden state of the last
committed row. Cached rows past the committed ones are junk, but a query sees only rows before its own, and the
next update rewrites them first.

Public layout (EAGLE-3 as in SafeAILab/EAGLE, vLLM and SGLang): `fc.weight` [H, n_aux*H_t],
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`
(q/k/v take 2H inputs), `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`
[draft_vocab, H], `d2t` (draft id i -> target id i + d2t[i]) and `t2d`; torch Linear weights are [out, in].
This project's drafters add Qwen3-style `midlayer.self_attn.{q,k}_norm.weight`; checkpoints without them load as
Llama-style (no q/k norm). The token embedding is always the target's (frozen, never stored here).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.attention import NEG_INF, causal_attention, extend_attention
from longspec_jax.config import ModelConfig, read_config_json
from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.kv_cache import KVCache
from longspec_jax.model import MLP, Attention, Linear, RMSNorm
from longspec_jax.rope import rope_frequencies
from longspec_jax.sampling import processed_log_probs

if TYPE_CHECKING:
  from longspec_jax.draft_tree import DraftTree
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer
  from longspec_jax.sharpdraft import SharpDraft

ARCHITECTURE = "LlamaForCausalLMEagle3"
# config.json keys of the EAGLE-3 layout on top of a Llama config (n0: the context length it was trained at).
EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config", "eagle_aux_hidden_state_layer_ids",
              "norm_before_residual", "n0")
DRAFTERS = (DrafterEntry(name="eagle3", loader="load_eagle3", checkpoint="eagle3", sharpdraft=True,
                         architectures=("LlamaForCausalLMEagle3", "Eagle3DraftModel", "Eagle3Speculator"),
                         trainer="longspec_jax.training.train_eagle3:Eagle3TrainConfig:train_eagle3"),)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
  """Low / mid / high layer inputs (vLLM's default (2, L//2, L-3)), clamped into [0, L-1] for tiny targets."""
  return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Layer(nnx.Module):
  def __init__(self, cfg: ModelConfig, qk_norm: bool, *, rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.self_attn = Attention(cfg, rngs=rngs, in_features=2 * cfg.hidden_size, qk_norm=qk_norm)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def inputs(self, embeds: jax.Array, feature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention input [.., 2H] and the residual stream (the un-normed feature)."""
    return jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(feature)], axis=-1), feature

  def out(self, residual: jax.Array, o: jax.Array) -> jax.Array:
    b, t = o.shape[:2]
    h = residual + self.self_attn.o_proj(o.reshape(b, t, -1))
    return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Net(nnx.Module):
  """Parameters of the EAGLE-3 drafter (attribute names follow the public checkpoint layout)."""

  def __init__(self, cfg: ModelConfig, num_aux: int, target_hidden: int, draft_vocab: int, qk_norm: bool = True,
               *, rngs: nnx.Rngs):
    self.fc = Linear(num_aux * target_hidden, cfg.hidden_size, ("taps", "embed"), rngs=rngs)
    self.midlayer = Eagle3Layer(cfg, qk_norm, rngs=rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.lm_head = Linear(cfg.hidden_size, draft_vocab, ("embed", "vocab"), rngs=rngs)
    self.cfg = cfg

  def feature(self, taps: jax.Array) -> jax.Array:
    """taps [B, T, n_aux, H_t] -> fc features [B, T, H]."""
    b, t = taps.shape[:2]
    return self.fc(taps.reshape(b, t, -1))

  def logits(self, h: jax.Array) -> jax.Array:
    """Output hidden (pre-norm) -> fp32 logits over the draft vocabulary."""
    return self.lm_head(self.norm(h)).astype(jnp.float32)


def _layer_qkv(net: Eagle3Net, embeds, feature, positions, sharpdraft):
  layer = net.midlayer
  x, residual = layer.inputs(embeds, feature)
  q, k, v = layer.self_attn.qkv(x, positions, rope_frequencies(net.cfg, jnp.max(positions)))
  if sharpdraft is not None:  # the query of row p sees rows 0..p
    q = sharpdraft.scale_queries(0, q, positions + 1)
  return residual, q, k, v


def run_cached(net: Eagle3Net, embeds: jax.Array, feature: jax.Array, positions: jax.Array, cache: KVCache, mode: str,
               sharpdraft: SharpDraft | None = None, attn_block: int = 512) -> tuple[jax.Array, KVCache]:
  """Runs rows [B, T] at `positions` and writes their K/V into the drafter cache. mode "prefill": the rows are
  positions 0..T-1 (blockwise causal attention); "extend": each sequence's rows at its own positions, attending
  to every cached row at a position <= the query's. Returns (output hidden [B, T, H], cache)."""
  residual, q, k, v = _layer_qkv(net, embeds, feature, positions, sharpdraft)
  if mode == "prefill":
    cache = cache.write_prefix(0, k, v)
    o = causal_attention(q, k, v, block=attn_block)
  else:
    o = extend_attention(q, k, v, cache.k[0], cache.v[0], positions)
    cache = cache.write(0, k, v, positions)
  return net.midlayer.out(residual, o), cache


def run_chain_row(net: Eagle3Net, embeds: jax.Array, feature: jax.Array, positions: jax.Array, cache: KVCache,
                  chain_kv: tuple[jax.Array, jax.Array] | None,
                  sharpdraft: SharpDraft | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """One speculative row [B, 1] at `positions`, attending to the cached rows before the chain, the chain's earlier
  rows (`chain_kv`: (k, v) [B, i, Hkv, D], or None for the first) and itself. The cache is only read: chain rows
  written into it made XLA copy the whole cache on every chain step. Returns (output hidden [B, 1, H], chain_kv
  with this row appended)."""
  residual, q, k, v = _layer_qkv(net, embeds, feature, positions, sharpdraft)
  if chain_kv is not None:
    k, v = jnp.concatenate([chain_kv[0], k], axis=1), jnp.concatenate([chain_kv[1], v], axis=1)
  return net.midlayer.out(residual, extend_attention(q, k, v, cache.k[0], cache.v[0], positions)), (k, v)


@flax.struct.dataclass
class Eagle3State:
  cache: KVCache  # one layer; lengths = rows holding real features (= num_tokens - 1)
  hidden: jax.Array  # [B, H] output hidden state of the last real row (num_tokens - 2)


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(DrafterSpec):
  graphdef: nnx.GraphDef
  cfg: ModelConfig  # the drafter layer's config (hidden size = the target's)
  taps: tuple[int, ...]  # the target's aux layer ids (residual stream at the input of those layers)
  vocab_size: int  # the target's vocabulary
  draft_vocab_size: int
  dtype: str = "float32"
  sharpdraft: object | None = None  # static, hashable; applied in run_cached
  attn_block: int = 512
  name: str = "eagle3"
  needs_target_kv: bool = False
  max_draft_tokens = None  # any K: a chain of single-token steps
  catch_up_in_propose = False  # update runs the verified rows
  drafts_trees = True

  # params = {"net": nnx.State of Eagle3Net, "embed": the target's [V, H] embedding, "d2t": [draft_vocab] int32}
  def _net(self, params) -> Eagle3Net:
    return nnx.merge(self.graphdef, params["net"])

  def _embed(self, params, tokens):
    return params["embed"][tokens].astype(self.dtype)

  def draft_ids(self, params: dict) -> jax.Array:
    """The target id of each draft-vocabulary entry ([N]; N = V: the identity)."""
    return jnp.arange(self.draft_vocab_size) + params["d2t"]

  def _draft(self, params, net: Eagle3Net, h, sp, key, sample: bool):
    """One draft per row from the output `h` [B, H], and (sampling) its q over the target vocabulary. Tokens outside
    the draft vocabulary have q = 0 whatever the temperature, top-k or top-p (their logit is -inf), so the choice
    among the N draft logits alone is the same draw at N/V of the cost (softmax, random bits)."""
    logits = net.logits(h)
    ids = self.draft_ids(params)
    if not sample:
      return ids[jnp.argmax(logits, axis=-1)].astype(jnp.int32), None
    logq = processed_log_probs(logits, sp)
    d = jax.random.categorical(key, logq, axis=-1)
    q = jnp.exp(logq)
    if self.draft_vocab_size != self.vocab_size:
      q = jnp.zeros(q.shape[:-1] + (self.vocab_size,), q.dtype).at[..., ids].set(q)
    return ids[d].astype(jnp.int32), q

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> Eagle3State:
    net = self._net(params)
    b, t = prefill.prompt_tokens.shape
    cfg = self.cfg
    cache = KVCache.zeros(1, b, max_len, cfg.num_key_value_heads, cfg.head_dim, self.dtype)
    toks = prefill.tokens[:, 1:t + 1]  # row p's token is x_{p+1}; the pending token closes the last prompt row
    feat = net.feature(prefill.taps.astype(self.dtype))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h, cache = run_cached(net, self._embed(params, toks), feat, pos, cache, "prefill", self.sharpdraft,
                          self.attn_block)
    last = jnp.take_along_axis(h, (prefill.prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return Eagle3State(cache=cache.replace(lengths=prefill.prompt_lens), hidden=last)

  def propose(self, params: dict, state: Eagle3State, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, Eagle3State]:
    net = self._net(params)
    keys = jax.random.split(key, num_draft)
    h, chain_kv = state.hidden, None
    row = ctx.num_tokens - 2  # the row whose output is `h`
    drafts, probs = [], []
    for i in range(num_draft):
      d, q = self._draft(params, net, h, ctx.sampling, keys[i], sample)
      drafts.append(d)
      probs.append(q)
      if i + 1 < num_draft:
        out, chain_kv = run_chain_row(net, self._embed(params, d[:, None]), h[:, None], (row + 1 + i)[:, None],
                                      state.cache, chain_kv, self.sharpdraft)
        h = out[:, 0]
    return jnp.stack(drafts, 1), (jnp.stack(probs, 1) if sample else None), state

  def propose_tree(self, params: dict, state: Eagle3State, ctx: ProposeContext,
                   tree: DraftTree) -> tuple[jax.Array, Eagle3State]:
    """Greedy drafts for every node of a `DraftTree` ([B, N], node order), depth by depth: a parent's top-k
    candidates become its children, and each node with children runs the layer on (its token, its parent's output
    hidden) at position row + depth, attending to the cache and its own ancestors. Returns (node tokens, state)."""
    net = self._net(params)
    row = ctx.num_tokens - 2  # the row whose output is state.hidden (the root's)
    parents, depths, ranks = tree.parents.tolist(), tree.depths[1:].tolist(), tree.ranks.tolist()
    has_children = set(parents)
    hidden = {0: state.hidden}  # node -> output hidden [B, H], for the nodes with children
    tokens = [None] * tree.num_nodes
    ran, kv = [], None  # nodes whose rows ran (ancestors of later rows) and their (k, v) [B, len(ran), Hkv, D]
    ids = self.draft_ids(params)
    for d in range(1, tree.depth + 1):
      level = [n for n in range(1, tree.num_nodes + 1) if depths[n - 1] == d]
      heads = sorted({parents[n - 1] for n in level})
      logits = net.logits(jnp.stack([hidden[p] for p in heads], axis=1))  # [B, P, Vd]
      top = jax.lax.top_k(logits, max(ranks[n - 1] for n in level) + 1)[1]
      for n in level:
        tokens[n - 1] = ids[top[:, heads.index(parents[n - 1]), ranks[n - 1]]].astype(jnp.int32)
      rows = [n for n in level if n in has_children]
      if not rows:
        continue
      embeds = self._embed(params, jnp.stack([tokens[n - 1] for n in rows], axis=1))
      feature = jnp.stack([hidden[parents[n - 1]] for n in rows], axis=1)
      positions = jnp.broadcast_to((row + d)[:, None], embeds.shape[:2])
      residual, q, k, v = _layer_qkv(net, embeds, feature, positions, self.sharpdraft)
      if kv is not None:
        k, v = jnp.concatenate([kv[0], k], axis=1), jnp.concatenate([kv[1], v], axis=1)
      kv, ran = (k, v), ran + rows
      mask = tree.ancestor_mask()[np.ix_(rows, ran)]
      o = extend_attention(q, k, v, state.cache.k[0], state.cache.v[0], positions, new_visible=mask,
                           cache_end=row + 1)
      out = net.midlayer.out(residual, o)
      for j, n in enumerate(rows):
        hidden[n] = out[:, j]
    return jnp.stack(tokens, axis=1), state

  def update(self, params: dict, state: Eagle3State, verify: VerifyResult) -> Eagle3State:
    net = self._net(params)
    k1 = verify.committed.shape[1]
    pos = verify.start[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    feat = net.feature(verify.taps.astype(self.dtype))
    h, cache = run_cached(net, self._embed(params, verify.committed), feat, pos, state.cache, "extend",
                          self.sharpdraft)
    last = jnp.take_along_axis(h, jnp.maximum(verify.num_committed - 1, 0)[:, None, None], axis=1)[:, 0]
    hidden = jnp.where((verify.num_committed > 0)[:, None], last.astype(state.hidden.dtype), state.hidden)
    return Eagle3State(cache=cache.replace(lengths=verify.num_tokens - 1), hidden=hidden)

  def attention_logits(self, params: dict, target: Transformer, tokens: jax.Array) -> list[jax.Array]:
    """Pre-softmax attention logits (1/sqrt(d) included, SharpDraft scaling not) of the drafter query that sees
    exactly N keys, after running the target and the drafter over `tokens` [B, N+1]: drafter rows 0..N-1
    (row p = feature at p, token p+1); the query of row N-1 sees rows 0..N-1. One [B, Hq, 1, N] per layer."""
    n = tokens.shape[1] - 1
    if n < 1:
      raise ValueError("attention_logits needs tokens [B, N+1] with N >= 1")
    taps = target(tokens, mode="train", taps=self.taps, return_logits=False).taps
    net = self._net(params)
    x, _ = net.midlayer.inputs(self._embed(params, tokens[:, 1:]), net.feature(taps[:, :n].astype(self.dtype)))
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tokens[:, 1:].shape)
    q, k, _ = net.midlayer.self_attn.qkv(x, pos, rope_frequencies(net.cfg, n - 1))
    k = jnp.repeat(k, self.cfg.q_per_kv, axis=2)  # query head h reads kv head h // G
    logits = jnp.einsum("bqhd,bnhd->bhqn", q[:, -1:], k, preferred_element_type=jnp.float32)
    return [logits * self.cfg.head_dim ** -0.5]


# ---- construction, public-layout export and loading -------------------------------------------------------------

def drafter_config(target: ModelConfig, **arch: Any) -> ModelConfig:
  """The drafter layer's config: the target's hidden size, vocabulary, RoPE and eps; heads / MLP from `arch`."""
  kw = dict(num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size)
  unknown = sorted(set(arch) - set(kw))
  if unknown:
    raise ValueError(f"unknown EAGLE-3 architecture keys {unknown}; known: {sorted(kw)}")
  kw.update(arch)
  return ModelConfig(family="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                     num_hidden_layers=1, max_position_embeddings=target.max_position_embeddings, rope=target.rope,
                     rms_norm_eps=target.rms_norm_eps, tie_word_embeddings=False, **kw)


def create_eagle3_net(cfg: ModelConfig, target: ModelConfig, aux_layers: Sequence[int], draft_vocab: int | None = None,
                      qk_norm: bool = True, seed: int = 0) -> Eagle3Net:
  return Eagle3Net(cfg, len(aux_layers), target.hidden_size, draft_vocab or cfg.vocab_size, qk_norm,
                   rngs=nnx.Rngs(seed))


def eagle3_from_net(net: Eagle3Net, target: Transformer, aux_layers: Sequence[int],
                    d2t: jax.typing.ArrayLike | None = None, sharpdraft: SharpDraft | None = None,
                    dtype: str = "float32") -> LoadedDrafter:
  """A LoadedDrafter from a built net and the target model (whose frozen embedding the drafter reads)."""
  graphdef, state = nnx.split(net)
  draft_vocab = net.lm_head.kernel.shape[1]
  spec = Eagle3Drafter(graphdef=graphdef, cfg=net.cfg, taps=tuple(int(i) for i in aux_layers),
                       vocab_size=target.cfg.vocab_size, draft_vocab_size=draft_vocab, dtype=dtype,
                       sharpdraft=sharpdraft)
  d2t = jnp.zeros((draft_vocab,), jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
  return LoadedDrafter(spec, {"net": state, "embed": target.embed_tokens.embedding[...], "d2t": d2t})


def save_eagle3(net: Eagle3Net, out_dir: str | os.PathLike, aux_layers: Sequence[int], target: ModelConfig, *,
                n0: int | None = None, d2t: jax.typing.ArrayLike | None = None,
                dtype: jax.typing.DTypeLike = jnp.bfloat16) -> Path:
  """config.json + model.safetensors in the public EAGLE-3 layout."""
  from safetensors.numpy import save_file

  from longspec_jax.hf_io import to_hf_tensors

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  cfg = net.cfg
  draft_vocab = net.lm_head.kernel.shape[1]
  hf = cfg.to_hf_dict()
  hf.update(architectures=[ARCHITECTURE], torch_dtype="bfloat16" if dtype == jnp.bfloat16 else np.dtype(dtype).name,
            draft_vocab_size=draft_vocab, target_hidden_size=target.hidden_size,
            eagle_aux_hidden_state_layer_ids=list(aux_layers))  # layer inputs, as vLLM reads them
  if min(aux_layers) >= 1:  # SGLang / SpecForge read eagle_config's ids as layer outputs
    hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in aux_layers],
                          "use_aux_hidden_state": True}
  if n0 is not None:
    hf["n0"] = int(n0)
  tensors = to_hf_tensors(net, dtype, prefix="")
  d2t = np.zeros((draft_vocab,), np.int64) if d2t is None else np.asarray(d2t, np.int64)
  tensors["d2t"] = d2t
  t2d = np.zeros((cfg.vocab_size,), bool)
  t2d[np.arange(draft_vocab) + d2t] = True
  tensors["t2d"] = t2d
  (out / "config.json").write_text(json.dumps(hf, indent=2))
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  return out


def _aux_ids(extra: dict, num_layers: int) -> tuple[int, ...]:
  """Layer-input ids (hf_drafter_formats.to_native has turned SpecForge's layer-output ids into these)."""
  ids = extra.get("eagle_aux_hidden_state_layer_ids")
  return tuple(int(i) for i in ids) if ids else default_aux_layers(num_layers)


def load_eagle3(drafter_dir: str | os.PathLike, target: Transformer,
                sharpdraft: SharpDraft | None = None) -> LoadedDrafter:
  """Loads an EAGLE-3 directory for `target` (a Transformer), validating it against the target: ours or SpecForge's
  (LlamaForCausalLMEagle3) or speculators' layout (hf_drafter_formats)."""
  from longspec_jax.hf_drafter_formats import read_native
  from longspec_jax.hf_io import empty_model, load_params_into

  drafter_dir = Path(drafter_dir)
  read_config_json(drafter_dir / "config.json", "EAGLE-3")  # a missing config is named as an EAGLE-3 one
  tcfg = target.cfg
  d, tensors = read_native(drafter_dir, "eagle3", tcfg.num_hidden_layers)
  extra = {k: d.pop(k) for k in EAGLE_KEYS if k in d}
  cfg = ModelConfig.from_hf_dict(d)
  where = f"EAGLE-3 drafter {drafter_dir}"
  if cfg.num_hidden_layers != 1:
    raise ValueError(f"{where} has num_hidden_layers={cfg.num_hidden_layers}; only single-layer EAGLE-3 drafters "
                     "are supported")
  if extra.get("norm_before_residual"):
    raise ValueError(f"{where} sets norm_before_residual=true, which is not supported")
  if cfg.vocab_size != tcfg.vocab_size:
    raise ValueError(f"{where} has vocab_size {cfg.vocab_size} but the target's vocabulary is {tcfg.vocab_size}: "
                     "drafter and target must share one tokenizer")
  target_hidden = extra.get("target_hidden_size") or cfg.hidden_size
  if cfg.hidden_size != tcfg.hidden_size or target_hidden != tcfg.hidden_size:
    raise ValueError(f"{where} has hidden size {cfg.hidden_size} (target_hidden_size {target_hidden}) but the "
                     f"target's hidden size is {tcfg.hidden_size}: the drafter reads the target's embedding and "
                     "hidden states, so both must equal it")
  aux = _aux_ids(extra, tcfg.num_hidden_layers)
  bad = [i for i in aux if not 0 <= i <= tcfg.num_hidden_layers]
  if bad:
    raise ValueError(f"{where}: aux hidden-state layer ids {bad} are outside the target's [0, "
                     f"{tcfg.num_hidden_layers}]")
  draft_vocab = int(extra.get("draft_vocab_size") or cfg.vocab_size)
  if not 0 < draft_vocab <= cfg.vocab_size:
    raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be in [1, vocab_size={cfg.vocab_size}]")

  d2t = None
  if draft_vocab < cfg.vocab_size:
    if "d2t" not in tensors:
      raise ValueError(f"{where} has a reduced draft vocabulary ({draft_vocab}) but no d2t tensor")
    d2t = np.asarray(tensors["d2t"], np.int64)
    ids = np.arange(draft_vocab) + d2t if d2t.shape == (draft_vocab,) else np.asarray([-1])
    if ids.min() < 0 or ids.max() >= cfg.vocab_size or len(set(ids.tolist())) != draft_vocab:
      raise ValueError(f"{where}: d2t must map the {draft_vocab} draft ids to distinct target ids in "
                       f"[0, {cfg.vocab_size})")
  qk_norm = "midlayer.self_attn.q_norm.weight" in tensors
  net = empty_model(lambda: create_eagle3_net(cfg, tcfg, aux, draft_vocab, qk_norm))
  load_params_into(net, tensors, where=f" {drafter_dir}", prefix="")
  return eagle3_from_net(net, target, aux, d2t, sharpdraft)


# ---------------------------------------------------------------- the training-time forward (trainers and tests)

def _ttt_attention(q, k0, v0, diag_k, diag_v):
  """q [B, T, Hq, D]; step-0 keys/values k0/v0 [B, T, Hkv, D] seen causally; diag_k/v: lists of [B, T, Hkv, D]
  keys/values each seen only by the query of the same row."""
  b, t, hq, d = q.shape
  hkv = k0.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  scale = d ** -0.5
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, NEG_INF)
  sd = [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
        for k in diag_k]
  p = jax.nn.softmax(jnp.concatenate([s, *sd], axis=-1), axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", p[..., :t].astype(v0.dtype), v0, preferred_element_type=jnp.float32)
  for i, v in enumerate(diag_v):
    o = o + jnp.einsum("bkgt,btkd->btkgd", p[..., t + i].astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(b, t, hq, d).astype(q.dtype)


def shifted_rows(rows: jax.Array, shift: int, pad_id: int) -> jax.Array:
  """rows[:, shift:] ([B, W, ...]) right-padded with pad_id back to the same width."""
  pad = jnp.full((rows.shape[0], shift) + rows.shape[2:], pad_id, rows.dtype)
  return jnp.concatenate([rows[:, shift:], pad], axis=1)


def ttt_forward(net: Eagle3Net, embed: jax.Array, tokens: jax.Array, taps: jax.Array, num_steps: int,
                pad_id: int = 0) -> list[tuple[jax.Array, jax.Array]]:
  """The unrolled TTT pass. tokens [B, W], taps [B, W, n_aux, H_t] (the target at every position), embed the
  target's [V, H] table. Returns a list over steps of (output hidden [B, W-1, H], targets [B, W-1]); row p of
  step j predicts targets[:, p] = x_{p+2+j}."""
  b, w = tokens.shape
  r = w - 1
  dtype = taps.dtype
  pos = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32), (b, r))
  rope = rope_frequencies(net.cfg, r + num_steps)
  layer = net.midlayer
  feat = net.feature(taps[:, :r])
  k0 = v0 = None
  diag_k, diag_v, out = [], [], []
  for j in range(num_steps):
    toks = shifted_rows(tokens, 1 + j, pad_id)[:, :r]
    x, residual = layer.inputs(embed[toks].astype(dtype), feat)
    q, k, v = layer.self_attn.qkv(x, pos + j, rope)
    if j == 0:
      k0, v0 = k, v
    else:
      diag_k.append(k)
      diag_v.append(v)
    h = layer.out(residual, _ttt_attention(q, k0, v0, diag_k, diag_v))
    out.append((h, shifted_rows(tokens, 2 + j, pad_id)[:, :r]))
    feat = h
  return out
