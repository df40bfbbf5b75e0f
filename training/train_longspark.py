"""`longspec train-drafter --drafter longspark`: the LongSpark drafter on the target's own long generations.

The frozen target forward over a 2-4K window is by far the most expensive part on a CPU and never changes, so it
runs once per window: the selected layers' K/V and their outputs (the boundary taps) for every row go to the data
dir's offline feature cache (longspec_jax.training.feature_cache, float16 memmaps), and training reads from it.

Per window, A anchors a are drawn in the target's continuation (from the last prompt token on): the block is
[x_a, MASK x (B_s-1)] at positions a..a+B_s-1 and slot j predicts x_{a+1+j} (weight exp(-j/gamma)). Each anchor
sees exactly what inference would show it after committing rows < a:
  * boundary = the selected layers' outputs at row a-1;
  * Global = the online-softmax summary of rows < a through the learned slot keys: the rows before the window's
    tail (shared by all anchors) are summarised once, then each anchor merges the tail rows below it (`merge_rows`,
    the function inference uses) -- the same numbers as a cumulative log-sum-exp, gradients reach the slot keys;
  * Raw = rows [a-W, a) of a K/V slab around the tail; Local = the anchor's own block.
The Markov term is teacher-forced: slot j's previous token is x_{a+j}.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import sharding as shd
from longspec_jax.drafters.frozen_target import target_io
from longspec_jax.drafters.longspark import (LongSparkConfig, LongSparkModel, create_longspark, longspark_config_for,
                                             longspark_train_logits, save_longspark_dir, train_batch_logits,
                                             window_summaries)
from longspec_jax.hf_io import load_model_dir
from longspec_jax.model import param_count
from longspec_jax.training.distill_store import decode_on_device
from longspec_jax.training.drafter_data import target_name, weights_sha256
from longspec_jax.training.feature_cache import FeatureCache, build_feature_cache
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.drafter_common import (block_loss, block_stats_fn, copy_target_layers, fold_input_scale,
                                                  inverse_median_scale, kept_store_split, last_logged, load_data_dirs,
                                                  store_evaluator, store_head, store_record, store_target,
                                                  train_store_drafter, train_to_export, trained_head, write_draft_vocab,
                                                  write_drafter_json)
from longspec_jax.training.trainer import DataDirsRunConfig, OptimConfig, Run, start_run, start_store_run

if TYPE_CHECKING:
  from longspec_jax.config import ModelConfig
  from longspec_jax.model import Transformer
  from longspec_jax.training.distill_store import DistillStore


@dataclasses.dataclass(frozen=True)
class LongSparkTrainConfig(DataDirsRunConfig):
  """`longspec train-drafter --drafter longspark`: a LongSpark multiscale drafter."""
  data_dirs: tuple[str, ...] = ("runs/drafter_data_long",)
  out_dir: str = "runs/drafter_longspark"
  num_layers: int = 5  # = target layers read, evenly spaced as in DFlash
  block_size: int = 7
  num_global_slots: int = 16
  raw_window: int = 256
  markov_rank: int = 64
  model: dict = dataclasses.field(default_factory=dict)  # drafter layer overrides, e.g. intermediate_size
  mask_token_id: int = -1  # -1 = the target's mask_token_id (a target without one needs an unused id here)
  # Train on boundary taps / median|tap| per (layer, dim) (targets with massive activations, e.g. SmolLM2); the
  # scale is folded into the state encoder at export, so the exported drafter reads raw taps.
  normalize_boundary: bool = False
  anchors_per_window: int = 32
  # Share of a batch's windows whose cut (the prefix/tail boundary the anchors follow) is drawn anywhere in the
  # window instead of at the prompt's end: their anchors predict the document's own text at every context length,
  # far more anchors than the target's continuations alone (which a big drafter memorises). 0 = continuations only.
  anywhere_fraction: float = 0.0
  gamma: float = 4.0  # slot-weight decay exp(-j/gamma), j = 0..B_s-1
  batch_size: int = 4
  steps: int = 1000
  optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=50)
  val_windows: int = 8  # whole windows of the first data dir held out
  max_windows: tuple[int, ...] = ()  # per data dir: use only its first N rows (0 or absent = all; bounds the cache)
  compute_dtype: str = "bfloat16"
  # >0: half the windows are moved to a random start in [0, position_shift_max - length] (see shift_window).
  position_shift_max: int = 0
  # With store_dir (StoreRunConfig; the drafter's layers in the store's --kv-layers, their outputs in --taps),
  # it trains, instead of data_dirs, on windows of the corpus text (and the target's own continuations), every window
  # cut anywhere, and the labels are the target's top-k next-token distribution at each slot (`distill`).
  # With a store: the LM head over the N tokens most often the target's argmax on the store's train windows, in
  # training (the 49,152-wide head dominated a step) and, by default, when the exported drafter drafts. 0 = all.
  draft_vocab_size: int = 0
  tail_rows: int = 256  # with a store: anchors are drawn in the tail_rows rows after a window's cut
  # Start each drafter layer from the target layer whose K/V it reads (attention and norms; the MLP from that
  # layer's first intermediate_size channels), so its queries start in the space of the keys it attends over.
  init_from_target: bool = False
  val_fraction: float = 0.03  # with a store: held-out share of its windows (split_windows)

  def __post_init__(self):
    self.require_positive("num_layers", "block_size", "num_global_slots", "raw_window", "anchors_per_window",
                          "batch_size", "steps")
    if not 0.0 <= self.anywhere_fraction <= 1.0:
      raise ValueError(f"anywhere_fraction must be in [0, 1], got {self.anywhere_fraction}")
    if self.gamma <= 0 or self.markov_rank < 0 or self.val_windows < 0:
      raise ValueError(f"need gamma > 0, markov_rank >= 0, val_windows >= 0, got {self.gamma}, "
                       f"{self.markov_rank}, {self.val_windows}")
    if not self.data_dirs and not self.store_dir:
      raise ValueError("data_dirs is empty (or give store_dir)")
    self.check_store_fields("draft_vocab_size")
    if self.draft_vocab_size and self.markov_rank:
      raise ValueError("draft_vocab_size needs markov_rank 0 (the Markov head scores the whole vocabulary)")
    if self.store_dir and self.tail_rows < 2:
      raise ValueError(f"tail_rows must be >= 2, got {self.tail_rows}")


# ---------------------------------------------------------------- the training forward (shared with the tests)

def boundary_scale(samplers: Sequence[AnchorSampler], batch_size: int, num_batches: int = 8) -> np.ndarray:
  """[L, H] float32: 1 / median |boundary tap| per (layer, dimension) over batches no training step draws."""
  taps = [samplers[i % len(samplers)].batch(10**12 + i, batch_size)["boundary"] for i in range(num_batches)]
  taps = [np.abs(t).reshape(-1, *t.shape[-2:]) for t in taps]  # [B, A, L, H] -> [rows, L, H]
  return inverse_median_scale(taps)


def decode_kv_batch(batch: dict, feature_dtype: str) -> dict:
  """A batch with the K/V as stored (StoreLongSparkRows(decode=False): pre_kv / slab_kv [B, rows, L, 2, Hkv, D]
  and their scales) with pre_k / pre_v / slab_k / slab_v [L, B, rows, Hkv, D] decoded in JAX, the float32 values
  window_kv gives; other batches as they are."""
  if "pre_kv" not in batch:
    return batch
  for part in ("pre", "slab"):
    batch = decode_on_device(batch, f"{part}_kv", feature_dtype, jnp.float32)
    kv = batch.pop(f"{part}_kv")
    batch[f"{part}_k"] = kv[:, :, :, 0].transpose(2, 0, 1, 3, 4)
    batch[f"{part}_v"] = kv[:, :, :, 1].transpose(2, 0, 1, 3, 4)
  return batch


def longspark_loss(model: LongSparkModel, batch: dict, distill: str = "") -> tuple[jax.Array, dict]:
  """Training loss: CE on the data's next tokens, or with `distill` the loss of that kind against the store's
  soft labels (slot weights in label_w)."""
  return block_loss(train_batch_logits(model, batch), batch, distill)


def drafter_config(cfg: LongSparkTrainConfig, target_cfg: ModelConfig) -> LongSparkConfig:
  return longspark_config_for(target_cfg, num_layers=cfg.num_layers, markov_rank=cfg.markov_rank,
                              num_global_slots=cfg.num_global_slots, raw_window=cfg.raw_window,
                              block_size=cfg.block_size,
                              mask_token_id=None if cfg.mask_token_id < 0 else cfg.mask_token_id, **cfg.model)


def init_from_target_layers(model: LongSparkModel, target: Transformer) -> None:
  """`init_from_target`: drafter layer i <- target layer target_layer_ids[i], the layer whose K/V it reads, so
  its queries start in the space of the keys it attends over (drafter_common.copy_target_layers)."""
  copy_target_layers(model.parallel_qwen_layers, [target.layers[i] for i in model.cfg.target_layer_ids])


# ---------------------------------------------------------------- the frozen-target feature cache

class LongSparkRows:
  """One data dir's windows as LongSpark training reads them from the offline feature cache (`<data_dir>/features`,
  see longspec_jax.training.feature_cache): the selected layers' K/V for every row and their outputs (the boundary
  taps). The tail of a window starts at tail_start = prompt_len - 2."""

  def __init__(self, cache: FeatureCache, rows, layer_ids):
    self.cache, self.rows, self.layer_ids = cache, rows, tuple(layer_ids)  # rows: [(tokens, prompt_len)]
    self.taps = tuple(i + 1 for i in self.layer_ids)  # tap i = the output of layer i - 1
    self.lens = np.asarray([len(r) for r, _ in rows])
    self.tail_start = np.asarray([max(p - 2, 0) for _, p in rows])

  def tokens(self, i: int) -> np.ndarray:
    return np.asarray(self.rows[i][0], np.int32)

  def window_kv(self, i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V rows [lo, hi) of window i as [L, rows, Hkv, D] each (rows outside the window are zero)."""
    k, v = self.cache.window_kv(i, lo, hi - lo, self.layer_ids)
    return k.astype(np.float32), v.astype(np.float32)

  def boundary(self, i: int, rows: np.ndarray) -> np.ndarray:
    return self.cache.taps_at(i, rows, self.taps).astype(np.float32)


