"""Query-scaled (top-k) attention: reference semantics, TPU/GPU kernels in interpret mode, lowering from CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from longspec_jax.pallas_kernels import (
    BlockSizes,
    check_lowering,
    merge_attention_views,
    length_masked_attention,
    reference_length_masked_attention,
    select_chunks,
    sharpdraft_rho,
    sparse_chunk_attention,
)

SD = jax.ShapeDtypeStruct
INTERPRET = {"tpu": pltpu.InterpretParams(), "gpu": True}
# Small blocks so that every kernel takes several steps (and GPU splits) on tiny shapes.
BLOCKS = {"tpu": BlockSizes(block_kv=32, chunks_per_step=2), "gpu": BlockSizes(block_kv=16, chunks_per_step=2,
                                                                                num_splits=2)}


def make_inputs(b, tq, hq, hkv, d, s, dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, tq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
  return q, k, v


# Compile time dominates these tiny tests; skipping LLVM's optimisations roughly halves it (this jit only).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit_call(fn, *args, **opts):
  """Runs fn under one jit: eager mode would compile every small op separately (slow on 2 cores)."""
  return jax.jit(functools.partial(fn, **opts), compiler_options=FAST_COMPILE)(*args)


def max_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  both_inf = np.isneginf(a) & np.isneginf(b)
  return float(np.max(np.abs(np.where(both_inf, 0.0, a) - np.where(both_inf, 0.0, b))))


# (b, tq, hq, hkv, d, s, lengths, options); lengths include an empty and a 1-key sequence.
CASES = {
    "gqa1_dense_rho1": (2, 4, 2, 2, 64, 64, [64, 17], {}),
    "gqa2_dense_rho_given": (2, 3, 4, 2, 128, 96, [0, 50], {"rho": jnp.array([1.0, 1.5, 2.0, 1.25])}),
    "gqa4_topk_fixed_slope": (2, 2, 4, 1, 64, 128, [128, 1], {"top_k": 3, "chunk_size": 8, "window_chunks": 2,
                                                              "alpha": jnp.array([0.2, 0.4, 0.0, 0.8]), "n0": 16.0}),
    # 3 kv heads of 64 lanes: the TPU kernel's lane block is the whole 192-lane row.
    "gqa2_topk_scores_rho": (2, 1, 6, 3, 64, 128, [100, 30], {"top_k": 3, "chunk_size": 16, "window_chunks": 1,
                                                              "rho": 1.7, "chunk_scores": "random"}),
}


def case_args(name, dtype=jnp.float32):
  b, tq, hq, hkv, d, s, lengths, opts = CASES[name]
  q, k, v = make_inputs(b, tq, hq, hkv, d, s, dtype)
  opts = dict(opts)
  if opts.get("chunk_scores") == "random":
    opts["chunk_scores"] = jax.random.normal(jax.random.key(7), (b, hkv, s // opts["chunk_size"]))
  return (q, k, v, jnp.array(lengths, jnp.int32)), opts


@functools.lru_cache(maxsize=None)
def reference_result(name):
  args, opts = case_args(name)
  return jit_call(reference_length_masked_attention, *args, **opts)


def naive_attention(q, k, v, lengths, scale):
  """Per-row loops in numpy: the definition the reference must match (rho folded into scale [B, Hq])."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, tq, hq, d = q.shape
  g = hq // k.shape[2]
  out, lse = np.zeros(q.shape), np.full((b, tq, hq), -np.inf)
  for bi in range(b):
    n = int(lengths[bi])
    for t in range(tq):
      for h in range(hq):
        if n == 0:
          continue
        logits = scale[bi, h] * (k[bi, :n, h // g] @ q[bi, t, h])
        mx = logits.max()
        w = np.exp(logits - mx)
        out[bi, t, h] = w @ v[bi, :n, h // g] / w.sum()
        lse[bi, t, h] = mx + np.log(w.sum())
  return out, lse


def test_reference_matches_naive_loops_with_rho_and_fixed_slope():
  q, k, v = make_inputs(2, 3, 4, 2, 16, 40)
  lengths = np.array([40, 0])
  rho = np.array([[1.0, 2.0, 1.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
  out, lse = jit_call(reference_length_masked_attention, q, k, v, jnp.array(lengths), rho=jnp.array(rho))
  nout, nlse = naive_attention(q, k, v, lengths, rho * 16 ** -0.5)
  assert max_err(out, nout) < 1e-5 and max_err(lse, nlse) < 1e-5
  assert np.all(np.asarray(out)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))

  alpha = np.array([0.3, 0.0, 1.0, 0.5])
  out, lse = jit_call(reference_length_masked_attention, q, k, v, jnp.array(lengths), alpha=jnp.array(alpha),
                      n0=10.0)
  rho = np.maximum(1.0, 1.0 + alpha * np.log(np.maximum(lengths, 1)[:, None] / 10.0))
  nout, nlse = naive_attention(q, k, v, lengths, rho * 16 ** -0.5)
  assert max_err(out, nout) < 1e-5 and max_err(lse, nlse) < 1e-5


def test_sharpdraft_rho_fixed_slope():
  rho = np.asarray(sharpdraft_rho(jnp.array([0, 5, 100, 100 * np.e]), 0.5, 100.0))
  np.testing.assert_allclose(rho, [1.0, 1.0, 1.0, 1.5], rtol=1e-6)


def test_select_chunks_sink_window_topk():
  # 8 chunks of 4 keys; sequence 0 has 30 valid keys (chunks 0..7), sequence 1 has 9 (chunks 0..2).
  q, k, _ = make_inputs(2, 2, 2, 1, 8, 32)
  scores = jnp.tile(jnp.array([9.0, 1.0, 7.0, 3.0, 8.0, 2.0, 6.0, 5.0]), (2, 1, 1))
  idx = np.asarray(jit_call(select_chunks, q, k, jnp.array([30, 9]), chunk_size=4, top_k=3, window_chunks=2,
                            chunk_scores=scores))
  # sink 0; window = chunks 6, 7; best of chunks 1..5 by score: 4 (8.0), 2 (7.0), 3 (3.0).
  np.testing.assert_array_equal(idx[0, 0], [0, 6, 7, 4, 2, 3])
  # window = chunks 1, 2; no candidate chunk left for top-k -> empty slots.
  np.testing.assert_array_equal(idx[1, 0], [0, 1, 2, -1, -1, -1])
  empty = np.asarray(jit_call(select_chunks, q, k, jnp.array([0, 3]), chunk_size=4, top_k=1, window_chunks=1))
  np.testing.assert_array_equal(empty[:, 0], [[-1, -1, -1], [0, -1, -1]])


def test_topk_mean_key_scores_pick_the_matching_chunk():
  # The block's mean query equals the keys of chunk 5, so chunk 5 must win the single top-k slot.
  d, c = 16, 4
  q, k, _ = make_inputs(1, 2, 2, 1, d, 32)
  target = jax.random.normal(jax.random.key(3), (d,)) * 4
  k = k.at[0, 5 * c:6 * c, 0].set(target)
  q = jnp.broadcast_to(target, q.shape)
  idx = np.asarray(jit_call(select_chunks, q, k, jnp.array([32]), chunk_size=c, top_k=1, window_chunks=1))
  np.testing.assert_array_equal(idx[0, 0], [0, 7, 5])


def test_topk_equals_dense_when_everything_is_selected():
  q, k, v = make_inputs(2, 2, 4, 2, 16, 64)
  lengths = jnp.array([64, 21])
  dense = jit_call(reference_length_masked_attention, q, k, v, lengths, rho=1.3)
  topk = jit_call(reference_length_masked_attention, q, k, v, lengths, rho=1.3, top_k=6, chunk_size=8,
                  window_chunks=1)
  assert max_err(dense[0], topk[0]) < 1e-6 and max_err(dense[1], topk[1]) < 1e-6


@pytest.mark.parametrize("name", [n for n in CASES if "topk" in n])
def test_dispatch_reference_path_matches_reference(name):
  # In top-k mode the dispatcher's CPU path gathers the selected chunks (O(budget)); the reference masks all keys.
  args, opts = case_args(name)
  out, lse = jit_call(length_masked_attention, *args, impl="reference", **opts)
  rout, rlse = reference_result(name)
  assert max_err(out, rout) < 1e-5 and max_err(lse, rlse) < 1e-5


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpret_matches_reference(impl, name):
  args, opts = case_args(name)
  rout, rlse = reference_result(name)
  out, lse = jit_call(length_masked_attention, *args, impl=impl, interpret=INTERPRET[impl], block_sizes=BLOCKS[impl],
                      **opts)
  assert out.shape == rout.shape and out.dtype == rout.dtype and lse.dtype == jnp.float32
  assert max_err(out, rout) < 2e-5, max_err(out, rout)
  assert max_err(lse, rlse) < 2e-5, max_err(lse, rlse)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rlse)))


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernel_interpret_bf16_default_blocks(impl):
  args, opts = case_args("gqa4_topk_fixed_slope", jnp.bfloat16)
  rout, rlse = jit_call(reference_length_masked_attention, *args, **opts)
  out, lse = jit_call(length_masked_attention, *args, impl=impl, interpret=INTERPRET[impl], **opts)
  assert out.dtype == jnp.bfloat16
  assert max_err(out, rout) < 3e-2 and max_err(lse, rlse) < 3e-2


def test_merge_attention_views_is_exact():
  # Two disjoint chunk sets attended separately and merged equal attention over their union.
  q, k, v = make_inputs(2, 3, 4, 2, 16, 64)
  lengths = jnp.array([64, 20])
  a = jnp.broadcast_to(jnp.array([0, 2, 5]), (2, 2, 3))
  b = jnp.broadcast_to(jnp.array([1, 7, -1]), (2, 2, 3))
  union = jnp.concatenate([a, b], axis=-1)
  attend = functools.partial(sparse_chunk_attention, chunk_size=8, rho=1.5, impl="reference")
  views = [jit_call(attend, q, k, v, lengths, idx) for idx in (a, b)]
  out, lse = merge_attention_views([o for o, _ in views], [l for _, l in views])
  rout, rlse = jit_call(attend, q, k, v, lengths, union)
  assert max_err(out, rout) < 1e-5 and max_err(lse, rlse) < 1e-5
  # A view with no keys (lse = -inf) weighs nothing; all-empty stays empty instead of nan.
  empty_out, empty_lse = jnp.zeros_like(rout), jnp.full_like(rlse, -jnp.inf)
  out, lse = merge_attention_views([rout, empty_out], [rlse, empty_lse])
  assert max_err(out, rout) < 1e-6 and max_err(lse, rlse) < 1e-6
  out, lse = merge_attention_views([empty_out, empty_out], [empty_lse, empty_lse])
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_auto_on_cpu_uses_reference_even_for_shapes_no_kernel_takes():
  assert jax.default_backend() == "cpu"
  q, k, v = make_inputs(1, 2, 2, 1, 24, 20)  # head_dim 24 and kv_len 20: no GPU kernel, no TPU 8-divisor
  out = jit_call(length_masked_attention, q, k, v, jnp.array([13]), block_sizes=BlockSizes(block_kv=16))
  ref = jit_call(reference_length_masked_attention, q, k, v, jnp.array([13]))
  assert max_err(out[0], ref[0]) == 0 and max_err(out[1], ref[1]) == 0


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v, n: length_masked_attention(q[0], k, v, n), "q must be"),
    (lambda q, k, v, n: length_masked_attention(q, k, v[:, :-1], n), "equal shapes"),
    (lambda q, k, v, n: length_masked_attention(q[..., :3, :], k, v, n), "multiple of kv_heads"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n[:1]), "lengths must have shape"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, rho=1.2, alpha=0.1, n0=8.0), "not both"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, alpha=0.1), "n0 > 0"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, rho=jnp.ones(3)), "rho must broadcast"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, impl="cuda"), "impl must be one of"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, top_k=2, chunk_size=24), "multiple of chunk_size"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, top_k=8, chunk_size=8), "exceeds"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, top_k=2, chunk_scores=jnp.ones((2, 2, 3))),
     "chunk_scores must have shape"),
    (lambda q, k, v, n: length_masked_attention(q, k.astype(jnp.bfloat16), v, n), "share a dtype"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, impl="tpu", top_k=1, chunk_size=4), "multiple of 8"),
    (lambda q, k, v, n: length_masked_attention(q, k, v, n, impl="gpu", block_sizes=BlockSizes(block_kv=24)),
     "power of two"),
    (lambda q, k, v, n: BlockSizes(block_kv=0), "positive int"),
])
def test_bad_inputs_raise_clear_errors(call, match):
  q, k, v = make_inputs(2, 2, 4, 2, 16, 64)
  with pytest.raises(ValueError, match=match):
    call(q, k, v, jnp.array([64, 3]))


