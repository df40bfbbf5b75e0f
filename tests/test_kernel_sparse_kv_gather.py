"""Sparse KV gather and attention over selected chunks: kernels in interpret mode vs reference, lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from longspec_jax.pallas_kernels import (
    BlockSizes,
    check_lowering,
    chunk_positions,
    gather_kv_chunks,
    num_selected_chunks,
    reference_gather_kv_chunks,
    reference_length_masked_attention,
    reference_sparse_chunk_attention,
    sparse_chunk_attention,
)
from longspec_jax.pallas_kernels.length_masked_attention.reference import key_masked_attention

SD = jax.ShapeDtypeStruct
INTERPRET = {"tpu": pltpu.InterpretParams(), "gpu": True}
# Compile time dominates these tiny tests; skipping LLVM's optimisations roughly halves it (this jit only).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit_call(fn, *args, **opts):
  return jax.jit(functools.partial(fn, **opts), compiler_options=FAST_COMPILE)(*args)


def make_inputs(b, tq, hq, hkv, d, s, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(kq, (b, tq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
  return q, k, v


def random_idx(b, hkv, n_sel, n_chunks, seed, n_empty=1):
  """Distinct chunk indices per (sequence, kv head), the last `n_empty` slots empty (-1)."""
  rng = np.random.default_rng(seed)
  idx = np.stack([np.stack([rng.permutation(n_chunks)[:n_sel] for _ in range(hkv)]) for _ in range(b)])
  idx[..., n_sel - n_empty:] = -1
  return jnp.asarray(idx, jnp.int32)


def max_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  both_inf = np.isneginf(a) & np.isneginf(b)
  return float(np.max(np.abs(np.where(both_inf, 0.0, a) - np.where(both_inf, 0.0, b))))


def test_num_selected_chunks_and_positions():
  assert num_selected_chunks(100, 8) == 12
  with pytest.raises(ValueError, match="smaller than one chunk"):
    num_selected_chunks(4, 8)
  pos = np.asarray(chunk_positions(jnp.array([[[2, -1, 0]]]), 4))
  np.testing.assert_array_equal(pos[0, 0], [8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3])


def test_reference_gather_copies_the_selected_chunks():
  _, k, v = make_inputs(1, 1, 2, 2, 4, 32)
  idx = jnp.array([[[3, -1], [0, 1]]])
  k_sel, v_sel = jit_call(reference_gather_kv_chunks, k, v, idx, chunk_size=8)
  np.testing.assert_array_equal(k_sel[0, :8, 0], k[0, 24:32, 0])
  np.testing.assert_array_equal(v_sel[0, :, 1], v[0, :16, 1])
  assert np.all(np.asarray(k_sel[0, 8:, 0]) == 0)


# (b, hkv, d, s, chunk, n_sel, chunks_per_step, dtype): n_sel not a multiple of chunks_per_step in most.
GATHER_CASES = {
    "d64_c8_sel5_step2_f32": (2, 2, 64, 128, 8, 5, 2, jnp.float32),
    "d128_c16_sel3_step4_bf16": (1, 3, 128, 128, 16, 3, 4, jnp.bfloat16),
    "d64_c8_sel12_default_bf16": (2, 1, 64, 256, 8, 12, None, jnp.bfloat16),
}


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(GATHER_CASES))
def test_gather_kernel_interpret_matches_reference(impl, name):
  b, hkv, d, s, c, n_sel, per_step, dtype = GATHER_CASES[name]
  _, k, v = make_inputs(b, 1, hkv, hkv, d, s, dtype)
  idx = random_idx(b, hkv, n_sel, s // c, seed=n_sel)
  blocks = None if per_step is None else BlockSizes(chunks_per_step=per_step)
  k_ref, v_ref = jit_call(reference_gather_kv_chunks, k, v, idx, chunk_size=c)
  k_sel, v_sel = jit_call(gather_kv_chunks, k, v, idx, chunk_size=c, impl=impl, interpret=INTERPRET[impl],
                          block_sizes=blocks)
  assert k_sel.shape == (b, n_sel * c, hkv, d) and k_sel.dtype == dtype
  # A gather is a copy: exact, including the zeroed empty slots.
  np.testing.assert_array_equal(np.asarray(k_sel, np.float32), np.asarray(k_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(v_sel, np.float32), np.asarray(v_ref, np.float32))


# (b, tq, hq, hkv, d, s, chunk, n_sel, lengths, options)
ATTN_CASES = {
    "gqa1_c8_rho1": (2, 2, 2, 2, 64, 128, 8, 5, [128, 45], {}),
    "gqa2_c16_rho_given": (2, 3, 4, 2, 128, 128, 16, 3, [70, 0], {"rho": jnp.array([[1.0, 2.0, 1.5, 1.1]])}),
    "gqa4_c8_fixed_slope": (1, 4, 8, 2, 64, 256, 8, 7, [200], {"alpha": 0.6, "n0": 8.0}),
}
BLOCKS = {"tpu": BlockSizes(chunks_per_step=2), "gpu": BlockSizes(chunks_per_step=2, num_splits=2)}


def attn_args(name, dtype=jnp.float32):
  b, tq, hq, hkv, d, s, c, n_sel, lengths, opts = ATTN_CASES[name]
  q, k, v = make_inputs(b, tq, hq, hkv, d, s, dtype)
  idx = random_idx(b, hkv, n_sel, s // c, seed=len(name))
  return (q, k, v, jnp.array(lengths, jnp.int32), idx), dict(opts, chunk_size=c)


@functools.lru_cache(maxsize=None)
def reference_result(name):
  args, opts = attn_args(name)
  return jit_call(reference_sparse_chunk_attention, *args, **opts)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_fused_sparse_attention_interpret_matches_reference(impl, name):
  args, opts = attn_args(name)
  rout, rlse = reference_result(name)
  out, lse = jit_call(sparse_chunk_attention, *args, impl=impl, interpret=INTERPRET[impl], block_sizes=BLOCKS[impl],
                      **opts)
  assert max_err(out, rout) < 2e-5, max_err(out, rout)
  assert max_err(lse, rlse) < 2e-5, max_err(lse, rlse)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rlse)))


def test_reference_sparse_attention_equals_masking_the_full_cache():
  # Independent formulation: attend over the whole cache with all keys outside the chunks masked.
  (q, k, v, lengths, idx), opts = attn_args("gqa2_c16_rho_given")
  out, lse = reference_result("gqa2_c16_rho_given")
  s, c = k.shape[1], opts["chunk_size"]
  in_sel = jnp.any(idx[..., None] == (jnp.arange(s) // c), axis=2) & (jnp.arange(s) < lengths[:, None, None])
  scale = jnp.broadcast_to(opts["rho"], (2, 4)) * q.shape[-1] ** -0.5
  mout, mlse = jit_call(key_masked_attention, q, k, v, in_sel, scale)
  assert max_err(out, mout) < 1e-5 and max_err(lse, mlse) < 1e-5


def test_fused_equals_attention_over_the_gathered_buffer():
  (q, k, v, lengths, idx), opts = attn_args("gqa4_c8_fixed_slope")
  out, lse = reference_result("gqa4_c8_fixed_slope")
  k_sel, v_sel = jit_call(gather_kv_chunks, k, v, idx, chunk_size=8, impl="reference")
  pos = chunk_positions(idx, 8)
  n_vis = jnp.sum((pos >= 0) & (pos < lengths[:, None, None]), axis=-1)  # [B, Hkv]
  rho = jnp.maximum(1.0, 1.0 + 0.6 * jnp.log(jnp.repeat(n_vis, 4, axis=1) / 8.0))
  gout, glse = jit_call(key_masked_attention, q, k_sel, v_sel, (pos >= 0) & (pos < lengths[:, None, None]),
                        rho * q.shape[-1] ** -0.5)
  assert max_err(out, gout) < 1e-5 and max_err(lse, glse) < 1e-5


def test_full_selection_equals_dense_attention():
  (q, k, v, lengths, _), _ = attn_args("gqa1_c8_rho1")
  every_chunk = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 2, 16))
  out, lse = jit_call(sparse_chunk_attention, q, k, v, lengths, every_chunk, chunk_size=8, impl="reference")
  dout, dlse = jit_call(reference_length_masked_attention, q, k, v, lengths)
  assert max_err(out, dout) < 1e-5 and max_err(lse, dlse) < 1e-5


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_fused_sparse_attention_interpret_bf16(impl):
  args, opts = attn_args("gqa4_c8_fixed_slope", jnp.bfloat16)
  rout, rlse = jit_call(reference_sparse_chunk_attention, *args, **opts)
  out, lse = jit_call(sparse_chunk_attention, *args, impl=impl, interpret=INTERPRET[impl], **opts)
  assert out.dtype == jnp.bfloat16
  assert max_err(out, rout) < 3e-2 and max_err(lse, rlse) < 3e-2


@pytest.mark.parametrize("call, match", [
    (lambda k, v, i: gather_kv_chunks(k, v[:, :-8], i, chunk_size=8), "equal shapes"),
    (lambda k, v, i: gather_kv_chunks(k, v, i, chunk_size=24), "multiple of chunk_size"),
    (lambda k, v, i: gather_kv_chunks(k, v, i[:, :1], chunk_size=8), "chunk_idx must have shape"),
    (lambda k, v, i: gather_kv_chunks(k, v, i.astype(jnp.float32), chunk_size=8), "must be integers"),
    (lambda k, v, i: gather_kv_chunks(k, v, i[..., :0], chunk_size=8), "at least one chunk"),
    (lambda k, v, i: gather_kv_chunks(k, v, i, chunk_size=8, impl="gpu", block_sizes=BlockSizes(chunks_per_step=3)),
     "power of two"),
    (lambda k, v, i: sparse_chunk_attention(k[:, :2], k, v, jnp.array([64]), i, chunk_size=8), "lengths"),
    (lambda k, v, i: sparse_chunk_attention(k[:, :2], k, v, jnp.array([64, 64]), i, chunk_size=4, impl="tpu"),
     "multiple of 8"),
])
def test_bad_inputs_raise_clear_errors(call, match):
  _, k, v = make_inputs(2, 1, 2, 2, 16, 64)
  idx = jnp.zeros((2, 2, 3), jnp.int32)
  with pytest.raises(ValueError, match=match):
    call(k, v, idx)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype, d, chunk", [(jnp.bfloat16, 128, 8), (jnp.float32, 64, 16)])
def test_gather_lowers_for_platform(platform, dtype, d, chunk):
  b, s, hkv, n_sel = 2, 8192, 2, 100  # budget 800 / 1600 keys, not a multiple of chunks_per_step
  impl = "tpu" if platform == "tpu" else "gpu"
  exported = check_lowering(functools.partial(gather_kv_chunks, chunk_size=chunk, impl=impl), platform,
                            SD((b, s, hkv, d), dtype), SD((b, s, hkv, d), dtype), SD((b, hkv, n_sel), jnp.int32))
  assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(b, n_sel * chunk, hkv, d)] * 2


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("dtype, d, hq, opts", [
    (jnp.bfloat16, 128, 8, {}),
    (jnp.bfloat16, 64, 16, {"alpha": 0.25, "n0": 512.0}),
])
def test_fused_sparse_attention_lowers_for_platform(platform, dtype, d, hq, opts):
  b, s, hkv, n_sel, chunk = 2, 8192, 2, 37, 8
  impl = "tpu" if platform == "tpu" else "gpu"
  fn = functools.partial(sparse_chunk_attention, chunk_size=chunk, impl=impl, **opts)
  args = (SD((b, 16, hq, d), dtype), SD((b, s, hkv, d), dtype), SD((b, s, hkv, d), dtype), SD((b,), jnp.int32),
          SD((b, hkv, n_sel), jnp.int32))
  exported = check_lowering(fn, platform, *args)
  assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(b, 16, hq, d), (b, 16, hq)]
