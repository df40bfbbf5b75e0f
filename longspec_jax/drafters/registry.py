"""The record each drafter module declares about itself, and the reader that collects those records.

Every `longspec_jax/drafters/X.py` that implements a method ends its header with

    DRAFTERS = (DrafterEntry(name="...", loader="...", ...),)

built from literals only. The registry reads these assignments from the modules' source (`ast`) instead of
importing them: a drafter module imports jax, and listing the methods (the CLI parser's choices) must not.
`load()` imports the module when a drafter is actually built.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from longspec_jax.model import Transformer


# K, drafts per verification: the default (or a block drafter's limit when smaller), and the most any method takes.
# Past 64 a verify pass of K + 1 rows costs many decode steps while acceptance rarely passes a few dozen tokens.
DEFAULT_NUM_DRAFT = 8
MAX_NUM_DRAFT = 64


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
  """What one drafting method is. Every field is a literal so the registry can read it without an import."""
  name: str  # the method name (`--method`, `load_drafter(name, ...)`)
  # `loader(drafter_dir, target, **options) -> LoadedDrafter`, a function of the declaring module; drafter_dir
  # is None when `checkpoint` is None. `sharpdraft=` is passed only to methods with `sharpdraft=True`.
  loader: str
  checkpoint: str | None = None  # shipped checkpoint name under assets/drafters (None: the method loads none)
  options: tuple[str, ...] = ()  # further keyword options of the loader (e.g. "budget"); their defaults are its
  # Attention over a growing key set: SharpDraft applies (`sharpdraft=` at load) and calibrates on the spec's
  # `attention_logits(params, target, tokens)`.
  sharpdraft: bool = False
  diagnostics: bool = False  # the spec has `diagnostics(params, state, ctx)` (recorded by the bench suite)
  # `train-drafter --drafter NAME`: "module:ConfigClass:train_function"; configs/drafter_NAME.yaml is the default
  # config. None: trained under another method's name (standalone uses pard's checkpoint) or not trainable.
  trainer: str | None = None
  # config.json `architectures` a checkpoint of this method has (() = not checked): another drafter's checkpoint
  # given by mistake is then named as such instead of failing deep in its loader.
  architectures: tuple[str, ...] = ()
  module: str = ""  # the declaring module, filled in by the registry

  def load(self, drafter_dir: str | os.PathLike | None, target: Transformer, **options: Any) -> Any:
    """The drafter: a base.LoadedDrafter (not named in the hint: base imports this module)."""
    return getattr(importlib.import_module(self.module), self.loader)(drafter_dir, target, **options)

  def load_trainer(self) -> tuple[type, Callable[..., Any]]:
    """(config class, train function) of `trainer`."""
    module, config, fn = self.trainer.split(":")
    mod = importlib.import_module(module)
    return getattr(mod, config), getattr(mod, fn)


def _declared(source: str, filename: str) -> list[DrafterEntry]:
  """The DrafterEntry calls of a module's top-level `DRAFTERS = (...)` assignment."""
  for node in ast.parse(source, filename).body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DRAFTERS"]:
      calls = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]
      out = []
      for call in calls:
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "DrafterEntry" and not call.args):
          raise ValueError(f"{filename}: DRAFTERS must hold DrafterEntry(key=literal, ...) calls")
        out.append(DrafterEntry(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}))
      return out
  return []


def read_entries(package_dir: Path, package: str) -> dict[str, DrafterEntry]:
  """Method name -> entry, from every module of `package` (at `package_dir`) that declares DRAFTERS."""
  entries = {}
  for path in sorted(package_dir.glob("*.py")):
    for e in _declared(path.read_text(), str(path)):
      if e.name in entries:
        raise ValueError(f"drafter method {e.name!r} is declared twice ({entries[e.name].module}, {path.stem})")
      entries[e.name] = dataclasses.replace(e, module=f"{package}.{path.stem}")
  return entries
