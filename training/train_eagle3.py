"""`longspec train-drafter --drafter eagle3`: the EAGLE-3 drafter trained with training-time test (TTT) on the
target's own generations.

A window of W tokens runs through the frozen target (taps at the aux layers, no gradient). Drafter rows p = 0..W-2
follow the inference convention of longspec_jax.drafters.eagle3 (row p: feature at p, token x_{p+1}). Step 0 is
the plain teacher-forced pass (features from the target) predicting x_{p+2}. Step j >= 1 re-runs every row with
the drafter's own output hidden state of step j-1 as the feature and token x_{p+1+j}, at RoPE position p+j,
predicting x_{p+2+j}: exactly the j-th speculative row of a chain that started at row p. Its query sees the step-0
keys of rows <= p (the real rows a chain starting at p sees) and the keys of steps 1..j at its own row (the chain's
earlier speculative rows). Loss = sum_j decay^j CE_j / sum_j decay^j.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.drafters.eagle3 import (Eagle3Net, create_eagle3_net, default_aux_layers, drafter_config,
                                          save_eagle3, shifted_rows, ttt_forward)
from longspec_jax.model import param_count
from longspec_jax.training.drafter_data import load_drafter_data, target_name, weights_sha256
from longspec_jax.training.feature_cache import open_row_taps, with_taps
from longspec_jax.training.drafter_common import (data_target, draft_vocab_from_counts, draw_windows, kept_store_split,
                                                  last_logged, pad_token, split_rows, store_evaluator,
                                                  store_record, store_target, train_store_drafter, train_to_export,
                                                  write_drafter_json)
from longspec_jax.training.losses import topk_distillation
from longspec_jax.training.trainer import DataDirsRunConfig, Run, start_run, start_store_run

if TYPE_CHECKING:
  from longspec_jax.config import ModelConfig
  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.model import Transformer
  from longspec_jax.training.feature_cache import RowTaps


@dataclasses.dataclass(frozen=True)
class Eagle3TrainConfig(DataDirsRunConfig):
  """`longspec train-drafter --drafter eagle3`: an EAGLE-3 drafter, training-time test."""
  out_dir: str = "runs/drafter_eagle3"
  model: dict = dataclasses.field(default_factory=dict)  # heads / head_dim / intermediate_size overrides
  aux_layers: tuple[int, ...] = ()  # () = default_aux_layers(L)
  # Draft vocabulary: the N tokens most frequent in the training rows (EAGLE-3's d2t map); 0 = the full vocabulary.
  # A label outside it gets no loss: the drafter can never propose it.
  draft_vocab_size: int = 0
  # Frozen-target taps: "auto" = each data dir's feature cache when present, "recompute" = run the target every
  # step, "require" = the cache or an error.
  features: str = "auto"
  # With store_dir (StoreRunConfig) the taps come from the distillation store.
  context_len: int = 512  # W: tokens per training window (n0, the context the drafter is trained at)
  ttt_steps: int = 4  # unrolled drafting steps per window
  step_decay: float = 0.8  # weight of step j = step_decay ** j
  val_windows: int = 64
  compute_dtype: str = "bfloat16"
  attn_block: int = 512

  def __post_init__(self):
    self.require_positive("context_len", "ttt_steps", "batch_size", "steps", "val_windows")
    if self.context_len < self.ttt_steps + 2:
      raise ValueError(f"context_len ({self.context_len}) must be >= ttt_steps + 2 ({self.ttt_steps + 2})")
    if not 0 < self.step_decay <= 1 or not 0 <= self.val_fraction < 1:
      raise ValueError(f"need 0 < step_decay <= 1 and 0 <= val_fraction < 1, got {self.step_decay}, "
                       f"{self.val_fraction}")
    if not self.data_dirs and not self.store_dir:
      raise ValueError("data_dirs is empty")
    self.check_store_fields()


class Windows:
  """Windows of W tokens from the data rows (row start unless the row is longer); batch s is a pure function of
  (seed, s), so a resumed run replays the same batches. A batch names its windows by data row id (`row_ids`,
  default the row's index) and start ("row", "start") so that their cached taps can be looked up."""

  def __init__(self, rows: list[list[int]], width: int, pad_id: int, seed: int, row_ids=None):
    keep = [i for i, r in enumerate(rows) if len(r) >= 3]
    if not keep:
      raise ValueError("no drafter data row has the 3+ tokens an EAGLE-3 training window needs")
    self.row_ids = np.asarray(keep if row_ids is None else [row_ids[i] for i in keep])
    rows = [rows[i] for i in keep]
    self.lens = np.asarray([len(r) for r in rows])
    self.tokens = np.full((len(rows), max(int(self.lens.max()), width)), pad_id, np.int32)
    for i, r in enumerate(rows):
      self.tokens[i, :len(r)] = r
    self.width, self.seed = width, seed

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
    """Rows `rows` of step `step`'s batch (see draw_windows)."""
    _, picks, offs, _ = draw_windows(self.lens, self.seed, step, batch_size, self.width, rows)
    cols = offs[:, None] + np.arange(self.width)[None, :]
    toks = np.take_along_axis(self.tokens[picks], cols, axis=1)
    valid = np.minimum(self.lens[picks] - offs, self.width).astype(np.int32)
    return {"tokens": toks, "valid": valid, "row": self.row_ids[picks], "start": offs}


def _head_stats(net: Eagle3Net, h, targets, weights, t2d):
  """(summed CE, summed top-1 hits) of one step; t2d [V]: target id -> draft id (-1: not in the draft vocab)."""
  draft = t2d[targets]
  weights = weights * (draft >= 0)
  targets = jnp.maximum(draft, 0)
  logits = net.logits(h)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  hit = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(nll * weights), jnp.sum(hit * weights)


def _distill_stats(net: Eagle3Net, h, topk_ids, topk_logprobs, weights, t2d, kind: str):
  """(summed distillation loss, summed hits on the target's argmax) of one step against the store's soft labels;
  a teacher token outside the draft vocabulary joins the rest, and a teacher argmax outside it is a miss."""
  draft = t2d[topk_ids]
  logits = net.logits(h)
  mean, total = topk_distillation(logits, jnp.maximum(draft, 0), topk_logprobs, kind, weights, draft >= 0)
  hit = (jnp.argmax(logits, -1) == draft[..., 0]).astype(jnp.float32)
  return mean * total, jnp.sum(hit * weights)


def ttt_stats(net: Eagle3Net, frozen: dict, batch: dict, num_steps: int, aux_layers: tuple[int, ...], pad_id: int,
              distill: str = "") -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-step (loss sum, hits, weight) arrays [num_steps] for a batch. frozen: {"embed": the target's [V, H]
  table, "t2d": [V] draft ids, and "target": the frozen target unless the batch brings cached "taps"}. With
  `distill` the batch brings the target's top-k next-token distribution per position ("topk_ids",
  "topk_logprobs" [B, W, k]): step j's row p is scored against the target's distribution at position p+1+j and
  its hits count agreement with the target's argmax there; otherwise CE and hits are on the data's tokens."""
  tokens, valid = batch["tokens"], batch["valid"]
  if "taps" in batch:
    taps = batch["taps"]
  else:
    taps = frozen["target"](tokens, mode="train", taps=aux_layers, return_logits=False).taps
  taps, embed = jax.lax.stop_gradient((taps, frozen["embed"]))
  r = tokens.shape[1] - 1
  ce, hits, wsum = [], [], []
  for j, (h, tgt) in enumerate(ttt_forward(net, embed, tokens, taps, num_steps, pad_id)):
    w = (jnp.arange(r)[None, :] + 2 + j < valid[:, None]).astype(jnp.float32)
    if distill:
      ids, logprobs = (shifted_rows(batch[k], 1 + j, 0)[:, :r] for k in ("topk_ids", "topk_logprobs"))
      c, n_hit = _distill_stats(net, h, ids, logprobs, w, frozen["t2d"], distill)
    else:
      c, n_hit = _head_stats(net, h, tgt, w, frozen["t2d"])
    ce.append(c)
    hits.append(n_hit)
    wsum.append(jnp.sum(w))
  return jnp.stack(ce), jnp.stack(hits), jnp.stack(wsum)


def ttt_loss(net: Eagle3Net, frozen: dict, batch: dict, num_steps: int, decay: float, aux_layers: tuple[int, ...],
             pad_id: int, distill: str = "") -> tuple[jax.Array, dict]:
  ce, hits, w = ttt_stats(net, frozen, batch, num_steps, aux_layers, pad_id, distill)
  per_step = ce / jnp.maximum(w, 1.0)
  step_w = decay ** jnp.arange(num_steps, dtype=jnp.float32)
  loss = jnp.sum(step_w * per_step) / jnp.sum(step_w)
  acc = hits / jnp.maximum(w, 1.0)
  metrics = {f"ce_{j}": per_step[j] for j in range(num_steps)}
  metrics.update({f"acc_{j}": acc[j] for j in range(num_steps)})
  return loss, metrics


def _load_data(cfg: Eagle3TrainConfig):
  """[(dir, dataset, manifest)] of the complete data dirs, all generated by one target."""
  found, skipped = [], []
  for d in cfg.data_dirs:
    if (Path(d) / "manifest.json").exists() and (Path(d) / "dataset").exists():
      ds, manifest = load_drafter_data(d)
      found.append((d, ds, manifest))
    else:
      skipped.append(d)
  if not found:
    raise FileNotFoundError(f"none of the drafter data dirs {list(cfg.data_dirs)} is complete (manifest.json + "
                            "dataset/); run `longspec make-drafter-data --out DIR`")
  if skipped:
    print(f"skipping incomplete drafter data dirs {skipped}")
  shas = {m["target"]["weights_sha256"] for _, _, m in found}
  if len(shas) > 1:
    raise ValueError(f"the drafter data dirs {[d for d, _, _ in found]} were generated by different targets")
  return found


def train_eagle3(cfg: Eagle3TrainConfig, resume: bool = True) -> Path:
  """Trains the EAGLE-3 drafter; returns the exported directory (or the checkpoint dir when stopped early)."""
  from longspec_jax.hf_io import load_model_dir

  if cfg.store_dir:
    return train_eagle3_from_store(cfg, resume)
  data = _load_data(cfg)
  first_dir, _, manifest = data[0]
  target_dir, target_cfg = data_target(manifest, first_dir, cfg.target_dir)
  train_rows, val_rows, train_ids, val_ids, first = [], [], [], [], 0
  for _, ds, _ in data:  # row ids number the rows of all data dirs in order (the feature caches' numbering)
    rows, tr, va = split_rows(ds, cfg, target_cfg.vocab_size)
    train_rows += [rows[i] for i in tr]
    val_rows += [rows[i] for i in va]
    train_ids += list(first + tr)
    val_ids += list(first + va)
    first += len(rows)
  pad_id = pad_token(target_cfg)
  sampler = Windows(train_rows, cfg.context_len, pad_id, cfg.seed, train_ids)
  aux = tuple(cfg.aux_layers) or default_aux_layers(target_cfg.num_hidden_layers)
  draft_ids = draft_vocab_ids(train_rows, target_cfg.vocab_size, cfg.draft_vocab_size)

  dtype = jnp.dtype(cfg.compute_dtype)
  target = load_model_dir(target_dir, dtype=dtype, attn_block=cfg.attn_block)
  cached = open_row_taps([d for d, _, _ in data], [ds for _, ds, _ in data], taps=aux,
                         weights_id=weights_sha256(target_dir), mode=cfg.features)
  net = create_eagle3_net(drafter_config(target_cfg, **cfg.model), target_cfg, aux, draft_vocab=len(draft_ids),
                          seed=cfg.seed)
  # Start the drafter's own LM head from the target's (tied: the embedding), restricted to the draft vocabulary:
  # its logits begin sensible.
  head = target.embed_tokens.embedding[...].T if target.lm_head is None else target.lm_head.kernel[...]
  net.lm_head.kernel[...] = jnp.asarray(head, jnp.float32)[:, draft_ids]

  print(f"EAGLE-3 drafter: {param_count(net) / 1e6:.2f}M parameters, aux layers {aux}, draft vocabulary "
        f"{len(draft_ids)}, {len(train_rows)} train / {len(val_rows)} val rows from {[d for d, _, _ in data]}, "
        f"window {cfg.context_len}, {cfg.ttt_steps} TTT steps, target taps "
        f"{'from the feature cache' if cached else 'computed every step (no feature cache)'}")

  graphdef, params = nnx.split(net)
  tgraph, tparams = nnx.split(target)
  run = start_run(cfg, params, resume=resume,
                  record={**dataclasses.asdict(cfg), "data_dirs_used": [d for d, _, _ in data]})

  def loss_fn(p, batch):
    # The frozen inputs travel in the batch (replicated), so they are arguments of the step, not constants.
    return ttt_loss(nnx.merge(graphdef, p), _frozen(tgraph, batch["frozen"]), batch, cfg.ttt_steps,
                    cfg.step_decay, aux, pad_id)

  frozen = run.replicate(frozen_inputs(target, tparams, draft_ids, with_target=cached is None))

  def batch_fn(step):
    rows = run.batch(lambda r: with_taps(sampler.batch(step, cfg.batch_size, r), cached, aux, dtype),
                     cfg.batch_size)
    return {**rows, "frozen": frozen}

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, tokens_fn=lambda s: cfg.batch_size * cfg.context_len,
                                     desc="train-eagle3")
  if stopped:
    return stopped
  net = nnx.merge(graphdef, trained)
  record = {
      "data": [{"dir": str(Path(d).resolve()), **m["counts"], "temperature": m["settings"]["temperature"],
                "greedy_fraction": m["settings"]["greedy_fraction"]} for d, _, m in data],
      "loss": "ce",
      "target_taps_from": "feature cache" if cached else "target forward per step",
      **validation_metrics(net, target, cfg, aux, (val_rows, val_ids), pad_id, draft_ids, cached)}
  return export_eagle3(net, target.cfg, cfg, aux, target_dir, draft_ids, run, train_s=time.time() - t0,
                       record=record)


def draft_vocab_ids(rows: Sequence[Sequence[int]], vocab_size: int, size: int) -> np.ndarray:
  """The `size` target ids most frequent in `rows`, ascending (all ids when size is 0 or >= vocab_size)."""
  if size <= 0 or size >= vocab_size:
    return np.arange(vocab_size)
  return draft_vocab_from_counts(
      np.bincount(np.concatenate([np.asarray(r, np.int64) for r in rows]), minlength=vocab_size), size)


def frozen_inputs(target: Transformer, tparams: nnx.State | None, draft_ids: np.ndarray, *,
                  with_target: bool) -> dict:
  """What a TTT step reads but does not train: the target's embedding, the target -> draft id map and, when the
  taps are not cached, the target's parameters."""
  v = target.cfg.vocab_size
  t2d = np.full((v,), -1, np.int32)
  t2d[draft_ids] = np.arange(len(draft_ids), dtype=np.int32)
  out = {"embed": target.embed_tokens.embedding[...], "t2d": t2d}
  if with_target:
    out["target"] = tparams
  return out


