"""Micro-benchmark of the Pallas kernels against the jnp reference path at drafter shapes.

On a TPU or GPU: times kernel and reference (jitted, median of --iters runs) for a draft block of 16 query
rows against n = 1K..64K keys, head_dim 64 and 128, and prints reference/kernel ratios. On CPU there is no
kernel to time: it times the reference only (sizes capped by --cpu-max-n) and, with --interpret-check,
runs every kernel in Pallas interpret mode on a tiny shape to report its max error (correctness only).

  python scripts/bench_kernels.py                       # accelerator: full table
  python scripts/bench_kernels.py --interpret-check     # CPU: reference timings + interpret-mode errors
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.pallas_kernels import (gather_kv_chunks, length_masked_attention, num_selected_chunks,
                                        sparse_chunk_attention)

KERNELS = ("qsa_dense", "qsa_topk", "gather", "sparse_attn")


def make_case(n, d, *, batch, q_len, q_heads, kv_heads, budget, chunk, window_chunks, dtype, seed=0):
  """Inputs for every kernel: full cache of n keys (all valid except a ragged last sequence)."""
  kq, kk, kv, ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, q_len, q_heads, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (batch, n, kv_heads, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (batch, n, kv_heads, d), jnp.float32).astype(dtype)
  lengths = jnp.full((batch,), n, jnp.int32).at[-1].set(max(1, n - n // 3))
  n_chunks = n // chunk
  n_sel = min(num_selected_chunks(budget, chunk), n_chunks)
  top_k = max(0, min(n_sel - 1 - window_chunks, n_chunks - 1))
  scores = jax.random.normal(ks, (batch, kv_heads, n_chunks))  # stands in for cached chunk summaries
  rng = np.random.default_rng(seed)
  idx = np.stack([np.stack([rng.permutation(n_chunks)[:n_sel] for _ in range(kv_heads)]) for _ in range(batch)])
  return dict(q=q, k=k, v=v, lengths=lengths, idx=jnp.asarray(idx, jnp.int32), scores=scores, top_k=top_k,
              chunk=chunk, window_chunks=window_chunks)


def kernel_fns(c, impl, interpret=False):
  """name -> (function of positional arrays, its arguments). impl "reference" is the jnp path the dispatcher
  falls back to (in top-k/sparse mode it gathers the selected chunks instead of masking every key)."""
  qsa = functools.partial(length_masked_attention, impl=impl, interpret=interpret)
  gather = functools.partial(gather_kv_chunks, impl=impl, interpret=interpret)
  sparse = functools.partial(sparse_chunk_attention, impl=impl, interpret=interpret)
  topk = dict(top_k=c["top_k"], chunk_size=c["chunk"], window_chunks=c["window_chunks"])
  attn = (c["q"], c["k"], c["v"], c["lengths"])
  return {
      "qsa_dense": (lambda q, k, v, n: qsa(q, k, v, n, alpha=0.3, n0=512.0), attn),
      "qsa_topk": (lambda q, k, v, n, s: qsa(q, k, v, n, alpha=0.3, n0=512.0, chunk_scores=s, **topk),
                   attn + (c["scores"],)),
      "gather": (lambda k, v, i: gather(k, v, i, chunk_size=c["chunk"]), (c["k"], c["v"], c["idx"])),
      "sparse_attn": (lambda q, k, v, n, i: sparse(q, k, v, n, i, chunk_size=c["chunk"], rho=1.2),
                      attn + (c["idx"],)),
  }


def time_fn(fn, args, iters):
  f = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def max_error(a, b):
  diffs = []
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    both_inf = np.isneginf(x) & np.isneginf(y)
    diffs.append(np.max(np.abs(np.where(both_inf, 0, x) - np.where(both_inf, 0, y))))
  return float(max(diffs))


def interpret_check():
  print("\n== interpret mode on CPU: correctness only (tiny shape, timings meaningless) ==")
  c = make_case(256, 64, batch=2, q_len=4, q_heads=4, kv_heads=2, budget=64, chunk=8, window_chunks=2,
                dtype=jnp.float32)
  ref = {name: jax.jit(fn)(*a) for name, (fn, a) in kernel_fns(c, "reference").items()}
  errors = {}
  for impl in ("tpu", "gpu"):
    for name, (fn, a) in kernel_fns(c, impl, interpret=True).items():
      errors[f"{impl}/{name}"] = max_error(jax.jit(fn)(*a), ref[name])
      print(f"  {impl:3s} {name:12s} max |kernel - reference| = {errors[f'{impl}/{name}']:.2e}")
  return errors


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="1024,4096,16384,65536", help="key counts n")
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--q-len", type=int, default=16, help="draft block rows")
  p.add_argument("--q-heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--budget", type=int, default=2048, help="sparse KV budget (keys)")
  p.add_argument("--chunk", type=int, default=8)
  p.add_argument("--window-chunks", type=int, default=8)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--cpu-max-n", type=int, default=4096, help="largest n timed on CPU (reference only)")
  p.add_argument("--kernels", default=",".join(KERNELS))
  p.add_argument("--interpret-check", action="store_true", help="also run kernels in interpret mode (tiny shape)")
  p.add_argument("--json", metavar="OUT", help="also write the rows (and, on an accelerator, each kernel's max "
                                               "|kernel - reference| compiled for real) here")
  args = p.parse_args()
  names = [n for n in args.kernels.split(",") if n]
  unknown = set(names) - set(KERNELS)
  if unknown:
    p.error(f"unknown kernels {sorted(unknown)}; choose from {KERNELS}")

  backend = jax.default_backend()
  impl = {"tpu": "tpu", "gpu": "gpu"}.get(backend)
  sizes = [int(x) for x in args.sizes.split(",")]
  if impl is None:
    print(f"backend {backend}: the Pallas kernels need a TPU or GPU; timing the jnp reference only"
          f" (n <= {args.cpu_max_n}).")
    sizes = [n for n in sizes if n <= args.cpu_max_n]
  print(f"device {jax.devices()[0].device_kind}, dtype {args.dtype}, batch {args.batch}, q_len {args.q_len}, "
        f"heads {args.q_heads}/{args.kv_heads}, budget {args.budget}, chunk {args.chunk}")
  print(f"{'kernel':12s} {'n':>6s} {'D':>4s} {'reference ms':>13s} {'kernel ms':>10s} {'ref/kernel':>10s} "
        f"{'max err':>9s}")
  rows = []
  for d in [int(x) for x in args.head_dims.split(",")]:
    for n in sizes:
      c = make_case(n, d, batch=args.batch, q_len=args.q_len, q_heads=args.q_heads, kv_heads=args.kv_heads,
                    budget=args.budget, chunk=args.chunk, window_chunks=args.window_chunks,
                    dtype=jnp.dtype(args.dtype))
      refs = kernel_fns(c, "reference")
      kers = kernel_fns(c, impl) if impl else {}
      for name in names:
        t_ref = time_fn(*refs[name], args.iters) * 1e3
        row = {"kernel": name, "n": n, "head_dim": d, "reference_ms": t_ref}
        if impl:
          t_ker = time_fn(*kers[name], args.iters) * 1e3
          err = max_error(jax.jit(kers[name][0])(*kers[name][1]), jax.jit(refs[name][0])(*refs[name][1]))
          row.update(kernel_ms=t_ker, max_error=err)
          print(f"{name:12s} {n:6d} {d:4d} {t_ref:13.3f} {t_ker:10.3f} {t_ref / t_ker:10.2f} {err:9.2e}")
        else:
          print(f"{name:12s} {n:6d} {d:4d} {t_ref:13.3f} {'n/a':>10s} {'n/a':>10s} {'n/a':>9s}")
        rows.append(row)
  interpret = interpret_check() if args.interpret_check else None
  if args.json:
    import json
    from pathlib import Path
    Path(args.json).write_text(json.dumps({"backend": backend, "device": jax.devices()[0].device_kind,
                                           "dtype": args.dtype, "rows": rows, "interpret_errors": interpret},
                                          indent=1))


if __name__ == "__main__":
  main()
