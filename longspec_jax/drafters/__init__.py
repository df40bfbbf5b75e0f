"""Drafter registry: method name -> builder(target_model, drafter_dir | None, sharpdraft | None) -> LoadedDrafter.

Later methods register themselves here; `longspec bench --method NAME` and `generate()` callers use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from longspec_jax import ASSETS_DIR

if TYPE_CHECKING:  # importing the registry must not import jax: the CLI parser lists method_names()
  from longspec_jax.drafters.base import LoadedDrafter

SHIPPED_DRAFTERS_DIR = ASSETS_DIR / "drafters"


def _vocab_size(target) -> int | None:
  """A target model's, or a target config's, vocabulary size (None: no target given)."""
  if target is None:
    return None
  return target.cfg.vocab_size if hasattr(target, "cfg") else target.vocab_size


def _config_vocab(drafter_dir: Path) -> int | None:
  """The vocabulary a checkpoint was made for: config.json's vocab_size (DeLS: model_config.vocab_size)."""
  if not (drafter_dir / "config.json").exists():
    return None
  cfg = json.loads((drafter_dir / "config.json").read_text())
  return cfg.get("vocab_size") or (cfg.get("model_config") or {}).get("vocab_size")


def _shipped(name: str, drafter_dir, target=None) -> Path:
  """`drafter_dir`, else the shipped checkpoint of `name` for this target: `assets/drafters/<name>` is for the
  shipped 8.4M target and `<name>-<target name>` (e.g. dflash-smollm2-135m) for a named one; the one whose
  config.json has the target's vocabulary is chosen."""
  if drafter_dir:
    path = Path(drafter_dir)
  else:
    path = SHIPPED_DRAFTERS_DIR / name
    vocab = _vocab_size(target)
    if vocab is not None:
      fits = [d for d in sorted(SHIPPED_DRAFTERS_DIR.iterdir())
              if (d.name == name or d.name.startswith(name + "-")) and _config_vocab(d) == vocab]
      if not fits:
        raise FileNotFoundError(f"no shipped {name} drafter for this target (vocabulary {vocab}); train one with "
                                "`longspec train-drafter` and pass --drafter DIR")
      path = fits[0]
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"no {name} drafter at {path} (train one with `longspec train-drafter` or pass "
                            "--drafter DIR)")
  return path


def _prompt_lookup(target, drafter_dir, sharpdraft):
  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
  return LoadedDrafter(PromptLookupDrafter(target.cfg.vocab_size))


def _standalone(mode):
  def build(target, drafter_dir, sharpdraft):
    from longspec_jax.drafters.standalone import load_standalone
    return load_standalone(_shipped("pard", drafter_dir, target), mode, sharpdraft=sharpdraft)
  return build


def _dflash(target, drafter_dir, sharpdraft):
  from longspec_jax.drafters.dflash import load_dflash
  return load_dflash(_shipped("dflash", drafter_dir, target), target, sharpdraft=sharpdraft)


def _eagle3(target, drafter_dir, sharpdraft):
  from longspec_jax.drafters.eagle3 import load_eagle3
  return load_eagle3(_shipped("eagle3", drafter_dir, target), target, sharpdraft=sharpdraft)


def _dels(target, drafter_dir, sharpdraft):
  from longspec_jax.drafters.dels import load_dels
  return load_dels(_shipped("dels", drafter_dir, target), target)


def _longspark(target, drafter_dir, sharpdraft):
  from longspec_jax.drafters.longspark import load_longspark
  return load_longspark(_shipped("longspark", drafter_dir, target), target)


def _budget(target, drafter_dir, sharpdraft, budget: int = 256):
  from longspec_jax.drafters.budget import load_budget
  return load_budget(_shipped("budgetdraft", drafter_dir, target), budget)


BUILDERS: dict[str, Callable] = {
    "dflash": _dflash,
    "eagle3": _eagle3,
    "prompt-lookup": _prompt_lookup,
    "standalone": _standalone("classic"),
    "pard": _standalone("pard"),
    "dels": _dels,
    "longspark": _longspark,
    "budget": _budget,  # BudgetDraft; `--drafter assets/drafters/pard` = the same rule on an untrained drafter
}


# Methods whose drafter has attention over a growing key set (SharpDraft applies) -> their shipped drafter dir.
ATTENTION_DRAFTERS = {"dflash": "dflash", "eagle3": "eagle3", "standalone": "pard", "pard": "pard"}


def method_names() -> list[str]:
  return ["ar"] + sorted(BUILDERS)


def drafter_path(name: str, drafter_dir=None, target=None) -> Path:
  """The checkpoint directory a method's drafter loads from (`drafter_dir` or the one shipped for `target`, a
  model or its config; None = the shipped 8.4M target)."""
  return _shipped(ATTENTION_DRAFTERS.get(name, name), drafter_dir, target)


# Methods that read a sparse drafter KV cache under a fixed budget (`--budget N`).
BUDGET_DRAFTERS = ("budget",)


def load_drafter(name: str, target, drafter_dir=None, sharpdraft: str = "off",
                 budget: int | None = None) -> LoadedDrafter | None:
  """The drafter of method `name` (see method_names()) for `target`, for `generate(..., drafter=)`; None for "ar".

  drafter_dir: a trained checkpoint directory (None = the one shipped for the default target).
  sharpdraft: "off" | "fixed" | "exact" (reads sharpdraft.json beside the drafter checkpoint).
  budget: drafter KV entries kept from the prompt (BUDGET_DRAFTERS only; None = their default, 256)."""
  from longspec_jax.sharpdraft import CHOICES, load_sharpdraft
  if sharpdraft not in CHOICES:
    raise ValueError(f"sharpdraft must be one of {CHOICES}, got {sharpdraft!r}")
  if name != "ar" and name not in BUILDERS:
    raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
  if sharpdraft != "off" and name not in ATTENTION_DRAFTERS:
    raise ValueError(f"SharpDraft scales drafter attention; method {name!r} has none (it applies to "
                     f"{', '.join(sorted(ATTENTION_DRAFTERS))})")
  if budget is not None and name not in BUDGET_DRAFTERS:
    raise ValueError(f"--budget applies to {', '.join(BUDGET_DRAFTERS)}, not to method {name!r}")
  if name == "ar":
    return None
  sd = load_sharpdraft(drafter_path(name, drafter_dir, target), sharpdraft, name) if sharpdraft != "off" else None
  return BUILDERS[name](target, drafter_dir, sd, **({"budget": budget} if budget is not None else {}))
