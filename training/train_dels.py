"""`longspec train-drafter --drafter dels --base dflash`: the DeLS local head over a frozen DFlash drafter.

Only the local head is trained, with next-token CE inside DFlash-sized blocks of the target's own generations: block
anchored at a reads x_a..x_{a+K-1} (zero GRU state per block) and predicts x_{a+1..a+K}, slot weights
exp(-(k-1)/gamma). No target forward is needed. Trainable: an input projection of the target's frozen embedding
(H -> E), the bias-free GRU (E -> G), a rank projection (G -> r) and an r -> H map into the target's frozen LM head
(zero init); the export fuses them into the public "direct vocab" tables emb [V, E] and head [V, r].

The unigram prior is counted on the training continuations (the tokens the loss sees). alpha/beta are then tuned
on held-out greedy rows by simulated greedy acceptance: for a block of the target's greedy output, the drafts
accepted before the first miss equal the labels, so feeding the labels to the GRU gives exactly the leading-correct
count the engine would see; DFlash's block logits come from the frozen target's taps, as in DFlash training.
"""

from __future__ import annotations

import dataclasses
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import sharding as shd
from longspec_jax.drafters.dels import (TENSOR_NAMES, DeLSConfig, base_is_longspark, combine, cut_to_draft_vocab,
                                        fuse_factors, local_block_logits, resolve_base_dir, save_dels_dir,
                                        unigram_log_prior)
from longspec_jax.drafters.dflash import DFlashModel, load_dflash_model
from longspec_jax.drafters.frozen_target import read_draft_vocab, target_io, trained_draft_vocab
from longspec_jax.hf_io import load_model_dir
from longspec_jax.training.drafter_data import target_name, weights_sha256
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.drafter_common import (block_loss, check_token_ids, kept_store_split, last_logged,
                                                  load_data_dirs, make_tap_fn, pad_token, soft_label_stats,
                                                  split_indices, store_head, store_record, store_target,
                                                  train_to_export, trained_head, write_drafter_json)
from longspec_jax.drafters.dflash import dflash_train_logits, train_batch_logits
from longspec_jax.training.train_dflash import BlockSampler, dflash_store_sampler
from longspec_jax.training.trainer import DataDirsRunConfig, start_run

if TYPE_CHECKING:
  from longspec_jax.model import Transformer
  from longspec_jax.training.distill_store import DistillStore


@dataclasses.dataclass(frozen=True)
class DeLSTrainConfig(DataDirsRunConfig):
  """`longspec train-drafter --drafter dels`: a DeLS-Spec local head over a frozen DFlash."""
  base: str = "dflash"  # the frozen DFlash: a shipped drafter name or a directory
  out_dir: str = "runs/drafter_dels"
  embed_dim: int = 64  # E
  gru_hidden_dim: int = 256  # G
  low_rank_dim: int = 64  # r
  rank_activation: str = "silu"
  context_len: int = 512  # window length the blocks are cut from (only the block tokens are read)
  anchors_per_window: int = 16
  gamma: float = 7.0  # slot-weight decay exp(-(k-1)/gamma)
  steps: int = 1200
  val_fraction: float = 0.1
  val_windows: int = 40
  val_anchors: int = 48
  tune_num_draft: int = 8  # drafts per step the alpha/beta tuning optimizes acceptance for
  alpha_grid: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
  beta_grid: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3)
  # store_dir (StoreRunConfig; `longspec make-distill-store` with the base's taps) replaces data_dirs: blocks
  # anywhere in the store's train windows, the head trained against the target's top-k distribution at each slot
  # (`distill`), alpha/beta tuned on its held-out windows against the target's argmax (DFlash's logits from the
  # stored taps).
  # With a store: no training, the head of this exported DeLS directory (saved as projections) tuned for `base`
  # (one head serves every base: it reads only the block's tokens).
  head_from: str = ""

  def __post_init__(self):
    self.require_positive("embed_dim", "gru_hidden_dim", "low_rank_dim", "context_len", "anchors_per_window",
                          "batch_size", "steps", "val_windows", "val_anchors", "tune_num_draft")
    if self.gamma <= 0 or not 0 < self.val_fraction < 1:
      raise ValueError(f"need gamma > 0 and 0 < val_fraction < 1, got {self.gamma}, {self.val_fraction}")
    if not self.data_dirs or not self.alpha_grid or not self.beta_grid:
      raise ValueError("data_dirs, alpha_grid and beta_grid must be non-empty")
    self.check_store_fields("head_from")


