"""SmolLM2-shaped weight products (30 layers of fused qkv / o / gate-up / down + the tied LM head) for R rows, as
jitted programs: fp32 weights, bf16 weights with x rounded to bf16, and bf16 weights with x split hi + lo
(`longspec_jax.model.matmul`); plus each variant's error against a float64 product of the fp32 x. Median ms of 9.

  python results/verify_pass/bf16_products.py > results/verify_pass/bf16_products.log
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.model import matmul

H, I, V, L = 576, 1536, 49152, 30
rng = np.random.default_rng(0)
shapes = [(H, H + 2 * 192), (H, H), (H, 2 * I), (I, H)]
layers32 = [[jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32) for s in shapes] for _ in range(L)]
head32 = jnp.asarray(rng.standard_normal((V, H)) * 0.02, jnp.float32)
layers16 = [[w.astype(jnp.bfloat16) for w in ws] for ws in layers32]
head16 = head32.astype(jnp.bfloat16)


def rounded(x, w, spec):
  return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def forward(mm):
  def f(layers, head, x):
    for wqkv, wo, wgu, wd in layers:
      qkv = mm(x, wqkv, "ri,io->ro")
      x = x + mm(qkv[:, :H], wo, "ri,io->ro")
      gu = mm(x, wgu, "ri,io->ro")
      x = x + mm(jax.nn.silu(gu[:, :I]) * gu[:, I:], wd, "ri,io->ro")
    return mm(x, head, "rh,vh->rv")
  return jax.jit(f)


variants = {"fp32": (forward(matmul), layers32, head32), "bf16, x rounded": (forward(rounded), layers16, head16),
            "bf16, x hi+lo": (forward(matmul), layers16, head16)}
x1 = jnp.asarray(rng.standard_normal((8, H)), jnp.float32)
w16 = np.asarray(layers16[0][2], np.float64)
want = np.asarray(x1, np.float64) @ w16
for name, mm in (("x rounded", rounded), ("x hi+lo", matmul)):
  for r in (1, 8):
    got = np.asarray(jax.jit(lambda x, w: mm(x, w, "ri,io->ro"))(x1[:r], layers16[0][2]))
    print(f"one [{H}x{2 * I}] bf16 product, {name}, {r} rows: max error / max |y| = "
          f"{np.abs(got - want[:r]).max() / np.abs(want).max():.2e}", flush=True)
print("rows " + " ".join(f"{r:>7d}" for r in (1, 2, 4, 8, 16)) + "   (ms, median of 9)")
for name, (f, layers, head) in variants.items():
  row = []
  for r in (1, 2, 4, 8, 16):
    x = jnp.asarray(rng.standard_normal((r, H)), jnp.float32)
    f(layers, head, x).block_until_ready()
    ts = []
    for _ in range(9):
      t = time.perf_counter()
      f(layers, head, x).block_until_ready()
      ts.append(time.perf_counter() - t)
    row.append(np.median(ts) * 1e3)
  print(f"{name:16s} " + " ".join(f"{v:7.1f}" for v in row), flush=True)
