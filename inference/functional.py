"""Generation as one pure, array-in/array-out function that callers jit themselves.

`generate()` is the convenient call: Python lists in, lists out, two jitted programs timed apart. This module is
the same computation as a single function of explicit inputs, for notebooks and for jobs that own their `jax.jit`
(shardings on a mesh, `jax.export`, embedding in a larger program):

    config, params, inputs = prepare_generation(model, [ids], max_new_tokens=32)      # host side, once
    gen = jax.jit(generate_arrays, static_argnums=0, compiler_options=COMPILER_OPTIONS)
    out = gen(config, params, inputs)                                                 # compiles
    out = gen(config, params, prepare_generation(model, [other], 32)[2])             # same bucket: no compile
    tokens = output_tokens(out, inputs)

`config` (`GenerationConfig`) is static and hashable: the target's graph, the buffer length, the drafter's static
spec, K and the verification rule; everything else is a traced array. Prompts and cache sizes are bucketed as in
`generate()`, so every call whose prompts and new-token count fall in the same buckets reuses one compiled program.
The body is the engine's own prefill and decode programs (`_ar_prefill`/`_ar_decode`,
`_spec_prefill`/`_spec_decode`) run back to back: outputs are those of `generate()` token for token.
`COMPILER_OPTIONS` (`longspec_jax.kv_cache`) keeps the KV-cache updates in place on CPU (without it XLA:CPU copies
every layer's cache on every step); TPU and GPU ignore it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from longspec_jax.inference.generate import _ar_decode, _ar_prefill, ar_sizes, pad_prompts, validate_prompts
from longspec_jax.inference.speculative import _spec_decode, _spec_prefill, spec_sizes, spec_stats
from longspec_jax import sharding as shd
from longspec_jax.kv_cache import COMPILER_OPTIONS
from longspec_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """The static half of a generation call (a `jax.jit` static argument): it fixes the program's shapes."""
  graphdef: Any  # the target's nnx.GraphDef
  max_len: int  # token buffer and KV cache length (prompt bucket + new tokens [+ K+1 headroom], bucketed)
  drafter: Any = None  # a drafter's static spec (`LoadedDrafter.spec`); None = autoregressive
  num_draft: int = 0  # K drafts per verification (speculative only)
  sample: bool = False  # speculative only: rejection-sampling verification (temperature > 0) vs greedy


@flax.struct.dataclass
class GenerationParams:
  target: Any  # nnx.State of the target (from nnx.split)
  drafter: Any = None  # the drafter's parameter pytree (None for AR or a parameter-free drafter)


@flax.struct.dataclass
class GenerationInputs:
  tokens: jax.Array  # [B, T] int32 right-padded prompts, T = the prompt bucket
  prompt_lens: jax.Array  # [B] int32
  max_new: jax.Array  # [] int32 new tokens per sequence (the buffer holds config.max_len)
  sampling: SamplingParams  # temperature / top-k / top-p, traced
  seed: jax.Array  # [] uint32
  eos_id: jax.Array  # [] int32; -1 = never stop early


@flax.struct.dataclass
class GenerationOutput:
  tokens: jax.Array  # [B, max_len]: prompt b in [0, prompt_lens[b]), then num_new[b] generated tokens
  num_new: jax.Array  # [B] generated tokens (EOS included when produced)
  target_forwards: jax.Array  # [] target passes after the prefill
  accept_hist: jax.Array | None = None  # [K+1] how often 0..K drafts were accepted (speculative only)
  active_steps: jax.Array | None = None  # [B] verification passes per sequence while generating (speculative)


def generate_arrays(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs
                    ) -> GenerationOutput:
  """Prefill and decode in one pure function; wrap it in `jax.jit(..., static_argnums=0)` (or jit a
  `functools.partial(generate_arrays, config)` with in/out shardings)."""
  i, g = inputs, config.graphdef
  if config.drafter is None:
    state = _ar_prefill(g, params.target, i.tokens, i.prompt_lens, i.max_new, i.sampling, i.seed, i.eos_id,
                        max_len=config.max_len)
    state = _ar_decode(g, params.target, state, i.max_new, i.sampling, i.eos_id)
    return GenerationOutput(tokens=state.tokens, num_new=state.num_new, target_forwards=state.steps)
  d, dp = config.drafter, params.drafter
  state = _spec_prefill(g, params.target, d, dp, i.tokens, i.prompt_lens, i.max_new, i.sampling, i.seed, i.eos_id,
                        max_len=config.max_len, num_draft=config.num_draft)
  state = _spec_decode(g, params.target, d, dp, state, i.max_new, i.sampling, i.seed, i.eos_id,
                       num_draft=config.num_draft, sample=config.sample)
  return GenerationOutput(tokens=state.tokens, num_new=state.num_new, target_forwards=state.step,
                          accept_hist=state.accept_hist, active_steps=state.active_steps)