HEAD_PARAMS = ("proj", "w_ih", "w_hh", "rank", "up")  # what training fits (and the export saves)


def init_head_params(cfg: DeLSTrainConfig, hidden: int, seed: int) -> dict:
  """Trainable tables in torch [out, in] layout; `up` starts at zero so the head starts as no correction."""
  e, g, r = cfg.embed_dim, cfg.gru_hidden_dim, cfg.low_rank_dim
  k = jax.random.split(jax.random.key(seed), 4)
  u = lambda key, shape, fan_in: jax.random.uniform(key, shape, jnp.float32, -1, 1) * fan_in ** -0.5
  return {"proj": u(k[0], (e, hidden), hidden), "w_ih": u(k[1], (3 * g, e), g), "w_hh": u(k[2], (3 * g, g), g),
          "rank": u(k[3], (r, g), g), "up": jnp.zeros((hidden, r), jnp.float32)}


def merge_head(params: dict, io: dict, log_prior: jax.typing.ArrayLike) -> dict:
  """Trainable tables + the target's frozen embedding/LM head -> the inference head (direct-vocab tables). An `io`
  whose LM head covers a draft vocabulary (drafter_common.store_head) gives head rows for those tokens alone."""
  return {**fuse_factors(io, params["proj"], params["up"]), "w_ih": params["w_ih"], "w_hh": params["w_hh"],
          "rank": params["rank"], "log_prior": jnp.asarray(log_prior, jnp.float32)}


def shipped_head(trained: dict, io: dict, log_prior: jax.typing.ArrayLike) -> tuple[dict, dict]:
  """(what the export saves: the trained tables rounded to bf16 as stored, and the fp32 prior; the inference head
  fused from exactly those, which alpha/beta are tuned on)."""
  saved = {k: np.asarray(jnp.asarray(trained[k], jnp.bfloat16).astype(jnp.float32)) for k in HEAD_PARAMS}
  saved["log_prior"] = np.asarray(log_prior, np.float32)
  return saved, jax.tree.map(np.asarray, merge_head(saved, io, log_prior))


def block_prev(batch: dict) -> jax.Array:
  """Tokens each block position reads first: the anchor, then the labels before it. [B*A, K]."""
  if "prev" in batch:  # LongSpark's batches carry them
    return batch["prev"].reshape(-1, batch["prev"].shape[-1])
  anchor_tok = jnp.take_along_axis(batch["tokens"], batch["anchors"], axis=1)
  prev = jnp.concatenate([anchor_tok[..., None], batch["labels"][..., :-1]], -1)
  return prev.reshape(-1, prev.shape[-1])


def dels_loss(dcfg: DeLSConfig, params: dict, batch: dict) -> tuple[jax.Array, dict]:
  head = merge_head(params, batch["io"], batch["log_prior"])
  logits = local_block_logits(dcfg, head, block_prev(batch))
  labels, w = batch["labels"].reshape(logits.shape[:2]), batch["label_w"].reshape(logits.shape[:2])
  loss, _ = cross_entropy(logits, labels, w)
  hit = (jnp.argmax(logits, -1) == labels) & (w > 0)
  return loss, {"top1_slot1": jnp.sum(hit[:, 0]) / jnp.maximum(jnp.sum(w[:, 0] > 0), 1)}


def _load_rows(cfg: DeLSTrainConfig):
  """(train rows, val rows, target dir, target config, manifests); rows are (tokens, prompt length, greedy)."""
  data, target_dir, target_cfg = load_data_dirs(cfg.data_dirs, cfg.target_dir)
  rows = [(list(p) + list(c), len(p), float(temp) == 0.0)
          for ds, _ in data for p, c, temp in zip(ds["prompt"], ds["continuation"], ds["temperature"])]
  train, val = split_indices(len(rows), cfg.seed, cfg.val_fraction, min_val=1)
  return [rows[i] for i in train], [rows[i] for i in val], target_dir, target_cfg, [m for _, m in data]


def _sampler_cfg(cfg: DeLSTrainConfig, block_size: int, anchors: int, gamma: float):
  return types.SimpleNamespace(context_len=cfg.context_len, block_size=block_size, anchors_per_window=anchors,
                               gamma=gamma, anywhere_fraction=0.0)  # anchors in the target's continuation


