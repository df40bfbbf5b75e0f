"""Drafter registry: every drafter module declares its methods (`DRAFTERS = (DrafterEntry(...),)`, see
registry.py); `longspec bench --method NAME`, `generate()` callers, `train-drafter` and `calibrate-sharpdraft` read
them here. Importing this package does not import jax: the CLI parser lists method_names()."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longspec_jax import ASSETS_DIR
from longspec_jax.drafters.registry import DrafterEntry, read_entries

if TYPE_CHECKING:
  from longspec_jax.config import ModelConfig
  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.model import Transformer

SHIPPED_DRAFTERS_DIR = ASSETS_DIR / "drafters"
ENTRIES: dict[str, DrafterEntry] = read_entries(Path(__file__).parent, __name__)

# Methods whose drafter has attention over a growing key set (SharpDraft applies), and those that read a sparse
# drafter KV cache under a fixed budget (`--budget N`).
SHARPDRAFT_METHODS = sorted(e.name for e in ENTRIES.values() if e.sharpdraft)
BUDGET_METHODS = sorted(e.name for e in ENTRIES.values() if "budget" in e.options)
# Methods built around another, learned drafter (`learned=NAME`: the hybrid), and the methods that can be it: any
# drafter with a checkpoint of its own.
COMPOSITE_METHODS = sorted(e.name for e in ENTRIES.values() if "learned" in e.options)
LEARNED_METHODS = sorted(e.name for e in ENTRIES.values() if e.checkpoint and "learned" not in e.options)
# Methods that read logits through the target's frozen LM head and can cut it to a draft vocabulary
# (`--draft-vocab N`: the N ids first in the checkpoint's draft_vocab.json).
DRAFT_VOCAB_METHODS = sorted(e.name for e in ENTRIES.values() if "draft_vocab" in e.options)
# Methods made of parts that `--parts A+B` turns on (the rest off): the combined drafter.
PARTS_METHODS = sorted(e.name for e in ENTRIES.values() if "parts" in e.options)
# Methods that read a global n-gram index (`--suffix-index FILE`, from `longspec build-suffix-index`).
SUFFIX_INDEX_METHODS = sorted(e.name for e in ENTRIES.values() if "suffix_index" in e.options)


def method_names() -> list[str]:
  return ["ar"] + sorted(ENTRIES)


def drafter_entry(name: str) -> DrafterEntry:
  """The registry record of method `name` (not "ar": it has no drafter)."""
  if name not in ENTRIES:
    raise ValueError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
  return ENTRIES[name]


def check_drafter_options(name: str, sharpdraft: str = "off", budget: int | None = None,
                          learned: str | None = None, draft_vocab: int | None = None,
                          parts: str | None = None, suffix_index: str | os.PathLike | Any = None) -> None:
  """Raises ValueError when an option does not apply to method `name` (jax-free: the CLI calls it before any
  model loads; load_drafter calls it too)."""
  from longspec_jax.sharpdraft_names import CHOICES
  if sharpdraft not in CHOICES:
    raise ValueError(f"sharpdraft must be one of {CHOICES}, got {sharpdraft!r}")
  entry = None if name == "ar" else drafter_entry(name)
  if sharpdraft != "off" and not (entry and entry.sharpdraft):
    raise ValueError(f"SharpDraft scales drafter attention; method {name!r} has none (it applies to "
                     f"{', '.join(SHARPDRAFT_METHODS)})")
  if budget is not None and not (entry and "budget" in entry.options):
    raise ValueError(f"--budget applies to {', '.join(BUDGET_METHODS)}, not to method {name!r}")
  if learned is not None:
    if not (entry and "learned" in entry.options):
      raise ValueError(f"--learned applies to {', '.join(COMPOSITE_METHODS)}, not to method {name!r}")
    if learned not in LEARNED_METHODS:
      raise ValueError(f"--learned must name a drafter with a checkpoint ({', '.join(LEARNED_METHODS)}), got "
                       f"{learned!r}")
  if draft_vocab is not None:
    if not (entry and "draft_vocab" in entry.options):
      raise ValueError(f"--draft-vocab applies to {', '.join(DRAFT_VOCAB_METHODS)}, not to method {name!r}")
    if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 1:
      raise ValueError(f"draft_vocab must be an integer >= 1 (tokens kept in the drafter's LM head), got "
                       f"{draft_vocab!r}")
  if parts is not None:
    if not (entry and "parts" in entry.options):
      raise ValueError(f"--parts applies to {', '.join(PARTS_METHODS)}, not to method {name!r}")
    if not isinstance(parts, str) or not parts:
      raise ValueError(f"parts must be part names joined by '+' (e.g. longspark+dels), got {parts!r}")
  if suffix_index is not None and not (entry and "suffix_index" in entry.options):
    raise ValueError(f"--suffix-index applies to {', '.join(SUFFIX_INDEX_METHODS)}, not to method {name!r}")
  if isinstance(suffix_index, (str, os.PathLike)) and not Path(suffix_index).is_file():
    raise FileNotFoundError(f"no suffix index at {suffix_index} (build one with `longspec build-suffix-index`)")


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
  """`drafter_dir`, else the shipped checkpoint `name` for this target: `assets/drafters/<name>` is for the
  shipped 8.4M target and `<name>-<target name>` (e.g. dflash-smollm2-135m) for a named one; the one whose
  config.json has the target's vocabulary is chosen (never another checkpoint's: `longspark-dels-...` is not a
  `longspark` one)."""
  if drafter_dir:
    path = Path(drafter_dir)
  else:
    path = SHIPPED_DRAFTERS_DIR / name
    vocab = _vocab_size(target)
    if vocab is not None:
      others = [c for c in {e.checkpoint for e in ENTRIES.values()} if c and c != name and c.startswith(name + "-")]
      ours = lambda d: (d == name or d.startswith(name + "-")) and not any(
          d == c or d.startswith(c + "-") for c in others)
      fits = [d for d in sorted(SHIPPED_DRAFTERS_DIR.iterdir()) if ours(d.name) and _config_vocab(d) == vocab]
      if not fits:
        raise FileNotFoundError(f"no shipped {name} drafter for this target (vocabulary {vocab}); train one with "
                                "`longspec train-drafter` and pass --drafter DIR")
      path = fits[0]
  if not (path / "config.json").exists():
    raise FileNotFoundError(f"no {name} drafter at {path} (train one with `longspec train-drafter` or pass "
                            "--drafter DIR)")
  return path


def drafter_path(name: str, drafter_dir: str | os.PathLike | None = None,
                 target: Transformer | ModelConfig | None = None, learned: str | None = None) -> Path:
  """The checkpoint directory a method's drafter loads from (`drafter_dir` or the one shipped for `target`, a
  model or its config; None = the shipped 8.4M target): for a composite method given `learned`, that drafter's.
  FileNotFoundError for a method that loads none."""
  checkpoint = drafter_entry(learned or name).checkpoint
  if checkpoint is None:
    raise FileNotFoundError(f"method {name!r} loads no drafter checkpoint")
  return _shipped(checkpoint, drafter_dir, target)


def given_options(**options: Any) -> dict:
  """The drafter options that were set (None = the method's default, left to its loader)."""
  return {name: value for name, value in options.items() if value is not None}


def check_architecture(entry: DrafterEntry, path: Path) -> None:
  """Another method's checkpoint given by mistake (config.json `architectures`) is named as such, at once."""
  found = json.loads((path / "config.json").read_text()).get("architectures") or []
  if entry.architectures and found and not set(found) & set(entry.architectures):
    owners = sorted(e.name for e in ENTRIES.values() if set(found) & set(e.architectures))
    raise ValueError(f"drafter checkpoint {path} is a {'/'.join(found)} checkpoint"
                     + (f" (method {', '.join(owners)})" if owners else "")
                     + f", not one for method {entry.name} ({' or '.join(entry.architectures)})")


def load_drafter(name: str, target: Transformer, drafter_dir: str | os.PathLike | None = None, sharpdraft: str = "off",
                 budget: int | None = None, learned: str | None = None,
                 draft_vocab: int | None = None, parts: str | None = None,
                 suffix_index: str | os.PathLike | Any = None) -> LoadedDrafter | None:
  """The drafter of method `name` (see method_names()) for `target`, for `generate(..., drafter=)`; None for "ar".

  drafter_dir: a trained checkpoint directory (None = the one shipped for the default target).
  sharpdraft: "off" | "fixed" | "exact" (reads sharpdraft.json beside the drafter checkpoint).
  budget: drafter KV entries kept from the prompt (BUDGET_METHODS only; None = their default: 256, or for `dels`
  no budget, the full DFlash context).
  learned: the learned drafter of a composite method (COMPOSITE_METHODS: the hybrid; None = its default), whose
  checkpoint `drafter_dir` then is.
  draft_vocab: the drafter's LM head cut to the first N ids of its checkpoint's draft_vocab.json (the target's
  most frequent next tokens; DRAFT_VOCAB_METHODS only; None = the full vocabulary).
  parts: the parts of a PARTS_METHODS drafter that are on, joined by '+' (None = all its checkpoint names).
  suffix_index: a SUFFIX_INDEX_METHODS drafter's global n-gram index (a file or a suffix_index.SuffixIndex)."""
  from longspec_jax.sharpdraft import load_sharpdraft
  check_drafter_options(name, sharpdraft, budget, learned, draft_vocab, parts, suffix_index)
  entry = None if name == "ar" else drafter_entry(name)
  if entry is None:
    return None
  path = drafter_path(name, drafter_dir, target, learned) if entry.checkpoint else None
  if path is not None:
    check_architecture(drafter_entry(learned or name), path)
  options = given_options(budget=budget, learned=learned, draft_vocab=draft_vocab, parts=parts,
                          suffix_index=suffix_index)
  if entry.sharpdraft:
    options["sharpdraft"] = load_sharpdraft(path, sharpdraft, name) if sharpdraft != "off" else None
  return entry.load(path, target, **options)
