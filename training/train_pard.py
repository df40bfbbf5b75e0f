"""`longspec train-drafter --drafter pard`: a small standalone LM of the target's tokenizer, trained on the
target's own generations with next-token CE plus PARD's mask-group objective.

PARD drafting appends K-1 mask tokens after the last committed token and reads K drafts from one causal forward
(the last real token predicts x+1, the j-th mask predicts x+1+j). Training matches that exactly: one prefill of a
C-token window gives the next-token loss at every position and a KV cache; then, for A random anchors a per
window, K-1 mask tokens are run in `extend` mode against a copy of that cache whose length is a+1 (keys after a
are invisible, the masks overwrite rows a+1..a+K-1). So each window trains A mask groups for the price of
A*(K-1) extra query rows, and the drafter never sees a mask position it would not see at inference.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.config import ModelConfig
from longspec_jax.drafters.pard import pard_forward
from longspec_jax.model import Transformer, create_model, default_target_config, param_count
from longspec_jax.training.drafter_common import (data_target, draw_windows, last_logged, pad_token, split_rows,
                                                   train_to_export, write_drafter_json)
from longspec_jax.training.drafter_data import load_drafter_data, target_name, weights_sha256
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.trainer import RunConfig, start_run

# The PARD drafter's architecture (Qwen3-style, ~1.5M parameters at vocab 8192, most of them the tied embedding).
DRAFTER_ARCH = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=64, intermediate_size=384)
# Fields that must equal the target's: drafts are token ids of the target's vocabulary.
SHARED_WITH_TARGET = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id")


@dataclasses.dataclass(frozen=True)
class PardTrainConfig(RunConfig):
  """`longspec train-drafter --drafter pard`: a PARD parallel (mask-token) drafter."""
  data_dir: str = "runs/drafter_data"
  out_dir: str = "runs/drafter_pard"
  model: dict = dataclasses.field(default_factory=dict)  # overrides of DRAFTER_ARCH / default_target_config
  context_len: int = 512  # C: tokens per training window (n0, the context the drafter is trained at)
  num_masks: int = 7  # K-1 mask tokens appended per anchor (K drafts per forward)
  anchors_per_window: int = 16  # A mask groups per window
  mask_weight: float = 1.0  # lambda: loss = CE_next + lambda * CE_mask
  steps: int = 1000
  val_windows: int = 64
  compute_dtype: str = "bfloat16"
  attn_block: int = 512

  def __post_init__(self):
    self.require_positive("context_len", "num_masks", "anchors_per_window", "batch_size", "steps", "val_windows")
    if self.mask_weight < 0 or not 0 <= self.val_fraction < 1:
      raise ValueError(f"need mask_weight >= 0 and 0 <= val_fraction < 1, got {self.mask_weight}, "
                       f"{self.val_fraction}")

  @property
  def train_max_len(self) -> int:
    return self.context_len + self.num_masks


def drafter_model_config(target: ModelConfig, overrides: dict) -> ModelConfig:
  """Drafter config: DRAFTER_ARCH + overrides, with the target's vocabulary, special ids and RoPE."""
  if target.mask_token_id is None:
    raise ValueError("the target config has no mask_token_id; PARD needs a reserved mask token")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown drafter model keys {unknown}; known: {sorted(fields)}")
  for k in SHARED_WITH_TARGET:
    if k in overrides and overrides[k] != getattr(target, k):
      raise ValueError(f"drafter {k}={overrides[k]} does not match the target's {k}={getattr(target, k)}: a "
                       "drafter must share the target's vocabulary and special tokens")
  kw = dict(DRAFTER_ARCH, max_position_embeddings=target.max_position_embeddings, rope=target.rope,
            rms_norm_eps=target.rms_norm_eps, tie_word_embeddings=True,
            **{k: getattr(target, k) for k in SHARED_WITH_TARGET})
  kw.update(overrides)
  return default_target_config(**kw)


