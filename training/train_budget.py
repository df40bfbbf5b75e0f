"""`longspec train-drafter --drafter budget`: BudgetDraft multi-view fine-tuning of a standalone drafter.

Teacher = the target's greedy token after every continuation prefix of long drafter-data rows (prompt + target
continuation): the continuation itself on greedy rows, the target's argmax (one forward per row, cached beside
the run) on sampled rows. Loss = CE(full-cache branch) + sparse_weight * CE(sparse branch), both on the
continuation rows only, with the budget drawn per step.

One forward serves both branches. Prompt rows run causal over the whole prompt once (both branches see the same
prompt K/V: at inference the drafter also prefills its prompt with full attention before it sparsifies). The
continuation rows then run twice: the full branch attends to every prompt key, the sparse branch only to the
chunks `select_budget_chunks` keeps from that layer's prompt keys (indices under stop-gradient), a per-KV-head
mask; both attend causally to their own continuation rows. That is exactly what `BudgetDrafter` computes at
inference (tested in tests/test_budget.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import sharding as shd
from longspec_jax.drafters.budget import CHUNK, check_budget, multiview_forward
from longspec_jax.model import Transformer, param_count
from longspec_jax.training.drafter_data import load_drafter_data, target_name, weights_sha256
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.drafter_common import (data_target, last_logged, pad_token, split_indices,
                                                   train_to_export, write_drafter_json)
from longspec_jax.training.trainer import OptimConfig, RunConfig, start_run


@dataclasses.dataclass(frozen=True)
class BudgetTrainConfig(RunConfig):
  """`longspec train-drafter --drafter budget`: BudgetDraft fine-tuning of a PARD drafter."""
  data_dir: str = "runs/drafter_data_long"
  init_dir: str = ""  # drafter checkpoint to fine-tune ("" = the shipped PARD / standalone drafter)
  out_dir: str = "runs/drafter_budget"
  budgets: tuple[int, ...] = (64, 128, 256, 512)  # drawn per step ...
  budget_probs: tuple[float, ...] = (0.4, 0.3, 0.2, 0.1)  # ... with these probabilities (the paper's)
  sparse_weight: float = 0.5  # lambda: loss = CE_full + lambda * CE_sparse
  keep_recent: bool = True  # selection keeps the newest (possibly partial) prompt chunk
  continuation_len: int = 256  # loss rows per sequence
  batch_size: int = 4
  steps: int = 80
  optim: OptimConfig = OptimConfig(lr=5e-4, warmup_steps=8)
  val_fraction: float = 0.08
  compute_dtype: str = "bfloat16"
  attn_block: int = 512
  log_every: int = 5

  def __post_init__(self):
    check_budget_draw(self)
    self.require_positive("continuation_len", "batch_size", "steps")
    if self.sparse_weight < 0 or not 0 <= self.val_fraction < 1:
      raise ValueError(f"need sparse_weight >= 0 and 0 <= val_fraction < 1, got {self.sparse_weight}, "
                       f"{self.val_fraction}")

  @property
  def max_budget(self) -> int:
    return max(self.budgets)


def check_budget_draw(cfg: Any) -> None:
  """Normalises and checks a multi-view config's `budgets` and `budget_probs` (a frozen dataclass's fields)."""
  object.__setattr__(cfg, "budgets", tuple(int(b) for b in cfg.budgets))
  object.__setattr__(cfg, "budget_probs", tuple(float(p) for p in cfg.budget_probs))
  for b in cfg.budgets:
    check_budget(b)
  if not cfg.budgets or len(cfg.budgets) != len(cfg.budget_probs) or min(cfg.budget_probs) < 0:
    raise ValueError(f"need one non-negative probability per budget, got budgets {cfg.budgets} and "
                     f"probabilities {cfg.budget_probs}")
  if abs(sum(cfg.budget_probs) - 1) > 1e-6:
    raise ValueError(f"budget_probs must sum to 1, got {sum(cfg.budget_probs)}")


def multiview_record(cfg: Any, last: dict) -> dict:
  """drafter.json's record of a multi-view run: its budget draw, schedule and the last logged branch losses."""
  return {"budgets": list(cfg.budgets), "budget_probs": list(cfg.budget_probs), "sparse_weight": cfg.sparse_weight,
          "budget_keep_recent": cfg.keep_recent, "steps": cfg.steps, "batch_size": cfg.batch_size,
          "lr": cfg.optim.lr, "tokens_seen": last.get("tokens"), "final_full_loss": last.get("full_loss"),
          "final_sparse_loss": last.get("sparse_loss")}


def row_key(row: dict) -> str:
  """Cache key of a row: a digest of its tokens (rows are found again whatever the dataset order)."""
  toks = np.asarray(row["prompt"] + row["continuation"], np.int32)
  return hashlib.sha1(toks.tobytes()).hexdigest()[:20]


