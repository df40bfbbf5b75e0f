"""The drafters' commands: `make-drafter-data`, `make-distill-store`, `train-drafter` and `calibrate-sharpdraft`.
Their default configs ship inside the package (longspec_jax/assets/configs/), so they run from any folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax import ASSETS_DIR
from longspec_jax.argtypes import add_command, fraction, int_list, nonneg_float, nonneg_int, positive_int
from longspec_jax.drafters import ENTRIES, SHARPDRAFT_METHODS
from longspec_jax.inference.cli.flags import add_output_flags, add_target_flags, dtype_arg
from longspec_jax.sharpdraft_names import ALPHA_RULES, GRANULARITIES, SHARPDRAFT_FILE

if TYPE_CHECKING:
  import argparse

DEFAULT_CONFIGS = ASSETS_DIR / "configs"
# --drafter NAME: the methods whose registry entry names a trainer; DEFAULT_CONFIGS/drafter_NAME.yaml their config.
TRAINABLE = sorted(name for name, e in ENTRIES.items() if e.trainer)
TARGET_ALIASES = ("--target",)  # the name these commands first gave --model
FEATURE_DTYPES = {"bfloat16": "bf16", "float8": "fp8"}  # the store's storage names, in the one dtype vocabulary


def cmd_make_drafter_data(a: argparse.Namespace) -> int:
  from longspec_jax import default_target_dir
  from longspec_jax.targets import resolve_target_dir
  from longspec_jax.training.drafter_data import MANIFEST, DrafterDataConfig, make_drafter_data

  cfg = DrafterDataConfig(
      target_dir=str(resolve_target_dir(a.model) if a.model else default_target_dir()), corpus_dir=a.corpus,
      out_dir=a.out, num_prompts=a.num_prompts, new_tokens=a.new_tokens, batch=a.batch, temperature=a.temperature,
      greedy_fraction=a.greedy_fraction, min_prompt_tokens=a.min_prompt_tokens,
      max_prompt_tokens=a.max_prompt_tokens, seed=a.seed)
  out = make_drafter_data(cfg)
  manifest = json.loads((Path(cfg.out_dir) / MANIFEST).read_text())
  print(json.dumps({k: manifest[k] for k in ("counts", "generation_s", "generated_tokens_per_s")}, indent=2))
  print(f"wrote {out}")
  if a.cache_taps or a.cache_kv_layers:
    _cache_features(cfg, a.cache_taps or "", a.cache_kv_layers)
  return 0


def _cache_features(cfg, taps_spec: str, kv_layers) -> None:
  import time

  from longspec_jax.hf_io import load_model_dir, weights_sha256
  from longspec_jax.training.feature_cache import build_feature_cache, cache_tap_indices

  target = load_model_dir(cfg.target_dir)
  taps = cache_tap_indices(taps_spec or "dflash", target.cfg)
  t0 = time.time()
  d = build_feature_cache(cfg.out_dir, target, taps, kv_layers or (), weights_id=weights_sha256(cfg.target_dir))
  size = sum(f.stat().st_size for f in d.iterdir())
  rows = json.loads((d / "index.json").read_text())["meta"]["lens"]
  print(f"feature cache {d}: taps {list(taps)}, kv layers {list(kv_layers or ())}, {size / 2**20:.0f} MiB "
        f"({size / sum(rows) * 1024 / 2**20:.2f} MiB per 1K tokens), {time.time() - t0:.0f} s this run")


def cmd_make_distill_store(a: argparse.Namespace) -> int:
  from longspec_jax.config import ModelConfig
  from longspec_jax.targets import resolve_target_dir
  from longspec_jax.training.distill_store import INDEX, DistillStoreConfig, build_distill_store
  from longspec_jax.training.feature_cache import cache_tap_indices

  target_cfg = ModelConfig.from_json_file(resolve_target_dir(a.model) / "config.json")
  cfg = DistillStoreConfig(
      target=a.model, corpus_dir=a.corpus, out_dir=a.out, max_tokens=a.max_tokens, max_minutes=a.max_minutes,
      max_documents=a.max_documents, window_tokens=a.window,
      taps=cache_tap_indices(a.taps, target_cfg) if a.taps else (), kv_layers=a.kv_layers or (), topk=a.topk,
      feature_dtype=FEATURE_DTYPES[a.dtype], shard_tokens=a.shard_tokens, on_policy_fraction=a.on_policy_fraction,
      on_policy_new_tokens=a.on_policy_new_tokens, seed=a.seed)
  out = build_distill_store(cfg, show_progress=not a.quiet)
  index = json.loads((out / INDEX).read_text())
  run = index["runs"][-1]
  print(json.dumps({"stored_tokens": index["stored_tokens"], "shards": len(index["shards"]), "bytes": index["bytes"],
                    "bytes_per_million_tokens": index["bytes"] * 1e6 / max(index["stored_tokens"], 1),
                    "this_run_seconds": run["seconds"], "this_run_tokens": run["tokens"]}, indent=2))
  return 0


def cmd_train_drafter(a: argparse.Namespace) -> int:
  from longspec_jax.yaml_config import load_yaml

  if a.multi_view_budgets:
    if a.drafter not in ("budget", "dflash-budget"):
      raise ValueError("--multi-view-budgets applies to --drafter budget and --drafter dflash-budget")
    a.set.append(f"budgets=[{a.multi_view_budgets}]")
  config_cls, train = ENTRIES[a.drafter].load_trainer()
  overrides = a.set + ([f"base={a.base}"] if a.base else [])  # --base: the frozen drafter a head wraps (dels)
  cfg = load_yaml(config_cls, a.config or DEFAULT_CONFIGS / f"drafter_{a.drafter}.yaml", overrides)
  print(train(cfg, resume=not a.no_resume))
  return 0


def cmd_calibrate_sharpdraft(a: argparse.Namespace) -> int:
  from longspec_jax.training.calibrate_sharpdraft import run_calibration, summary
  out = run_calibration(a.drafter, a.drafter_dir, a.model, a.corpus, a.granularity, a.rule, a.fit_max_keys,
                        a.num_windows, a.batch, a.seed, a.n0, a.out)
  print(summary(json.loads(out.read_text())))
  print(f"wrote {out}")
  return 0


def _corpus_out(parser, out_default: str) -> None:
  """The flags every command that runs the target over the corpus shares."""
  add_target_flags(parser, rope=False, dtype=False, aliases=TARGET_ALIASES)
  parser.add_argument("--corpus", default="data/corpus", help="corpus directory (from `longspec corpus`)")
  parser.add_argument("--out", default=out_default, help="output directory")


def add_commands(sub: argparse._SubParsersAction) -> None:
  m = add_command(
      sub, "make-drafter-data", "generate drafter training data: corpus prompts continued by the target",
      "Continue prompts cut from the corpus train split with the target (half greedy, half sampled)\n"
      "and save prompt + continuation rows (datasets/Arrow) for drafter training; optionally cache the\n"
      "frozen target's taps and K/V for them. Resumable.")
  _corpus_out(m, "runs/drafter_data")
  m.add_argument("--num-prompts", type=positive_int, default=400, help="prompts to continue")
  m.add_argument("--new-tokens", type=positive_int, default=256, help="tokens the target generates per prompt")
  m.add_argument("--batch", type=positive_int, default=16, help="prompts generated together")
  m.add_argument("--temperature", type=nonneg_float, default=0.8, help="for the sampled batches")
  m.add_argument("--greedy-fraction", type=fraction, default=0.5, help="share of batches decoded greedily")
  m.add_argument("--min-prompt-tokens", type=positive_int, default=128, help="shortest prompt cut from the corpus")
  m.add_argument("--max-prompt-tokens", type=positive_int, default=256, help="longest prompt cut from the corpus")
  m.add_argument("--seed", type=nonneg_int, default=0, help="prompt cuts and sampling")
  m.add_argument("--cache-taps", metavar="SPEC",
                 help="also cache the frozen target's taps for training, e.g. 'dflash,eagle3' (those drafters' "
                      "default taps) or tap indices '2,15'; rerun on finished data to add the cache")
  m.add_argument("--cache-kv-layers", type=int_list, metavar="L1,L2,...",
                 help="also cache the post-RoPE K/V of these target layers")
  m.set_defaults(fn=cmd_make_drafter_data)

  d = add_command(
      sub, "make-distill-store",
      "run the target teacher-forced over the corpus: taps, K/V and top-k soft labels",
      "Run the frozen target once, teacher-forced, over long windows of the corpus train split (and,\n"
      "with --on-policy-fraction, over its own continuations), storing per token the taps and K/V\n"
      "rows drafters read and the target's top-k next-token log-probabilities. Sharded .npy files\n"
      "with index.json; rerunning the same command resumes after the last complete shard.")
  _corpus_out(d, "runs/distill")
  for flag, default, text in (("--max-tokens", 9_000_000, "stop once this many tokens are stored"),
                              ("--window", 8192, "tokens per window (documents concatenated)"),
                              ("--topk", 32, "next-token log-probabilities kept per token"),
                              ("--shard-tokens", 65536, "tokens per shard (the unit of resume)"),
                              ("--on-policy-new-tokens", 256, "tokens the target generates per on-policy window")):
    d.add_argument(flag, type=positive_int, default=default, help=text)
  d.add_argument("--max-minutes", type=nonneg_float, default=0.0,
                 help="also stop once this run has taken this many minutes (0 = no limit; the shard in hand is kept)")
  d.add_argument("--max-documents", type=nonneg_int, default=0,
                 help="read only the train split's first N documents (0 = all): a small store, quickly")
  d.add_argument("--taps", default="", metavar="SPEC",
                 help="residual-stream taps to store: indices and/or drafter names, e.g. dflash,eagle3,2")
  d.add_argument("--kv-layers", type=int_list, metavar="L1,L2,...", help="target layers whose K/V rows to store")
  d.add_argument("--dtype", type=dtype_arg(tuple(FEATURE_DTYPES)), default="bfloat16", metavar="{bfloat16,float8}",
                 help="storage of taps and K/V (float8: e4m3 with a per-row scale)")
  d.add_argument("--on-policy-fraction", type=fraction, default=0.0,
                 help="share of windows whose last --on-policy-new-tokens the target generates itself")
  d.add_argument("--seed", type=nonneg_int, default=0, help="document order and on-policy draws")
  add_output_flags(d, json_help="", quiet="no progress bar")
  d.set_defaults(fn=cmd_make_distill_store)

  t = add_command(
      sub, "train-drafter", "train a drafter for the target on make-drafter-data output",
      "Train a drafter (sharded, orbax checkpoints, exact resume) from a YAML config; the result is a\n"
      "drafter directory that load_drafter and --drafter DIR read.")
  t.add_argument("--drafter", choices=TRAINABLE, default="pard", help="which drafter to train")
  t.add_argument("--config", help="YAML config (default: the shipped longspec_jax/assets/configs/"
                                  "drafter_<drafter>.yaml)")
  t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  t.add_argument("--no-resume", action="store_true", help="start over instead of resuming the last checkpoint")
  t.add_argument("--base", help="dels: the frozen DFlash the local head wraps (shipped name or directory)")
  t.add_argument("--multi-view-budgets", metavar="B1,B2,...",
                 help="--drafter budget / dflash-budget: the budgets drawn per step (same as --set budgets=[...])")
  t.set_defaults(fn=cmd_train_drafter)

  c = add_command(
      sub, "calibrate-sharpdraft",
      "measure a drafter's attention-score statistics at n0 and write sharpdraft.json",
      "SharpDraft calibration: run the drafter's attention over corpus windows of its training length\n"
      "n0, fit the score model (relevant keys' margin and background spread) per drafter, layer or\n"
      "head, and write sharpdraft.json beside the checkpoint (read by --sharpdraft fixed|exact).")
  c.add_argument("--drafter", required=True, choices=SHARPDRAFT_METHODS, help="the method whose drafter to calibrate")
  c.add_argument("--drafter-dir", help="drafter checkpoint (default: the one shipped for the target)")
  add_target_flags(c, rope=False, dtype=False)
  c.add_argument("--corpus", default="data/corpus", help="corpus whose train split gives the text")
  c.add_argument("--granularity", choices=GRANULARITIES, default="head",
                 help="share one set of statistics per drafter, per layer, or keep one per head")
  c.add_argument("--rule", choices=ALPHA_RULES, default="tangent",
                 help="fixed-slope alpha: tangent of the exact rule at n0, or least-squares fit up to --fit-max-keys")
  c.add_argument("--fit-max-keys", type=positive_int, default=16384,
                 help="--rule fit: the largest key count the slope is fitted over")
  c.add_argument("--num-windows", type=positive_int, default=256, help="corpus windows of n0 tokens measured")
  c.add_argument("--batch", type=positive_int, default=8, help="windows per forward")
  c.add_argument("--seed", type=nonneg_int, default=0, help="window choice")
  c.add_argument("--n0", type=positive_int, help="override drafter.json's n0")
  c.add_argument("--out", help=f"output file (default: DRAFTER_DIR/{SHARPDRAFT_FILE})")
  c.set_defaults(fn=cmd_calibrate_sharpdraft)
