"""`longspec train-drafter --drafter dflash`: the DFlash block drafter, trained on the target's own generations.

Each training window (a data row: corpus prompt + the target's continuation, at most `context_len` = n0 tokens)
is run once through the frozen target for its hidden-state taps. A anchors are drawn per window in the
continuation; anchor a's block is [x_a, MASK x (B-1)] at positions a..a+B-1, sees the context features of
positions < a and its own block only (bidirectionally), and slot k is trained to predict x_{a+k} with weight
exp(-(k-1)/gamma): early slots matter most, since a draft is only accepted after all the ones before it. All A
blocks of a window share one context K/V computation and one attention call with a block-diagonal mask.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.drafters.dflash import (DFlashModel, create_dflash, dflash_config_for, dflash_train_logits,
                                         save_dflash_dir, train_batch_logits)
from longspec_jax.drafters.frozen_target import target_io
from longspec_jax.hf_io import load_model_dir
from longspec_jax.model import param_count
from longspec_jax.training.drafter_data import target_name, weights_sha256
from longspec_jax.training.feature_cache import open_row_taps, with_taps
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.drafter_common import (block_loss, block_stats_fn, check_token_ids, copy_target_layers,
                                                  draw_windows, fold_input_scale, inverse_median_scale,
                                                  kept_store_split, last_logged, load_data_dirs, make_tap_fn, pad_token,
                                                  split_indices, store_evaluator, store_head, store_record,
                                                  store_target, train_store_drafter, train_to_export, trained_head,
                                                  write_draft_vocab, write_drafter_json)
from longspec_jax.training.trainer import DataDirsRunConfig, start_run, start_store_run

if TYPE_CHECKING:
  from longspec_jax.model import Transformer
  from longspec_jax.training.distill_store import DistillStore
  from longspec_jax.training.feature_cache import RowTaps


@dataclasses.dataclass(frozen=True)
class DFlashTrainConfig(DataDirsRunConfig):
  """`longspec train-drafter --drafter dflash`: a DFlash block drafter over the target's taps."""
  out_dir: str = "runs/drafter_dflash"
  num_layers: int = 2  # drafter decoder layers
  model: dict = dataclasses.field(default_factory=dict)  # drafter layer overrides, e.g. intermediate_size
  mask_token_id: int = -1  # -1 = the target's mask_token_id (a target without one needs an unused id here)
  # Frozen-target taps: "auto" = each data dir's feature cache when present, "recompute" = run the target every
  # step, "require" = the cache or an error.
  features: str = "auto"
  # Divide each tap dimension by its typical magnitude (median |x| over training windows) before fc, and fold that
  # fixed scale into fc at export (same function, public layout). A preconditioning for targets with massive
  # activations (SmolLM2: a few dimensions ~100x the rest), which otherwise swamp fc's output at the start.
  normalize_taps: bool = False
  num_target_taps: int = 5  # target layers read, evenly spaced from 1 to L-3
  block_size: int = 16
  context_len: int = 512  # n0: the longest window trained on (the data rows are at most this long)
  # Data dirs take turns, each batch from one dir padded only to that dir's longest row (capped at context_len):
  # long and short dirs mixed without padding every short row to the longest (one compile per dir).
  dir_turns: bool = False
  # Share of a batch's windows whose anchors follow a cut drawn anywhere in the window (predicting the document's
  # own text) instead of the prompt's end; they span as many rows after the cut as the continuation has. Few long
  # windows have too few continuation anchors to learn from without memorising (as in train_longspark).
  anywhere_fraction: float = 0.0
  anchors_per_window: int = 16
  gamma: float = 7.0  # slot-weight decay exp(-(k-1)/gamma)
  steps: int = 600
  val_windows: int = 64
  compute_dtype: str = "bfloat16"
  # With store_dir (StoreRunConfig; the drafter's taps in the store's --taps) it trains, instead of data_dirs, on
  # windows of context_len rows cut from the store's windows (corpus text and the target's own continuations),
  # anchors anywhere in them, and the labels are the target's top-k next-token distribution at each slot (`distill`).
  # With a store: the LM head over the N tokens most often the target's argmax on the store's train windows, in
  # training and, by default, when the exported drafter drafts (as in train_longspark). 0 = all.
  draft_vocab_size: int = 0
  # Start the drafter's layers from the target's last num_layers layers (drafter_common.copy_target_layers): the
  # drafter turns context features into next-token predictions, the target's top layers' job.
  init_from_target: bool = False

  def __post_init__(self):
    self.require_positive("num_layers", "num_target_taps", "context_len", "anchors_per_window", "batch_size", "steps",
                          "val_windows")
    if self.block_size < 2 or self.gamma <= 0 or not 0 <= self.val_fraction < 1:
      raise ValueError(f"need block_size >= 2, gamma > 0 and 0 <= val_fraction < 1, got {self.block_size}, "
                       f"{self.gamma}, {self.val_fraction}")
    if not self.data_dirs and not self.store_dir:
      raise ValueError("data_dirs is empty (or give store_dir)")
    if not 0.0 <= self.anywhere_fraction <= 1.0:
      raise ValueError(f"anywhere_fraction must be in [0, 1], got {self.anywhere_fraction}")
    self.check_store_fields("draft_vocab_size")


