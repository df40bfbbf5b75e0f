"""Generation as one pure, array-in/array-out function that callers jit themselves, laid out on a mesh.

The function and its inputs are the engine's (`longspec_jax.inference.engine`):

    config, params, inputs = prepare(model, [ids], max_new_tokens=32)               # host side, once
    gen = jax.jit(generate_arrays, static_argnums=0, compiler_options=COMPILER_OPTIONS)
    tokens = output_tokens(gen(config, params, inputs), inputs)                     # compiles once per bucket

This module adds the shardings for that jit on a device mesh (data parallel over the batch, or tensor parallel
over the target's heads, MLP and vocabulary) and the multi-host placement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from longspec_jax import sharding as shd
from longspec_jax.inference.engine import (GenerationConfig, GenerationInputs, GenerationOutput, GenerationParams,
                                           generate_arrays)
from longspec_jax.kv_cache import COMPILER_OPTIONS


def generation_shardings(mesh: Mesh, config: GenerationConfig, params: GenerationParams,
                         rules: Iterable[tuple[str, str | None]] = shd.DATA_PARALLEL_RULES
                         ) -> tuple[tuple, GenerationOutput]:
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
                     rules: Iterable[tuple[str, str | None]] = shd.DATA_PARALLEL_RULES
                     ) -> tuple[Callable[[GenerationParams, GenerationInputs], GenerationOutput], GenerationParams,
                                GenerationInputs]:
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
