"""Timing on the engine's public steps (`longspec_jax.inference.engine`), for `longspec bench` and the suite.

The suite prefills each prompt once (`engine.prefill` over the union of its methods' taps and K/V needs) and starts
every method from that prefill (`engine.start`); the target prefill is deterministic, so this is exactly the state
each method's own prefill would build. Each method's decode loop is the engine's `decode_program`, timed alone.
A step's two halves are also timed apart (profiling mode): the drafter's first proposal and one target pass over
[pending, drafts] at the prompt's context. Each half runs as an ahead-of-time compiled executable: inside the decode
loop a half costs no host dispatch, but a `jax.jit` call with the static config does, mostly hashing the config's
graph definition to find the compiled program (2-2.6 ms per call for SmolLM2's drafters on a 2-core CPU, against
5-11 ms for their draft passes), and timing that would misstate what a step costs.

Every program here is module-level: a second run in the same process (a sweep, a notebook, the tests) reuses its
compilations. `Timer` keys warm-up calls by program and shape, so a compilation is never timed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.drafters.base import ProposeContext, state_nbytes
from longspec_jax.inference import engine
from longspec_jax.kv_cache import COMPILER_OPTIONS

if TYPE_CHECKING:
  from longspec_jax.drafters.base import DrafterSpec, LoadedDrafter
  from longspec_jax.inference.draft_length import DraftLengthRule
  from longspec_jax.model import Transformer


class Timer:
  """Medians of timed calls; the first call of each program shape (its compilation) is not timed."""

  def __init__(self):
    self.warm: set = set()
    self.executables: dict = {}

  def compiled(self, key: Hashable, program: jax.stages.Wrapped, *args: Any, **static: Any) -> jax.stages.Compiled:
    """`program` (a jax.jit) compiled ahead of time for these arguments, once per `key`: call it with the
    non-static arguments only."""
    if key not in self.executables:
      self.executables[key] = program.lower(*args, **static).compile()
    return self.executables[key]

  def timed(self, key: Hashable, fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    """(last result, median seconds) of `repeats` calls; an untimed first call the first time `key` is seen."""
    if key not in self.warm:
      jax.block_until_ready(fn())
      self.warm.add(key)
    times, out = [], None
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn())
      times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


# --- programs ---------------------------------------------------------------------------------------------------

def _start_from_shared(config: engine.GenerationConfig, params, inputs, shared: engine.Prefilled,
                       tap_index: tuple[int, ...]) -> engine.EngineState:
  """A method's start state from the shared prefill: its own taps (`tap_index` into the union, in its order)."""
  d = config.drafter
  pre = shared.replace(taps=shared.taps[:, :, jnp.asarray(tap_index, jnp.int32)] if d is not None and d.taps else None,
                       new_kv=shared.new_kv if d is not None and d.needs_target_kv else None)
  return engine.start(config, params, inputs, pre)


def _first_draft(config: engine.GenerationConfig, params, inputs, state: engine.EngineState):
  """The engine's draft half from a start state, at K (a tree's nodes with `config.tree`)."""
  return engine.draft(config, params, inputs, state, config.num_draft, jax.random.key(0))[0]


def _verify_pass(graphdef, target_params, cache, block, *, taps: tuple, tree=None):
  """The engine's verify half over `block` (its logits: what the step's acceptance reads; the taps and K/V rows the
  program does not return are the same work, as attention over the block computes them anyway). One program per
  target, block shape, taps and tree, shared by the methods that agree on them."""
  return engine.verify_pass(nnx.merge(graphdef, target_params), cache, block, taps=taps, tree=tree).logits


def _diagnostics(config: engine.GenerationConfig, params, inputs, state: engine.EngineState):
  ctx = ProposeContext(tokens=state.tokens, num_tokens=state.num_tokens, sampling=inputs.sampling)
  return config.drafter.diagnostics(params.drafter, state.drafter_state, ctx)


shared_prefill_program = jax.jit(engine.prefill, static_argnums=0, static_argnames=("max_len", "taps", "return_kv"),
                                 compiler_options=COMPILER_OPTIONS)
start_program = jax.jit(_start_from_shared, static_argnums=(0, 4), compiler_options=COMPILER_OPTIONS)
draft_program = jax.jit(_first_draft, static_argnums=0, compiler_options=COMPILER_OPTIONS)
verify_program = jax.jit(_verify_pass, static_argnums=0, static_argnames=("taps", "tree"),
                         compiler_options=COMPILER_OPTIONS)
diagnostics_program = jax.jit(_diagnostics, static_argnums=0)


# --- measurements ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SharedPrefill:
  """One prompt's target prefill, shared by every method run on it."""
  pre: engine.Prefilled
  taps: tuple[int, ...]  # the tap indices pre.taps holds, in order
  seconds: float


