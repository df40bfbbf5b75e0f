"""DeLS-Spec: a frozen DFlash drafter plus a small recurrent local head that sees the drafts chosen so far.

DFlash drafts all block positions in one parallel pass, so slot i never sees the drafts before it. The local head
is a 1-layer bias-free GRU over (small, projected) target embeddings of the tokens chosen so far in the block, zero
state per block, read out through a rank-r projection and a [V, r] head (the target's LM head times a learned
r -> H map, fused). Per block position i the logits are combined as

  z_i = z_dflash_i + alpha_i * z_local_i - beta_i * log p_unigram

and the block is decoded left to right in a `lax.scan`: the token chosen at position i is fed to the GRU before
position i+1. Greedy drafts take argmax z_i; sampled drafts are drawn from processed(z_i), and that distribution is
returned as q, so rejection sampling stays exact.

Where the GRU starts (`gru_start`):
  "pending": our default. The GRU first reads the pending token (the block's anchor), so every draft, the first
    included, is corrected. This matches the public trainer, which feeds x_a..x_{a+K-1} for targets x_{a+1..a+K}.
  "first_draft": the public runtime. Draft 1 is DFlash's alone; the GRU starts at draft 1 (never sees the pending
    token). Position 0's alpha/beta are ignored. Public checkpoints load in this mode.

The base is any parallel block drafter with `block_logits(params, state, pending, num_draft)`: DFlash (the
paper's), DFlash over BudgetDraft's sparse context view (`dels --budget N`), LongSpark without a Markov head
(`longspark-dels`: the head corrects its later slots the same way), or their ensemble (combined.py).

Tensor names follow the public local-head state dict (`prefix_gru.weight_ih_l0` [3G, E] with gates r, z, n,
`prefix_gru.weight_hh_l0` [3G, G], `rank_proj.weight` [r, G], and either the direct-vocab tables
`embed_tokens.weight` [V, E] and `low_rank_lm_head.weight` [V, r], or the unmerged projections of the target's
own tables `embed_down_proj.weight` [E, H] and `rank_to_hidden.weight` [H, r], fused with the target's embedding and
LM head at load: 100x smaller for a 49K vocabulary) plus `log_prior` [V]. DeLS adds no state: it carries the base's
state and the base's update.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.config import read_config_json
from longspec_jax.drafters.base import LoadedDrafter, ReadsLikeInner
from longspec_jax.drafters.dflash import load_dflash
from longspec_jax.drafters.longspark import (ARCHITECTURE as LONGSPARK, PUBLIC_ARCHITECTURE as PUBLIC_LONGSPARK,
                                             LongSparkDrafter, load_longspark)
from longspec_jax.drafters.registry import DrafterEntry
from longspec_jax.sampling import processed_log_probs

if TYPE_CHECKING:
  from longspec_jax.drafters.base import Drafter, PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer
  from longspec_jax.sampling import SamplingParams
  from longspec_jax.sharpdraft import SharpDraft

ARCHITECTURE = "DeLSLocalHead"
WEIGHTS_FILE = "model.safetensors"
# DeLS-Spec's release (dt3t/DeLS-Spec-Weights/<target>/): the local head and the unigram counts of its training
# tokens, both torch files. Copied beside the config.json of the z-lab DFlash they correct, they make that directory
# a `dels` drafter (load_public_dels_dir).
PUBLIC_HEAD_FILE = "local_head.pt"
PUBLIC_PRIOR_FILE = "loss_mask_unigram.pt"
GRU_STARTS = ("pending", "first_draft")
ACTIVATIONS = ("identity", "silu")
# Public state-dict name -> our head pytree key.
TENSOR_NAMES = {"embed_tokens.weight": "emb", "prefix_gru.weight_ih_l0": "w_ih", "prefix_gru.weight_hh_l0": "w_hh",
                "rank_proj.weight": "rank", "low_rank_lm_head.weight": "head", "log_prior": "log_prior",
                "embed_down_proj.weight": "proj", "rank_to_hidden.weight": "up"}
# `budget=N`: the head over BudgetDraft's sparse view of the DFlash context (`dflash-budget`), the combination
# of two seeds whose state stays constant in the context.
DRAFTERS = (DrafterEntry(name="dels", loader="load_dels", checkpoint="dels", options=("budget",),
                         architectures=("DeLSLocalHead", "DFlashDraftModel"),
                         trainer="longspec_jax.training.train_dels:DeLSTrainConfig:train_dels"),
            # The local head over LongSpark (checkpoint: its alpha/beta and head, naming the LongSpark it corrects).
            DrafterEntry(name="longspark-dels", loader="load_dels", checkpoint="longspark-dels",
                         architectures=("DeLSLocalHead",)))


@dataclasses.dataclass(frozen=True)
class DeLSConfig:
  vocab_size: int
  embed_dim: int  # E: GRU input width (= the target's hidden size for the full-embedding variant)
  gru_hidden_dim: int  # G
  low_rank_dim: int  # r
  alpha: tuple[float, ...]  # per block position (K_max = block_size - 1 entries): local-head weight
  beta: tuple[float, ...]  # per block position: weight of -log p_unigram
  rank_activation: str = "silu"
  gru_start: str = "pending"

  def __post_init__(self):
    for name in ("vocab_size", "embed_dim", "gru_hidden_dim", "low_rank_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"DeLS {name} must be >= 1, got {getattr(self, name)}")
    if self.rank_activation not in ACTIVATIONS:
      raise ValueError(f"DeLS rank_activation must be one of {ACTIVATIONS}, got {self.rank_activation!r}")
    if self.gru_start not in GRU_STARTS:
      raise ValueError(f"DeLS gru_start must be one of {GRU_STARTS}, got {self.gru_start!r}")
    if not self.alpha or len(self.alpha) != len(self.beta):
      raise ValueError(f"DeLS alpha and beta need one entry per block position, got {len(self.alpha)} and "
                       f"{len(self.beta)}")

  def with_schedule(self, alpha: float | Sequence[float], beta: float | Sequence[float]) -> "DeLSConfig":
    """alpha/beta as scalars (broadcast over this config's positions) or per-position sequences."""
    n = len(self.alpha)
    expand = lambda x: tuple(float(v) for v in (np.full(n, x) if np.ndim(x) == 0 else x))
    return dataclasses.replace(self, alpha=expand(alpha), beta=expand(beta))

  def mix_weights(self, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(alpha [k], beta [k], feed [k]): feed[i] = whether position i's step first reads a token into the GRU."""
    if k > len(self.alpha):
      raise ValueError(f"num_draft_tokens {k} exceeds the {len(self.alpha)} positions DeLS has weights for")
    alpha, beta = np.asarray(self.alpha[:k], np.float32), np.asarray(self.beta[:k], np.float32)
    feed = np.ones(k, bool)
    if self.gru_start == "first_draft":
      alpha[0] = beta[0] = 0.0
      feed[0] = False
    return jnp.asarray(alpha), jnp.asarray(beta), jnp.asarray(feed)


def gru_cell(head: dict, x: jax.Array, h: jax.Array) -> jax.Array:
  """torch.nn.GRU (bias=False) step: x [N, E], h [N, G] -> [N, G]; weight rows are the gates r, z, n."""
  gi = jnp.einsum("ne,ge->ng", x, head["w_ih"])
  gh = jnp.einsum("nh,gh->ng", h, head["w_hh"])
  i_r, i_z, i_n = jnp.split(gi, 3, axis=-1)
  h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)
  r = jax.nn.sigmoid(i_r + h_r)
  z = jax.nn.sigmoid(i_z + h_z)
  n = jnp.tanh(i_n + r * h_n)
  return (1.0 - z) * n + z * h


def local_logits(cfg: DeLSConfig, head: dict, h: jax.Array) -> jax.Array:
  s = jnp.einsum("ng,rg->nr", h, head["rank"])
  if cfg.rank_activation == "silu":
    s = jax.nn.silu(s)
  return jnp.einsum("nr,vr->nv", s, head["head"])


def local_block_logits(cfg: DeLSConfig, head: dict, prev: jax.Array) -> jax.Array:
  """Teacher-forced local logits [N, K, V]: prev [N, K] are the tokens read before each position (the pending
  token then drafts 1..K-1 for gru_start "pending"); a position whose feed flag is off reads nothing."""
  n, k = prev.shape
  _, _, feed = cfg.mix_weights(k)

  def step(h, xs):
    tok, f = xs
    h = jnp.where(f, gru_cell(head, head["emb"][tok], h), h)
    return h, local_logits(cfg, head, h)

  h0 = jnp.zeros((n, cfg.gru_hidden_dim), jnp.float32)
  _, out = jax.lax.scan(step, h0, (prev.T, feed))
  return jnp.swapaxes(out, 0, 1)


def combine(base: jax.Array, local: jax.Array, log_prior: jax.Array, alpha: jax.Array, beta: jax.Array) -> jax.Array:
  """z = base + alpha * local - beta * log p_unigram; alpha/beta broadcast over the trailing vocab axis."""
  return base + alpha[..., None] * local - beta[..., None] * log_prior


def decode_block(cfg: DeLSConfig, head: dict, base_logits: jax.Array, pending: jax.Array,
                 sp: SamplingParams | None = None, key: jax.Array | None = None,
                 ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Left-to-right decode of one block. base_logits [B, K, V] (the base's), pending [B].
  Returns (drafts [B, K], z [B, K, V]) greedily (sp None), or (drafts, log q [B, K, V]) when sampling with sp.
  ids [N]: the columns are these target tokens alone (a draft vocabulary; head["head"] and the prior cut to them),
  z / log q cover them and drafts are target ids."""
  b, k, _ = base_logits.shape
  alpha, beta, feed = cfg.mix_weights(k)
  # Everything that does not depend on the drafts is done for the whole block before the scan: the prior term,
  # and (sampling) the Gumbel noise, so each step draws argmax(log q + g) = a sample of q.
  base = jnp.swapaxes(base_logits, 0, 1).astype(jnp.float32) - beta[:, None, None] * head["log_prior"]
  noise = jax.random.gumbel(key, base.shape) if sp is not None else jnp.zeros((k,), jnp.float32)

  def step(carry, xs):
    h, prev = carry
    base_i, a_i, f_i, g_i = xs
    h = jnp.where(f_i, gru_cell(head, head["emb"][prev], h), h)
    z = base_i + a_i * local_logits(cfg, head, h)
    out = z if sp is None else processed_log_probs(z, sp)
    tok = jnp.argmax(out + g_i, -1).astype(jnp.int32)
    tok = tok if ids is None else ids[tok]
    return (h, tok), (tok, out)

  h0 = jnp.zeros((b, cfg.gru_hidden_dim), jnp.float32)
  _, (toks, out) = jax.lax.scan(step, (h0, pending.astype(jnp.int32)), (base, alpha, feed, noise))
  return toks.T, jnp.swapaxes(out, 0, 1)


@dataclasses.dataclass(frozen=True)
class DeLSDrafter(ReadsLikeInner):
  base: Any  # DFlashDrafter | LongSparkDrafter | combined.BlockEnsembleDrafter
  cfg: DeLSConfig
  name: str = "dels"
  catch_up_in_propose = False  # the base's update

  @property
  def inner(self) -> Drafter:
    return self.base  # its block limit too: dels_from_head checks there are alpha/beta for that many positions

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> Any:
    return self.base.init_state(params["base"], prefill, max_len)

  def propose(self, params: dict, state: Any, ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, Any]:
    pending = ctx.pending
    base_logits = self.base.block_logits(params["base"], state, pending, num_draft)
    # A base with a draft vocabulary gives -inf to every other token, so the block is decoded over its columns
    # alone (the head and prior were cut to them in dels_from_head): the same drafts and q, a 6x smaller head.
    ids = params["base"]["io"].get("draft_ids")
    if ids is not None:
      base_logits = jnp.take(base_logits, ids, axis=-1)
    if not sample:
      drafts, _ = decode_block(self.cfg, params["head"], base_logits, pending, ids=ids)
      return drafts, None, state
    drafts, logq = decode_block(self.cfg, params["head"], base_logits, pending, ctx.sampling, key, ids)
    q = jnp.exp(logq)
    if ids is not None:
      q = jnp.zeros(q.shape[:-1] + (self.vocab_size,), q.dtype).at[..., ids].set(q)
    return drafts, q, state

  def update(self, params: dict, state: Any, verify: VerifyResult) -> Any:
    return self.base.update(params["base"], state, verify)


def dels_from_head(base: LoadedDrafter, cfg: DeLSConfig, head: dict, name: str = "dels") -> LoadedDrafter:
  if not base.spec.drafts_blocks:  # DFlash, LongSpark or their ensemble (combined.py)
    raise ValueError(f"DeLS corrects a parallel block drafter (DFlash, LongSpark or their ensemble), not "
                     f"{base.spec.name!r}")
  if isinstance(base.spec, LongSparkDrafter) and base.spec.cfg.markov_rank:
    raise ValueError("DeLS over a LongSpark with a Markov head: its slots already read the previous draft; use "
                     "one without (markov_rank 0)")
  if cfg.vocab_size != base.spec.vocab_size:
    raise ValueError(f"DeLS local head vocabulary {cfg.vocab_size} does not match the base drafter's "
                     f"{base.spec.vocab_size}")
  if len(cfg.alpha) < base.spec.max_draft_tokens:
    raise ValueError(f"DeLS has alpha/beta for {len(cfg.alpha)} positions; the base {base.spec.name} drafts up to "
                     f"{base.spec.max_draft_tokens}")
  check_head(cfg, head)
  head = {k: jnp.asarray(v, jnp.float32) for k, v in head.items()}
  ids = base.params["io"].get("draft_ids")
  if ids is not None:  # see DeLSDrafter.propose
    head = cut_to_draft_vocab(head, ids)
  return LoadedDrafter(DeLSDrafter(base=base.spec, cfg=cfg, name=name), {"base": base.params, "head": head})


def head_shapes(cfg: DeLSConfig) -> dict:
  v, e, g, r = cfg.vocab_size, cfg.embed_dim, cfg.gru_hidden_dim, cfg.low_rank_dim
  return {"emb": (v, e), "w_ih": (3 * g, e), "w_hh": (3 * g, g), "rank": (r, g), "head": (v, r), "log_prior": (v,)}


def check_head(cfg: DeLSConfig, head: dict) -> None:
  want = head_shapes(cfg)
  missing = sorted(set(want) - set(head))
  if missing:
    raise ValueError(f"DeLS local head lacks {missing}")
  bad = {k: (tuple(head[k].shape), s) for k, s in want.items() if tuple(head[k].shape) != s}
  if bad:
    raise ValueError(f"DeLS local head tensor shapes (got, expected): {bad}")


def fuse_factors(io: dict, proj: jax.typing.ArrayLike, up: jax.typing.ArrayLike) -> dict:
  """The direct-vocab tables {emb [V, E], head [V, r]} from the projections of the target's own tables: proj
  [E, H] (embedding -> GRU input) and up [H, r] (rank -> the target's LM head). io: frozen_target.target_io."""
  embed = jnp.asarray(io["embed"], jnp.float32)  # [V, H]
  lm_head = jnp.asarray(io["lm_head"], jnp.float32).T if "lm_head" in io else embed  # [V or N, H]
  return {"emb": embed @ jnp.asarray(proj, jnp.float32).T, "head": lm_head @ jnp.asarray(up, jnp.float32)}


def unigram_log_prior(counts: np.ndarray | Sequence[float], vocab_size: int) -> np.ndarray:
  """log((count + 1) / sum): add-one smoothing over the vocabulary, as the public code does."""
  c = np.zeros(vocab_size, np.float64)
  counts = np.asarray(counts, np.float64).reshape(-1)
  if counts.size > vocab_size:
    raise ValueError(f"unigram counts cover {counts.size} tokens, more than the vocabulary {vocab_size}")
  c[:counts.size] = counts
  c += 1.0
  return (np.log(c) - np.log(c.sum())).astype(np.float32)


# ---- our checkpoint directory -----------------------------------------------------------------------------------

def save_dels_dir(cfg: DeLSConfig, head: dict, out_dir: str | os.PathLike, base_drafter: str,
                  extra_config: dict | None = None) -> Path:
  """config.json + model.safetensors (bf16 tables, fp32 prior). base_drafter: a shipped drafter name or a path
  (relative to out_dir) of the frozen base this head was tuned on. `head` holds either the direct-vocab tables
  (emb, head) or the target-table projections (proj, up: see fuse_factors), saved as given."""
  import ml_dtypes
  from safetensors.numpy import save_file

  factored = "proj" in head
  if factored:
    want = {"proj": (cfg.embed_dim, None), "up": (None, cfg.low_rank_dim)}
    bad = {k: tuple(head[k].shape) for k, (a, b) in want.items()
           if np.ndim(head[k]) != 2 or (a and head[k].shape[0] != a) or (b and head[k].shape[1] != b)}
    if bad:
      raise ValueError(f"DeLS projections need proj [E={cfg.embed_dim}, H] and up [H, r={cfg.low_rank_dim}], "
                       f"got {bad}")
    check_head(cfg, {**head, "emb": np.zeros((cfg.vocab_size, cfg.embed_dim)),
                     "head": np.zeros((cfg.vocab_size, cfg.low_rank_dim))})
  else:
    check_head(cfg, head)
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  conf = {"architectures": [ARCHITECTURE], "base_drafter": base_drafter,
          "model_config": {"vocab_size": cfg.vocab_size, "embed_dim": cfg.embed_dim,
                           "gru_hidden_dim": cfg.gru_hidden_dim, "low_rank_dim": cfg.low_rank_dim,
                           "rank_activation": cfg.rank_activation,
                           "rnn_parameterization": "projected_target_embedding" if factored else "direct_vocab",
                           "lm_head_mode": "target_lm_head" if factored else "low_rank"},
          "gru_start": cfg.gru_start, "alpha": list(cfg.alpha), "beta": list(cfg.beta), **(extra_config or {})}
  (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
  names = {v: k for k, v in TENSOR_NAMES.items()}
  tensors = {names[k]: np.ascontiguousarray(v, np.float32) for k, v in head.items()}  # (safetensors writes the buffer)
  tensors = {k: (v if k == "log_prior" else v.astype(ml_dtypes.bfloat16)) for k, v in tensors.items()}
  save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
  return out_dir


def resolve_base_dir(drafter_dir: Path, name: str) -> Path:
  """A base drafter named in a DeLS config: a shipped drafter name, else a path (relative to drafter_dir)."""
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
  path = Path(name)
  if len(path.parts) == 1 and (SHIPPED_DRAFTERS_DIR / name / "config.json").exists():
    return SHIPPED_DRAFTERS_DIR / name
  return path if path.is_absolute() else drafter_dir / path


def base_is_longspark(base_dir: str | os.PathLike) -> bool:
  """Whether the block drafter in base_dir is a LongSpark (else a DFlash), by its config's architecture."""
  archs = read_config_json(Path(base_dir) / "config.json", "DeLS base drafter").get("architectures") or []
  return bool({LONGSPARK, PUBLIC_LONGSPARK} & set(archs))


def cut_to_draft_vocab(head: dict, ids: jax.Array) -> dict:
  """The head's output table and prior cut to a base's draft vocabulary `ids` (see DeLSDrafter.propose)."""
  return {**head, "head": head["head"][ids], "log_prior": head["log_prior"][ids]}


def load_base(base_dir: str | os.PathLike, target: Transformer, sharpdraft: SharpDraft | None = None,
              budget: int | None = None) -> LoadedDrafter:
  """The block drafter a DeLS head corrects: DFlash or LongSpark (base_is_longspark), each drafting over the draft
  vocabulary it was trained with; with `budget`, the DFlash over BudgetDraft's sparse context view."""
  if base_is_longspark(base_dir):
    if sharpdraft is not None:
      raise ValueError("SharpDraft applies to a DFlash base; LongSpark's views do not grow with the context")
    if budget is not None:
      raise ValueError("a budget applies to a DFlash base; LongSpark's state is constant already")
    return load_longspark(base_dir, target)
  if budget is not None:
    if sharpdraft is not None:
      raise ValueError("SharpDraft scales attention over a growing key set; a budget view's is fixed")
    from longspec_jax.drafters.budget import load_dflash_budget
    return load_dflash_budget(base_dir, target, budget=budget)
  return load_dflash(base_dir, target, sharpdraft=sharpdraft)


def read_dels_head(drafter_dir: str | os.PathLike, target: Transformer) -> tuple[DeLSConfig, dict, dict]:
  """(config, head tables, config.json) of our DeLS directory; projected tables are fused with `target`'s."""
  from longspec_jax.hf_io import _read_tensors
  drafter_dir = Path(drafter_dir)
  path = drafter_dir / "config.json"
  conf = read_config_json(path, "DeLS")
  if ARCHITECTURE not in (conf.get("architectures") or []):
    hint = (f"; a DFlash directory drafts as DeLS with DeLS-Spec's {PUBLIC_HEAD_FILE} and {PUBLIC_PRIOR_FILE} "
            "beside its config.json" if "DFlashDraftModel" in (conf.get("architectures") or []) else "")
    raise ValueError(f"not a DeLS local-head config: {path} (architectures {conf.get('architectures')}){hint}")
  mc = conf["model_config"]
  cfg = DeLSConfig(vocab_size=int(mc["vocab_size"]), embed_dim=int(mc["embed_dim"]),
                   gru_hidden_dim=int(mc["gru_hidden_dim"]), low_rank_dim=int(mc["low_rank_dim"]),
                   rank_activation=mc.get("rank_activation", "identity"), gru_start=conf.get("gru_start", "pending"),
                   alpha=tuple(float(a) for a in conf["alpha"]), beta=tuple(float(b) for b in conf["beta"]))
  tensors = _read_tensors(drafter_dir)
  unknown = sorted(set(tensors) - set(TENSOR_NAMES))
  if unknown:
    raise ValueError(f"unexpected DeLS tensors {unknown} in {drafter_dir}")
  head = {TENSOR_NAMES[k]: np.asarray(v, np.float32) for k, v in tensors.items()}
  if "proj" in head or "up" in head:
    if not {"proj", "up"} <= set(head) or {"emb", "head"} & set(head):
      raise ValueError(f"{drafter_dir}: a DeLS head holds either both projections (embed_down_proj, "
                       f"rank_to_hidden) or both direct-vocab tables, got {sorted(tensors)}")
    from longspec_jax.drafters.frozen_target import target_io
    head.update(fuse_factors(target_io(target), head.pop("proj"), head.pop("up")))
  return cfg, head, conf


def load_dels(drafter_dir: str | os.PathLike, target: Transformer, base_dir: str | os.PathLike | None = None,
              sharpdraft: SharpDraft | None = None, budget: int | None = None) -> LoadedDrafter:
  """Our DeLS directory: the local head, its alpha/beta, and the base block drafter it names (or `base_dir`);
  `budget` puts the DFlash base on BudgetDraft's sparse view (load_base). A DFlash directory holding DeLS-Spec's
  released files loads as that release (load_public_dels_dir)."""
  if base_dir is None and (Path(drafter_dir) / PUBLIC_HEAD_FILE).is_file():
    return load_public_dels_dir(drafter_dir, target, sharpdraft, budget)
  cfg, head, conf = read_dels_head(drafter_dir, target)
  base = load_base(Path(base_dir) if base_dir else resolve_base_dir(Path(drafter_dir), conf["base_drafter"]),
                   target, sharpdraft, budget)
  name = "longspark-dels" if isinstance(base.spec, LongSparkDrafter) else "dels"
  return dels_from_head(base, cfg, head, name=name)


# ---- public local-head checkpoints (SpecForge local_head.pt / merged_rnn_local_head.pt) -------------------------

def load_public_local_head(path: str | os.PathLike, target: Transformer, block_size: int,
                           alpha: float | Sequence[float] = 0.3, beta: float | Sequence[float] = 0.3,
                           unigram_counts: np.ndarray | Sequence[float] | None = None) -> tuple[DeLSConfig, dict]:
  """(DeLSConfig, head) from a public torch checkpoint {model_config, model_state_dict}:
  - the projected-input ("direct_vocab", merged_rnn_local_head.pt) variant carries `embed_tokens.weight` [V, E];
  - the full-embedding variant (E = the target's hidden size) reads the target's own embedding;
  the head is `low_rank_lm_head.weight` [V, r] or, with lm_head_mode "target_lm_head", `rank_to_hidden.weight`
  [H, r] fused with the target's LM head. The prior is uniform unless `unigram_counts` [V] is given. The public
  runtime's schedule: draft 1 uncorrected, the GRU starting at it."""
  import torch
  ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
  if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model_state_dict" not in ckpt:
    raise ValueError(f"{path}: a public DeLS local head holds model_config and model_state_dict")
  mc, sd = ckpt["model_config"], {k: v.detach().float().numpy() for k, v in ckpt["model_state_dict"].items()}
  if "embed_down_proj.weight" in sd:
    raise ValueError(f"{path} keeps an unmerged input projection; convert it to merged_rnn_local_head.pt first")
  tcfg = target.cfg
  v = int(mc["vocab_size"])
  if v != tcfg.vocab_size:
    raise ValueError(f"{path}: local head vocabulary {v} vs the target's {tcfg.vocab_size}")
  embed = np.asarray(target.embed_tokens.embedding[...], np.float32)  # [V, H]
  lm_head = embed if target.lm_head is None else np.asarray(target.lm_head.kernel[...], np.float32).T  # [V, H]
  direct = mc.get("rnn_parameterization", mc.get("local_head_parameterization")) == "direct_vocab" or \
      mc.get("architecture") == "direct_vocab_rnn"
  if direct:
    if "embed_tokens.weight" not in sd:
      raise ValueError(f"{path}: a direct-vocab local head needs embed_tokens.weight")
    emb = sd.pop("embed_tokens.weight")
  else:
    if int(mc["embed_dim"]) != tcfg.hidden_size:
      raise ValueError(f"{path}: the full-embedding local head reads the target embedding, so embed_dim "
                       f"{mc['embed_dim']} must equal the hidden size {tcfg.hidden_size}")
    emb = embed
    sd.pop("embed_tokens.weight", None)
  if mc.get("lm_head_mode", "low_rank") == "target_lm_head":
    if "rank_to_hidden.weight" not in sd:
      raise ValueError(f"{path}: lm_head_mode target_lm_head needs rank_to_hidden.weight")
    head = lm_head @ sd.pop("rank_to_hidden.weight")
    sd.pop("low_rank_lm_head.weight", None)
  else:
    head = sd.pop("low_rank_lm_head.weight", None)
    if head is None:
      raise ValueError(f"{path}: no low_rank_lm_head.weight")
  sd.pop("target_lm_head.weight", None)
  want = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "rank_proj.weight")
  missing = [k for k in want if k not in sd]
  if missing:
    raise ValueError(f"{path}: missing local-head tensors {missing}")
  extra = sorted(set(sd) - set(want))
  if extra:
    raise ValueError(f"{path}: unexpected local-head tensors {extra}")
  n = block_size - 1
  cfg = DeLSConfig(vocab_size=v, embed_dim=int(mc["embed_dim"]), gru_hidden_dim=int(mc["gru_hidden_dim"]),
                   low_rank_dim=int(mc["low_rank_dim"]), rank_activation=mc.get("rank_activation", "identity"),
                   gru_start="first_draft", alpha=(0.0,) * n, beta=(0.0,) * n).with_schedule(alpha, beta)
  prior = unigram_log_prior(unigram_counts if unigram_counts is not None else np.zeros(v), v)
  head = {"emb": emb, "w_ih": sd["prefix_gru.weight_ih_l0"], "w_hh": sd["prefix_gru.weight_hh_l0"],
          "rank": sd["rank_proj.weight"], "head": head, "log_prior": prior}
  check_head(cfg, head)
  return cfg, {k: jnp.asarray(x, jnp.float32) for k, x in head.items()}


def load_public_dels(path: str | os.PathLike, base: LoadedDrafter, target: Transformer,
                     alpha: float | Sequence[float] = 0.3, beta: float | Sequence[float] = 0.3,
                     unigram_counts: np.ndarray | Sequence[float] | None = None) -> LoadedDrafter:
  cfg, head = load_public_local_head(path, target, base.spec.cfg.block_size, alpha, beta, unigram_counts)
  return dels_from_head(base, cfg, head)


def read_public_unigram_counts(path: str | os.PathLike) -> np.ndarray:
  """The token counts in DeLS-Spec's loss_mask_unigram.pt: a tensor, or a dict holding it under "counts"."""
  import torch
  stats = torch.load(str(path), map_location="cpu", weights_only=True)
  counts = stats.get("counts") if isinstance(stats, dict) else stats
  if not torch.is_tensor(counts):
    raise ValueError(f"{path}: a DeLS-Spec unigram prior holds a count tensor, or a dict with one under 'counts'")
  return counts.double().numpy().reshape(-1)


def load_public_dels_dir(drafter_dir: str | os.PathLike, target: Transformer, sharpdraft: SharpDraft | None = None,
                         budget: int | None = None) -> LoadedDrafter:
  """A DFlash directory (z-lab's layout) holding DeLS-Spec's released local_head.pt and loss_mask_unigram.pt: the
  head over that DFlash, at the public runtime's alpha = beta = 0.3 (its README's setting; the prior is add-one
  smoothed counts, as its runtime's default)."""
  drafter_dir = Path(drafter_dir)
  prior = drafter_dir / PUBLIC_PRIOR_FILE
  if not prior.is_file():
    raise FileNotFoundError(f"{prior} is missing: DeLS-Spec's runtime subtracts beta * log p_unigram, from the "
                            f"{PUBLIC_PRIOR_FILE} released beside {PUBLIC_HEAD_FILE}")
  base = load_base(drafter_dir, target, sharpdraft, budget)
  return load_public_dels(drafter_dir / PUBLIC_HEAD_FILE, base, target,
                          unigram_counts=read_public_unigram_counts(prior))
