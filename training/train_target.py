"""`longspec train-target`: trains the default target on the corpus with a sequence-length curriculum."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.config import ModelConfig
from longspec_jax.distributed import is_main_process
from longspec_jax.model import Transformer, create_model, default_target_config
from longspec_jax.tokenizer import load_tokenizer, special_token_ids
from longspec_jax.training.data import TokenStream, load_corpus, tokenize_split
from longspec_jax.training.losses import cross_entropy
from longspec_jax.training.trainer import (Checkpointer, OptimConfig, Stage, TrainState, make_optimizer, stage_at,
                                           start_run)


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
  corpus_dir: str = "data/corpus"
  tokenizer_dir: str = "data/tokenizer"
  out_dir: str = "runs/target"
  model: dict = dataclasses.field(default_factory=dict)  # overrides of default_target_config()
  stages: tuple[Stage, ...] = (Stage(1024, 8, 100),)
  optim: OptimConfig = OptimConfig()
  seed: int = 0
  compute_dtype: str = "float32"
  remat_min_len: int = 4096  # per-layer remat from this length on
  attn_block: int = 512
  checkpoint_every_minutes: float = 5.0
  log_every: int = 10
  mesh_data: int = 0  # 0 = all devices
  stop_after_steps: int = 0  # >0: stop (after checkpointing) once this many steps are done; rerun to continue

  @property
  def total_steps(self) -> int:
    return sum(s.steps for s in self.stages)


def token_stream(cfg: TargetTrainConfig, split: str = "train") -> TokenStream:
  """Tokenized split, cached as .npy beside the run (tokenizing 28M chars takes a while on 2 cores). Every process
  of a multi-host run without the cache tokenizes on its own; process 0 writes the cache (whole, by a rename, so a
  process that finds it never reads half a file)."""
  cache = Path(cfg.out_dir) / f"tokens_{split}.npy"
  if cache.exists():
    return TokenStream(np.load(cache), seed=cfg.seed)
  tok = load_tokenizer(cfg.tokenizer_dir)
  ids = tokenize_split(tok, load_corpus(cfg.corpus_dir)[split]["text"], special_token_ids(tok)["eos"])
  if is_main_process():
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.tmp")
    with open(tmp, "wb") as f:
      np.save(f, ids)
    os.replace(tmp, cache)
  return TokenStream(ids, seed=cfg.seed)


def build(cfg: TargetTrainConfig, vocab_size: int) -> tuple[ModelConfig, dict[bool, Transformer]]:
  model_cfg = default_target_config(vocab_size=vocab_size, **cfg.model)
  dtype = jnp.dtype(cfg.compute_dtype)
  # Two graph variants of one parameter set: remat only pays off at long lengths.
  models = {remat: create_model(model_cfg, seed=cfg.seed, dtype=dtype, remat=remat, attn_block=cfg.attn_block)
            for remat in (False, True)}
  return model_cfg, models


def train_target(cfg: TargetTrainConfig, resume: bool = True) -> Path:
  """Trains the target; returns the exported HF directory (or the checkpoint dir when stopped early)."""
  tok = load_tokenizer(cfg.tokenizer_dir)
  stream = token_stream(cfg)
  model_cfg, models = build(cfg, tok.get_vocab_size())
  graphdefs = {r: nnx.split(m)[0] for r, m in models.items()}
  params = nnx.split(models[False])[1]
  run = start_run(cfg, params, resume=resume, total_steps=cfg.total_steps,
                  batch_sizes=tuple(s.batch_size for s in cfg.stages))
  if is_main_process():
    (run.out / "model_config.json").write_text(json.dumps(model_cfg.to_hf_dict(), indent=2))

  def make_loss(graphdef):
    def loss_fn(p, batch):
      model = nnx.merge(graphdef, p)
      tokens = batch["tokens"]
      logits = model(tokens[:, :-1], mode="train").logits
      loss, _ = cross_entropy(logits, tokens[:, 1:])
      return loss, {}
    return loss_fn

  steps = {r: run.train_step(make_loss(g)) for r, g in graphdefs.items()}

  def batch_fn(step):
    st = stage_at(cfg.stages, step)
    return run.batch(lambda rows: {"tokens": stream.batch(step, st.batch_size, st.seq_len, rows)}, st.batch_size)

  def step_fn(state, batch):
    remat = batch["tokens"].shape[1] - 1 >= cfg.remat_min_len
    return steps[remat](state, batch)

  if not run.train(step_fn, batch_fn, desc="train-target",
                   tokens_fn=lambda s: stage_at(cfg.stages, s).seq_len * stage_at(cfg.stages, s).batch_size):
    return run.out / "checkpoints"
  model = nnx.merge(graphdefs[False], run.local_params())
  if not is_main_process():  # process 0 exports
    return run.out / "final"
  return export_final(model, cfg, stream)


def export_final(model: Transformer, cfg: TargetTrainConfig, stream: TokenStream) -> Path:
  """HF directory with the tokenizer and the training split's unigram log-probs (the eval baseline, and the
  prior DeLS-Spec subtracts)."""
  from longspec_jax.training.eval_target import unigram_log_probs
  from longspec_jax.hf_io import save_model_dir
  final = save_model_dir(model, Path(cfg.out_dir) / "final", tokenizer_dir=cfg.tokenizer_dir,
                         dtype=jnp.bfloat16)
  np.save(final / "unigram.npy", unigram_log_probs([stream.tokens], model.cfg.vocab_size))
  return final


def load_params_from_checkpoint(cfg: TargetTrainConfig, step: int | None = None) -> tuple[Transformer, int]:
  """Loads (model) from an orbax run directory, for export mid-training."""
  tok = load_tokenizer(cfg.tokenizer_dir)
  model_cfg, models = build(cfg, tok.get_vocab_size())
  graphdef, params = nnx.split(models[False])
  optimizer = make_optimizer(cfg.optim, cfg.total_steps)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
  ckpt = Checkpointer(Path(cfg.out_dir) / "checkpoints")
  state = ckpt.restore(state, step)
  ckpt.close()
  return nnx.merge(graphdef, state.params), int(state.step)