class BlockSampler:
  """Windows + anchors + block labels; the batch for step s is a pure function of (seed, s), so a resumed run
  replays the same batches. rows: (tokens, prompt length[, data row id]); a batch names its windows by data row
  id (default: the row's index) and start ("row", "start") so that their cached taps can be looked up."""

  def __init__(self, rows: list[tuple], cfg: DFlashTrainConfig, pad_id: int, seed: int):
    rows = [(row[0], row[1], row[2] if len(row) > 2 else i) for i, row in enumerate(rows) if len(row[0]) >= 3]
    if not rows:
      raise ValueError("no drafter data row has the 3+ tokens a DFlash block needs")
    self.lens = np.asarray([len(r) for r, _, _ in rows])
    self.prompt_lens = np.asarray([p for _, p, _ in rows])
    self.row_ids = np.asarray([i for _, _, i in rows])
    self.tokens = np.full((len(rows), int(self.lens.max())), pad_id, np.int32)
    for i, (r, _, _) in enumerate(rows):
      self.tokens[i, :len(r)] = r
    self.cfg, self.seed, self.pad_id = cfg, seed, pad_id
    self.slot_weight = np.exp(-np.arange(cfg.block_size - 1) / cfg.gamma).astype(np.float32)

  def __len__(self):
    return len(self.lens)

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
    """Rows `rows` of step `step`'s batch (see draw_windows)."""
    cfg = self.cfg
    c, bs, a = cfg.context_len, cfg.block_size, cfg.anchors_per_window
    rng, picks, offs, u = draw_windows(self.lens, self.seed, step, batch_size, c, rows, a)
    valid = np.minimum(self.lens[picks] - offs, c)
    cols = np.minimum(offs[:, None] + np.arange(c)[None, :], self.tokens.shape[1] - 1)
    toks = np.where(np.arange(c)[None, :] < valid[:, None], np.take_along_axis(self.tokens[picks], cols, 1),
                    self.pad_id).astype(np.int32)
    # Anchors in the target's continuation (from the last prompt token on), each with >= 1 real label.
    lo = np.clip(self.prompt_lens[picks] - 1 - offs, 1, valid - 2)
    hi = valid - 1
    if cfg.anywhere_fraction:  # (no draws otherwise: continuation-only runs replay their old batches)
      anywhere, cut = rng.random(batch_size)[rows] < cfg.anywhere_fraction, rng.random(batch_size)[rows]
      cut = 1 + (cut * (valid - 2)).astype(np.int64)  # in [1, valid - 2]
      span = self.lens[picks] - self.prompt_lens[picks] + 1
      lo, hi = np.where(anywhere, cut, lo), np.where(anywhere, np.minimum(cut + span, valid - 1), hi)
    anchors = (lo[:, None] + u * (hi - lo)[:, None]).astype(np.int32)
    tgt_pos = anchors[..., None] + np.arange(1, bs)[None, None, :]
    labels = np.take_along_axis(toks[:, None, :], np.minimum(tgt_pos, c - 1), axis=2)
    weights = (tgt_pos < valid[:, None, None]) * self.slot_weight[None, None, :]
    return {"tokens": toks, "anchors": anchors, "labels": labels, "label_w": weights.astype(np.float32),
            "row": self.row_ids[picks], "start": offs}


