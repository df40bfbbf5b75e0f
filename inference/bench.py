"""`longspec bench`: one method against this project's jitted AR, in the same process, on the first N tokens of a
text file. Timings are medians over repeats; the first call of each program (compilation) is not timed."""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from longspec_jax.drafters import given_options, load_drafter
from longspec_jax.drafters.base import state_nbytes
from longspec_jax.inference import engine
from longspec_jax.inference.benchmark.measure import Timer, step_costs
from longspec_jax.inference.benchmark.prompts import bench_prompts
from longspec_jax.inference.generate import GenerationResult, run_prepared

if TYPE_CHECKING:
  from tokenizers import Tokenizer

  from longspec_jax.draft_tree import DraftTree
  from longspec_jax.inference.draft_length import DraftLengthRule
  from longspec_jax.model import Transformer


def profile_step(config: engine.GenerationConfig, params: engine.GenerationParams, inputs: engine.GenerationInputs,
                 repeats: int = 3) -> tuple[float, float, int]:
  """(draft ms, verify ms, drafter state bytes) of one speculative step of this call at its context, the draft
  and the verify pass timed apart outside the decode loop (profiling mode). The programs are module-level: a
  second call in the same bucket compiles nothing."""
  state = jax.block_until_ready(engine.prefill_program(config, params, inputs))
  draft_ms, verify_ms = step_costs(Timer(), config, params, inputs, state, repeats)
  return draft_ms, verify_ms, state_nbytes(state.drafter_state)


def decode_rate(config: engine.GenerationConfig, params: engine.GenerationParams, inputs: engine.GenerationInputs,
                repeats: int) -> tuple[GenerationResult, float | None, float, float]:
  """(result, decode tokens/s, prefill s, decode s) of a prepared call (`engine.prepare`), its prefill and decode
  programs timed apart: medians over `repeats` calls after a compiling one (the module-level jitted programs, which
  profile_step reuses). The first token of each sequence comes from the prefill, so the rate counts the tokens the
  decode loop made."""
  run = lambda: run_prepared(config, params, inputs)
  run()
  results = [run() for _ in range(repeats)]
  res = results[-1]
  prefill_s = statistics.median(r.prefill_s for r in results)
  decode_s = statistics.median(r.decode_s for r in results)
  n_decoded = sum(len(t) - 1 for t in res.tokens)
  return res, (n_decoded / decode_s if n_decoded else None), prefill_s, decode_s


def run_bench(model: Transformer, tok: Tokenizer, method: str, text: str, context: int, new_tokens: int,
              temperature: float = 0.0, seed: int = 0, batch: int = 1, num_draft: int | None = None,
              drafter_dir: str | Path | None = None, repeats: int = 3, top_k: int = 0, top_p: float = 1.0,
              sharpdraft: str = "off",
              log: Callable[[str], None] | None = None, budget: int | None = None,
              draft_length: DraftLengthRule | str | None = None, learned: str | None = None,
              draft_vocab: int | None = None, parts: str | None = None, tree: DraftTree | str | None = None,
              suffix_index: str | Path | None = None) -> dict:
  """One method vs AR on the same prompts: each call prepared once (`engine.prepare`: checks, K, buckets), then
  compiled, run and timed from that. `log(message)` reports each phase (the CLI prints it to stderr)."""
  log = log or (lambda msg: None)
  drafter = load_drafter(method, model, drafter_dir, sharpdraft=sharpdraft, budget=budget, learned=learned,
                         draft_vocab=draft_vocab, parts=parts, suffix_index=suffix_index)
  prompts = bench_prompts(tok.encode(text).ids, context, batch, model.cfg.bos_token_id)
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
  # Each call as generate() runs it: checks, K (the drafter's default when None), buckets.
  spec_call = (engine.prepare(model, prompts, new_tokens, drafter=drafter, num_draft=num_draft,
                              draft_length=draft_length, tree=tree, **kw)
               if drafter is not None else None)
  log(f"ar: compiling, then {repeats} timed calls")
  ar, ar_tps, ar_prefill, ar_decode = decode_rate(*engine.prepare(model, prompts, new_tokens, **kw), repeats)
  out = {"method": method, "sharpdraft": sharpdraft, "context": context, "new_tokens": new_tokens,
         "batch": batch, "temperature": temperature, "seed": seed,
         "num_draft_tokens": spec_call[0].num_draft if spec_call else 0,
         "draft_length": spec_call[0].draft_length.to_json() if spec_call and spec_call[0].draft_length else "fixed",
         "ar_tokens_per_s": ar_tps, "ar_prefill_ms": 1000 * ar_prefill,
         "ar_decode_ms": 1000 * ar_decode, "ar_tokens": ar.tokens[0]}
  out.update(given_options(budget=budget, learned=learned, draft_vocab=draft_vocab,
                           suffix_index=None if suffix_index is None else str(suffix_index)))
  if spec_call and spec_call[0].tree is not None:
    out["tree"] = str(spec_call[0].tree)
  if drafter is None:
    out.update(tau=1.0, accept_per_position=[], target_forwards=ar.target_forwards, tokens_per_s=ar_tps,
               speedup=1.0, draft_ms_per_step=0.0, verify_ms_per_step=None, drafter_state_bytes=0,
               exact_match_ar=True if temperature == 0 else None)
  else:
    log(f"{method}: compiling, then {repeats} timed calls")
    res, tps, prefill, decode = decode_rate(*spec_call, repeats)
    log(f"{method}: tau {res.stats['tau']:.2f}; timing one draft and one verify step")
    draft_ms, verify_ms, state_bytes = profile_step(*spec_call)
    out.update(tau=res.stats["tau"], accept_per_position=res.stats["accept_per_position"],
               target_forwards=res.target_forwards, tokens_per_s=tps,
               speedup=tps / ar_tps if tps and ar_tps else None,
               prefill_ms=1000 * prefill, decode_ms=1000 * decode, draft_ms_per_step=draft_ms,
               verify_ms_per_step=verify_ms, drafter_state_bytes=state_bytes,
               # What a verify pass costs in AR steps (same process): speedup ~ tau / (this + draft/AR step).
               verify_over_decode=verify_ms * ar_tps / 1000 if ar_tps else None,
               **{k: res.stats[k] for k in ("draft_sizes", "size_share", "rows_per_step", "class_rates")
                  if k in res.stats},
               exact_match_ar=(res.tokens == ar.tokens) if temperature == 0 else None)
  out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return out
