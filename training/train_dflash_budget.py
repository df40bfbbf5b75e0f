"""`longspec train-drafter --drafter dflash-budget`: BudgetDraft's multi-view fine-tune of a DFlash drafter, from
a distillation store.

Each training window (context_len rows of the store: tokens, the drafter's taps, the target's top-k distribution)
is split at a drawn prompt length P; anchors are drawn in the continuation [P, P + continuation_len). The context
K/V of the window is computed once, and every anchor's block runs twice: the full branch sees every context row
before its anchor (plain DFlash), the sparse branch sees, of the prompt rows, only the chunks the step's budget
keeps (`select_budget_chunks` on that layer's prompt keys, per KV head, under stop-gradient) and every row from P
to its anchor. That is what `DFlashBudgetDrafter` computes at inference while the ring holds every generated row
(tests/test_budget_dflash.py). Loss = L_full + sparse_weight * L_sparse, each the store trainer's block loss
(`distill`: KL against the target's top-k, or hard CE), budget drawn per step.

Held-out: the store windows DFlash's own store trainer holds out with the same seed and val_fraction, so neither
the initial drafter nor this fine-tune saw them; tau_sim of the full branch and of the sparse branch at every
training budget, before and after.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.drafters.budget import CHUNK, dflash_multiview_logits
from longspec_jax.drafters.dflash import DFlashModel, load_dflash_model, save_dflash_dir
from longspec_jax.drafters.frozen_target import DRAFT_VOCAB_FILE, target_io
from longspec_jax.training.drafter_common import (block_loss, block_stats_fn, last_logged, pad_token,
                                                  store_evaluator, store_record, store_target, train_to_export,
                                                  trained_head, write_drafter_json)
from longspec_jax.training.drafter_data import target_name, weights_sha256
from longspec_jax.training.train_budget import check_budget_draw, multiview_record
from longspec_jax.training.train_dflash import StoreBlockSampler
from longspec_jax.training.trainer import OptimConfig, StoreRunConfig, start_store_run


@dataclasses.dataclass(frozen=True)
class DFlashBudgetTrainConfig(StoreRunConfig):
  """`longspec train-drafter --drafter dflash-budget`: BudgetDraft multi-view fine-tuning of a DFlash drafter."""
  store_dir: str = "runs/distill_smollm2"
  init_dir: str = ""  # the DFlash checkpoint to fine-tune ("" = the one shipped for the store's target)
  out_dir: str = "runs/drafter_dflash_budget"
  budgets: tuple[int, ...] = (64, 128, 256, 512)  # drawn per step ...
  budget_probs: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)  # ... with these probabilities
  sparse_weight: float = 1.0  # loss = L_full + sparse_weight * L_sparse
  keep_recent: bool = True  # selection keeps the newest (possibly partial) prompt chunk
  distill: str = "kl"  # kl | tv | hard (StoreRunConfig)
  context_len: int = 2048  # rows per training window
  min_prompt: int = 1024  # P drawn in [min_prompt, valid - continuation_len]
  continuation_len: int = 256  # anchors drawn in [P, P + continuation_len)
  anchors_per_window: int = 16
  gamma: float = 3.0  # slot k weighs exp(-(k-1)/gamma)
  batch_size: int = 4
  steps: int = 200
  optim: OptimConfig = OptimConfig(lr=2e-4, warmup_steps=20)
  val_fraction: float = 0.03  # DFlash's store trainer's split: the same held-out windows
  val_windows: int = 16
  compute_dtype: str = "bfloat16"
  log_every: int = 5

  def __post_init__(self):
    check_budget_draw(self)
    self.check_store_fields()
    self.require_positive("context_len", "continuation_len", "anchors_per_window", "batch_size", "steps",
                          "val_windows")
    if not 1 <= self.min_prompt <= self.context_len - self.continuation_len:
      raise ValueError(f"need 1 <= min_prompt <= context_len - continuation_len, got min_prompt {self.min_prompt}, "
                       f"context_len {self.context_len}, continuation_len {self.continuation_len}")
    if self.sparse_weight < 0 or not 0 < self.val_fraction < 1:
      raise ValueError(f"need sparse_weight >= 0 and 0 < val_fraction < 1, got {self.sparse_weight}, "
                       f"{self.val_fraction}")

  @property
  def max_budget(self) -> int:
    return max(self.budgets)


class PromptSplitSampler(StoreBlockSampler):
  """DFlash store blocks whose window is split at a prompt length P drawn per row; anchors lie in the
  continuation. Each batch carries prompt_lens [B] and num_chunks [B] (the step's budget / 8, or `budget`)."""

  def __init__(self, windows, cfg, budget: int | None = None):
    super().__init__(windows, cfg)
    self.budget = budget

  def anchors(self, step: int, batch_size: int, rows: slice, valid: np.ndarray) -> tuple[np.ndarray, dict]:
    cfg = self.cfg
    rng = np.random.default_rng([self.windows.seed, step, 2])
    budget = self.budget or int(rng.choice(cfg.budgets, p=cfg.budget_probs))
    u_p, u_a = rng.random(batch_size)[rows], rng.random((batch_size, cfg.anchors_per_window))[rows]
    hi = np.maximum(valid - 2 - cfg.continuation_len, cfg.min_prompt)
    prompt = (cfg.min_prompt + u_p * (hi - cfg.min_prompt + 1)).astype(np.int32)
    room = np.clip(valid - 1 - prompt, 1, cfg.continuation_len)  # anchors < valid - 1: a label after them
    anchors = (prompt[:, None] + u_a * room[:, None]).astype(np.int32)
    return anchors, {"prompt_lens": prompt, "num_chunks": np.full(len(prompt), budget // CHUNK, np.int32)}


def multiview_loss(model: DFlashModel, batch: dict, cfg: DFlashBudgetTrainConfig) -> tuple[jax.Array, dict]:
  full_logits, sparse_logits = dflash_multiview_logits(model, batch, cfg.max_budget, cfg.keep_recent)
  full, aux = block_loss(full_logits, batch, cfg.distill)
  sparse, _ = block_loss(sparse_logits, batch, cfg.distill)
  return full + cfg.sparse_weight * sparse, {"full_loss": full, "sparse_loss": sparse, **aux,
                                             "budget": batch["num_chunks"][0] * CHUNK}


def held_out_evaluator(graphdef: nnx.GraphDef, samplers: dict, extra: dict, cfg: DFlashBudgetTrainConfig,
                       dtype: jax.typing.DTypeLike) -> Callable[[Any], dict]:
  """evaluate(params) -> {branch: {val_tau_sim, val_acc_j...}} for the full branch and the sparse branch at every
  budget; each branch's stats are compiled, and its held-out batches read, once."""
  stats_of = {i: block_stats_fn(lambda p, b, i=i: dflash_multiview_logits(nnx.merge(graphdef, p), b, cfg.max_budget,
                                                                    cfg.keep_recent)[i], "kl") for i in (0, 1)}
  evaluators = {}
  for name, (sampler, branch) in samplers.items():
    stats = stats_of[branch]  # the budget is in the batch (num_chunks): one compile serves every sparse budget
    evaluators[name] = store_evaluator(lambda p, b, s=stats: s(p, {**b, "taps": b["taps"].astype(dtype), **extra}),
                                       sampler, cfg.batch_size, cfg.val_windows)
  return lambda params: {name: evaluate(params) for name, evaluate in evaluators.items()}


def train_dflash_budget(cfg: DFlashBudgetTrainConfig, resume: bool = True) -> Path:
  from longspec_jax.drafters import drafter_path
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.training.distill_store import DistillStore, StoreWindows

  store = DistillStore(cfg.store_dir)
  target_dir = Path(cfg.target_dir) if cfg.target_dir else store_target(store)
  target = load_model_dir(target_dir)
  init_dir = Path(cfg.init_dir) if cfg.init_dir else drafter_path("dflash", target=target)
  dtype = jnp.dtype(cfg.compute_dtype)
  model = load_dflash_model(init_dir, dtype=dtype)
  model.cfg.check_target(target.cfg)
  pad_id = pad_token(target.cfg)
  train_w, val_w = cfg.store_split(store)

  def sampler(windows, seed, gamma, budget=None):
    rows = StoreWindows(store, windows, cfg.context_len, model.cfg.taps, pad_id, seed)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return PromptSplitSampler(rows, SimpleNamespace(**{**fields, "gamma": gamma,
                                                       "block_size": model.cfg.block_size}), budget)

  def cast(b):
    return {**b, "taps": b["taps"].astype(dtype)}

  train_sampler = sampler(train_w, cfg.seed, cfg.gamma)
  val_samplers = {"full": (sampler(val_w, cfg.seed + 1, 1e9, cfg.budgets[0]), 0),
                  **{f"sparse_{b}": (sampler(val_w, cfg.seed + 1, 1e9, b), 1) for b in cfg.budgets}}
  local_extra = trained_head(target_io(target), init_dir)  # the head over the drafter's draft vocabulary
  train_tokens = int(train_sampler.windows.lens.sum())
  graphdef, params, run = start_store_run(
      cfg, model, resume=resume, what=f"BudgetDraft fine-tune of the DFlash drafter {init_dir}", store=store,
      train_w=train_w, val_w=val_w, train_tokens=train_tokens, details=f"budgets {cfg.budgets} w.p. "
      f"{cfg.budget_probs}, windows of {cfg.context_len}, prompt >= {cfg.min_prompt}, loss {cfg.distill}")
  held_out = held_out_evaluator(graphdef, val_samplers, local_extra, cfg, dtype)
  initial = held_out(params)  # the fine-tune's starting point (also on a resumed run)
  print("held-out tau_sim before:", {k: v["val_tau_sim"] for k, v in initial.items()}, flush=True)
  extra = {k: run.replicate(v) for k, v in local_extra.items()}

  def batch_fn(step):
    return {**run.batch(lambda r: cast(train_sampler.batch(step, cfg.batch_size, r)), cfg.batch_size), **extra}

  def loss_fn(p, batch):
    return multiview_loss(nnx.merge(graphdef, p), batch, cfg)

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, desc="train-drafter dflash-budget",
                                     tokens_fn=lambda s: cfg.batch_size * cfg.context_len)
  if stopped:
    return stopped
  after = held_out(trained)
  print("held-out tau_sim after:", {k: v["val_tau_sim"] for k, v in after.items()}, flush=True)
  trained = nnx.merge(graphdef, trained)
  final = save_dflash_dir(trained, Path(cfg.out_dir) / "final", dtype=jnp.bfloat16)
  if (init_dir / DRAFT_VOCAB_FILE).exists():
    shutil.copy(init_dir / DRAFT_VOCAB_FILE, final / DRAFT_VOCAB_FILE)
  init_info = init_dir / "drafter.json"
  init_meta = json.loads(init_info.read_text()) if init_info.exists() else {}
  last = last_logged(cfg.out_dir)
  info = {
      "kind": "dflash-budget",
      "init_from": init_dir.name,
      "n0": init_meta.get("n0"),
      "block_size": trained.cfg.block_size,
      "target_layer_ids": list(trained.cfg.target_layer_ids),
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "data": store_record(store, train_w, val_w, train_tokens, "taps"),
      "loss": cfg.distill,
      "draft_vocab_size": init_meta.get("draft_vocab_size"),
      **multiview_record(cfg, last),
      "context_len": cfg.context_len,
      "min_prompt": cfg.min_prompt,
      "continuation_len": cfg.continuation_len,
      "val_tau_sim": {"initial": {k: v["val_tau_sim"] for k, v in initial.items()},
                      "trained": {k: v["val_tau_sim"] for k, v in after.items()}},
  }
  return write_drafter_json(final, info, last=last, train_s=time.time() - t0, model=trained)