class WindowSampler:
  """Training batches from the drafter data rows (prompt + continuation). Each window starts at a row's start
  (positions from 0, BOS kept, as at inference) unless the row is longer than C+1 tokens; the batch for step s is
  a pure function of (seed, s), so a resumed run replays the same batches."""

  def __init__(self, rows: list[list[int]], cfg: PardTrainConfig, pad_id: int, seed: int):
    rows = [r for r in rows if len(r) >= 2]
    if not rows:
      raise ValueError("no drafter data row has the 2+ tokens a training window needs")
    self.lens = np.asarray([len(r) for r in rows])
    width = int(self.lens.max()) + cfg.num_masks + 1
    self.tokens = np.full((len(rows), width), pad_id, np.int32)
    for i, r in enumerate(rows):
      self.tokens[i, :len(r)] = r
    self.cfg, self.seed = cfg, seed

  def __len__(self):
    return len(self.lens)

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
    """Rows `rows` of step `step`'s batch (see draw_windows)."""
    cfg = self.cfg
    c, km1, a = cfg.context_len, cfg.num_masks, cfg.anchors_per_window
    _, picks, offs, u = draw_windows(self.lens, self.seed, step, batch_size, c + 1, rows, a)
    valid = np.minimum(self.lens[picks] - offs, c + 1)  # real tokens in each window (inputs + last target)
    cols = offs[:, None] + np.arange(c + 1 + km1)[None, :]
    toks = np.take_along_axis(self.tokens[picks], np.minimum(cols, self.tokens.shape[1] - 1), axis=1)
    ntp_w = (np.arange(1, c + 1)[None, :] < valid[:, None]).astype(np.float32)
    # Anchor a (a real input position with a real next token) predicts x[a+1]; its mask j (1..K-1) x[a+1+j].
    anchors = (u * (valid[:, None] - 1)).astype(np.int32)
    tgt_pos = anchors[..., None] + 1 + np.arange(1, km1 + 1)
    mask_tgt = np.take_along_axis(toks[:, None, :], tgt_pos, axis=2)
    mask_w = (tgt_pos < valid[:, None, None]).astype(np.float32)
    return {"tokens": toks[:, :c + 1], "ntp_w": ntp_w, "anchors": anchors, "mask_tgt": mask_tgt,
            "mask_w": mask_w}


def pard_loss(model: Transformer, batch: dict, num_masks: int, mask_id: int,
              mask_weight: float) -> tuple[jax.Array, dict]:
  ntp_logits, mask_logits = pard_forward(model, batch, num_masks, mask_id)
  ntp, _ = cross_entropy(ntp_logits, batch["tokens"][:, 1:], batch["ntp_w"])
  mask, _ = cross_entropy(mask_logits, batch["mask_tgt"], batch["mask_w"])
  return ntp + mask_weight * mask, {"ntp_loss": ntp, "mask_loss": mask}


def train_pard(cfg: PardTrainConfig, resume: bool = True) -> Path:
  """Trains the PARD drafter; returns the exported HF directory (or the checkpoint dir when stopped early)."""
  ds, manifest = load_drafter_data(cfg.data_dir)
  target_dir, target = data_target(manifest, cfg.data_dir, cfg.target_dir)
  model_cfg = drafter_model_config(target, cfg.model)
  rows, train, val = split_rows(ds, cfg, target.vocab_size)
  train_rows, val_rows = [rows[i] for i in train], [rows[i] for i in val]
  pad_id = pad_token(target)
  sampler = WindowSampler(train_rows, cfg, pad_id, cfg.seed)

  model = create_model(model_cfg, seed=cfg.seed, dtype=jnp.dtype(cfg.compute_dtype), attn_block=cfg.attn_block)
  print(f"PARD drafter: {param_count(model) / 1e6:.2f}M parameters, {len(train_rows)} train / {len(val_rows)} "
        f"val rows, window {cfg.context_len} + {cfg.num_masks} masks x {cfg.anchors_per_window} anchors")
  graphdef, params = nnx.split(model)
  run = start_run(cfg, params, resume=resume)

  def loss_fn(p, batch):
    return pard_loss(nnx.merge(graphdef, p), batch, cfg.num_masks, target.mask_token_id, cfg.mask_weight)

  def batch_fn(step):
    return run.batch(lambda rows: sampler.batch(step, cfg.batch_size, rows), cfg.batch_size)

  t0 = time.time()
  trained, stopped = train_to_export(run, loss_fn, batch_fn, tokens_fn=lambda s: cfg.batch_size * cfg.context_len,
                                     desc="train-drafter")
  if stopped:
    return stopped
  return export_drafter(nnx.merge(graphdef, trained), cfg, target_dir, manifest, val_rows, pad_id,
                        train_s=time.time() - t0)


