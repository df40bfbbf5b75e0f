"""Model and drafter calls in tests, compiled as one program each.

Run op by op, JAX compiles every primitive at every new shape as a program of its own: a test that calls a
drafter's `init_state`, `update` and `block_logits` directly paid hundreds of such compiles (up to 9 s of one test
on this CPU). `compiled(fn, *args, **kwargs)` jits the whole call instead; arguments that hold no arrays (modes,
sizes, flags, configs) are static."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx


def _traced(value: Any) -> bool:
  """Whether jit takes `value` as a traced argument (arrays, pytrees of them, nnx modules) or a static one."""
  if isinstance(value, (nnx.Module, nnx.State)):
    return True
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves)


@functools.lru_cache(maxsize=None)
def _jitted(fn: Callable, static_argnums: tuple[int, ...], static_argnames: tuple[str, ...]) -> Callable:
  return nnx.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames)


def _call_module(module: nnx.Module, *args: Any, **kwargs: Any) -> Any:
  return module(*args, **kwargs)


def compiled(fn: Callable, *args: Any, **kwargs: Any) -> Any:
  """fn(*args, **kwargs) as one jitted program (an nnx module `fn` is called as `fn(*args, **kwargs)`); a second
  call with the same function, static values and shapes reuses the compilation."""
  if isinstance(fn, nnx.Module):
    fn, args = _call_module, (fn, *args)
  static_argnums = tuple(i for i, a in enumerate(args) if not _traced(a))
  static_argnames = tuple(sorted(k for k, v in kwargs.items() if not _traced(v)))
  return _jitted(fn, static_argnums, static_argnames)(*args, **kwargs)
