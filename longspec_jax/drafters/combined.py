"""The seeds combined: LongSpark and BudgetDraft's sparse-view DFlash drafting one block together, corrected by the
DeLS local head. Every part keeps a state of one size at any context.

The two block drafters read different things: LongSpark the target's own K/V through constant multiscale views,
DFlash the target's hidden states, here through BudgetDraft's selection (sink + best-scoring chunks + the newest
rows). Their per-position log-probabilities are added with weights (a product of experts; the default weights sum
to 1, a geometric mean, so the sum keeps one drafter's scale and the DeLS head's alpha/beta, tuned over one
drafter, still apply). The DeLS head then decodes the block left to right over that sum (dels.decode_block).
Where a part has a draft vocabulary, every other token gets -inf from it, so the sum drafts over the intersection.

SharpDraft has nothing to scale here: the DFlash part's queries see a fixed number of keys (budget + ring) and
LongSpark's see fixed-size views. Lossless like every block drafter: greedy drafts are argmaxes, sampled drafts
are drawn from the returned q.

The checkpoint is a config.json that names the parts' checkpoints (shipped names or paths relative to it) and the
weights; it holds no tensors of its own. `parts=` (e.g. "longspark+dels") turns parts off for ablations.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.config import read_config_json
from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
from longspec_jax.drafters.dflash import block_drafts
from longspec_jax.drafters.registry import DrafterEntry

if TYPE_CHECKING:
  from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult
  from longspec_jax.model import Transformer

ARCHITECTURE = "CombinedBlockDrafter"
BLOCK_PARTS = ("longspark", "dflash")
PARTS = BLOCK_PARTS + ("dels",)
DRAFTERS = (DrafterEntry(name="combined", loader="load_combined", checkpoint="combined",
                         architectures=("CombinedBlockDrafter",),
                         options=("budget", "parts")),)


def parse_parts(parts: str | Sequence[str]) -> tuple[str, ...]:
  """"longspark+dflash+dels" (or a sequence) -> the parts, checked: known, no repeats, at least one block part."""
  names = tuple(parts.split("+")) if isinstance(parts, str) else tuple(parts)
  unknown = [p for p in names if p not in PARTS]
  if unknown or len(set(names)) != len(names) or not set(names) & set(BLOCK_PARTS):
    raise ValueError(f"parts must be distinct names from {PARTS} joined by '+', with at least one of "
                     f"{BLOCK_PARTS}; got {parts!r}")
  return tuple(p for p in PARTS if p in names)


def _taps_of(x, idx):
  return None if x is None else x[:, :, jnp.asarray(idx)]


@dataclasses.dataclass(frozen=True)
class BlockEnsembleDrafter(DrafterSpec):
  """Parallel block drafters (DFlash / LongSpark interface: `block_logits`) whose log-probs are summed with
  `weights`. Each part reads its own taps, sliced from the union the engine delivers."""
  parts: tuple[Any, ...]
  weights: tuple[float, ...]
  name: str = "combined"
  catch_up_in_propose = False  # every part's update reads the verified rows
  drafts_blocks = True

  def __post_init__(self):
    if len(self.parts) != len(self.weights) or not self.parts or min(self.weights) <= 0:
      raise ValueError(f"one positive weight per part, got {len(self.parts)} parts and weights {self.weights}")
    if len({p.vocab_size for p in self.parts}) != 1:
      raise ValueError(f"the parts draft over different vocabularies: {[p.vocab_size for p in self.parts]}")

  @property
  def taps(self) -> tuple[int, ...]:
    return tuple(sorted({t for p in self.parts for t in p.taps}))

  @property
  def needs_target_kv(self) -> bool:
    return any(p.needs_target_kv for p in self.parts)

  @property
  def vocab_size(self) -> int:
    return self.parts[0].vocab_size

  @property
  def max_draft_tokens(self) -> int:
    return min(p.max_draft_tokens for p in self.parts)

  def _own(self, part, record):
    """`record` (a PrefillResult or VerifyResult) as `part` expects it: only its taps, in its order."""
    idx = [self.taps.index(t) for t in part.taps]
    return record.replace(taps=_taps_of(record.taps, idx))

  def init_state(self, params: dict, prefill: PrefillResult, max_len: int) -> tuple[Any, ...]:
    return tuple(p.init_state(pp, self._own(p, prefill), max_len) for p, pp in zip(self.parts, params["parts"]))

  def block_logits(self, params: dict, state: tuple[Any, ...], pending: jax.Array, num_draft: int) -> jax.Array:
    """sum_i w_i log_softmax(part_i's logits) [B, num_draft, V]; -inf wherever any part gives -inf."""
    total = 0.0
    for p, pp, s, w in zip(self.parts, params["parts"], state, self.weights):
      total = total + w * jax.nn.log_softmax(p.block_logits(pp, s, pending, num_draft).astype(jnp.float32), -1)
    return total

  def propose(self, params: dict, state: tuple[Any, ...], ctx: ProposeContext, key: jax.Array, num_draft: int,
              sample: bool) -> tuple[jax.Array, jax.Array | None, tuple[Any, ...]]:
    return (*block_drafts(self.block_logits(params, state, ctx.pending, num_draft), ctx, key, sample), state)

  def update(self, params: dict, state: tuple[Any, ...], verify: VerifyResult) -> tuple[Any, ...]:
    return tuple(p.update(pp, s, self._own(p, verify))
                 for p, pp, s in zip(self.parts, params["parts"], state))


def ensemble(parts: list[LoadedDrafter], weights: Sequence[float] | np.ndarray,
             name: str = "combined") -> LoadedDrafter:
  """The parts as one block drafter. Its `io.draft_ids` is the intersection of the parts' draft vocabularies
  (absent if a part drafts over the whole vocabulary), so a DeLS head over it decodes over those columns alone."""
  from longspec_jax.drafters.longspark import LongSparkDrafter
  if any(isinstance(p.spec, LongSparkDrafter) and p.spec.cfg.markov_rank for p in parts):
    raise ValueError("a LongSpark with a Markov head reads the previous draft; combine one without (markov_rank 0)")
  ids = [p.params["io"].get("draft_ids") for p in parts]
  io = {}
  if all(i is not None for i in ids):
    common = set(np.asarray(ids[0]).tolist())
    for i in ids[1:]:
      common &= set(np.asarray(i).tolist())
    io["draft_ids"] = jnp.asarray(sorted(common), jnp.int32)
  spec = BlockEnsembleDrafter(parts=tuple(p.spec for p in parts), weights=tuple(float(w) for w in weights),
                              name=name)
  return LoadedDrafter(spec, {"parts": tuple(p.params for p in parts), "io": io})


def load_combined(drafter_dir: str | os.PathLike, target: Transformer, budget: int = 256,
                  parts: str | Sequence[str] | None = None) -> LoadedDrafter:
  """Our combined config.json: {"architectures": ["CombinedBlockDrafter"], "vocab_size", "longspark": CKPT,
  "dflash": CKPT, "dels": CKPT (a DeLS head), "weights": {"longspark": w, "dflash": w} (relative; default equal),
  "parts": [...]}; `parts` overrides the config's (a subset of those it names), `budget` is the DFlash part's
  BudgetDraft budget."""
  from longspec_jax.drafters.budget import load_dflash_budget
  from longspec_jax.drafters.dels import dels_from_head, read_dels_head, resolve_base_dir
  from longspec_jax.drafters.longspark import load_longspark
  drafter_dir = Path(drafter_dir)
  conf = read_config_json(drafter_dir / "config.json", "combined drafter")
  if ARCHITECTURE not in (conf.get("architectures") or []):
    raise ValueError(f"not a combined-drafter config: {drafter_dir / 'config.json'} "
                     f"(architectures {conf.get('architectures')})")
  named = parse_parts(conf.get("parts", [p for p in PARTS if p in conf]))
  on = parse_parts(parts) if parts is not None else named
  missing = [p for p in on if p not in conf]
  if missing:
    raise ValueError(f"parts {missing} are not named in {drafter_dir / 'config.json'} (it names "
                     f"{[p for p in PARTS if p in conf]})")
  where = {p: resolve_base_dir(drafter_dir, conf[p]) for p in on}
  loaders = {"longspark": lambda d: load_longspark(d, target),
             "dflash": lambda d: load_dflash_budget(d, target, budget=budget)}
  blocks = [p for p in BLOCK_PARTS if p in on]
  weights = conf.get("weights", {})
  w = np.asarray([float(weights.get(p, 1.0)) for p in blocks])
  loaded = ensemble([loaders[p](where[p]) for p in blocks], w / w.sum())  # relative weights, summing to 1
  if "dels" not in on:
    return loaded
  cfg, head, _ = read_dels_head(where["dels"], target)
  return dels_from_head(loaded, cfg, head, name="combined")