def teacher_labels(target_dir: Path, rows: list[dict], cache_path: Path) -> list[np.ndarray]:
  """Per row, the target's greedy next token after each continuation prefix (label of continuation row r).

  Greedy rows: the continuation shifted by one (the last row has no label: -1). Sampled rows: the target's
  argmax from one forward, cached in `cache_path` (keyed by the row's tokens) so a rerun does not redo it."""
  from longspec_jax.hf_io import load_model_dir
  cached = dict(np.load(cache_path)) if cache_path.exists() else {}
  todo = [r for r in rows if r["temperature"] > 0 and row_key(r) not in cached]
  if todo:
    target = load_model_dir(target_dir)
    graphdef, params = nnx.split(target)

    @jax.jit
    def argmax_at(params, toks, at):
      m = nnx.merge(graphdef, params)
      return jnp.argmax(m(toks, mode="train", logits_at=at).logits, -1)

    for n, r in enumerate(todo):
      p, c = r["prompt"], r["continuation"]
      at = np.asarray([len(p) + np.arange(len(c))], np.int32)
      cached[row_key(r)] = np.asarray(argmax_at(params, np.asarray([p + c], np.int32), at))[0].astype(np.int32)
      if (n + 1) % 8 == 0 or n + 1 == len(todo):
        np.savez(cache_path, **cached)
        print(f"teacher labels: {n + 1}/{len(todo)} sampled rows", flush=True)
  out = []
  for r in rows:
    c = np.asarray(r["continuation"], np.int32)
    out.append(cached[row_key(r)] if r["temperature"] > 0 else np.append(c[1:], -1).astype(np.int32))
  return out