def _frozen(tgraph, frozen: dict) -> dict:
  return {**frozen, "target": nnx.merge(tgraph, frozen["target"])} if "target" in frozen else frozen


def validation_metrics(net: Eagle3Net, target: Transformer, cfg: Eagle3TrainConfig, aux: tuple[int, ...],
                       rows: tuple[list[list[int]], list[int]], pad_id: int, draft_ids: np.ndarray,
                       cached: RowTaps | None) -> dict:
  """CE and top-1 accuracy per TTT step on held-out rows (step j: the (j+1)-th draft of a chain whose earlier
  drafts were right), a proxy for per-position acceptance on the target's own text. rows: (rows, row ids)."""
  rows, ids = rows
  if not rows:
    return {}
  sampler = Windows(rows, cfg.context_len, pad_id, cfg.seed + 1, ids)
  bs = min(cfg.batch_size, cfg.val_windows)
  graphdef, params = nnx.split(net)
  tgraph, tparams = nnx.split(target)
  frozen = frozen_inputs(target, tparams, draft_ids, with_target=cached is None)
  stats = jax.jit(lambda p, f, b: ttt_stats(nnx.merge(graphdef, p), _frozen(tgraph, f), b, cfg.ttt_steps, aux,
                                            pad_id))
  acc = None
  for i in range(-(-cfg.val_windows // bs)):
    part = stats(params, frozen, with_taps(sampler.batch(i, bs), cached, aux, target.dtype))
    acc = part if acc is None else tuple(x + y for x, y in zip(acc, part))
  ce, hits, w = (np.asarray(x, np.float64) for x in acc)
  return {"val_ce_per_step": [round(float(x), 4) for x in ce / np.maximum(w, 1)],
          "val_top1_per_step": [round(float(x), 4) for x in hits / np.maximum(w, 1)]}


def export_eagle3(net: Eagle3Net, tcfg: ModelConfig, cfg: Eagle3TrainConfig, aux: tuple[int, ...], target_dir: Path,
                  draft_ids: np.ndarray, run: Run, *, train_s: float, record: dict) -> Path:
  """Public-layout directory (bf16) plus drafter.json: what every EAGLE-3 run records, and `record` (its data,
  loss, where the taps came from and the held-out metrics)."""
  last = last_logged(cfg.out_dir)
  final = save_eagle3(net, Path(cfg.out_dir) / "final", aux, tcfg, n0=cfg.context_len,
                      d2t=np.asarray(draft_ids) - np.arange(len(draft_ids)))
  info = {
      "kind": "eagle3",
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "aux_layers": list(aux),
      "n0": cfg.context_len,
      "train_max_len": cfg.context_len + cfg.ttt_steps - 2,  # largest RoPE position + 1 seen in training
      "steps": run.total_steps,  # cfg.steps, or what fitted its time budget
      "batch_size": cfg.batch_size,
      "ttt_steps": cfg.ttt_steps,
      "step_decay": cfg.step_decay,
      "tokens_seen": last.get("tokens"),
      "final_loss_per_step": [last.get(f"ce_{j}") for j in range(cfg.ttt_steps)],
      "final_train_acc_per_step": [last.get(f"acc_{j}") for j in range(cfg.ttt_steps)],
      "draft_vocab_size": len(draft_ids),
      **record,
  }
  return write_drafter_json(final, info, last=last, train_s=train_s, model=net)


# --- training from a distillation store ------------------------------------------------------------------------

def train_eagle3_from_store(cfg: Eagle3TrainConfig, resume: bool) -> Path:
  """train_eagle3 on a distillation store: windows of context_len tokens from the store's train windows, taps
  from the store, the loss `cfg.distill` against the target's soft labels; held-out tau_sim every eval_every
  steps on the store's held-out windows."""
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.training.distill_store import DistillStore, StoreWindows, decode_on_device

  kind = cfg.distill or "kl"
  store = DistillStore(cfg.store_dir)
  target_dir = Path(cfg.target_dir) if cfg.target_dir else store_target(store)
  dtype = jnp.dtype(cfg.compute_dtype)
  target = load_model_dir(target_dir, dtype=dtype, attn_block=cfg.attn_block)
  tcfg = target.cfg
  pad_id = pad_token(tcfg)
  aux = tuple(cfg.aux_layers) or default_aux_layers(tcfg.num_hidden_layers)
  # the held-out windows fixed at the first start: the curve's anchors stay put while the store grows
  train_w, val_w, _ = kept_store_split(cfg.out_dir, store, cfg.store_split(store), resume)
  # training batches carry the taps as stored, decoded in the step: the host only copies bytes
  sampler = StoreWindows(store, train_w, cfg.context_len, aux, pad_id, cfg.seed, decode=False)
  val_sampler = StoreWindows(store, val_w, cfg.context_len, aux, pad_id, cfg.seed + 1)
  draft_ids = draft_vocab_from_counts(store.argmax_counts(train_w, tcfg.vocab_size), cfg.draft_vocab_size)

  net = create_eagle3_net(drafter_config(tcfg, **cfg.model), tcfg, aux, draft_vocab=len(draft_ids), seed=cfg.seed)
  head = target.embed_tokens.embedding[...].T if target.lm_head is None else target.lm_head.kernel[...]
  net.lm_head.kernel[...] = jnp.asarray(head, jnp.float32)[:, draft_ids]
  train_tokens = int(sampler.lens.sum())
  graphdef, _, run = start_store_run(
      cfg, net, resume=resume, what="EAGLE-3 drafter", store=store, train_w=train_w, val_w=val_w,
      train_tokens=train_tokens, details=f"aux layers {aux}, draft vocabulary {len(draft_ids)}, window "
      f"{cfg.context_len}, {cfg.ttt_steps} TTT steps, loss {kind}")
  frozen = run.replicate(frozen_inputs(target, None, draft_ids, with_target=False))

  def loss_fn(p, batch):
    batch = decode_on_device(batch, "taps", store.settings["feature_dtype"], dtype)
    return ttt_loss(nnx.merge(graphdef, p), batch["frozen"], batch, cfg.ttt_steps, cfg.step_decay, aux, pad_id,
                    kind)

  def cast(rows):
    return {**rows, "taps": rows["taps"].astype(dtype)}

  def batch_fn(step):
    return {**run.batch(lambda r: sampler.batch(step, cfg.batch_size, r), cfg.batch_size), "frozen": frozen}

  stats = jax.jit(lambda p, f, b: ttt_stats(nnx.merge(graphdef, p), f, b, cfg.ttt_steps, aux, pad_id, kind))
  local_frozen = frozen_inputs(target, None, draft_ids, with_target=False)
  t0 = time.time()
  net, held_out, stopped = train_store_drafter(
      run, cfg, graphdef, loss_fn, batch_fn, lambda p, b: stats(p, local_frozen, cast(b)), val_sampler,
      desc="train-eagle3", tokens_per_step=cfg.batch_size * cfg.context_len)
  if stopped:
    return stopped
  record = {
      "data": store_record(store, train_w, val_w, train_tokens, "taps"),
      "loss": kind,
      "epochs": round((last_logged(cfg.out_dir).get("tokens") or 0) / max(train_tokens, 1), 2),
      "target_taps_from": f"distillation store ({store.settings['feature_dtype']})",
      "val_top1_per_step": [held_out[f"val_acc_{j}"] for j in range(cfg.ttt_steps)],
      "val_tau_sim": held_out["val_tau_sim"]}
  return export_eagle3(net, tcfg, cfg, aux, target_dir, draft_ids, run, train_s=time.time() - t0, record=record)


# --- a shipped drafter against the store: held-out tau_sim, and a smaller draft vocabulary ---------------------

def evaluate_on_store(loaded: LoadedDrafter, target: Transformer, store_dir: str | Path, *, context_len: int = 512,
                      ttt_steps: int = 4, val_windows: int = 32, val_fraction: float = 0.03, seed: int = 0,
                      held_out_within_tokens: int = 0) -> dict:
  """Held-out {val_acc_j, val_loss_j (KL), val_tau_sim} of an EAGLE-3 drafter (`load_eagle3`) on the store's
  held-out windows (the split train_eagle3_from_store uses with the same seed, val_fraction and
  held_out_within_tokens): drafters trained any way are compared on the same rows."""
  from longspec_jax.training.distill_store import DistillStore, StoreWindows, split_windows
  spec, params = loaded.spec, loaded.params
  store = DistillStore(store_dir)
  _, val_w = split_windows(store, seed, val_fraction, held_out_within_tokens=held_out_within_tokens)
  pad_id = pad_token(target.cfg)
  sampler = StoreWindows(store, val_w, context_len, spec.taps, pad_id, seed + 1)
  draft_ids = np.arange(spec.draft_vocab_size) + np.asarray(params["d2t"])
  frozen = jax.tree.map(jnp.asarray, frozen_inputs(target, None, draft_ids, with_target=False))
  graphdef = spec.graphdef
  stats = jax.jit(lambda p, b: ttt_stats(nnx.merge(graphdef, p), frozen, b, ttt_steps, spec.taps, pad_id, "kl"))
  cast = lambda b: {**b, "taps": b["taps"].astype(np.float32)}
  return store_evaluator(lambda p, b: stats(p, cast(b)), sampler, 4, val_windows)(params["net"])


def shrink_draft_vocab(drafter_dir: str | Path, target: Transformer, store_dir: str | Path, size: int,
                       out_dir: str | Path, *, val_fraction: float = 0.03, seed: int = 0) -> Path:
  """A copy of an EAGLE-3 drafter whose draft vocabulary keeps only the `size` tokens of its own that are the
  target's argmax most often on the store's train windows (the LM head's other rows dropped): a smaller checkpoint
  and a cheaper head, at the acceptance of the dropped tokens (drafter.json records the argmax share kept)."""
  import json
  import shutil

  from longspec_jax.drafters.eagle3 import load_eagle3
  from longspec_jax.training.distill_store import DistillStore, split_windows
  loaded = load_eagle3(drafter_dir, target)
  spec, params = loaded.spec, loaded.params
  ids = np.arange(spec.draft_vocab_size) + np.asarray(params["d2t"])
  if not 0 < size < len(ids):
    raise ValueError(f"size must be in [1, {len(ids)}) (the drafter's draft vocabulary), got {size}")
  store = DistillStore(store_dir)
  train_w, val_w = split_windows(store, seed, val_fraction)
  counts = store.argmax_counts(train_w, target.cfg.vocab_size)
  rows = np.sort(np.argsort(-counts[ids], kind="stable")[:size])  # positions in the old draft vocabulary
  small = nnx.merge(spec.graphdef, params["net"])
  small.lm_head.kernel = nnx.Param(small.lm_head.kernel[...][:, rows])  # the kept draft ids' rows of the head
  keep = ids[rows]
  meta = json.loads((Path(drafter_dir) / "config.json").read_text())
  out = save_eagle3(small, out_dir, spec.taps, target.cfg, n0=meta.get("n0"), d2t=keep - np.arange(size))
  held_out = store.argmax_counts(val_w, target.cfg.vocab_size)
  info_path = Path(drafter_dir) / "drafter.json"
  info = json.loads(info_path.read_text()) if info_path.exists() else {}
  info.update(draft_vocab_size=size, parameters=param_count(small),
              draft_vocab_shrunk_from=len(ids),
              argmax_share_kept={"train": round(float(counts[keep].sum() / counts.sum()), 4),
                                 "held_out": round(float(held_out[keep].sum() / held_out.sum()), 4),
                                 "before_train": round(float(counts[ids].sum() / counts.sum()), 4),
                                 "before_held_out": round(float(held_out[ids].sum() / held_out.sum()), 4)})
  (out / "drafter.json").write_text(json.dumps(info, indent=2))
  for extra in ("sharpdraft.json",):
    if (Path(drafter_dir) / extra).exists():
      shutil.copy(Path(drafter_dir) / extra, out / extra)
  return out
