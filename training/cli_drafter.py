"""`longspec make-drafter-data` and `longspec train-drafter`: registered on the main CLI's subparsers by
`add_subcommands`. Each handler returns an exit code."""

from __future__ import annotations

import json
from pathlib import Path

from longspec_jax.argtypes import fraction, nonneg_float, nonneg_int, positive_int

# --drafter NAME -> (module, config class, train function); configs/drafter_NAME.yaml is the default config.
DRAFTERS = {
    "pard": ("longspec_jax.training.train_drafter", "DrafterTrainConfig", "train_standalone_drafter"),
    "dflash": ("longspec_jax.training.train_dflash", "DFlashTrainConfig", "train_dflash"),
    "eagle3": ("longspec_jax.training.train_eagle3", "Eagle3TrainConfig", "train_eagle3"),
    "dels": ("longspec_jax.training.train_dels", "DeLSTrainConfig", "train_dels"),
    "longspark": ("longspec_jax.training.train_longspark", "LongSparkTrainConfig", "train_longspark"),
    "budget": ("longspec_jax.training.train_budget", "BudgetTrainConfig", "train_budget"),
}


def cmd_make_drafter_data(a) -> int:
  from longspec_jax import default_target_dir
  from longspec_jax.targets import resolve_target_dir
  from longspec_jax.training.drafter_data import MANIFEST, DrafterDataConfig, make_drafter_data

  cfg = DrafterDataConfig(
      target_dir=str(resolve_target_dir(a.target) if a.target else default_target_dir()), corpus_dir=a.corpus,
      out_dir=a.out,
      num_prompts=a.num_prompts, new_tokens=a.new_tokens, batch=a.batch, temperature=a.temperature,
      greedy_fraction=a.greedy_fraction, min_prompt_tokens=a.min_prompt_tokens,
      max_prompt_tokens=a.max_prompt_tokens, seed=a.seed)
  out = make_drafter_data(cfg)
  manifest = json.loads((Path(cfg.out_dir) / MANIFEST).read_text())
  print(json.dumps({k: manifest[k] for k in ("counts", "generation_s", "generated_tokens_per_s")}, indent=2))
  print(f"wrote {out}")
  return 0


def cmd_train_drafter(a) -> int:
  import importlib

  from longspec_jax.yaml_config import load_yaml

  if a.multi_view_budgets:
    if a.drafter != "budget":
      raise ValueError("--multi-view-budgets applies to --drafter budget")
    a.set.append(f"budgets=[{a.multi_view_budgets}]")
  module, config_cls, train_fn = DRAFTERS[a.drafter]
  mod = importlib.import_module(module)
  overrides = a.set + ([f"base={a.base}"] if a.base else [])  # --base: the frozen drafter a head wraps (dels)
  cfg = load_yaml(getattr(mod, config_cls), a.config or f"configs/drafter_{a.drafter}.yaml", overrides)
  print(getattr(mod, train_fn)(cfg, resume=not a.no_resume))
  return 0


def add_subcommands(subparsers) -> None:
  m = subparsers.add_parser("make-drafter-data",
                            help="generate drafter training data: corpus prompts continued by the target")
  m.add_argument("--target", help="target: a name (smollm2-135m), a model dir, or the shipped target (default)")
  m.add_argument("--corpus", default="data/corpus")
  m.add_argument("--out", default="runs/drafter_data")
  m.add_argument("--num-prompts", type=positive_int, default=400)
  m.add_argument("--new-tokens", type=positive_int, default=256)
  m.add_argument("--batch", type=positive_int, default=16)
  m.add_argument("--temperature", type=nonneg_float, default=0.8, help="for the sampled batches")
  m.add_argument("--greedy-fraction", type=fraction, default=0.5, help="share of batches decoded greedily")
  m.add_argument("--min-prompt-tokens", type=positive_int, default=128)
  m.add_argument("--max-prompt-tokens", type=positive_int, default=256)
  m.add_argument("--seed", type=nonneg_int, default=0)
  m.set_defaults(fn=cmd_make_drafter_data)

  t = subparsers.add_parser("train-drafter", help="train a drafter for the target on make-drafter-data output")
  t.add_argument("--drafter", choices=sorted(DRAFTERS), default="pard")
  t.add_argument("--config", help="YAML config (default: configs/drafter_<drafter>.yaml)")
  t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  t.add_argument("--no-resume", action="store_true")
  t.add_argument("--base", help="dels: the frozen DFlash the local head wraps (shipped name or directory)")
  t.add_argument("--multi-view-budgets", metavar="B1,B2,...",
                 help="--drafter budget: the budgets drawn per step (same as --set budgets=[...])")
  t.set_defaults(fn=cmd_train_drafter)
