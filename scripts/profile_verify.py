"""Where a target pass of T rows over a cache of S positions spends its time (decode: T = 1; verification:
T = K + 1), next to the memory and compute floors of this machine.

For each context S and row count T, timed as jitted programs on a donated cache (as inside the decode loop),
interleaved and repeated (medians, ms):
  pass       the whole "extend" pass: every layer, the cache write, the LM head over T rows
  layers     the same pass over a 64-position cache: weights, projections, MLP (attention over the cache ~0)
  attention  every layer's attention over S cached positions + its cache write alone (`extend_attention`,
             `KVCache.write`)
  lm_head    final norm + LM head over T rows
and the floors: bytes that must be read (weights + the K/V of S positions) / measured read bandwidth, and FLOPs
(2 x params x T + attention 4 x T x Hq x S x D x L) / measured peak matmul throughput. A pass cannot beat the larger
of the two; on a CPU the two costs mostly add up (the same cores load and multiply).

With `--kv-dtype float32,int8` (a list) every KV cache dtype is profiled in the same process, its calls interleaved
with the others', and each row also gives its times as ratios over the first dtype's (`*_ratio`).

  python scripts/profile_verify.py --model smollm2-135m --contexts 1024,4096,8192 --rows 1,9,16 \\
      --out results/verify_profile/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.attention import NEG_INF, extend_attention
from longspec_jax.config import KV_DTYPES
from longspec_jax.kv_cache import COMPILER_OPTIONS, quantize_kv
from longspec_jax.model import param_count
from longspec_jax.targets import TARGET_DTYPES, load_target, parse_rope_scaling

SMALL_CACHE = 64


def interleaved_medians(fns: dict, repeats: int) -> dict:
  """Median ms of each zero-argument function, calls interleaved so that machine noise hits all alike."""
  for f in fns.values():
    jax.block_until_ready(f())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[name].append(1000 * (time.perf_counter() - t0))
  return {name: statistics.median(v) for name, v in times.items()}


def machine_floors(repeats: int) -> dict:
  """Read bandwidth (GB/s: a reduction over 256 MB, far past the caches) and fp32 matmul throughput (GFLOP/s: a
  [256, 1024] x [1024, 1024] product, large enough to run at the machine's peak)."""
  big = jnp.ones((64 * 2 ** 20,), jnp.float32)
  x, w = jnp.ones((256, 1024), jnp.float32), jnp.ones((1024, 1024), jnp.float32)
  read = jax.jit(lambda a: a.sum())
  mm = jax.jit(lambda x, w: x @ w)
  ms = interleaved_medians({"read": lambda: read(big), "mm": lambda: mm(x, w)}, repeats)
  return {"read_gb_per_s": big.nbytes / ms["read"] / 1e6,
          "matmul_gflop_per_s": 2 * x.size * w.shape[1] / ms["mm"] / 1e6}


def filled_cache(model, s: int, t: int):
  cache = model.init_cache(1, s + t)
  rows = lambda x, seed: 0.1 * jax.random.normal(jax.random.key(seed), x.shape, jnp.float32)
  if cache.k_scale is None:
    fill = lambda bufs, seed: tuple(rows(x, seed + i).astype(x.dtype) for i, x in enumerate(bufs))
    return cache.replace(k=fill(cache.k, 0), v=fill(cache.v, 1000), lengths=jnp.array([s], jnp.int32))
  k, v = ([quantize_kv(rows(x, seed + i)) for i, x in enumerate(bufs)]
          for bufs, seed in ((cache.k, 0), (cache.v, 1000)))
  return cache.replace(k=tuple(x[0] for x in k), k_scale=tuple(x[1] for x in k), v=tuple(x[0] for x in v),
                       v_scale=tuple(x[1] for x in v), lengths=jnp.array([s], jnp.int32))


def profile(models: dict, contexts, rows, repeats: int) -> list[dict]:
  """models: KV cache dtype -> the target with that cache; every dtype's calls interleaved with the others'."""
  return [row for s in contexts for t in rows for row in profile_one(models, s, t, repeats)]


def profile_one(models: dict, s: int, t: int, repeats: int) -> list[dict]:
  fns, rows_out = {}, []
  for kv, model in models.items():
    fns.update({(kv, name): f for name, f in pass_fns(model, s, t).items()})
    rows_out.append({"kv_dtype": kv, "context": s, "rows": t})
  ms = interleaved_medians(fns, repeats)
  cfg, first = next(iter(models.values())).cfg, next(iter(models))
  for row in rows_out:
    kv, model = row["kv_dtype"], models[row["kv_dtype"]]
    row.update({f"{name}_ms": round(ms[(kv, name)], 2) for name in ("pass", "layers", "attention", "lm_head")})
    row.update({f"{name}_ratio": round(ms[(kv, name)] / ms[(first, name)], 3) for name in ("pass", "attention")})
    cache = model.init_cache(1, s + t)
    attn_flops = 4 * t * cfg.num_attention_heads * s * cfg.head_dim * cfg.num_hidden_layers
    row.update(weight_bytes=sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))),
               kv_bytes=round((cache.nbytes - cache.lengths.nbytes) * s / (s + t)),
               flops=2 * param_count(model) * t + attn_flops)
  return rows_out


