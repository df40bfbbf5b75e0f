"""Meshes and logical-axis sharding rules (MaxText style): parameters carry logical axis names; rules map them to
mesh axes. Data parallel replicates parameters and shards the batch on "data"; tensor parallel maps the wide
dimensions (heads, MLP, vocab) to "model"."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_PARALLEL_RULES = ()
TENSOR_PARALLEL_RULES = (("q_heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"))


def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  data = data or len(devices) // model
  if data * model != len(devices):
    raise ValueError(f"mesh data={data} x model={model} does not match {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def logical_to_spec(axes: Sequence[str | None], rules: Iterable[tuple[str, str | None]]) -> P:
  rules = dict(rules)
  return P(*(rules.get(a) for a in axes))


def param_shardings(state: Any, mesh: Mesh, rules: Iterable[tuple[str, str | None]] = DATA_PARALLEL_RULES) -> Any:
  """NamedSharding for every nnx.Param leaf of `state` from its `logical_axes` metadata."""
  def one(v):
    axes = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
    return NamedSharding(mesh, logical_to_spec(axes, rules) if axes else P())

  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return jax.tree.unflatten(jax.tree.structure(state), [one(v) for v in variables])


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def process_batch(build_rows: Callable[[slice], Any], batch_size: int, mesh: Mesh) -> Any:
  """The global batch (every leaf [batch_size, ...]) as jax.Arrays sharded on "data", each process building only
  the rows its own devices hold: `build_rows(rows)` returns rows[lo:hi] of every leaf of the global batch, and
  `jax.make_array_from_process_local_data` assembles the processes' parts (one process builds every row)."""
  sharding = batch_sharding(mesh)
  lo, hi = process_rows(sharding, (batch_size,))

  def one(x):
    x = np.asarray(x)
    if x.shape[0] != hi - lo:
      raise ValueError(f"build_rows returned {x.shape[0]} rows for rows [{lo}, {hi}) of the global batch")
    return jax.make_array_from_process_local_data(sharding, x, (batch_size, *x.shape[1:]))
  return jax.tree.map(one, build_rows(slice(lo, hi)))


def global_batch(batch: Any, mesh: Mesh) -> Any:
  """A host batch that every process holds whole (every leaf [B, ...]) -> jax.Arrays sharded on "data", each
  process handing over only its own rows."""
  size = len(jax.tree.leaves(batch)[0])
  return process_batch(lambda rows: jax.tree.map(lambda x: np.asarray(x)[rows], batch), size, mesh)


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int]:
  """[lo, hi): the rows of a batch-sharded global array of `shape` that this process's devices hold."""
  rows = {idx[0].indices(shape[0])[:2] for idx in sharding.addressable_devices_indices_map(shape).values()}
  lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
  if sum(b - a for a, b in rows) != hi - lo:
    raise ValueError(f"this process's batch rows {sorted(rows)} are not contiguous: order the mesh's devices by "
                     "process (make_mesh does)")
  return lo, hi
