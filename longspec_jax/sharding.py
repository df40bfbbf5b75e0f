"""Meshes and logical-axis sharding rules (MaxText style): parameters carry logical axis names; rules map them to
mesh axes. Data parallel replicates parameters and shards the batch on "data"; tensor parallel maps the wide
dimensions (heads, MLP, vocab) to "model"."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_PARALLEL_RULES = ()
TENSOR_PARALLEL_RULES = (("q_heads", "model"), ("kv_heads", "model"), ("mlp", "model"), ("vocab", "model"))


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  data = data or len(devices) // model
  if data * model != len(devices):
    raise ValueError(f"mesh data={data} x model={model} does not match {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def logical_to_spec(axes, rules) -> P:
  rules = dict(rules)
  return P(*(rules.get(a) for a in axes))


def param_shardings(state, mesh: Mesh, rules=DATA_PARALLEL_RULES):
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