def pass_fns(model, s: int, t: int) -> dict:
  """The four timed calls (pass, layers, attention, lm_head) of one target at context s with t rows."""
  cfg = model.cfg
  graphdef, params = nnx.split(model)

  def pass_fn(params, cache, tokens):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, mode="extend")
    return out.logits, out.cache

  def attention_fn(cache, q, k, positions):
    outs = []
    for layer in range(cfg.num_hidden_layers):
      k_scale, v_scale = cache.layer_scales(layer)
      outs.append(extend_attention(q, k, k, cache.k[layer], cache.v[layer], positions, k_scale=k_scale,
                                   v_scale=v_scale))
      cache = cache.write(layer, k, k, positions)
    return jnp.stack(outs), cache

  def lm_head_fn(params, h):
    m = nnx.merge(graphdef, params)
    return m.logits_from_hidden(m.norm(h))

  run_pass = jax.jit(pass_fn, donate_argnums=(1,), compiler_options=COMPILER_OPTIONS)
  run_attention = jax.jit(attention_fn, donate_argnums=(0,), compiler_options=COMPILER_OPTIONS)
  run_lm_head = jax.jit(lm_head_fn)
  tokens = jnp.ones((1, t), jnp.int32)
  state = {"full": filled_cache(model, s, t), "small": filled_cache(model, SMALL_CACHE, t),
           "attn": filled_cache(model, s, t)}
  q = 0.1 * jnp.ones((1, t, cfg.num_attention_heads, cfg.head_dim), model.dtype)
  k = 0.1 * jnp.ones((1, t, cfg.num_key_value_heads, cfg.head_dim), model.dtype)
  positions = jnp.full((1, t), s, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
  h = jnp.ones((1, t, cfg.hidden_size), model.dtype)

  def call(kind):
    def go():
      if kind == "attention":
        out, state["attn"] = run_attention(state["attn"], q, k, positions)
        return out
      out, state[kind] = run_pass(params, state[kind], tokens)
      return out
    return go

  return {"pass": call("full"), "layers": call("small"), "attention": call("attention"),
          "lm_head": lambda: run_lm_head(params, h)}


def attention_parts(model, contexts, rows, repeats: int) -> list[dict]:
  """extend_attention's three stages over S cached positions, every layer (ms, medians), with the FLOPs of each of
  the two products: scores (q k^T, [Hkv, T*G, D] x [Hkv, S, D], plus a max over them so that the product is not
  dead code), softmax (mask, max, exp, sum over [Hkv, T*G, S] fp32 scores) and values (p v). Where the pass's
  attention time goes for few rows over a long cache."""
  cfg, n_layers = model.cfg, model.cfg.num_hidden_layers
  hkv, d = cfg.num_key_value_heads, cfg.head_dim
  g = cfg.num_attention_heads // hkv
  scores = jax.jit(lambda q, ks: jnp.stack([jnp.einsum("nrd,nsd->nrs", q, k, preferred_element_type=jnp.float32)
                                            .max() for k in ks]))
  softmax = jax.jit(lambda sc, s: jnp.stack([jnp.exp(jnp.where(jnp.arange(x.shape[-1]) < s, x, NEG_INF)
                                                     - x.max(-1, keepdims=True)).sum(-1) for x in sc]))
  values = jax.jit(lambda p, vs: jnp.stack([jnp.einsum("nrs,nsd->nrd", p, v, preferred_element_type=jnp.float32)
                                            for v in vs]))
  out = []
  for s in contexts:
    ks = [0.1 * jax.random.normal(jax.random.key(i), (hkv, s, d), model.dtype) for i in range(n_layers)]
    for t in rows:
      q = 0.1 * jnp.ones((hkv, t * g, d), model.dtype)
      # One array per layer, as in the pass (slicing one stacked array inside the program cost ~10x more here).
      sc = [jax.random.normal(jax.random.key(99 + i), (hkv, t * g, s), jnp.float32) for i in range(n_layers)]
      pr = jnp.abs(sc[0]).astype(model.dtype)
      ms = interleaved_medians({"scores": lambda: scores(q, ks), "softmax": lambda: softmax(sc, s),
                                "values": lambda: values(pr, ks)}, repeats)
      out.append({"context": s, "rows": t, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                  "product_flops": 2 * hkv * t * g * s * d * n_layers})  # each of the two products
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="named target or HF directory (default: the shipped target)")
  p.add_argument("--rope-scaling", default=None, help="e.g. yarn:2 for SmolLM2-135M past 8K")
  p.add_argument("--dtype", default="float32", choices=list(TARGET_DTYPES), help="the target's dtype (see load_target)")
  p.add_argument("--kv-dtype", default=None, help="KV cache dtypes to profile side by side, e.g. float32,int8 (of "
                 f"{', '.join(KV_DTYPES)}; default the activations' dtype); ratios are over the first")
  p.add_argument("--contexts", default="1024,4096,8192")
  p.add_argument("--rows", default="1,9,16")
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--skip-stages", action="store_true", help="skip the float attention stages table")
  p.add_argument("--out", default=None, help="write the table as JSON here")
  a = p.parse_args()
  parse_rope_scaling(a.rope_scaling)
  model = load_target(a.model, rope_scaling=a.rope_scaling, dtype=a.dtype)
  kv_dtypes = a.kv_dtype.split(",") if a.kv_dtype else [model.kv_dtype]
  graphdef, params = nnx.split(model)
  models = {kv: nnx.merge(graphdef, params).with_kv_dtype(kv) for kv in kv_dtypes}
  contexts = [int(x) for x in a.contexts.split(",")]
  rows = [int(x) for x in a.rows.split(",")]
  floors = machine_floors(a.repeats)
  table = profile(models, contexts, rows, a.repeats)
  decode_ms = {(r["kv_dtype"], r["context"]): r["pass_ms"] for r in table if r["rows"] == 1}
  print(f"machine: read {floors['read_gb_per_s']:.1f} GB/s, fp32 matmul {floors['matmul_gflop_per_s']:.0f} GFLOP/s; "
        f"model {a.model or 'shipped'} {a.dtype}")
  print(f"{'kv':>8} {'ctx':>6} {'rows':>4} {'pass':>7} {'layers':>7} {'attn':>7} {'lm_head':>7} {'x decode':>8} "
        f"{'mem floor':>9} {'flop floor':>10} {'pass/1st':>8} {'attn/1st':>8}")
  for r in table:
    r["mem_floor_ms"] = round((r["weight_bytes"] + r["kv_bytes"]) / floors["read_gb_per_s"] / 1e6, 2)
    r["flop_floor_ms"] = round(r["flops"] / floors["matmul_gflop_per_s"] / 1e6, 2)
    decode = decode_ms.get((r["kv_dtype"], r["context"]))
    r["over_decode"] = round(r["pass_ms"] / decode, 3) if decode else None
    print(f"{r['kv_dtype']:>8} {r['context']:>6} {r['rows']:>4} {r['pass_ms']:>7.1f} {r['layers_ms']:>7.1f} "
          f"{r['attention_ms']:>7.1f} {r['lm_head_ms']:>7.1f} {r['over_decode'] or float('nan'):>8.2f} "
          f"{r['mem_floor_ms']:>9.1f} {r['flop_floor_ms']:>10.1f} {r['pass_ratio']:>8.3f} {r['attention_ratio']:>8.3f}")
  if a.skip_stages:
    parts = []
  else:
    parts = attention_parts(model, contexts, [t for t in rows if t > 1] or rows, a.repeats)
  if parts:
    print(f"attention stages, all layers (ms): {'ctx':>6} {'rows':>4} {'scores':>7} {'softmax':>7} {'values':>7} "
          f"{'product GFLOP/s':>15}")
    for r in parts:
      r["product_gflop_per_s"] = round(r["product_flops"] / r["scores_ms"] / 1e6, 1)
      print(f"{'':>34} {r['context']:>6} {r['rows']:>4} {r['scores_ms']:>7.1f} {r['softmax_ms']:>7.1f} "
            f"{r['values_ms']:>7.1f} {r['product_gflop_per_s']:>15.1f}")
  if a.out:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"model": a.model or "shipped", "rope_scaling": a.rope_scaling,
                                       "dtype": a.dtype, "kv_dtypes": kv_dtypes, "machine": platform.machine(),
                                       "cpus": jax.device_count(),
                                       "jax": jax.__version__, **floors, "table": table,
                                       "attention_stages": parts}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