def train_dels(cfg: DeLSTrainConfig, resume: bool = True) -> Path:
  """Trains the local head, tunes alpha/beta; returns the exported directory (or the checkpoint dir when stopped)."""
  if cfg.store_dir:
    return train_dels_from_store(cfg, resume)
  train_rows, val_rows, target_dir, target_cfg, manifests = _load_rows(cfg)
  base_dir = resolve_base_dir(Path.cwd(), cfg.base)
  base_model = load_dflash_model(base_dir)
  base_model.cfg.check_target(target_cfg)
  bs = base_model.cfg.block_size
  v = target_cfg.vocab_size
  check_token_ids([r for r, _, _ in train_rows + val_rows], v)
  pad_id = pad_token(target_cfg)
  sampler = BlockSampler([(r, p) for r, p, _ in train_rows], _sampler_cfg(cfg, bs, cfg.anchors_per_window,
                                                                         cfg.gamma), pad_id, cfg.seed)
  counts = np.bincount(np.concatenate([np.asarray(r[p:], np.int64) for r, p, _ in train_rows]), minlength=v)
  log_prior = unigram_log_prior(counts, v)
  dcfg = DeLSConfig(vocab_size=v, embed_dim=cfg.embed_dim, gru_hidden_dim=cfg.gru_hidden_dim,
                    low_rank_dim=cfg.low_rank_dim, rank_activation=cfg.rank_activation,
                    alpha=(0.0,) * (bs - 1), beta=(0.0,) * (bs - 1))

  target = load_model_dir(target_dir)
  params = init_head_params(cfg, target_cfg.hidden_size, cfg.seed)
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  print(f"DeLS local head: {n_params / 1e6:.3f}M trainable parameters (E={cfg.embed_dim}, G={cfg.gru_hidden_dim}, "
        f"r={cfg.low_rank_dim}) over the frozen DFlash {base_dir}; {len(train_rows)} train / {len(val_rows)} val "
        f"rows, block {bs}")

  run = start_run(cfg, params, resume=resume)
  data_sharding = shd.batch_sharding(run.mesh)
  io = run.replicate(target_io(target))
  prior = run.replicate(jnp.asarray(log_prior, jnp.float32))

  def batch_fn(step):
    batch = jax.device_put(sampler.batch(step, cfg.batch_size), data_sharding)
    return dict(batch, io=io, log_prior=prior)

  t0 = time.time()
  trained, stopped = train_to_export(run, lambda p, b: dels_loss(dcfg, p, b), batch_fn, desc="train-drafter dels",
                                     tokens_fn=lambda s: cfg.batch_size * cfg.anchors_per_window * (bs - 1))
  if stopped:  # (process 0 tunes and exports)
    return stopped
  saved, head = shipped_head(trained, target_io(target), log_prior)
  train_s = time.time() - t0
  tuning = tune_alpha_beta(cfg, val_hits(cfg, dcfg, head, base_model, target, val_rows, pad_id))
  dcfg = dcfg.with_schedule(tuning.pop("alpha"), tuning.pop("beta"))
  return export_dels(cfg, dcfg, saved, base_dir, target_dir, manifests, train_s, tuning)