def shared_prefill(timer: Timer, graphdef: nnx.GraphDef, target_params: nnx.State, inputs: engine.GenerationInputs,
                   max_len: int, specs: Sequence[DrafterSpec]) -> SharedPrefill:
  """The prefill of `inputs` into a cache of `max_len`, with the union of the drafter `specs`' taps and K/V needs."""
  taps = tuple(sorted({t for s in specs for t in s.taps}))
  return_kv = any(s.needs_target_kv for s in specs)
  pre, seconds = timer.timed(
      ("prefill", graphdef, inputs.tokens.shape, max_len, taps, return_kv),
      lambda: shared_prefill_program(graphdef, target_params, inputs.tokens, inputs.prompt_lens, max_len=max_len,
                                     taps=taps, return_kv=return_kv), 1)
  return SharedPrefill(pre, taps, seconds)


def start_state(config: engine.GenerationConfig, params: engine.GenerationParams, inputs: engine.GenerationInputs,
                shared: SharedPrefill) -> engine.EngineState:
  d = config.drafter
  tap_index = tuple(shared.taps.index(t) for t in d.taps) if d is not None else ()
  return start_program(config, params, inputs, shared.pre, tap_index)


def _fresh(state):
  """A copy of a start state: the decode program donates (consumes) its input."""
  return jax.block_until_ready(jax.tree.map(lambda x: jnp.array(x, copy=True), state))


def time_decode(timer: Timer, config: engine.GenerationConfig, params: engine.GenerationParams,
                inputs: engine.GenerationInputs, state0: engine.EngineState,
                repeats: int) -> tuple[engine.EngineState, float]:
  """(final state, median seconds) of the engine's decode program run from copies of `state0`; the copies are made
  before the clock starts."""
  key = ("decode", config, inputs.tokens.shape)
  copies = iter([_fresh(state0) for _ in range(repeats + (key not in timer.warm))])
  no_limit = jnp.int32(engine.NO_STEP_LIMIT)
  return timer.timed(key, lambda: engine.decode_program(config, params, inputs, next(copies), no_limit), repeats)


def step_costs(timer: Timer, config: engine.GenerationConfig, params: engine.GenerationParams,
               inputs: engine.GenerationInputs, state: engine.EngineState, repeats: int) -> tuple[float, float]:
  """(draft ms, verify ms) of one step from a start state: the drafter's proposal and one target pass over
  [pending, drafts] at the prompt's context, each timed alone (medians)."""
  d = config.drafter
  key = ("draft", config, inputs.tokens.shape)
  draft = timer.compiled(key, draft_program, config, params, inputs, state)
  drafts, draft_s = timer.timed(key, lambda: draft(params, inputs, state), repeats)
  pending = jnp.take_along_axis(state.tokens, state.target_cache.lengths[:, None], axis=1)
  block = jnp.concatenate([pending, drafts], axis=1)
  key = ("verify", config.graphdef, config.max_len, block.shape, d.taps, config.tree)
  verify = timer.compiled(key, verify_program, config.graphdef, params.target, state.target_cache, block,
                          taps=d.taps, tree=config.tree)
  _, verify_s = timer.timed(key, lambda: verify(params.target, state.target_cache, block), repeats)
  return 1000 * draft_s, 1000 * verify_s


def measure(timer: Timer, config: engine.GenerationConfig, params: engine.GenerationParams,
            inputs: engine.GenerationInputs, shared: SharedPrefill, repeats: int, diagnostics: bool = False) -> dict:
  """One method (AR when config.drafter is None) on one prompt from the shared prefill: its decode loop (timed),
  tau and acceptance, and for a drafter the step's halves timed apart, its state bytes and, with `diagnostics`,
  the drafter's own diagnostics at the prompt's end. Batch of one."""
  state0 = start_state(config, params, inputs, shared)
  state, decode_s = time_decode(timer, config, params, inputs, state0, repeats)
  out = dict(new_tokens=int(state.num_new[0]), decode_s=decode_s, target_forwards=int(state.step))
  if config.drafter is None:
    out.update(tau=1.0, accept_hist=[], draft_ms_per_step=0.0, verify_ms_per_step=None, drafter_state_bytes=0,
               diagnostics={})
  else:
    stats = engine.spec_stats(state.accept_hist, state.active_steps, state.num_new, state.step)
    draft_ms, verify_ms = step_costs(timer, config, params, inputs, state0, repeats)
    diag = diagnostics_program(config, params, inputs, state0) if diagnostics else {}
    out.update(engine.length_stats(config, state))
    out.update(tau=stats["tau"], accept_hist=stats["accept_hist"], draft_ms_per_step=draft_ms,
               verify_ms_per_step=verify_ms, drafter_state_bytes=state_nbytes(state0.drafter_state),
               diagnostics={k: np.round(np.asarray(v, np.float64), 5).tolist() for k, v in diag.items()})
  out["tokens"] = engine.output_tokens(state, inputs)[0]
  return out