def validation_metrics(model: Transformer, cfg: PardTrainConfig, rows: list[list[int]], pad_id: int,
                       mask_id: int) -> dict:
  """Losses and top-1 accuracy per draft position (anchor = position 1, mask j = position j+1) on held-out
  rows: a proxy for PARD acceptance on greedy target text."""
  if not rows:
    return {}
  sampler = WindowSampler(rows, cfg, pad_id, seed=cfg.seed + 1)
  bs = min(cfg.batch_size, cfg.val_windows)
  graphdef, params = nnx.split(model)

  @jax.jit
  def stats(params, batch):
    m = nnx.merge(graphdef, params)
    ntp_logits, mask_logits = pard_forward(m, batch, cfg.num_masks, mask_id)
    ntp, n_ntp = cross_entropy(ntp_logits, batch["tokens"][:, 1:], batch["ntp_w"])
    mask, n_mask = cross_entropy(mask_logits, batch["mask_tgt"], batch["mask_w"])
    # Position 1 at each anchor is the anchor's own next-token prediction.
    anchor_logits = jnp.take_along_axis(ntp_logits, batch["anchors"][..., None], axis=1)
    anchor_tgt = jnp.take_along_axis(batch["tokens"], batch["anchors"] + 1, axis=1)
    hit = jnp.concatenate([(jnp.argmax(anchor_logits, -1) == anchor_tgt)[..., None],
                           jnp.argmax(mask_logits, -1) == batch["mask_tgt"]], axis=-1)
    w = jnp.concatenate([jnp.ones_like(batch["mask_w"][..., :1]), batch["mask_w"]], axis=-1)
    return ntp * n_ntp, n_ntp, mask * n_mask, n_mask, jnp.sum(hit * w, (0, 1)), jnp.sum(w, (0, 1))

  acc = None
  for i in range(-(-cfg.val_windows // bs)):
    part = stats(params, sampler.batch(i, bs))
    acc = part if acc is None else tuple(x + y for x, y in zip(acc, part))
  ntp_sum, n_ntp, mask_sum, n_mask, hits, w = (np.asarray(x, np.float64) for x in acc)
  return {"val_ntp_loss": round(float(ntp_sum / n_ntp), 4), "val_mask_loss": round(float(mask_sum / n_mask), 4),
          "val_top1_per_position": [round(float(h), 4) for h in hits / np.maximum(w, 1)]}


def export_drafter(model: Transformer, cfg: PardTrainConfig, target_dir: Path, manifest: dict,
                   val_rows: list[list[int]], pad_id: int, train_s: float) -> Path:
  """HF directory (bf16 safetensors + the target's tokenizer) plus drafter.json describing how it was trained."""
  from longspec_jax.hf_io import save_model_dir

  last = last_logged(cfg.out_dir)
  final = save_model_dir(model, Path(cfg.out_dir) / "final", tokenizer_dir=target_dir, dtype=jnp.bfloat16)
  info = {
      "kind": "standalone",
      "mode": "pard",
      "mask_token_id": model.cfg.mask_token_id,
      "num_mask_tokens_trained": cfg.num_masks,
      "target": target_name(target_dir),
      "target_weights_sha256": weights_sha256(target_dir),
      "target_vocab_size": model.cfg.vocab_size,
      "train_max_len": cfg.train_max_len,
      "n0": cfg.context_len,
      "data": {"dir": str(Path(cfg.data_dir).resolve()), **manifest["counts"],
               "temperature": manifest["settings"]["temperature"],
               "greedy_fraction": manifest["settings"]["greedy_fraction"]},
      "steps": cfg.steps,
      "batch_size": cfg.batch_size,
      "anchors_per_window": cfg.anchors_per_window,
      "mask_weight": cfg.mask_weight,
      "tokens_seen": last.get("tokens"),
      "final_ntp_loss": last.get("ntp_loss"),
      "final_mask_loss": last.get("mask_loss"),
      **validation_metrics(model, cfg, val_rows, pad_id, model.cfg.mask_token_id),
  }
  return write_drafter_json(final, info, last=last, train_s=train_s, model=model)