class LongRowSampler:
  """Batches of whole rows: prompt right-padded to a multiple of 8, continuation and teacher labels padded to
  continuation_len, and the budget of the step. A pure function of (seed, step)."""

  def __init__(self, rows: list[dict], labels: list[np.ndarray], cfg: BudgetTrainConfig, pad_id: int, seed: int):
    self.cfg, self.seed = cfg, seed
    c = cfg.continuation_len
    n = len(rows)
    self.prompt_lens = np.asarray([len(r["prompt"]) for r in rows], np.int32)
    width = -(-int(self.prompt_lens.max()) // CHUNK) * CHUNK
    self.prompt = np.full((n, width), pad_id, np.int32)
    self.cont = np.full((n, c), pad_id, np.int32)
    self.labels = np.zeros((n, c), np.int32)
    self.weights = np.zeros((n, c), np.float32)
    for i, (r, lab) in enumerate(zip(rows, labels)):
      self.prompt[i, :len(r["prompt"])] = r["prompt"]
      m = min(len(r["continuation"]), c)
      self.cont[i, :m] = r["continuation"][:m]
      self.labels[i, :m] = np.maximum(lab[:m], 0)
      self.weights[i, :m] = lab[:m] >= 0

  def __len__(self):
    return len(self.prompt_lens)

  def take(self, idx: np.ndarray, budget: int) -> dict:
    return {"prompt": self.prompt[idx], "prompt_lens": self.prompt_lens[idx], "cont": self.cont[idx],
            "labels": self.labels[idx], "weights": self.weights[idx],
            "num_chunks": np.full((len(idx),), budget // CHUNK, np.int32)}

  def batch(self, step: int, batch_size: int) -> dict:
    rng = np.random.default_rng([self.seed, step])
    budget = int(rng.choice(self.cfg.budgets, p=self.cfg.budget_probs))
    return self.take(rng.integers(0, len(self), size=batch_size), budget)


def multiview_loss(model: Transformer, batch: dict, cfg: BudgetTrainConfig) -> tuple[jax.Array, dict]:
  full_logits, sparse_logits = multiview_forward(model, batch, cfg.max_budget, cfg.keep_recent)
  full, _ = cross_entropy(full_logits, batch["labels"], batch["weights"])
  sparse, _ = cross_entropy(sparse_logits, batch["labels"], batch["weights"])
  return full + cfg.sparse_weight * sparse, {"full_loss": full, "sparse_loss": sparse,
                                             "budget": batch["num_chunks"][0] * CHUNK}


def _rows(ds) -> list[dict]:
  return [{"prompt": list(p), "continuation": list(c), "temperature": float(t)}
          for p, c, t in zip(ds["prompt"], ds["continuation"], ds["temperature"])]


def _load_init(cfg: BudgetTrainConfig):
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
  from longspec_jax.hf_io import load_model_dir
  init = Path(cfg.init_dir) if cfg.init_dir else SHIPPED_DRAFTERS_DIR / "pard"
  return init, load_model_dir(init, dtype=jnp.dtype(cfg.compute_dtype), attn_block=cfg.attn_block)


def train_budget(cfg: BudgetTrainConfig, resume: bool = True) -> Path:
  """Fine-tunes the drafter with the multi-view objective; returns the exported HF directory (or the checkpoint
  dir when stopped early)."""
  ds, manifest = load_drafter_data(cfg.data_dir)
  target_dir, target = data_target(manifest, cfg.data_dir, cfg.target_dir)
  out = Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  rows = _rows(ds)
  labels = teacher_labels(target_dir, rows, out / "teacher_labels.npz")
  train_idx, val_idx = split_indices(len(rows), cfg.seed, cfg.val_fraction)
  pad_id = pad_token(target)
  sampler = LongRowSampler([rows[i] for i in train_idx], [labels[i] for i in train_idx], cfg, pad_id, cfg.seed)

  init_dir, model = _load_init(cfg)
  if model.cfg.vocab_size != target.vocab_size:
    raise ValueError(f"drafter {init_dir} has vocab_size {model.cfg.vocab_size}, the target {target.vocab_size}")
  print(f"BudgetDraft: fine-tuning {init_dir} ({param_count(model) / 1e6:.2f}M parameters), {len(train_idx)} "
        f"train / {len(val_idx)} val rows, budgets {cfg.budgets} w.p. {cfg.budget_probs}")
  graphdef, params = nnx.split(model)
  initial = jax.tree.map(jnp.copy, params)
  run = start_run(cfg, params, resume=resume)

  def loss_fn(p, batch):
    return multiview_loss(nnx.merge(graphdef, p), batch, cfg)

  data_sharding = shd.batch_sharding(run.mesh)

  def batch_fn(step):
    return jax.device_put(sampler.batch(step, cfg.batch_size), data_sharding)

  tokens_per_step = int(cfg.batch_size * (sampler.prompt.shape[1] + cfg.continuation_len))
  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, tokens_fn=lambda s: tokens_per_step, desc="train-budget")
  if stopped:
    return stopped
  val = LongRowSampler([rows[i] for i in val_idx], [labels[i] for i in val_idx], cfg, pad_id, cfg.seed + 1)
  metrics = {"initial": validation_metrics(graphdef, initial, val, cfg),
             "trained": validation_metrics(graphdef, trained, val, cfg)}
  return export_budget_drafter(nnx.merge(graphdef, trained), cfg, init_dir, target_dir, manifest, metrics,
                               train_s=time.time() - t0)


def validation_metrics(graphdef: nnx.GraphDef, params: nnx.State, val: LongRowSampler, cfg: BudgetTrainConfig) -> dict:
  """Held-out CE and top-1 agreement with the teacher (= classic-mode acceptance proxy per drafted token) of the
  full-cache branch and of the sparse branch at every training budget."""
  if not len(val):
    return {}

  @jax.jit
  def stats(params, batch):
    full, sparse = multiview_forward(nnx.merge(graphdef, params), batch, cfg.max_budget, cfg.keep_recent)
    w = batch["weights"]
    out = []
    for logits in (full, sparse):
      ce, n = cross_entropy(logits, batch["labels"], w)
      out += [ce * n, jnp.sum((jnp.argmax(logits, -1) == batch["labels"]) * w), n]
    return out

  res = {}
  for budget in cfg.budgets:
    acc = None
    for i in range(len(val)):
      part = stats(params, val.take(np.asarray([i]), budget))
      acc = part if acc is None else [a + p for a, p in zip(acc, part)]
    f_ce, f_hit, n, s_ce, s_hit, _ = (float(x) for x in acc)
    res["full"] = {"ce": round(f_ce / n, 4), "top1": round(f_hit / n, 4)}
    res[f"sparse_{budget}"] = {"ce": round(s_ce / n, 4), "top1": round(s_hit / n, 4)}
  return res


def export_budget_drafter(model: Transformer, cfg: BudgetTrainConfig, init_dir: Path, target_dir: Path, manifest: dict,
                          metrics: dict, train_s: float) -> Path:
  from longspec_jax.hf_io import save_model_dir
  last = last_logged(cfg.out_dir)
  final = save_model_dir(model, Path(cfg.out_dir) / "final", tokenizer_dir=target_dir, dtype=jnp.bfloat16)
  init_meta = json.loads((init_dir / "drafter.json").read_text()) if (init_dir / "drafter.json").exists() else {}
  info = {
      "kind": "budget",
      "mode": "classic",
      "mask_token_id": model.cfg.mask_token_id,
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "target_vocab_size": model.cfg.vocab_size,
      "init_from": str(init_dir),
      "init_n0": init_meta.get("n0"),
      **multiview_record(cfg, last),
      "data": {"dir": str(Path(cfg.data_dir).resolve()), **manifest["counts"],
               "temperature": manifest["settings"]["temperature"],
               "greedy_fraction": manifest["settings"]["greedy_fraction"],
               "min_prompt_tokens": manifest["settings"]["min_prompt_tokens"],
               "max_prompt_tokens": manifest["settings"]["max_prompt_tokens"]},
      "teacher": "target greedy tokens (greedy rows: the continuation; sampled rows: target argmax)",
      "val_rows": int(round(cfg.val_fraction * manifest["counts"]["sequences"])),
      "val_top1_per_slot_note": "classic mode drafts one token per slot from its own prefix: one top-1 per branch",
      "val": metrics,
  }
  return write_drafter_json(final, info, last=last, train_s=train_s, model=model)