def val_hits(cfg: DeLSTrainConfig, dcfg: DeLSConfig, head: dict, base_model: DFlashModel, target: Transformer,
             rows: list[tuple], pad_id: int) -> dict:
  """Held-out rows. grid: per block of a greedy row with K real labels, hits [n_grid, N, K] of the combined argmax
  for every (alpha, beta) on the grid (index ia * len(beta_grid) + ib). local_*: the local head alone on all rows."""
  bs = base_model.cfg.block_size
  k = bs - 1
  graphdef, bparams = nnx.split(base_model)
  io = target_io(target)
  tap_fn = make_tap_fn(target, base_model.cfg.taps)
  grid = jnp.asarray([(a, b) for a in cfg.alpha_grid for b in cfg.beta_grid], jnp.float32)
  head = {n: jnp.asarray(x) for n, x in head.items()}

  def local_and_labels(batch):
    return (local_block_logits(dcfg, head, block_prev(batch)), batch["labels"].reshape(-1, k),
            batch["label_w"].reshape(-1, k))

  @jax.jit
  def grid_hits(bparams, batch, taps):
    base = dflash_train_logits(nnx.merge(graphdef, bparams), io, taps, batch["tokens"], batch["anchors"])
    base = base.reshape(-1, k, base.shape[-1]).astype(jnp.float32)
    local, labels, w = local_and_labels(batch)
    hits = lambda ab: jnp.argmax(combine(base, local, head["log_prior"], ab[0], ab[1]), -1) == labels
    return jax.lax.map(hits, grid), jnp.all(w > 0, -1)

  @jax.jit
  def local_stats(batch):
    local, labels, w = local_and_labels(batch)
    ce, n = cross_entropy(local, labels, w)
    return jnp.argmax(local, -1) == labels, w > 0, ce * n, n

  def batches(group):
    sampler = BlockSampler(group, _sampler_cfg(cfg, bs, cfg.val_anchors, 1e9), pad_id, cfg.seed + 1)
    for i in range(-(-min(cfg.val_windows, len(group)) // cfg.batch_size)):
      yield {n: jnp.asarray(x) for n, x in sampler.batch(i, cfg.batch_size).items()}

  out = {"grid": [], "local_hit": [], "real": [], "ce": 0.0, "n": 0.0}
  for batch in batches([(r, p) for r, p, g in rows if g]):
    hits, full = grid_hits(bparams, batch, tap_fn(batch["tokens"]))
    out["grid"].append(np.asarray(hits)[:, np.asarray(full)])
  for batch in batches([(r, p) for r, p, _ in rows]):
    hit, real, ce, n = local_stats(batch)
    out["local_hit"].append(np.asarray(hit))
    out["real"].append(np.asarray(real))
    out["ce"] += float(ce)
    out["n"] += float(n)
  return out


def _leading(hits, k):
  """Mean leading-correct count over the first k positions. hits [..., N, K] -> [...]."""
  return np.cumprod(hits[..., :k], axis=-1).sum(-1).mean(-1)


def tune_alpha_beta(cfg: DeLSTrainConfig, v: dict) -> dict:
  """Grid over scalar (alpha, beta) and a per-position schedule by coordinate ascent, each fitted on one half of
  the held-out blocks `v` (val_hits or store_val_hits) and compared on the other; the better one on the second half
  is kept."""
  if not v["grid"]:
    raise ValueError("no held-out greedy rows to tune alpha/beta on; raise val_fraction")
  hits = np.concatenate(v["grid"], axis=1)  # [n_grid, N, K]
  k_all, kt = hits.shape[2], min(cfg.tune_num_draft, hits.shape[2])
  n = hits.shape[1]
  perm = np.random.default_rng(cfg.seed).permutation(n)
  fit, check = perm[: n // 2], perm[n // 2:]
  pairs = [(a, b) for a in cfg.alpha_grid for b in cfg.beta_grid]
  zero = pairs.index((0.0, 0.0)) if (0.0, 0.0) in pairs else None

  def schedule_score(choice, idx):  # choice [K]: a grid index per position
    return _leading(np.stack([hits[c, idx, i] for i, c in enumerate(choice)], -1), kt)

  scalar_fit = _leading(hits[:, fit], kt)
  best = int(np.argmax(scalar_fit))
  choice = [best] * k_all
  for _ in range(3):  # coordinate ascent: positions interact only through the leading-correct product
    for i in range(kt):
      scores = [schedule_score(choice[:i] + [g] + choice[i + 1:], fit) for g in range(len(pairs))]
      choice[i] = int(np.argmax(scores))
  scalar_check = float(_leading(hits[best, check], kt))
  sched_check = float(schedule_score(choice, check))
  use_schedule = sched_check > scalar_check
  final = choice if use_schedule else [best] * k_all
  all_idx = np.arange(n)
  per_pos = lambda ch: [round(float(x), 4) for x in
                        np.cumprod(np.stack([hits[c, all_idx, i] for i, c in enumerate(ch)], -1), -1).mean(0)]
  local_hit, real = np.concatenate(v["local_hit"]), np.concatenate(v["real"])
  res = {
      "alpha": [pairs[c][0] for c in final], "beta": [pairs[c][1] for c in final],
      "tuning": {
          "held_out_greedy_blocks": int(n), "num_draft": kt,
          "grid_mean_accept_fit_half": {f"{a},{b}": round(float(s), 4) for (a, b), s in zip(pairs, scalar_fit)},
          "scalar_best": {"alpha": pairs[best][0], "beta": pairs[best][1],
                          "mean_accept_check_half": round(scalar_check, 4)},
          "schedule_mean_accept_check_half": round(sched_check, 4),
          "base_alone_mean_accept_check_half": (round(float(_leading(hits[zero, check], kt)), 4)
                                                  if zero is not None else None),
          "chosen": "per-position schedule" if use_schedule else "scalar",
          "accept_per_position_base": per_pos([zero] * k_all) if zero is not None else None,
          "accept_per_position_dels": per_pos(final),
      },
  }
  res["tuning"]["local_head_val_ce"] = round(v["ce"] / max(v["n"], 1), 4)
  res["tuning"]["local_head_val_top1_per_slot"] = [round(float(x), 4) for x in
                                                   (local_hit & real).sum(0) / np.maximum(real.sum(0), 1)]
  return res


def export_dels(cfg: DeLSTrainConfig, dcfg: DeLSConfig, saved: dict, base_dir: Path, target_dir: str | Path,
                manifests: list[dict], train_s: float, tuning: dict) -> Path:
  """saved: shipped_head's tables. manifests: the data dirs' manifests, or with a store its drafter.json "data"
  record (store_record)."""
  final = save_dels_dir(dcfg, saved, Path(cfg.out_dir) / "final", base_drafter=cfg.base)
  info = {
      "kind": "dels",
      "base_drafter": cfg.base,
      "base_weights_sha256": weights_sha256(base_dir),
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "data": manifests if cfg.store_dir else [
          {"dir": Path(d).name, **m["counts"], "temperature": m["settings"]["temperature"],
           "greedy_fraction": m["settings"]["greedy_fraction"]} for d, m in zip(cfg.data_dirs, manifests)],
      "unigram_prior": ("add-one smoothed counts of the target's argmax on the store's train windows" if cfg.store_dir
                        else "add-one smoothed counts of the training continuations"),
      **({"loss": cfg.distill or "kl"} if cfg.store_dir else {}),
      "embed_dim": cfg.embed_dim, "gru_hidden_dim": cfg.gru_hidden_dim, "low_rank_dim": cfg.low_rank_dim,
      "rank_activation": cfg.rank_activation, "gru_start": dcfg.gru_start,
      "steps": 0 if cfg.head_from else cfg.steps, "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "gamma": cfg.gamma,
      "alpha": list(dcfg.alpha), "beta": list(dcfg.beta),
      **tuning["tuning"],
  }
  return write_drafter_json(final, info, last=last_logged(cfg.out_dir), train_s=train_s)


# --- training from a distillation store ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StoreBase:
  """The frozen base block drafter scored on a store's held-out blocks: its model, a sampler of those blocks
  (`num_slots` draft slots each), its block logits [B, A, K, N] of a batch, the head it drafts with ({"io"[,
  "t2d"]}: trained_head) and that head's token ids in column order (None: the whole vocabulary)."""
  model: object
  sampler: object
  logits: object
  head_io: dict
  num_slots: int
  draft_ids: np.ndarray | None


def store_base(base_dir: Path, target: Transformer, store: DistillStore, val_w: np.ndarray,
               cfg: DeLSTrainConfig) -> StoreBase:
  """DFlash or LongSpark (by the base's architecture) on the held-out windows `val_w`, drawn the way that drafter's
  own store evaluation draws them (evaluate_dflash_on_store / evaluate_longspark_on_store), cfg.val_anchors each."""
  from longspec_jax.drafters.longspark import load_longspark_model
  from longspec_jax.drafters.longspark import train_batch_logits as longspark_batch_logits
  from longspec_jax.training import train_longspark
  size = trained_draft_vocab(base_dir)
  ids = read_draft_vocab(base_dir, size) if size else None
  if base_is_longspark(base_dir):
    model = load_longspark_model(base_dir)
    sampler = train_longspark.store_eval_sampler(model, store, val_w, cfg.seed + 1, cfg.val_anchors)
    return StoreBase(model, sampler, longspark_batch_logits,
                     trained_head(target_io(target, final_norm=True), base_dir), model.cfg.block_size, ids)
  model = load_dflash_model(base_dir)
  model.cfg.check_target(target.cfg)
  sampler = dflash_store_sampler(store, val_w, model.cfg.taps, model.cfg.block_size, cfg.seed + 1, cfg.context_len,
                                 cfg.val_anchors, pad_token(target.cfg))
  return StoreBase(model, sampler, train_batch_logits, trained_head(target_io(target), base_dir),
                   model.cfg.block_size - 1, ids)


def _store_head_factors(cfg: DeLSTrainConfig, store, target, train_w, num_slots: int, draft_ids, log_prior,
                        resume: bool):
  """Trains the local head alone on blocks of num_slots + 1 rows anywhere in the store's train windows against the
  target's top-k distribution (cfg.distill) over the base's draft vocabulary (outside it the base's logits are
  -inf: nothing else can be drafted, so the head's softmax need not cover it). Returns (trained tables, seconds)
  or (the checkpoint dir, None) when stopped early."""
  kind = cfg.distill or "kl"
  sampler = dflash_store_sampler(store, train_w, (), num_slots + 1, cfg.seed, cfg.context_len,
                                 cfg.anchors_per_window, pad_token(target.cfg), cfg.gamma)
  ids = np.arange(target.cfg.vocab_size) if draft_ids is None else draft_ids
  head_io, t2d = store_head(target_io(target), ids)
  dcfg = DeLSConfig(vocab_size=target.cfg.vocab_size, embed_dim=cfg.embed_dim, gru_hidden_dim=cfg.gru_hidden_dim,
                    low_rank_dim=cfg.low_rank_dim, rank_activation=cfg.rank_activation,
                    alpha=(0.0,) * num_slots, beta=(0.0,) * num_slots)
  params = init_head_params(cfg, target.cfg.hidden_size, cfg.seed)
  print(f"DeLS local head from the distillation store {store.dir}: "
        f"{sum(int(x.size) for x in jax.tree.leaves(params)) / 1e6:.3f}M trainable parameters; {len(train_w)} "
        f"train windows ({int(sampler.windows.lens.sum())} tokens), vocabulary {len(ids)}, loss {kind}, "
        f"{num_slots} slots")
  run = start_run(cfg, params, resume=resume, record=dataclasses.asdict(cfg))
  extra = {k: run.replicate(x) for k, x in
           {"io": head_io, "t2d": t2d, "log_prior": jnp.asarray(log_prior[ids], jnp.float32)}.items()}

  def batch_fn(step):
    def rows(r):
      b = sampler.batch(step, cfg.batch_size, r)
      b.pop("taps")  # (none read)
      return b
    return {**run.batch(rows, cfg.batch_size), **extra}

  def loss_fn(p, batch):
    logits = local_block_logits(dcfg, merge_head(p, batch["io"], batch["log_prior"]), block_prev(batch))
    return block_loss(logits.reshape(batch["labels"].shape + logits.shape[-1:]), batch, kind)

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, desc="train-drafter dels (store)",
                                     tokens_fn=lambda s: cfg.batch_size * cfg.anchors_per_window * num_slots)
  return (stopped, None) if stopped else (trained, time.time() - t0)


def read_head_factors(drafter_dir: str | Path, cfg: DeLSTrainConfig) -> dict:
  """The trained tables (HEAD_PARAMS) of an exported DeLS head saved as projections of the target's tables, of
  cfg's shape."""
  from longspec_jax.hf_io import _read_tensors
  tensors = {TENSOR_NAMES.get(k, k): np.asarray(v, np.float32) for k, v in _read_tensors(Path(drafter_dir)).items()}
  missing = [k for k in HEAD_PARAMS if k not in tensors]
  if missing:
    raise ValueError(f"head_from {drafter_dir}: no {missing} (a DeLS head exported as target-table projections)")
  got = (tensors["proj"].shape[0], tensors["w_hh"].shape[1], tensors["rank"].shape[0])
  if got != (cfg.embed_dim, cfg.gru_hidden_dim, cfg.low_rank_dim):
    raise ValueError(f"head_from {drafter_dir} has (embed_dim, gru_hidden_dim, low_rank_dim) {got}; the config says "
                     f"{(cfg.embed_dim, cfg.gru_hidden_dim, cfg.low_rank_dim)}")
  return {k: tensors[k] for k in HEAD_PARAMS}


def train_dels_from_store(cfg: DeLSTrainConfig, resume: bool) -> Path:
  """train_dels on a distillation store (or, with head_from, an exported head retuned for another base): the head
  from _store_head_factors, alpha/beta tuned on the base's held-out blocks (store_val_hits); the export holds the
  head as projections of the target's tables."""
  from longspec_jax.training.distill_store import DistillStore

  store = DistillStore(cfg.store_dir)
  target_dir = Path(cfg.target_dir) if cfg.target_dir else store_target(store)
  target = load_model_dir(target_dir)
  base_dir = resolve_base_dir(Path.cwd(), cfg.base)
  v = target.cfg.vocab_size
  # The split the store trainers make with the same seed and val_fraction: tuning blocks the base never saw.
  train_w, val_w, _ = kept_store_split(cfg.out_dir, store, cfg.store_split(store), resume)
  log_prior = unigram_log_prior(store.argmax_counts(train_w, v), v)
  base = store_base(base_dir, target, store, val_w, cfg)
  if cfg.head_from:
    trained, train_s = read_head_factors(cfg.head_from, cfg), 0.0
  else:
    trained, train_s = _store_head_factors(cfg, store, target, train_w, base.num_slots, base.draft_ids, log_prior,
                                           resume)
    if train_s is None:
      return trained
  saved, head = shipped_head(trained, target_io(target), log_prior)
  dcfg = DeLSConfig(vocab_size=v, embed_dim=cfg.embed_dim, gru_hidden_dim=cfg.gru_hidden_dim,
                    low_rank_dim=cfg.low_rank_dim, rank_activation=cfg.rank_activation,
                    alpha=(0.0,) * base.num_slots, beta=(0.0,) * base.num_slots)
  tuning = tune_alpha_beta(cfg, store_val_hits(cfg, dcfg, head, base))
  dcfg = dcfg.with_schedule(tuning.pop("alpha"), tuning.pop("beta"))
  data = store_record(store, train_w, val_w, int(store.window_lengths()[train_w].sum()), "taps")
  if cfg.head_from:
    data[0]["head_from"] = Path(cfg.head_from).parent.name + "/" + Path(cfg.head_from).name
  return export_dels(cfg, dcfg, saved, base_dir, target_dir, data, train_s, tuning)


def store_val_hits(cfg: DeLSTrainConfig, dcfg: DeLSConfig, head: dict, base: StoreBase) -> dict:
  """val_hits on a store's held-out blocks: a slot is a hit when the combined argmax is the target's argmax there
  (the GRU reads the text's own tokens, as in tau_sim). Computed over the base's draft vocabulary, where every
  combined argmax falls."""
  k = base.num_slots
  graphdef, bparams = nnx.split(base.model)
  small = {n: jnp.asarray(x) for n, x in head.items()}
  if base.draft_ids is not None:
    small = cut_to_draft_vocab(small, jnp.asarray(base.draft_ids))
  t2d = jnp.asarray(base.head_io["t2d"]) if "t2d" in base.head_io else jnp.arange(dcfg.vocab_size, dtype=jnp.int32)
  grid = jnp.asarray([(a, b) for a in cfg.alpha_grid for b in cfg.beta_grid], jnp.float32)

  @jax.jit
  def block_hits(bparams, batch):
    logits = base.logits(nnx.merge(graphdef, bparams), {**batch, **base.head_io})
    logits = logits.reshape(-1, k, logits.shape[-1]).astype(jnp.float32)
    local = local_block_logits(dcfg, small, block_prev(batch))
    label = t2d[batch["topk_ids"][..., 0]].reshape(-1, k)  # -1 (outside the draft vocabulary): always a miss
    hits = lambda ab: jnp.argmax(combine(logits, local, small["log_prior"], ab[0], ab[1]), -1) == label
    loss_sums, local_hit, w = soft_label_stats(local.reshape(batch["label_w"].shape + local.shape[-1:]),
                                               {**batch, "t2d": t2d}, "kl")
    real = w > 0
    return (jax.lax.map(hits, grid), jnp.all(real, -1).reshape(-1), (local_hit & real).reshape(-1, k),
            real.reshape(-1, k), jnp.sum(loss_sums), jnp.sum(w))

  out = {"grid": [], "local_hit": [], "real": [], "ce": 0.0, "n": 0.0}
  for i in range(-(-cfg.val_windows // cfg.batch_size)):
    batch = {n: jnp.asarray(x) for n, x in base.sampler.batch(i, cfg.batch_size).items()}
    hits, full, local_hit, real, ce, n = block_hits(bparams, batch)
    out["grid"].append(np.asarray(hits)[:, np.asarray(full)])
    out["local_hit"].append(np.asarray(local_hit))
    out["real"].append(np.asarray(real))
    out["ce"] += float(ce)
    out["n"] += float(n)
  return out
