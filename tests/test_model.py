"""Target model: blockwise attention, static cache paths and taps agree with the plain causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.attention import causal_attention, extend_attention
from longspec_jax.model import int8_matmul, matmul
from tests.compiled import compiled


def naive_causal(q, k, v):
  b, t, hq, d = q.shape
  g = hq // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("t,block,g", [(37, 8, 1), (64, 16, 2), (50, 64, 4), (129, 32, 2)])
def test_blockwise_causal_matches_naive(t, block, g):
  rng = np.random.default_rng(t)
  q = jnp.asarray(rng.normal(size=(2, t, 2 * g, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32)
  np.testing.assert_allclose(causal_attention(q, k, v, block=block), naive_causal(q, k, v), atol=2e-5)


def test_blockwise_gradient_matches_naive():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 2, 8)), jnp.float32) for _ in range(3))
  f1 = lambda q: causal_attention(q, k, v, block=16).sum()
  f2 = lambda q: naive_causal(q, k, v).sum()
  np.testing.assert_allclose(jax.grad(f1)(q), jax.grad(f2)(q), atol=2e-5)


@pytest.mark.parametrize("earlier", [0, 2])
def test_extend_attention_reads_committed_cache_rows_and_new_rows_causally(earlier):
  """`earlier` new rows precede the queries without being queried (a drafter chain's rows kept out of the cache):
  the cache is visible only before the first new row."""
  rng = np.random.default_rng(1)
  b, t, hq, hkv, d, s = 2, 3, 4, 2, 8, 20
  q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
  k_new, v_new = (jnp.asarray(rng.normal(size=(b, earlier + t, hkv, d)), jnp.float32) for _ in range(2))
  # Every cache row holds values, also past each sequence's start (stale rows): those must stay unseen.
  kc, vc = (jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32) for _ in range(2))
  start = np.array([5, 10])  # position of the first new row
  pos = jnp.asarray(start[:, None] + earlier + np.arange(t))
  out, lse = extend_attention(q, k_new, v_new, kc, vc, pos, return_lse=True)
  q, k_new, v_new, kc, vc = (np.asarray(x, np.float64) for x in (q, k_new, v_new, kc, vc))  # the reference: numpy
  for bi in range(b):
    for ti in range(t):
      keys = np.concatenate([kc[bi, :, :start[bi]].transpose(1, 0, 2), k_new[bi, :earlier + ti + 1]])
      vals = np.concatenate([vc[bi, :, :start[bi]].transpose(1, 0, 2), v_new[bi, :earlier + ti + 1]])
      kk, vv = np.repeat(keys, hq // hkv, axis=1), np.repeat(vals, hq // hkv, axis=1)
      sc = np.einsum("hd,shd->hs", q[bi, ti], kk) / np.sqrt(d)
      lse_ref = np.log(np.exp(sc - sc.max(-1, keepdims=True)).sum(-1)) + sc.max(-1)
      np.testing.assert_allclose(lse[bi, ti], lse_ref, atol=1e-5)
      np.testing.assert_allclose(out[bi, ti], np.einsum("hs,shd->hd", np.exp(sc - lse_ref[:, None]), vv), atol=1e-5)


def test_prefill_then_extend_matches_full_forward(tiny_model):
  m = tiny_model
  tok = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 40)))
  full = compiled(m, tok, mode="train").logits
  cache = m.init_cache(2, 64)
  pre = compiled(m, tok[:, :30], cache=cache, mode="prefill")
  np.testing.assert_allclose(pre.logits, full[:, :30], atol=1e-5)
  ext = compiled(m, tok[:, 30:], cache=pre.cache.replace(lengths=jnp.asarray([30, 30])), mode="extend")
  np.testing.assert_allclose(ext.logits, full[:, 30:], atol=1e-5)


def test_ragged_extend_writes_at_each_offset(tiny_model):
  """Two sequences at different lengths in one batch: each continues from its own offset."""
  m = tiny_model
  rng = np.random.default_rng(3)
  a, b = rng.integers(0, 128, 25), rng.integers(0, 128, 18)
  tok = np.zeros((2, 25), np.int32)
  tok[0], tok[1, :18] = a, b
  pre = compiled(m, jnp.asarray(tok), cache=m.init_cache(2, 64), mode="prefill")
  nxt = jnp.asarray([[7, 8], [9, 10]])
  ext = compiled(m, nxt, cache=pre.cache.replace(lengths=jnp.asarray([25, 18])), mode="extend")
  ref_a = compiled(m, jnp.asarray(np.concatenate([a, [7, 8]]))[None], mode="train").logits[0, -2:]
  ref_b = compiled(m, jnp.asarray(np.concatenate([b, [9, 10]]))[None], mode="train").logits[0, -2:]
  np.testing.assert_allclose(ext.logits[0], ref_a, atol=1e-5)
  np.testing.assert_allclose(ext.logits[1], ref_b, atol=1e-5)


def test_taps_and_written_kv(tiny_model, tiny_cfg):
  m = tiny_model
  tok = jnp.asarray(np.random.default_rng(4).integers(0, 128, (1, 12)))
  out = compiled(m, tok, cache=m.init_cache(1, 32), mode="prefill", taps=(0, 1, 2), return_kv=True)
  assert out.taps.shape == (1, 12, 3, tiny_cfg.hidden_size)
  np.testing.assert_allclose(out.taps[:, :, 0], m.embed(tok), atol=0)
  np.testing.assert_allclose(out.taps[:, :, 2], out.hidden * 0 + out.taps[:, :, 2])  # final pre-norm stream
  k, v = out.new_kv
  assert k.shape == (2, 1, 12, 2, 16)
  cached_k = np.stack([x[:, :, :12].transpose(0, 2, 1, 3) for x in out.cache.k])  # -> [L, B, T, Hkv, D]
  np.testing.assert_allclose(cached_k, k, atol=0)
  with pytest.raises(ValueError, match="tap index"):
    compiled(m, tok, mode="train", taps=(5,))


def test_logits_at_selects_rows(tiny_model):
  m = tiny_model
  tok = jnp.asarray(np.random.default_rng(5).integers(0, 128, (2, 10)))
  full = compiled(m, tok, mode="train").logits
  sel = compiled(m, tok, mode="train", logits_at=jnp.asarray([[3], [9]])).logits
  np.testing.assert_allclose(sel[:, 0], jnp.stack([full[0, 3], full[1, 9]]), atol=1e-6)


def test_params_carry_logical_axes(tiny_model):
  variables = jax.tree.leaves(nnx.state(tiny_model), is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert variables and all(v.get_metadata().get("logical_axes") for v in variables)


@pytest.mark.parametrize("rows", [1, 5])
def test_narrow_weight_matmul_keeps_fp32_activations(rows):
  """bf16 weights with fp32 activations: the product is that of the fp32 x with the stored weights to ~1e-6
  (x in two bf16 parts), not that of x rounded to bf16 (~1e-3 off: enough to change greedy tokens between a
  decode step and a verify pass)."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((1, rows, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
  want = np.einsum("bri,io->bro", np.asarray(x, np.float64), np.asarray(w, np.float64))
  rounded = np.einsum("bri,io->bro", np.asarray(x.astype(jnp.bfloat16), np.float64), np.asarray(w, np.float64))
  scale = np.abs(want).max()
  got = matmul(x, w, "...i,io->...o")
  assert got.dtype == jnp.float32 and got.shape == (1, rows, 40)
  assert np.abs(np.asarray(got) - want).max() < 1e-5 * scale < np.abs(rounded - want).max()
  head = matmul(x, w.T, "...h,vh->...v", jnp.float32)  # the tied LM head's layout
  assert np.abs(np.asarray(head) - want).max() < 1e-5 * scale
  wide = matmul(x, w.astype(jnp.float32), "...i,io->...o")  # equal widths: a plain product
  np.testing.assert_allclose(wide, want, rtol=1e-5, atol=1e-5 * scale)


def test_bf16_weight_model_decodes_like_its_own_forward(tiny_model):
  """A target with bf16 weights and fp32 activations (dtype "bf16-weights"): fp32 cache and logits, and a
  one-row decode step (padded products) gives the logits of the same model's full forward."""
  graphdef, state = nnx.split(tiny_model)
  m = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), state))
  tok = jnp.asarray(np.random.default_rng(7).integers(0, 128, (1, 21)))
  full = compiled(m, tok, mode="train").logits
  cache = m.init_cache(1, 32)
  assert full.dtype == jnp.float32 and cache.k[0].dtype == jnp.float32
  pre = compiled(m, tok[:, :20], cache=cache, mode="prefill")
  step = compiled(m, tok[:, 20:], cache=pre.cache.replace(lengths=jnp.asarray([20])), mode="extend")
  np.testing.assert_allclose(step.logits[:, 0], full[:, 20], atol=1e-4)
  assert not np.allclose(full, compiled(tiny_model, tok, mode="train").logits, atol=1e-4)  # the weights really are bf16


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_int8_matmul_is_the_product_with_the_stored_weights_for_any_row_count(rows):
  """int8 weights (scale per output channel), x in three int8 parts: the product of the fp32 x with the dequantized
  weights to ~1e-6 of its scale, not that of x rounded to one int8 part; and a row's result does not depend on
  which other rows share the product (the integer products are exact)."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.float32)
  w = rng.standard_normal((48, 40)).astype(np.float32)
  scale = np.abs(w).max(0) / 127
  wq = np.round(w / scale).astype(np.int8)
  want = np.asarray(x, np.float64) @ (wq.astype(np.float64) * scale)
  s = np.abs(np.asarray(x)).max(-1, keepdims=True) / 127
  one_part = (np.round(np.asarray(x) / s) * s) @ (wq.astype(np.float64) * scale)
  got = np.asarray(int8_matmul(x, jnp.asarray(wq), jnp.asarray(scale), "...i,io->...o"))
  assert got.shape == (rows, 40)
  err = np.abs(got - want).max()
  assert err < 1e-6 * np.abs(want).max() and np.abs(one_part - want).max() > 1e-3 * np.abs(want).max()
  alone = np.asarray(int8_matmul(x[:1], jnp.asarray(wq), jnp.asarray(scale), "...i,io->...o"))
  np.testing.assert_array_equal(alone[0], got[0])


def test_int8_weight_model_decodes_like_its_own_forward(tiny_model):
  """Transformer.quantize_int8: the decoder projections become int8 kernels with a scale per output channel
  (logical axes kept), the embedding stays fp32, and a one-row decode step gives the logits of the same model's
  full forward; the logits stay near the fp32 model's."""
  graphdef, state = nnx.split(tiny_model)
  m = nnx.merge(graphdef, state).quantize_int8()
  q = m.layers[0].self_attn.q_proj
  assert q.kernel[...].dtype == jnp.int8 and q.kernel_scale[...].shape == (q.kernel[...].shape[1],)
  assert m.embed_tokens.embedding[...].dtype == jnp.float32
  variables = jax.tree.leaves(nnx.state(m), is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert all(v.get_metadata().get("logical_axes") for v in variables)
  tok = jnp.asarray(np.random.default_rng(9).integers(0, 128, (1, 21)))
  full = compiled(m, tok, mode="train").logits
  pre = compiled(m, tok[:, :20], cache=m.init_cache(1, 32), mode="prefill")
  step = compiled(m, tok[:, 20:], cache=pre.cache.replace(lengths=jnp.asarray([20])), mode="extend")
  np.testing.assert_allclose(step.logits[:, 0], full[:, 20], atol=1e-4)
  ref = compiled(tiny_model, tok, mode="train").logits
  assert 0 < np.abs(np.asarray(full - ref)).max() < 0.05 * np.abs(np.asarray(ref)).max()