class StoreLongSparkRows:
  """A distillation store's windows read the way `LongSparkRows` reads a feature cache (tokens, the selected
  layers' K/V and outputs), plus the target's top-k next-token distribution at every row (`soft_labels`). A
  window's tail starts 2 rows before the target's own continuation (on-policy windows) or at its first row; with
  `anywhere_fraction` most cuts are drawn anywhere anyway. decode=False: batches carry the K/V as stored (an
  AnchorSampler then gives pre_kv / slab_kv, decoded in the step by decode_kv_batch), so the host only copies
  bytes."""

  def __init__(self, store, layer_ids, decode: bool = True):
    stored = list(store.settings["kv_layers"])
    missing = [l for l in layer_ids if l not in stored]
    if missing:
      raise ValueError(f"the distillation store at {store.dir} has K/V of layers {stored}, not {missing}; rebuild "
                       "it with --kv-layers including them")
    self.store, self.layer_ids, self.decode = store, tuple(layer_ids), decode
    self.kv_sel = [stored.index(l) for l in layer_ids]
    self.tap_sel = store.tap_positions([l + 1 for l in layer_ids])  # tap i = the output of layer i - 1
    self.lens = store.window_lengths()
    gen = np.asarray([w["generated_from"] for _, w in store.windows])
    self.tail_start = np.where(gen > 0, np.maximum(gen - 2, 0), 0)

  def _read(self, i, lo, hi, features, taps=None) -> dict:
    return self.store.read_rows(int(i), int(lo), int(hi - lo), taps, features)

  def tokens(self, i: int) -> np.ndarray:
    return self.store.tokens(int(i))

  def window_kv(self, i: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """K/V rows [lo, hi) of window i as [L, rows, Hkv, D] each (rows outside the window are zero)."""
    a, b = max(lo, 0), min(hi, int(self.lens[i]))
    kv = self._read(i, a, max(b, a + 1), ("kv",))["kv"][:, self.kv_sel]  # [rows, L, 2, Hkv, D]
    out = np.zeros((hi - lo,) + kv.shape[1:], np.float32)
    if b > a:
      out[a - lo:b - lo] = kv[:b - a]
    return out[:, :, 0].transpose(1, 0, 2, 3), out[:, :, 1].transpose(1, 0, 2, 3)

  def window_kv_bits(self, i: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """window_kv as stored: {"kv": [rows, L, 2, Hkv, D] bits, and for fp8 "kv_scale": [rows, L]}; rows outside
    the window are zero bits and scales, which decode to zero."""
    a, b = max(lo, 0), min(hi, int(self.lens[i]))
    raw = self.store.read_rows(int(i), a, max(b, a + 1) - a, None, ("kv",), decode=False)
    out = {}
    for key in ("kv", "kv_scale"):
      if key in raw:
        x = raw[key][:, self.kv_sel]
        out[key] = np.zeros((hi - lo,) + x.shape[1:], x.dtype)
        if b > a:
          out[key][a - lo:b - lo] = x[:b - a]
    return out

  def boundary(self, i: int, rows: np.ndarray) -> np.ndarray:
    lo = int(np.min(rows))
    return self._read(i, lo, int(np.max(rows)) + 1, ("taps",), self.tap_sel)["taps"][np.asarray(rows) - lo]

  def soft_labels(self, i: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(topk_ids, topk_logprobs) [*rows.shape, k] of window i at `rows`: the target's distribution of the token
    after each row."""
    lo = int(np.min(rows))
    part = self._read(i, lo, int(np.max(rows)) + 1, ())
    return part["topk_ids"][rows - lo], part["topk_logprobs"][rows - lo]


class AnchorSampler:
  """Batches of windows from one cache; the batch for step s is a pure function of (seed, s), so a resumed run
  replays the same batches. Shapes are fixed per cache (prefix rows Cp, slab rows) so the step compiles once.
  A window's prefix is rows [0, cut); its slab is rows [cut - W, cut + T), so the slab's first W rows are prefix
  rows (Raw only) and the rest are the tail the anchors live in. The cut is tail_start (anchors in the target's
  continuation), or for `anywhere_fraction` of the windows a uniform row (anchors in the document's text)."""

  def __init__(self, cache: LongSparkRows | StoreLongSparkRows, windows, cfg: LongSparkTrainConfig, seed: int,
               tail: int = 0):
    self.c, self.windows, self.cfg, self.seed = cache, np.asarray(windows), cfg, seed
    w = cfg.raw_window
    self.tail = tail or int((cache.lens - cache.tail_start)[windows].max())  # T (0: the longest continuation)
    last_cut = (cache.lens - 3) if cfg.anywhere_fraction else cache.tail_start
    self.cp = int(-(-max(last_cut[windows].max(), 1) // 128) * 128)
    self.slab = int(-(-(w + self.tail) // 8) * 8)
    self.slot_weight = np.exp(-np.arange(cfg.block_size) / cfg.gamma).astype(np.float32)

  def window_batch(self, wins: Sequence[int] | np.ndarray, anchors: Sequence[np.ndarray],
                   cuts: np.ndarray | None = None) -> dict:
    cfg, c = self.cfg, self.c
    cuts = c.tail_start[wins] if cuts is None else np.asarray(cuts)
    bs, w = cfg.block_size, cfg.raw_window
    soft = hasattr(c, "soft_labels")
    raw = not getattr(c, "decode", True)  # K/V as stored, decoded in the step (decode_kv_batch)
    parts = {k: [] for k in ("slab_pos", "boundary", "prev", "labels", "label_w")
             + (("topk_ids", "topk_logprobs") if soft else ())}
    for i, anc, s in zip(wins, anchors, cuts):
      s, t = int(s), int(c.lens[i])
      toks = c.tokens(i)
      lo = s - w
      if raw:
        for part, (a, b) in (("pre", (0, self.cp)), ("slab", (lo, lo + self.slab))):
          for key, x in c.window_kv_bits(i, a, b).items():
            parts.setdefault(f"{part}_{key}", []).append(x)  # pre_kv, pre_kv_scale, slab_kv, slab_kv_scale
      else:
        for part, (a, b) in (("pre", (0, self.cp)), ("slab", (lo, lo + self.slab))):
          k, v = c.window_kv(i, a, b)
          parts.setdefault(f"{part}_k", []).append(k), parts.setdefault(f"{part}_v", []).append(v)
      pos = lo + np.arange(self.slab)
      parts["slab_pos"].append(np.where((pos >= 0) & (pos < t), pos, -1))
      parts["boundary"].append(c.boundary(i, anc - 1))
      tgt = anc[:, None] + np.arange(bs + 1)[None, :]  # x_a .. x_{a+B_s}
      seq = toks[np.minimum(tgt, t - 1)]
      parts["prev"].append(seq[:, :-1])
      parts["labels"].append(seq[:, 1:])
      parts["label_w"].append((tgt[:, 1:] < t) * self.slot_weight[None, :])
      if soft:  # row a + j holds the target's distribution of x_{a+1+j}, slot j's label
        ids, logprobs = c.soft_labels(i, np.minimum(tgt[:, :-1], t - 1))
        parts["topk_ids"].append(ids.astype(np.int32)), parts["topk_logprobs"].append(logprobs)
    out = {k: np.stack(v, 1 if k in ("pre_k", "pre_v", "slab_k", "slab_v") else 0) for k, v in parts.items()}
    out["pre_len"] = cuts.astype(np.int32)
    out["anchors"] = np.asarray(anchors, np.int32)
    out["label_w"] = out["label_w"].astype(np.float32)
    return out

  def batch(self, step: int, batch_size: int) -> dict:
    rng = np.random.default_rng([self.seed, step])
    wins = self.windows[rng.integers(0, len(self.windows), size=batch_size)]
    lens = self.c.lens[wins]
    cuts = self.c.tail_start[wins]
    if self.cfg.anywhere_fraction:  # (no draws otherwise: continuation-only runs replay their old batches)
      anywhere = rng.random(len(wins)) < self.cfg.anywhere_fraction
      cuts = np.where(anywhere, (rng.random(len(wins)) * (lens - 2)).astype(np.int64), cuts)
    # Anchors from cut + 1 (the last prompt token at the prompt's end) to the second-to-last row (>= 1 label),
    # inside the slab's tail rows [cut, cut + T).
    hi = np.minimum(lens - 2, cuts + self.tail - 1)
    anchors = [cut + 1 + rng.integers(0, h - cut, size=self.cfg.anchors_per_window) for cut, h in zip(cuts, hi)]
    out = self.window_batch(wins, anchors, cuts)
    if self.cfg.position_shift_max:
      room = np.maximum(self.cfg.position_shift_max - self.c.lens[wins], 0)
      shift = (rng.random(len(wins)) * room).astype(np.int32)
      out["shift"] = np.where(rng.random(len(wins)) < 0.5, shift, 0).astype(np.int32)
    return out


def device_batches(run: Run, samplers: Sequence[AnchorSampler], batch_size: int,
                   extra: dict) -> Callable[[int], dict]:
  """batch_fn(step) for Run.train: the samplers take turns (each keeps its own fixed shapes, so the step compiles
  once per sampler); K/V stacks [L, B, ...] are sharded on their batch axis, the rest on the first; `extra` (already
  placed) is added to every batch."""
  batch_sharding = shd.batch_sharding(run.mesh)
  kv_sharding = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec(None, "data"))

  def batch_fn(step):
    b = samplers[step % len(samplers)].batch(step, batch_size)
    on_device = {k: jax.device_put(v, kv_sharding if k in ("pre_k", "pre_v", "slab_k", "slab_v")
                                   else batch_sharding) for k, v in b.items()}
    return dict(on_device, **extra)
  return batch_fn


def train_longspark(cfg: LongSparkTrainConfig, resume: bool = True) -> Path:
  """Trains LongSpark; returns the exported drafter directory (or the checkpoint dir when stopped early)."""
  if cfg.store_dir:
    return train_longspark_from_store(cfg, resume)
  data, target_dir, target_cfg = load_data_dirs(cfg.data_dirs, cfg.target_dir)
  loaded = []  # per data dir: (rows used = (tokens, prompt length), manifest, rows in the dir)
  for i, (ds, manifest) in enumerate(data):
    rows = [(list(p) + list(c), len(p)) for p, c in zip(ds["prompt"], ds["continuation"])]
    limit = cfg.max_windows[i] if i < len(cfg.max_windows) else 0
    loaded.append((rows[:limit or None], manifest, len(rows)))
  target = load_model_dir(target_dir)
  dcfg = drafter_config(cfg, target_cfg)
  weights_id = weights_sha256(target_dir)
  caches = []
  for d, (rows, _, num_rows) in zip(cfg.data_dirs, loaded):
    # Built once (resumable) for the rows used; a cache that make-drafter-data built with these layers is reused.
    layers = dcfg.target_layer_ids
    build_feature_cache(d, target, [i + 1 for i in layers], layers, weights_id=weights_id, num_rows=len(rows))
    cache = FeatureCache.open(d, taps=[i + 1 for i in layers], kv_layers=layers, weights_id=weights_id,
                              num_rows=num_rows, use_rows=len(rows))
    caches.append(LongSparkRows(cache, rows, layers))
  order = np.random.default_rng([cfg.seed, 7]).permutation(len(caches[0].rows))
  n_val = min(cfg.val_windows, len(order) - 1)
  val = order[:n_val]
  samplers = [AnchorSampler(caches[0], order[n_val:], cfg, cfg.seed)]
  samplers += [AnchorSampler(c, np.arange(len(c.rows)), cfg, cfg.seed + 1 + j) for j, c in enumerate(caches[1:])]

  model = create_longspark(dcfg, seed=cfg.seed, dtype=jnp.dtype(cfg.compute_dtype))
  if cfg.init_from_target:
    init_from_target_layers(model, target)
  print(f"LongSpark drafter: {param_count(model) / 1e6:.2f}M parameters (+ the target's frozen embedding/norm/head), "
        f"target layers {dcfg.target_layer_ids}, windows {[len(s.windows) for s in samplers]} (+{n_val} val), "
        f"prefix rows {[s.cp for s in samplers]}, {cfg.anchors_per_window} anchors/window")

  graphdef, params = nnx.split(model)
  run = start_run(cfg, params, resume=resume)
  io = run.replicate(target_io(target, final_norm=True))
  scale = boundary_scale(samplers, cfg.batch_size) if cfg.normalize_boundary else None
  extra = {"io": io} if scale is None else {"io": io, "boundary_scale": run.replicate(scale)}

  batch_fn = device_batches(run, samplers, cfg.batch_size, extra)  # data dirs take turns

  def loss_fn(p, batch):
    return longspark_loss(nnx.merge(graphdef, p), batch)

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, desc="train-drafter longspark",
                                     tokens_fn=lambda s: cfg.batch_size * cfg.anchors_per_window)
  if stopped:
    return stopped
  trained = nnx.merge(graphdef, trained)
  if scale is not None:
    fold_input_scale(trained.draft_state_encoder.proj.fc_in, scale)
  val_sampler = AnchorSampler(caches[0], val, cfg, cfg.seed)
  return export_longspark(trained, cfg, target, target_dir, [l[1] for l in loaded], val_sampler, val,
                          time.time() - t0)


def store_stats_fn(graphdef: nnx.GraphDef, kind: str) -> Callable[[Any, dict], tuple[jax.Array, jax.Array, jax.Array]]:
  return block_stats_fn(lambda params, batch: train_batch_logits(nnx.merge(graphdef, params), batch), kind)


def store_eval_sampler(model: LongSparkModel, store: DistillStore, windows: np.ndarray, seed: int,
                       anchors_per_window: int, tail_rows: int = 256, anywhere_fraction: float = 0.9) -> AnchorSampler:
  """Held-out LongSpark blocks of `model`'s shape in the store's `windows`, every slot weighing alike."""
  cfg = LongSparkTrainConfig(store_dir=str(store.dir), block_size=model.cfg.block_size,
                             raw_window=model.cfg.raw_window, anchors_per_window=anchors_per_window, gamma=1e9,
                             tail_rows=tail_rows, anywhere_fraction=anywhere_fraction)
  return AnchorSampler(StoreLongSparkRows(store, model.cfg.target_layer_ids), windows, cfg, seed, tail=tail_rows)


def evaluate_longspark_on_store(drafter_dir: str | Path, target: Transformer, store_dir: str | Path, *,
                                draws: int = 32, val_fraction: float = 0.03, seed: int = 0, tail_rows: int = 256,
                                anchors_per_window: int = 32, anywhere_fraction: float = 0.9,
                                held_out_within_tokens: int = 0) -> dict:
  """Held-out {val_acc_j, val_loss_j (KL), val_tau_sim} of an exported LongSpark drafter on the store's held-out
  windows (the split train_longspark_from_store makes with the same seed, val_fraction and held_out_within_tokens),
  `draws` windows of `anchors_per_window` anchors each, over the draft vocabulary it drafts with (drafter.json):
  drafters trained any way are compared on the same anchors."""
  from longspec_jax.drafters.longspark import load_longspark_model
  from longspec_jax.training.distill_store import DistillStore, split_windows
  store = DistillStore(store_dir)
  model = load_longspark_model(drafter_dir)
  _, val_w = split_windows(store, seed, val_fraction, held_out_within_tokens=held_out_within_tokens)
  sampler = store_eval_sampler(model, store, val_w, seed + 1, anchors_per_window, tail_rows, anywhere_fraction)
  extra = trained_head(target_io(target, final_norm=True), drafter_dir)
  graphdef, params = nnx.split(model)
  stats = store_stats_fn(graphdef, "kl")
  return store_evaluator(lambda p, b: stats(p, {**b, **extra}), sampler, 4, draws)(params)


def train_longspark_from_store(cfg: LongSparkTrainConfig, resume: bool) -> Path:
  """train_longspark on a distillation store: anchors in windows of the store's train split, K/V and boundary taps
  from the store, the loss `cfg.distill` against the target's soft labels at every slot, the LM head over the draft
  vocabulary; held-out per-slot top-1 agreement and tau_sim every eval_every steps."""
  from longspec_jax.training.distill_store import DistillStore

  kind = cfg.distill or "kl"
  store = DistillStore(cfg.store_dir)
  target_dir = Path(cfg.target_dir) if cfg.target_dir else store_target(store)
  target = load_model_dir(target_dir)
  dcfg = drafter_config(cfg, target.cfg)
  rows = StoreLongSparkRows(store, dcfg.target_layer_ids)
  train_w, val_w, scale = kept_store_split(
      cfg.out_dir, store, cfg.store_split(store), resume,
      lambda w: boundary_scale([AnchorSampler(rows, w, cfg, cfg.seed, tail=cfg.tail_rows)], cfg.batch_size)
      if cfg.normalize_boundary else None)
  # training batches carry the K/V as stored, decoded in the step: the host only copies bytes
  raw_rows = StoreLongSparkRows(store, dcfg.target_layer_ids, decode=False)
  sampler = AnchorSampler(raw_rows, train_w, cfg, cfg.seed, tail=cfg.tail_rows)
  flat = dataclasses.replace(cfg, gamma=1e9, position_shift_max=0)  # held out: every slot counts alike
  val_sampler = AnchorSampler(rows, val_w, flat, cfg.seed + 1, tail=cfg.tail_rows)
  counts = store.argmax_counts(train_w, target.cfg.vocab_size)
  vocab_order = np.argsort(-counts, kind="stable")  # most often the target's argmax first
  draft_ids = vocab_order[:cfg.draft_vocab_size] if cfg.draft_vocab_size else None

  model = create_longspark(dcfg, seed=cfg.seed, dtype=jnp.dtype(cfg.compute_dtype))
  if cfg.init_from_target:
    init_from_target_layers(model, target)
  train_tokens = int(rows.lens[train_w].sum())
  graphdef, _, run = start_store_run(
      cfg, model, resume=resume, what="LongSpark drafter", store=store, train_w=train_w, val_w=val_w,
      train_tokens=train_tokens, details=f"target layers {dcfg.target_layer_ids}, draft vocabulary "
      f"{cfg.draft_vocab_size or target.cfg.vocab_size}, loss {kind}, prefix rows {sampler.cp}, tail {sampler.tail}, "
      f"{cfg.anchors_per_window} anchors/window")
  io = target_io(target, final_norm=True)
  extra = {}
  if draft_ids is not None:
    io, t2d = store_head(io, draft_ids)
    extra["t2d"] = t2d
  if scale is not None:
    extra["boundary_scale"] = scale
  local_extra = {"io": io, **extra}
  extra = {k: run.replicate(v) for k, v in local_extra.items()}
  batch_fn = device_batches(run, [sampler], cfg.batch_size, extra)

  def loss_fn(p, batch):
    return longspark_loss(nnx.merge(graphdef, p), decode_kv_batch(batch, store.settings["feature_dtype"]), kind)

  stats = store_stats_fn(graphdef, kind)
  t0 = time.time()
  trained, held_out, stopped = train_store_drafter(
      run, cfg, graphdef, loss_fn, batch_fn, lambda p, b: stats(p, {**b, **local_extra}), val_sampler,
      desc="train-drafter longspark (store)", tokens_per_step=cfg.batch_size * cfg.anchors_per_window)
  if stopped:
    return stopped
  if cfg.normalize_boundary:
    fold_input_scale(trained.draft_state_encoder.proj.fc_in, local_extra["boundary_scale"])
  last = last_logged(cfg.out_dir)
  final = save_longspark_dir(trained, Path(cfg.out_dir) / "final", dtype=jnp.bfloat16)
  if draft_ids is not None:
    write_draft_vocab(final, vocab_order[:max(cfg.draft_vocab_size, 16384)], store, len(train_w))
  info = {
      **drafter_info(trained, cfg, target_dir),
      "data": store_record(store, train_w, val_w, train_tokens, "kv_layers"),
      "loss": kind,
      "draft_vocab_size": cfg.draft_vocab_size or None,  # the default --draft-vocab when it drafts
      "steps": run.total_steps,  # cfg.steps, or what fitted its time budget
      "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "tail_rows": cfg.tail_rows,
      "anywhere_fraction": cfg.anywhere_fraction,
      "gamma": cfg.gamma,
      "init_from_target": cfg.init_from_target,
      "anchors_seen": last.get("tokens"),
      "val_top1_per_slot": [held_out[f"val_acc_{j}"] for j in range(cfg.block_size)],
      "val_tau_sim": held_out["val_tau_sim"],
  }
  return write_drafter_json(final, info, last=last, train_s=time.time() - t0, model=trained)


def validation_metrics(model: LongSparkModel, target: Transformer, sampler: AnchorSampler,
                       windows: np.ndarray) -> dict:
  """Held-out windows, every continuation anchor: block CE, top-1 per slot and the mean number of leading
  correct slots (= greedy acceptance length where the window is the target's greedy output), Markov term fed the
  true previous tokens (as greedy decoding does while drafts are correct)."""
  if len(windows) == 0:
    return {}
  graphdef, params = nnx.split(model)
  io = target_io(target, final_norm=True)
  flat = dataclasses.replace(sampler.cfg, gamma=1e9)
  sampler = AnchorSampler(sampler.c, sampler.windows, flat, sampler.seed)

  @jax.jit
  def stats(params, batch):
    m = nnx.merge(graphdef, params)
    g_out = window_summaries(m, batch)
    logits = longspark_train_logits(m, io, batch["boundary"], batch["anchors"], g_out, batch["slab_k"],
                                    batch["slab_v"], batch["slab_pos"], batch["prev"])
    ce, n = cross_entropy(logits, batch["labels"], batch["label_w"])
    hit = jnp.argmax(logits, -1) == batch["labels"]
    real = batch["label_w"] > 0
    full = jnp.all(real, axis=-1)
    lead = jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1)
    return ce * n, n, jnp.sum(hit & real, (0, 1)), jnp.sum(real, (0, 1)), jnp.sum(lead * full), jnp.sum(full)

  acc = None
  c, a = sampler.c, sampler.cfg.anchors_per_window
  for i in windows:
    all_anchors = np.arange(c.tail_start[i] + 1, c.lens[i] - 1)
    for j in range(0, len(all_anchors), a):
      anc = all_anchors[j:j + a]
      anc = np.concatenate([anc, np.full(a - len(anc), anc[-1])])  # pad the last group (counted twice: tiny)
      part = stats(params, sampler.window_batch([i], [anc]))
      acc = part if acc is None else tuple(x + y for x, y in zip(acc, part))
  ce_sum, n, hits, real, lead, full = (np.asarray(x, np.float64) for x in acc)
  return {"val_block_ce": round(float(ce_sum / n), 4),
          "val_top1_per_slot": [round(float(h), 4) for h in hits / np.maximum(real, 1)],
          "val_mean_leading_correct": round(float(lead / max(full, 1)), 4)}


def drafter_info(model: LongSparkModel, cfg: LongSparkTrainConfig, target_dir: str | Path) -> dict:
  """The head of an exported drafter's drafter.json: how it was made, its shape, its target."""
  return {
      "kind": "longspark",
      "block_size": cfg.block_size,
      "num_global_slots": cfg.num_global_slots,
      "raw_window": cfg.raw_window,
      "markov_rank": cfg.markov_rank,
      "model": dict(cfg.model),
      "mask_token_id": model.cfg.mask_token_id,
      "normalize_boundary": cfg.normalize_boundary,  # trained on taps / median|tap|, the scale folded into the encoder
      "target_layer_ids": list(model.cfg.target_layer_ids),
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
  }


def export_longspark(model: LongSparkModel, cfg: LongSparkTrainConfig, target: Transformer, target_dir: str | Path,
                     manifests: list[dict], val_sampler: AnchorSampler, val_windows: np.ndarray,
                     train_s: float) -> Path:
  last = last_logged(cfg.out_dir)
  final = save_longspark_dir(model, Path(cfg.out_dir) / "final", dtype=jnp.bfloat16)
  info = {
      **drafter_info(model, cfg, target_dir),
      "data": [{"dir": Path(d).name, **m["counts"], "temperature": m["settings"]["temperature"],
                "greedy_fraction": m["settings"]["greedy_fraction"],
                "prompt_tokens": [m["settings"]["min_prompt_tokens"], m["settings"]["max_prompt_tokens"]]}
               for d, m in zip(cfg.data_dirs, manifests)],
      "val_windows": [int(i) for i in val_windows],
      "steps": cfg.steps,
      "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "anywhere_fraction": cfg.anywhere_fraction,
      "gamma": cfg.gamma,
      "anchors_seen": last.get("tokens"),
      **validation_metrics(model, target, val_sampler, val_windows),
  }
  return write_drafter_json(final, info, last=last, train_s=train_s, model=model)
