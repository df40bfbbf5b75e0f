"""Per-step costs of the decode loop's small ops on this machine (jitted, medians): token sampling over the
vocabulary, and the target's attention over a static cache (all layers of the shipped target's shape), as written
in `longspec_jax.attention.cached_attention` (one single-batch-dim product per KV head) and as one product with
(batch, kv_head) batch dims (its earlier layout). With the memory-bandwidth floor of reading the cache once.

  python scripts/bench_decode_ops.py --cache-len 18432 --rows 1,9
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.inference.bench import _timed
from longspec_jax.attention import cached_attention, masked_attention
from longspec_jax.sampling import SamplingParams, processed_log_probs, sample_token


def median_ms(fn, *args, repeats: int = 20) -> float:
  return 1000 * _timed(lambda: jax.block_until_ready(fn(*args)), repeats)[1]


def two_batch_dim_attention(q, k_cache, v_cache, q_positions):
  """cached_attention's maths as one product with (batch, kv_head) batch dims (its layout before it moved to one
  product per KV head)."""
  visible = jnp.arange(k_cache.shape[1])[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
  return masked_attention(q, k_cache, v_cache, visible)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--cache-len", type=int, default=18432)
  p.add_argument("--rows", default="1,9", help="query rows per step: 1 = AR decode, K+1 = verify")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--q-heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=8192)
  a = p.parse_args()
  key = jax.random.key(0)

  print("sampling (ms per call):")
  for shape in [(1, a.vocab), (1, 9, a.vocab)]:
    logits = jax.random.normal(key, shape)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 50, 1.0), (0.7, 0, 0.9)]:
      sp = SamplingParams.make(temperature, top_k, top_p)
      if len(shape) == 2:
        ms = median_ms(jax.jit(sample_token), key, logits, sp)
        what = "sample_token"
      else:
        ms = median_ms(jax.jit(processed_log_probs), logits, sp)
        what = "processed_log_probs"
      print(f"  {what} {list(shape)} T={temperature} top_k={top_k} top_p={top_p}: {ms:.2f}")

  s, n_layers = a.cache_len, a.layers
  ck = jax.random.normal(key, (n_layers, 1, s, a.kv_heads, a.head_dim), jnp.float32)
  cv = jax.random.normal(jax.random.key(1), ck.shape, jnp.float32)
  floor_ms = 1000 * 2 * ck.nbytes / _read_bandwidth()
  print(f"attention over a [{n_layers} layers, 1, {s}, {a.kv_heads}, {a.head_dim}] fp32 cache (ms per step; "
        f"reading K and V once: ~{floor_ms:.0f} ms):")
  for t in map(int, a.rows.split(",")):
    q = jax.random.normal(key, (1, t, a.q_heads, a.head_dim), jnp.float32)
    pos = jnp.full((1, t), s - 2 * t, jnp.int32) + jnp.arange(t)[None]
    all_layers = lambda attn: jax.jit(lambda q, ck, cv, pos: sum(
        attn(q, ck[li], cv[li], pos).sum() for li in range(n_layers)))
    ref = np.asarray(jax.jit(cached_attention)(q, ck[0], cv[0], pos))
    np.testing.assert_allclose(np.asarray(jax.jit(two_batch_dim_attention)(q, ck[0], cv[0], pos)), ref, atol=1e-4)
    print(f"  rows={t}: cached_attention (one product per KV head) "
          f"{median_ms(all_layers(cached_attention), q, ck, cv, pos):.1f}, (batch, kv_head) batch dims "
          f"{median_ms(all_layers(two_batch_dim_attention), q, ck, cv, pos):.1f}")
  return 0


def _read_bandwidth() -> float:
  """Bytes/s of one pass over a 75 MB array with numpy (median of 10)."""
  x = np.ones(75 * 2 ** 20 // 4, np.float32)
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    x.sum()
    times.append(time.perf_counter() - t0)
  return x.nbytes / statistics.median(times)


if __name__ == "__main__":
  raise SystemExit(main())
