"""Drafter registry: method name -> builder(target_model, drafter_dir | None) -> LoadedDrafter.

Later methods register themselves here; `longspec bench --method NAME` and `generate()` callers use it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from longspec_jax import ASSETS_DIR
from longspec_jax.drafters.base import LoadedDrafter

SHIPPED_DRAFTERS_DIR = ASSETS_DIR / "drafters"


def _shipped(name: str, drafter_dir) -> Path:
  path = Path(drafter_dir) if drafter_dir else SHIPPED_DRAFTERS_DIR / name
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"no {name} drafter at {path} (train one with `longspec train-drafter` or pass "
                            "--drafter DIR)")
  return path


def _prompt_lookup(target, drafter_dir):
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
  return LoadedDrafter(PromptLookupDrafter(target.cfg.vocab_size))


def _standalone(mode):
  def build(target, drafter_dir):
    from longspec_jax.drafters.standalone import load_standalone
    return load_standalone(_shipped("pard", drafter_dir), mode)
  return build


BUILDERS: dict[str, Callable] = {
    "prompt-lookup": _prompt_lookup,
    "standalone": _standalone("classic"),
    "pard": _standalone("pard"),
}


def method_names() -> list[str]:
  return ["ar"] + sorted(BUILDERS)


def build_drafter(name: str, target, drafter_dir=None) -> LoadedDrafter | None:
  if name == "ar":
    return None
  if name not in BUILDERS:
    raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
  return BUILDERS[name](target, drafter_dir)