# --- draft length calibration ------------------------------------------------------------------------------------

def _steps_at(config: engine.GenerationConfig, params, inputs, state: engine.EngineState, size: int, steps: int):
  return jax.lax.fori_loop(0, steps, lambda _, s: engine.step_at(config, params, inputs, s, size)[0], state)


steps_at_program = jax.jit(_steps_at, static_argnums=(0, 4, 5), compiler_options=COMPILER_OPTIONS)


def calibrate_draft_length(model: Transformer, drafter: LoadedDrafter | DrafterSpec, prompt_ids: list[int],
                           sizes: tuple[int, ...], steps: int = 16, repeats: int = 3, timer: Timer | None = None,
                           new_tokens: int = 256, prior_prompts: list[list[int]] | None = None,
                           cost_lengths: list[int] | None = None) -> tuple[DraftLengthRule, list[float], list]:
  """(rule, AR step ms per cost context, observed rates): a DraftLengthRule over `sizes` (largest = K) whose costs
  and prior rates are measured here. Costs: `steps` engine steps at each fixed size from the prefill of
  `prompt_ids` (or of its first n tokens for each n of `cost_lengths`: then one row of costs per cache length,
  the rule's cost_contexts), over the same number of AR steps timed just before (median of `repeats` such
  ratios). Priors: the (first draft, continuation) acceptance per draft class over a greedy generation of
  `new_tokens` per prompt of `prior_prompts` (one batch; default `prompt_ids` alone) verifying K drafts every
  step; a class never seen keeps the rule's initial_rate. One prompt's rates vary a lot with what the text is
  doing there, hence several."""
  from longspec_jax.inference.draft_length import DraftLengthRule, observed_rates
  timer = timer or Timer()
  k = max(sizes)
  call = dict(max_new_tokens=steps * (k + 1) + 1, eos_id=-1)
  setups = [(engine.prepare(model, [prompt_ids[:n]], drafter=drafter, num_draft=k, **call),
             engine.prepare(model, [prompt_ids[:n]], **call)) for n in cost_lengths or [len(prompt_ids)]]
  contexts = [method[0].max_len for method, _ in setups]
  if contexts != sorted(set(contexts)):
    raise ValueError(f"cost lengths {cost_lengths} give cache lengths {contexts}: give ascending lengths far enough "
                     "apart to land in distinct cache buckets")
  cost_rows, ar_ms = [], []
  for (config, params, inputs), (ac, ap, ai) in setups:
    # Each size's run is paired with an AR run just before it and the cost is the median of the pairs' ratios:
    # load on a shared machine drifts over seconds, and timing all sizes after AR let it bias whole rows.
    method_state = jax.block_until_ready(engine.prefill_program(config, params, inputs))
    ar_state = jax.block_until_ready(engine.prefill_program(ac, ap, ai))
    run_ar = lambda: timer.timed(("steps_at", ac, 0, steps), lambda: steps_at_program(ac, ap, ai, ar_state, 0,
                                                                                       steps), 1)[1]
    ratios, ar_secs = {size: [] for size in sizes}, []
    for _ in range(repeats):
      for size in sizes:
        ar_secs.append(run_ar())
        _, secs = timer.timed(("steps_at", config, size, steps),
                              lambda: steps_at_program(config, params, inputs, method_state, size, steps), 1)
        ratios[size].append(secs / ar_secs[-1])
    cost_rows.append(tuple(round(statistics.median(ratios[s]), 4) for s in sizes))
    ar_ms.append(round(1000 * statistics.median(ar_secs) / steps, 3))
  always_k = DraftLengthRule((k,))  # counts per class while verifying K drafts every step
  c, p, i = engine.prepare(model, prior_prompts or [prompt_ids], new_tokens, drafter=drafter,
                           draft_length=always_k, eos_id=-1)
  state = engine.decode_program(c, p, i, engine.prefill_program(c, p, i))
  observed = observed_rates(state.class_counts)
  default = DraftLengthRule(tuple(sizes)).initial_rate
  priors = tuple(tuple(default if x is None else x for x in row) for row in observed)
  if cost_lengths is None:
    return DraftLengthRule(tuple(sizes), costs=cost_rows[0], prior_rates=priors), ar_ms, observed
  rule = DraftLengthRule(tuple(sizes), costs=tuple(cost_rows), cost_contexts=tuple(contexts), prior_rates=priors)
  return rule, ar_ms, observed
