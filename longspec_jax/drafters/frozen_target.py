"""The target's frozen parts a drafter reads: which of its layers to tap, and its embedding, LM head and final norm
carried in a drafter's parameters (`io`), with the functions that apply them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.model import matmul, rms_norm
from longspec_jax.sampling import NEG_INF

if TYPE_CHECKING:
  from longspec_jax.config import ModelConfig
  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.model import Transformer


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
  """n target layers evenly spaced from layer 1 to layer L-3 (clamped into [0, L-1] for tiny targets)."""
  last = num_target_layers - 1
  start = min(1, last)
  end = min(max(start, num_target_layers - 3), last)
  return tuple(int(round(x)) for x in np.linspace(start, end, n))


def check_block_drafter(what: str, arch: ModelConfig, target_layer_ids: Sequence[int], num_target_layers: int,
                        mask_token_id: int) -> None:
  """What a block drafter's config (DFlash, LongSpark: Qwen3-style layers over a mask-filled block, reading
  target layers) must satisfy."""
  if not target_layer_ids:
    raise ValueError(f"{what} needs at least one target layer id")
  bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
  if bad:
    raise ValueError(f"target_layer_ids {bad} outside the target's layers [0, {num_target_layers})")
  if not 0 <= mask_token_id < arch.vocab_size:
    raise ValueError(f"mask_token_id {mask_token_id} outside the vocabulary [0, {arch.vocab_size})")
  if arch.family != "qwen3":
    raise ValueError(f"{what} layers are Qwen3-style; got family {arch.family!r}")


def taps_of(target_layer_ids: Sequence[int]) -> tuple[int, ...]:
  """Our tap i is the residual stream entering layer i, i.e. the output of layer i-1 (the public layouts name the
  layer whose output they read)."""
  return tuple(i + 1 for i in target_layer_ids)


def check_reads_target(what: str, arch: ModelConfig, num_target_layers: int, target: ModelConfig,
                       fields: tuple[str, ...]) -> None:
  """A drafter (`arch`, made for a `num_target_layers`-layer target) reads `target`'s hidden states and uses its
  embedding / LM head: the layer count and `fields` of the two configs must agree."""
  problems = []
  if num_target_layers != target.num_hidden_layers:
    problems.append(f"trained for a {num_target_layers}-layer target, this one has {target.num_hidden_layers}")
  for name in fields:
    if getattr(arch, name) != getattr(target, name):
      problems.append(f"{name} {getattr(arch, name)} vs the target's {getattr(target, name)}")
  if problems:
    raise ValueError(f"{what} drafter does not match the target: " + "; ".join(problems))


def target_io(target: Transformer, final_norm: bool = False) -> dict:
  """The target's frozen embedding (a drafter embeds its block with it), LM head when untied (logits are read
  through it) and, with `final_norm`, its final RMSNorm (for a drafter that has none of its own)."""
  io = {"embed": target.embed_tokens.embedding[...]}
  if target.lm_head is not None:
    io["lm_head"] = target.lm_head.kernel[...]
  if final_norm:
    io.update(norm=target.norm.scale[...], norm_eps=jnp.float32(target.norm.eps))
  return io


def embed_tokens(io: dict, tokens: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
  return io["embed"][tokens].astype(dtype)


DRAFT_VOCAB_FILE = "draft_vocab.json"  # beside a checkpoint: {"ids": target token ids, most frequent first, ...}


def read_draft_vocab(drafter_dir: str | os.PathLike, size: int) -> np.ndarray:
  """The first `size` ids of the checkpoint's draft_vocab.json (written by scripts/make_draft_vocab.py)."""
  import json
  from pathlib import Path
  path = Path(drafter_dir) / DRAFT_VOCAB_FILE
  if not path.is_file():
    raise FileNotFoundError(f"--draft-vocab needs {path} (token ids by frequency; make it from a distillation "
                            "store with scripts/make_draft_vocab.py)")
  ids = json.loads(path.read_text())["ids"]
  if size > len(ids):
    raise ValueError(f"draft_vocab {size} is more than the {len(ids)} ids in {path}")
  return np.asarray(ids[:size], np.int64)


def with_draft_vocab(loaded: LoadedDrafter, drafter_dir: str | os.PathLike, size: int | None) -> LoadedDrafter:
  """A LoadedDrafter whose params["io"] head is cut to the checkpoint's `size` most frequent tokens (None: the
  draft vocabulary it was trained with, drafter.json's draft_vocab_size, else as is)."""
  if size is None:
    size = trained_draft_vocab(drafter_dir)
  if size is None:
    return loaded
  io = restrict_head(loaded.params["io"], read_draft_vocab(drafter_dir, size))
  return dataclasses.replace(loaded, params={**loaded.params, "io": io})


def trained_draft_vocab(drafter_dir: str | os.PathLike) -> int | None:
  """The draft vocabulary size a block drafter was trained with (its drafter.json's draft_vocab_size; None when
  trained over the whole vocabulary): out of it the target's head was never trained against, so it drafts with it."""
  import json
  from pathlib import Path
  info = Path(drafter_dir) / "drafter.json"
  size = json.loads(info.read_text()).get("draft_vocab_size") if info.is_file() else None
  return int(size) if size else None


def restrict_head(io: dict, draft_ids: np.ndarray | Sequence[int]) -> dict:
  """`io` whose LM head covers only `draft_ids` (target token ids, distinct): the drafter's logits are computed
  for those tokens alone and every other token gets -inf, so it never proposes one (greedy) or gives it q = 0
  (sampling); verification stays exact. The head's cost scales with len(draft_ids) instead of the vocabulary."""
  ids = np.asarray(draft_ids, np.int64)
  vocab = io["embed"].shape[0]
  if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != len(ids):
    raise ValueError(f"draft_ids must be distinct token ids in [0, {vocab}), got {len(ids)} ids "
                     f"(range {ids.min() if len(ids) else None}..{ids.max() if len(ids) else None})")
  rows = io["lm_head"].T if "lm_head" in io else io["embed"]  # [V, H]
  return {**io, "draft_ids": jnp.asarray(ids, jnp.int32), "draft_head": rows[ids]}


def head_logits(io: dict, h: jax.Array) -> jax.Array:
  """Logits over the target vocabulary [..., V] from drafter hidden states h [..., H]."""
  if "draft_ids" in io:
    small = matmul(h, io["draft_head"], "...h,nh->...n", jnp.float32)
    full = jnp.full(small.shape[:-1] + (io["embed"].shape[0],), NEG_INF, jnp.float32)
    return full.at[..., io["draft_ids"]].set(small)
  if "lm_head" in io:
    return matmul(h, io["lm_head"], "...h,hv->...v", jnp.float32)
  return matmul(h, io["embed"], "...h,vh->...v", jnp.float32)


def apply_final_norm(io: dict, h: jax.Array) -> jax.Array:
  """The target's final RMSNorm from `target_io(target, final_norm=True)`."""
  return rms_norm(h, io["norm"], io["norm_eps"])