def dflash_loss(model: DFlashModel, batch: dict, distill: str = "") -> tuple[jax.Array, dict]:
  return block_loss(train_batch_logits(model, batch), batch, distill)


def _load_rows(cfg: DFlashTrainConfig):
  """(train rows, val rows, target dir, target config, manifests, datasets); held-out rows are whole sequences.
  A row is (tokens, prompt length, id): ids number the rows of all data dirs in order."""
  data, target_dir, target_cfg = load_data_dirs(cfg.data_dirs, cfg.target_dir)
  rows = [(list(p) + list(c), len(p)) for ds, _ in data for p, c in zip(ds["prompt"], ds["continuation"])]
  rows = [(r, p, i) for i, (r, p) in enumerate(rows)]
  check_token_ids([r for r, _, _ in rows], target_cfg.vocab_size)
  train, val = split_indices(len(rows), cfg.seed, cfg.val_fraction)
  return ([rows[i] for i in train], [rows[i] for i in val], target_dir, target_cfg, [m for _, m in data],
          [ds for ds, _ in data])


def train_dflash(cfg: DFlashTrainConfig, resume: bool = True) -> Path:
  """Trains DFlash; returns the exported drafter directory (or the checkpoint dir when stopped early)."""
  if cfg.store_dir:
    return train_dflash_from_store(cfg, resume)
  train_rows, val_rows, target_dir, target_cfg, manifests, datasets = _load_rows(cfg)
  target = load_model_dir(target_dir)
  dcfg = dflash_config_for(target_cfg, num_layers=cfg.num_layers, num_target_taps=cfg.num_target_taps,
                           block_size=cfg.block_size,
                           mask_token_id=None if cfg.mask_token_id < 0 else cfg.mask_token_id, **cfg.model)
  cached = open_row_taps(cfg.data_dirs, datasets, taps=dcfg.taps, weights_id=weights_sha256(target_dir),
                         mode=cfg.features)
  pad_id = pad_token(target_cfg)
  samplers = block_samplers(train_rows, cfg, pad_id, np.cumsum([len(ds) for ds in datasets]))

  model = create_dflash(dcfg, seed=cfg.seed, dtype=jnp.dtype(cfg.compute_dtype))
  print(f"DFlash drafter: {param_count(model) / 1e6:.2f}M parameters (+ the target's frozen embedding/head), "
        f"{len(train_rows)} train / {len(val_rows)} val rows, target layers {dcfg.target_layer_ids}, block "
        f"{cfg.block_size}, window {[s.cfg.context_len for s in samplers]} x {cfg.anchors_per_window} anchors, "
        f"target taps {'from the feature cache' if cached else 'computed every step (no feature cache)'}")

  graphdef, params = nnx.split(model)
  run = start_run(cfg, params, resume=resume)
  io = run.replicate(target_io(target))
  tap_fn = None if cached else make_tap_fn(target, dcfg.taps, place=run.replicate)  # no target copy with a cache

  def target_taps(batch):
    if cached is None:
      batch["taps"] = tap_fn(batch["tokens"])  # each process runs the target on its own rows
    return batch

  scale = None
  if cfg.normalize_taps:
    batches = [target_taps(with_taps(samplers[0].batch(10**12 + i, cfg.batch_size), cached, dcfg.taps, model.dtype))
               for i in range(8)]  # steps no training run reaches
    scale = tap_scale([{**b, "real": np.asarray(b["tokens"]) != pad_id} for b in batches])
  extra = {"io": io} if scale is None else {"io": io, "tap_scale": run.replicate(scale)}

  def batch_fn(step):
    sampler = samplers[step % len(samplers)]
    batch = run.batch(lambda rows: with_taps(sampler.batch(step, cfg.batch_size, rows), cached, dcfg.taps,
                                             model.dtype), cfg.batch_size)
    return dict(target_taps(batch), **extra)

  def loss_fn(p, batch):
    return dflash_loss(nnx.merge(graphdef, p), batch)

  def tokens_fn(step):
    return cfg.batch_size * samplers[step % len(samplers)].cfg.context_len

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, tokens_fn=tokens_fn, desc="train-drafter dflash")
  if stopped:
    return stopped
  trained = nnx.merge(graphdef, trained)
  if scale is not None:
    fold_input_scale(trained.fc, scale)
  return export_dflash(trained, cfg, target, target_dir, manifests, val_rows, pad_id, time.time() - t0, cached)