def prepare_generation(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, drafter=None,
                       num_draft_tokens: int = 0) -> tuple[GenerationConfig, GenerationParams, GenerationInputs]:
  """Validates and buckets a call the way `generate()` does; returns its (static config, params, inputs)."""
  from longspec_jax.drafters.base import LoadedDrafter

  cfg = model.cfg
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompts = validate_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
  eos = cfg.eos_token_id if eos_id is None else eos_id
  sp = SamplingParams.make(temperature, top_k, top_p)
  graphdef, target_params = nnx.split(model)
  longest = max(map(len, prompts))
  if drafter is None:
    t_bucket, max_len = ar_sizes(cfg, longest, max_new_tokens)
    config, params = GenerationConfig(graphdef, max_len), GenerationParams(target_params)
  else:
    if not isinstance(drafter, LoadedDrafter):
      drafter = LoadedDrafter(drafter)
    k = int(num_draft_tokens)
    t_bucket, max_len = spec_sizes(cfg, drafter.spec, longest, max_new_tokens, k)
    config = GenerationConfig(graphdef, max_len, drafter.spec, k, sample=temperature > 0)
    params = GenerationParams(target_params, drafter.params)
  tokens, lens = pad_prompts(prompts, cfg.pad_token_id or 0, t_bucket)
  inputs = GenerationInputs(tokens=jnp.asarray(tokens), prompt_lens=jnp.asarray(lens),
                            max_new=jnp.int32(max_new_tokens), sampling=sp, seed=jnp.uint32(seed),
                            eos_id=jnp.int32(-1 if eos is None else eos))
  return config, params, inputs


def output_tokens(out: GenerationOutput, inputs: GenerationInputs) -> list[list[int]]:
  """The generated tokens of each sequence, as `generate()` returns them."""
  buf, num_new, lens = np.asarray(out.tokens), np.asarray(out.num_new), np.asarray(inputs.prompt_lens)
  return [buf[b, lens[b]:lens[b] + num_new[b]].tolist() for b in range(len(lens))]


def output_stats(out: GenerationOutput) -> dict:
  """tau, per-position acceptance and target passes of a speculative call (as `generate().stats`)."""
  if out.accept_hist is None:
    return {"target_forwards": int(out.target_forwards)}
  return spec_stats(out.accept_hist, out.active_steps, out.num_new, out.target_forwards)


def generation_shardings(mesh: Mesh, config: GenerationConfig, params: GenerationParams,
                         rules=shd.DATA_PARALLEL_RULES) -> tuple[tuple, GenerationOutput]:
  """(in_shardings, out_shardings) for `jax.jit(functools.partial(generate_arrays, config), ...)` on `mesh`: the
  batch on "data", parameters by their logical axes under `rules` (replicated for data parallelism,
  `shd.TENSOR_PARALLEL_RULES` to split heads, MLP and vocabulary over "model")."""
  batch, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
  param_sh = GenerationParams(target=shd.param_shardings(params.target, mesh, rules),
                              drafter=jax.tree.map(lambda _: rep, params.drafter))
  input_sh = GenerationInputs(tokens=batch, prompt_lens=batch, max_new=rep, sampling=rep, seed=rep, eos_id=rep)
  spec = config.drafter is not None
  out_sh = GenerationOutput(tokens=batch, num_new=batch, target_forwards=rep, accept_hist=rep if spec else None,
                            active_steps=batch if spec else None)
  return (param_sh, input_sh), out_sh


def place_generation(mesh: Mesh, config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs,
                     rules=shd.DATA_PARALLEL_RULES):
  """(jitted generation, params, inputs) laid out on `mesh` by `generation_shardings`. Works when the mesh spans
  several processes (multi-host): every process calls it with the same host values; parameters are placed from
  host copies and each process hands over only its own rows of the batch. Gather the output with
  `longspec_jax.distributed.host_values` (a collective: every process calls it)."""
  (param_sh, input_sh), out_sh = generation_shardings(mesh, config, params, rules)
  params = jax.device_put(jax.tree.map(np.asarray, params), param_sh)
  rows = shd.global_batch({"tokens": inputs.tokens, "prompt_lens": inputs.prompt_lens}, mesh)
  scalars = jax.device_put(jax.tree.map(np.asarray, (inputs.max_new, inputs.sampling, inputs.seed, inputs.eos_id)),
                           shd.replicated(mesh))
  inputs = GenerationInputs(tokens=rows["tokens"], prompt_lens=rows["prompt_lens"], max_new=scalars[0],
                            sampling=scalars[1], seed=scalars[2], eos_id=scalars[3])
  fn = jax.jit(functools.partial(generate_arrays, config), in_shardings=(param_sh, input_sh), out_shardings=out_sh,
               compiler_options=COMPILER_OPTIONS)
  return fn, params, inputs