# Drafter-like shapes for export: block of 16 rows, 4K keys.
LOWERING_CASES = {
    "dense_bf16_d128": (jnp.bfloat16, 128, 2, 8, {}),
    "fixed_slope_f32_d64_gqa4": (jnp.float32, 64, 2, 8, {"alpha": 0.3, "n0": 1024.0}),
    "topk_bf16_d64": (jnp.bfloat16, 64, 4, 8, {"top_k": 64, "chunk_size": 8, "window_chunks": 4, "rho": 1.2}),
    "topk_bf16_d128_chunk128": (jnp.bfloat16, 128, 1, 4, {"top_k": 4, "chunk_size": 128, "window_chunks": 2}),
}
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", list(LOWERING_CASES))
def test_kernel_lowers_for_platform(platform, name):
  dtype, d, hkv, hq, opts = LOWERING_CASES[name]
  b, s = 2, 4096
  args = (SD((b, 16, hq, d), dtype), SD((b, s, hkv, d), dtype), SD((b, s, hkv, d), dtype), SD((b,), jnp.int32))
  impl = "tpu" if platform == "tpu" else "gpu"
  exported = check_lowering(functools.partial(length_masked_attention, impl=impl, **opts), platform, *args)
  assert CUSTOM_CALL[platform] in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(b, 16, hq, d), (b, 16, hq)]


def _topk_inside_kernel(x_ref, o_ref):
  o_ref[...], _ = lax.top_k(x_ref[...], 8)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowering_check_catches_a_non_lowerable_kernel(platform):
  params = {} if platform == "tpu" else {"compiler_params": plgpu.CompilerParams()}
  bad = pl.pallas_call(_topk_inside_kernel, out_shape=SD((8, 8), jnp.float32), **params)
  with pytest.raises(NotImplementedError, match="top_k"):
    check_lowering(bad, platform, SD((8, 128), jnp.float32))
