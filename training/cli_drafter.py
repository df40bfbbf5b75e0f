"""`longspec make-drafter-data` and `longspec train-drafter`: registered on the main CLI's subparsers by
`add_subcommands`. Each handler returns an exit code."""

from __future__ import annotations

import json
from pathlib import Path

from longspec_jax.argtypes import fraction, int_list, nonneg_float, nonneg_int, positive_int

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
  if a.cache_taps or a.cache_kv_layers:
    _cache_features(cfg, a.cache_taps or "", a.cache_kv_layers)
  return 0


def cache_tap_indices(spec: str, target_cfg) -> tuple[int, ...]:
  """'dflash,eagle3,7' -> the union of DFlash's default taps (5 layers), EAGLE-3's default aux layers and 7."""
  from longspec_jax.drafters.dflash import default_target_layer_ids
  from longspec_jax.drafters.eagle3 import default_aux_layers

  n = target_cfg.num_hidden_layers
  named = {"dflash": [i + 1 for i in default_target_layer_ids(n, 5)], "eagle3": list(default_aux_layers(n))}
  out = set()
  for part in filter(None, (p.strip() for p in spec.split(","))):
    if part in named:
      out.update(named[part])
    elif part.isdigit():
      out.add(int(part))
    else:
      raise ValueError(f"--cache-taps: {part!r} is neither a tap index nor one of {sorted(named)}")
  return tuple(sorted(out))


def _cache_features(cfg, taps_spec: str, kv_layers) -> None:
  import time

  from longspec_jax.hf_io import load_model_dir, weights_sha256
  from longspec_jax.training.feature_cache import build_feature_cache

  target = load_model_dir(cfg.target_dir)
  taps = cache_tap_indices(taps_spec or "dflash", target.cfg)
  t0 = time.time()
  d = build_feature_cache(cfg.out_dir, target, taps, kv_layers or (), weights_id=weights_sha256(cfg.target_dir))
  size = sum(f.stat().st_size for f in d.iterdir())
  rows = json.loads((d / "index.json").read_text())["meta"]["lens"]
  print(f"feature cache {d}: taps {list(taps)}, kv layers {list(kv_layers or ())}, {size / 2**20:.0f} MiB "
        f"({size / sum(rows) * 1024 / 2**20:.2f} MiB per 1K tokens), {time.time() - t0:.0f} s this run")


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
  m.add_argument("--cache-taps", metavar="SPEC",
                 help="also cache the frozen target's taps for training, e.g. 'dflash,eagle3' (those drafters' "
                      "default taps) or tap indices '2,15'; rerun on finished data to add the cache")
  m.add_argument("--cache-kv-layers", type=int_list, metavar="L1,L2,...",
                 help="also cache the post-RoPE K/V of these target layers")
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