def block_samplers(train_rows: list[tuple], cfg: DFlashTrainConfig, pad_id: int,
                   dir_ends: np.ndarray) -> list[BlockSampler]:
  """One sampler over all rows, or with dir_turns one per data dir (row ids < dir_ends[i] are dir i's) whose
  window is its longest row rounded up to 128 (at most context_len); seeds differ per dir."""
  if not cfg.dir_turns or len(dir_ends) == 1:
    return [BlockSampler(train_rows, cfg, pad_id, cfg.seed)]
  out = []
  for i, end in enumerate(dir_ends):
    rows = [r for r in train_rows if (dir_ends[i - 1] if i else 0) <= r[2] < end]
    if not rows:
      raise ValueError(f"data dir {cfg.data_dirs[i]} has no training rows")
    longest = -(-max(len(r[0]) for r in rows) // 128) * 128
    out.append(BlockSampler(rows, dataclasses.replace(cfg, context_len=min(longest, cfg.context_len)), pad_id,
                            cfg.seed + i))
  return out


def tap_scale(batches: list[dict]) -> np.ndarray:
  """[n, H] float32: 1 / median |tap| per (tap, dimension) over the real rows ("real" [B, C]) of batches that no
  training step draws (the median ignores the few huge attention-sink rows)."""
  return inverse_median_scale([np.abs(np.asarray(b["taps"], np.float32)[b["real"]]) for b in batches])


def validation_metrics(model: DFlashModel, target: Transformer, cfg: DFlashTrainConfig, rows: list[tuple], pad_id: int,
                       cached: RowTaps | None = None) -> dict:
  """Held-out rows: block CE, top-1 per slot, and the mean number of leading correct slots (= greedy acceptance
  length where the row is the target's greedy output)."""
  if not rows:
    return {}
  # Flat slot weights; anchors in the continuation only (the target's own text, as at inference).
  sampler = BlockSampler(rows, dataclasses.replace(cfg, gamma=1e9, anywhere_fraction=0.0), pad_id, seed=cfg.seed + 1)
  bs = min(cfg.batch_size, cfg.val_windows)
  graphdef, params = nnx.split(model)
  io = target_io(target)
  tap_fn = None if cached else make_tap_fn(target, model.cfg.taps)

  @jax.jit
  def stats(params, batch, taps):
    logits = dflash_train_logits(nnx.merge(graphdef, params), io, taps, batch["tokens"], batch["anchors"])
    ce, n = cross_entropy(logits, batch["labels"], batch["label_w"])
    hit = jnp.argmax(logits, -1) == batch["labels"]
    real = batch["label_w"] > 0
    full = jnp.all(real, axis=-1)  # blocks whose every slot has a label
    lead = jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1)
    return (ce * n, n, jnp.sum(hit & real, (0, 1)), jnp.sum(real, (0, 1)), jnp.sum(lead * full), jnp.sum(full))

  acc = None
  for i in range(-(-cfg.val_windows // bs)):
    batch = with_taps(sampler.batch(i, bs), cached, model.cfg.taps, model.dtype)
    taps = batch.pop("taps") if cached else tap_fn(jnp.asarray(batch["tokens"]))
    part = stats(params, batch, taps)
    acc = part if acc is None else tuple(x + y for x, y in zip(acc, part))
  ce_sum, n, hits, real, lead, full = (np.asarray(x, np.float64) for x in acc)
  return {"val_block_ce": round(float(ce_sum / n), 4),
          "val_top1_per_slot": [round(float(h), 4) for h in hits / np.maximum(real, 1)],
          "val_mean_leading_correct": round(float(lead / max(full, 1)), 4)}


def export_dflash(model: DFlashModel, cfg: DFlashTrainConfig, target: Transformer, target_dir: Path,
                  manifests: list[dict], val_rows: list[tuple], pad_id: int, train_s: float,
                  cached: RowTaps | None = None) -> Path:
  last = last_logged(cfg.out_dir)
  final = save_dflash_dir(model, Path(cfg.out_dir) / "final", dtype=jnp.bfloat16)
  info = {
      "kind": "dflash",
      "n0": cfg.context_len,
      "block_size": cfg.block_size,
      "target_layer_ids": list(model.cfg.target_layer_ids),
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "data": [{"dir": Path(d).name, **m["counts"], "temperature": m["settings"]["temperature"],
                "greedy_fraction": m["settings"]["greedy_fraction"]} for d, m in zip(cfg.data_dirs, manifests)],
      "steps": cfg.steps,
      "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "anywhere_fraction": cfg.anywhere_fraction,
      "dir_turns": cfg.dir_turns,
      "gamma": cfg.gamma,
      "tokens_seen": last.get("tokens"),
      "target_taps_from": "feature cache" if cached else "target forward per step",
      "normalize_taps": cfg.normalize_taps,  # trained on taps / median|tap|, the scale folded into fc
      **validation_metrics(model, target, cfg, val_rows, pad_id, cached),
  }
  return write_drafter_json(final, info, last=last, train_s=train_s, model=model)


# --- training from a distillation store ------------------------------------------------------------------------

class StoreBlockSampler:
  """DFlash blocks from a distillation store: windows of context_len rows (`StoreWindows`: tokens, the drafter's
  taps, the target's top-k distribution at every row), A anchors drawn in each among the rows that have context
  and a label after them; slot k's labels are x_{a+k} and the target's distribution of it, stored at row
  a + k - 1. The batch for step s is a pure function of (seed, s), so a resumed run replays it."""

  def __init__(self, windows, cfg: DFlashTrainConfig):
    self.windows, self.cfg = windows, cfg
    self.slot_weight = np.exp(-np.arange(cfg.block_size - 1) / cfg.gamma).astype(np.float32)

  def anchors(self, step: int, batch_size: int, rows: slice, valid: np.ndarray) -> tuple[np.ndarray, dict]:
    """(anchors [B, A], further batch entries): anchors anywhere in [1, valid - 2]."""
    u = np.random.default_rng([self.windows.seed, step, 1]).random((batch_size, self.cfg.anchors_per_window))[rows]
    return (1 + u * np.maximum(valid - 2, 1)[:, None]).astype(np.int32), {}

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
    cfg = self.cfg
    c, bs = cfg.context_len, cfg.block_size
    b = self.windows.batch(step, batch_size, rows)
    valid = b["valid"]
    anchors, extra = self.anchors(step, batch_size, rows, valid)
    tgt = anchors[..., None] + np.arange(1, bs)[None, None, :]  # [B, A, B_s - 1]
    at = lambda x, pos: np.take_along_axis(  # x [B, C, ...] at positions [B, A, S]
        x, np.minimum(pos, c - 1).reshape(len(x), -1, *([1] * (x.ndim - 2))), 1).reshape(*pos.shape, *x.shape[2:])
    return {"tokens": b["tokens"], "taps": b["taps"], "anchors": anchors, "labels": at(b["tokens"], tgt),
            "label_w": ((tgt < valid[:, None, None]) * self.slot_weight).astype(np.float32),
            "topk_ids": at(b["topk_ids"], tgt - 1), "topk_logprobs": at(b["topk_logprobs"], tgt - 1), **extra}


def dflash_store_sampler(store: DistillStore, windows: np.ndarray, taps: Sequence[int], block_size: int, seed: int,
                         context_len: int, anchors_per_window: int, pad_id: int,
                         gamma: float = 1e9) -> StoreBlockSampler:
  """Blocks of `block_size` in windows of context_len rows of the store's `windows`, the target layers `taps` read
  (() for none); gamma 1e9: every slot weighs alike (held-out scoring)."""
  from longspec_jax.training.distill_store import StoreWindows
  cfg = SimpleNamespace(context_len=context_len, block_size=block_size, anchors_per_window=anchors_per_window,
                        gamma=gamma)
  return StoreBlockSampler(StoreWindows(store, windows, context_len, taps, pad_id, seed), cfg)


def train_dflash_from_store(cfg: DFlashTrainConfig, resume: bool) -> Path:
  """train_dflash on a distillation store: blocks anywhere in windows of the store's train split, taps from the
  store, the loss `cfg.distill` against the target's soft labels at every slot, the LM head over the draft
  vocabulary; held-out per-slot top-1 agreement and tau_sim every eval_every steps."""
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.training.distill_store import DistillStore, StoreWindows

  kind = cfg.distill or "kl"
  store = DistillStore(cfg.store_dir)
  target_dir = Path(cfg.target_dir) if cfg.target_dir else store_target(store)
  target = load_model_dir(target_dir)
  dcfg = dflash_config_for(target.cfg, num_layers=cfg.num_layers, num_target_taps=cfg.num_target_taps,
                           block_size=cfg.block_size,
                           mask_token_id=None if cfg.mask_token_id < 0 else cfg.mask_token_id, **cfg.model)
  pad_id = pad_token(target.cfg)
  dtype = jnp.dtype(cfg.compute_dtype)

  def sampler(windows, seed, gamma=cfg.gamma):
    return dflash_store_sampler(store, windows, dcfg.taps, cfg.block_size, seed, cfg.context_len,
                                cfg.anchors_per_window, pad_id, gamma)

  def scale_fn(windows):  # from batches no training step draws
    rows = StoreWindows(store, windows, cfg.context_len, dcfg.taps, pad_id, cfg.seed)
    batches = [rows.batch(10**12 + i, cfg.batch_size) for i in range(8)]
    return tap_scale([{**b, "real": np.arange(cfg.context_len) < b["valid"][:, None]} for b in batches])

  split = cfg.store_split(store)
  train_w, val_w, scale = kept_store_split(cfg.out_dir, store, split, resume,
                                           scale_fn if cfg.normalize_taps else None)
  train_sampler = sampler(train_w, cfg.seed)
  val_sampler = sampler(val_w, cfg.seed + 1, gamma=1e9)  # held out: every slot counts alike
  vocab_order = np.argsort(-store.argmax_counts(train_w, target.cfg.vocab_size), kind="stable")
  draft_ids = vocab_order[:cfg.draft_vocab_size] if cfg.draft_vocab_size else None

  model = create_dflash(dcfg, seed=cfg.seed, dtype=dtype)
  if cfg.init_from_target:
    copy_target_layers(model.layers, target.layers[-cfg.num_layers:])
  train_tokens = int(train_sampler.windows.lens.sum())
  graphdef, _, run = start_store_run(
      cfg, model, resume=resume, what="DFlash drafter", store=store, train_w=train_w, val_w=val_w,
      train_tokens=train_tokens, details=f"target layers {dcfg.target_layer_ids}, draft vocabulary "
      f"{cfg.draft_vocab_size or target.cfg.vocab_size}, loss {kind}, window {cfg.context_len} x "
      f"{cfg.anchors_per_window} anchors, block {cfg.block_size}")
  local_extra = {"io": target_io(target)}
  if draft_ids is not None:
    local_extra["io"], local_extra["t2d"] = store_head(local_extra["io"], draft_ids)
  if scale is not None:
    local_extra["tap_scale"] = scale
  extra = {k: run.replicate(v) for k, v in local_extra.items()}

  def cast(b):
    return {**b, "taps": b["taps"].astype(dtype)}

  def batch_fn(step):
    return {**run.batch(lambda r: cast(train_sampler.batch(step, cfg.batch_size, r)), cfg.batch_size), **extra}

  def loss_fn(p, batch):
    return dflash_loss(nnx.merge(graphdef, p), batch, kind)

  stats = block_stats_fn(lambda p, batch: train_batch_logits(nnx.merge(graphdef, p), batch), kind)
  t0 = time.time()
  trained, held_out, stopped = train_store_drafter(
      run, cfg, graphdef, loss_fn, batch_fn, lambda p, b: stats(p, {**cast(b), **local_extra}), val_sampler,
      desc="train-drafter dflash (store)", tokens_per_step=cfg.batch_size * cfg.context_len)
  if stopped:
    return stopped
  if scale is not None:
    fold_input_scale(trained.fc, scale)
  last = last_logged(cfg.out_dir)
  final = save_dflash_dir(trained, Path(cfg.out_dir) / "final", dtype=jnp.bfloat16)
  if draft_ids is not None:
    write_draft_vocab(final, vocab_order[:max(cfg.draft_vocab_size, 16384)], store, len(train_w))
  info = {
      "kind": "dflash",
      "n0": cfg.context_len,
      "block_size": cfg.block_size,
      "target_layer_ids": list(trained.cfg.target_layer_ids),
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "data": store_record(store, train_w, val_w, train_tokens, "taps"),
      "loss": kind,
      "draft_vocab_size": cfg.draft_vocab_size or None,  # the default --draft-vocab when it drafts
      "steps": cfg.steps,
      "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "gamma": cfg.gamma,
      "init_from_target": cfg.init_from_target,
      "tokens_seen": last.get("tokens"),
      "normalize_taps": cfg.normalize_taps,
      "target_taps_from": f"distillation store ({store.settings['feature_dtype']})",
      "val_top1_per_slot": [held_out[f"val_acc_{j}"] for j in range(cfg.block_size - 1)],
      "val_tau_sim": held_out["val_tau_sim"],
  }
  return write_drafter_json(final, info, last=last, train_s=time.time() - t0, model=trained)


def evaluate_dflash_on_store(drafter_dir: str | Path, target: Transformer, store_dir: str | Path, *, draws: int = 32,
                             val_fraction: float = 0.03, seed: int = 0, context_len: int = 512,
                             anchors_per_window: int = 24, batch_size: int = 8,
                             held_out_within_tokens: int = 0) -> dict:
  """Held-out {val_acc_j, val_loss_j (KL), val_tau_sim} of an exported DFlash drafter on the store's held-out
  windows (the split and draws train_dflash_from_store makes with the same seed, val_fraction,
  held_out_within_tokens, window and batch size), `draws` windows, over the draft vocabulary it drafts with
  (drafter.json): drafters trained any way are compared on the same blocks."""
  from longspec_jax.drafters.dflash import load_dflash_model
  from longspec_jax.training.distill_store import DistillStore, split_windows
  store = DistillStore(store_dir)
  model = load_dflash_model(drafter_dir)
  _, val_w = split_windows(store, seed, val_fraction, held_out_within_tokens=held_out_within_tokens)
  sampler = dflash_store_sampler(store, val_w, model.cfg.taps, model.cfg.block_size, seed + 1, context_len,
                                 anchors_per_window, pad_token(target.cfg))
  extra = trained_head(target_io(target), drafter_dir)
  graphdef, params = nnx.split(model)
  stats = block_stats_fn(lambda p, batch: train_batch_logits(nnx.merge(graphdef, p), batch), "kl")
  return store_evaluator(lambda p, b: stats(p, {**b, **extra}), sampler, batch_size, draws)(params)
