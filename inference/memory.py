"""`longspec memory`: how a target (an HF config.json) fits a Cloud TPU slice for generation, per (data, model)
mesh: parameter and KV-cache bytes per chip under this project's tensor-parallel rules. The counts come from the
model code itself (`nnx.eval_shape` of the Transformer and of its cache: nothing is allocated), so they are
exact for parameters and cache; activations and XLA scratch are not counted (the `budget` leaves headroom)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import sharding as shd
from longspec_jax.config import ModelConfig

GIB = 1 << 30
# Accelerator-type prefix -> (TensorCores per chip as the type's number counts them, HBM bytes per chip).
# v4 and v5p names count TensorCores (2 per chip); v5e ("v5litepod") and v6e names count chips.
TPU_CHIPS = {"v4": (2, 32 * GIB), "v5p": (2, 95 * GIB), "v5litepod": (1, 16 * GIB), "v6e": (1, 32 * GIB)}


def slice_chips(accelerator_type: str) -> tuple[int, int]:
  """(chips, HBM bytes per chip) of an accelerator type such as v4-32, v5p-64, v5litepod-16, v6e-8."""
  m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator_type)
  if not m:
    raise ValueError(f"unknown accelerator type {accelerator_type!r}; expected one of "
                     f"{', '.join(f'{k}-N' for k in TPU_CHIPS)} (e.g. v5litepod-16)")
  per_chip, hbm = TPU_CHIPS[m.group(1)]
  n = int(m.group(2))
  if n % per_chip:
    raise ValueError(f"{accelerator_type}: {m.group(1)} sizes count {per_chip} TensorCores per chip")
  return n // per_chip, hbm


def estimate(cfg: ModelConfig, accelerator_type: str, context: int, batch: int, dtype: str = "bfloat16",
             budget: float = 0.9) -> dict:
  """Per-chip parameter and KV-cache bytes for every (data, model) mesh of the slice that divides the batch and
  the sharded dimensions; `fits` = total <= budget x HBM."""
  from longspec_jax.model import Transformer

  chips, hbm = slice_chips(accelerator_type)
  dt = jnp.dtype(dtype)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dt))
  variables = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
  # (elements, whether the leaf is split over "model" under the tensor-parallel rules)
  leaves = [(math.prod(v.shape), "model" in shd.logical_to_spec(v.get_metadata().get("logical_axes") or (),
                                                                  shd.TENSOR_PARALLEL_RULES)) for v in variables]
  n_params = sum(n for n, _ in leaves)
  cache = jax.eval_shape(lambda: model.init_cache(1, context))
  kv_per_seq = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache) if x.ndim > 1)
  wide = {"q_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "mlp": cfg.intermediate_size,
          "vocab": cfg.vocab_size}
  rows = []
  for model_ax in (m for m in range(1, chips + 1) if chips % m == 0):
    data_ax = chips // model_ax
    if batch % data_ax or any(n % model_ax for n in wide.values()):
      continue
    params_b = sum(n // (model_ax if split else 1) for n, split in leaves) * dt.itemsize
    kv_b = kv_per_seq * (batch // data_ax) // model_ax  # batch over "data", KV heads over "model"
    rows.append({"data": data_ax, "model": model_ax, "params_gib_per_chip": round(params_b / GIB, 3),
                 "kv_cache_gib_per_chip": round(kv_b / GIB, 3), "total_gib_per_chip": round((params_b + kv_b) / GIB, 3),
                 "fits": params_b + kv_b <= budget * hbm})
  return {"accelerator_type": accelerator_type, "chips": chips, "hbm_gib_per_chip": hbm / GIB,
          "parameters": n_params, "param_dtype": dt.name, "context": context, "batch": batch,
          "kv_cache_gib_per_sequence": round(kv_per_seq / GIB, 4), "budget_fraction": budget, "meshes": rows,
          "note": "activations and XLA scratch not included; mesh axes must divide the batch (data) and the heads, "
                  "MLP width and vocabulary (model)"}


def table(res: dict) -> str:
  lines = [f"{res['parameters'] / 1e9:.2f}B parameters ({res['param_dtype']}), context {res['context']} x batch "
           f"{res['batch']} on {res['accelerator_type']} ({res['chips']} chips x {res['hbm_gib_per_chip']:g} GiB)",
           f"{'data':>5} {'model':>5} {'params':>9} {'kv cache':>9} {'total':>9}  fits (<= "
           f"{res['budget_fraction']:.0%} HBM)"]
  for r in res["meshes"]:
    lines.append(f"{r['data']:>5} {r['model']:>5} {r['params_gib_per_chip']:>8.2f}G {r['kv_cache_gib_per_chip']:>8.2f}G "
                 f"{r['total_gib_per_chip']:>8.2f}G  {'yes' if r['fits'] else 'no'}")
  if not res["meshes"]:
    lines.append("no (data, model) mesh divides the batch and the sharded dimensions")
  return "\n".join(lines)
