"""`generate()`: Python lists in, lists out. It prepares the call on the host (checks, buckets, the drafter's
default K), runs the engine's two jitted programs (prefill, decode loop) and returns the tokens with timings.
Prompt lengths and cache sizes are bucketed, so a second call in the same bucket reuses both programs."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from longspec_jax.inference import engine

if TYPE_CHECKING:
  from longspec_jax.draft_tree import DraftTree
  from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
  from longspec_jax.inference.draft_length import DraftLengthRule
  from longspec_jax.model import Transformer


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]  # generated tokens per prompt (EOS included when produced)
  prompt_lengths: list[int]
  target_forwards: int  # forwards after prefill
  wall_s: float  # the whole call
  prefill_s: float  # prefill program (the first generated token included)
  decode_s: float  # decode loop program
  stats: dict = dataclasses.field(default_factory=dict)  # speculative: tau, acceptance per position, K


def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             drafter: LoadedDrafter | DrafterSpec | None = None, num_draft: int | None = None,
             draft_length: DraftLengthRule | str | None = None,
             tree: DraftTree | str | None = None) -> GenerationResult:
  """Generates up to `max_new_tokens` per prompt (stops per sequence at EOS). Greedy when temperature == 0.

  With `drafter` (from `load_drafter`), runs speculative decoding (lossless) with K = `num_draft` drafts per
  step (None: the drafter's default) instead of plain autoregression. draft_length "auto" (or a
  `DraftLengthRule`) picks the drafts verified per step among a few sizes up to K, 0 (a decode step) included.
  `tree` (a `DraftTree` or its text, e.g. "0;1;0.0;0.0.0"): greedy tree drafting (eagle3) instead of a chain.
  """
  t0 = time.perf_counter()
  prepared = engine.prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, drafter,
                            num_draft, draft_length, tree)
  return run_prepared(*prepared, t0=t0)


def run_prepared(config: engine.GenerationConfig, params: engine.GenerationParams, inputs: engine.GenerationInputs,
                 programs: tuple | None = None, t0: float | None = None) -> GenerationResult:
  """generate() from `engine.prepare`'s output (and `engine.compile_programs`'s, to reuse compiled programs)."""
  t0 = time.perf_counter() if t0 is None else t0
  state, prefill_s, decode_s = engine.run(config, params, inputs, programs=programs)
  tokens = engine.output_tokens(state, inputs)
  stats = {}
  if config.drafter is not None:
    stats = engine.spec_stats(state.accept_hist, state.active_steps, state.num_new, state.step)
    stats.update(engine.length_stats(config, state))
  return GenerationResult(tokens=tokens, prompt_lengths=np.asarray(inputs.prompt_lens).tolist(),
                          target_forwards=int(state.step), wall_s=time.perf_counter() - t0, prefill_s=prefill_s,
                          decode_s=decode_s, stats=stats)
