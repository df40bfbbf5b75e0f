"""LongSpark drafter: the exact online-softmax merge, lossless through the engine (greedy exact match, sampling
statistics), the Global summaries equal a full softmax over the committed rows at every step of a real decode, the
state does not grow with the context, rejected rows never enter, training forward == inference forward, the public
checkpoint layout, bad input, and the trainer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from longspec_jax.inference.generate import generate
from longspec_jax.drafters.base import PrefillResult, ProposeContext, VerifyResult, state_nbytes
from longspec_jax.drafters.longspark import (LongSparkModel, create_longspark, load_longspark, longspark_config_for,
                                             longspark_from_model, merge_rows, save_longspark_dir)
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.frozen_target import DRAFT_VOCAB_FILE, head_logits, restrict_head, target_io
from longspec_jax.sampling import NEG_INF
from longspec_jax.model import create_model, default_target_config
from longspec_jax.sampling import SamplingParams
from longspec_jax.verify import verify_greedy
from tests.test_speculative import (N_POS, V, _cfg, _chi2_pvalues, _exact_marginals, _prompts, _sample,
                                    peaky_target, target)  # noqa: F401  (fixtures)
from tests.test_train_drafter import env  # noqa: F401  (fixture: tiny target + target-generated data)
from longspec_jax.drafters.longspark import anchor_summaries, longspark_train_logits
from tests.compiled import compiled

W = 16  # a small raw window so that the tests' prompts and decodes wrap the ring


def _longspark(target_model, seed=1, markov_rank=8, window=W, slots=4):
  return create_longspark(longspark_config_for(target_model.cfg, num_layers=2, markov_rank=markov_rank,
                                               raw_window=window, num_global_slots=slots), seed=seed)


@pytest.fixture(scope="module")
def longspark(target):
  return longspark_from_model(_longspark(target), target)


def _full_summary(gq, k, v, n):
  """Reference: per slot, a plain softmax over ALL n rows. gq [Hq, G, D], k/v [R, Hkv, D]."""
  hq, hkv = gq.shape[0], k.shape[1]
  kk = np.repeat(np.asarray(k, np.float64)[:n], hq // hkv, axis=1)
  vv = np.repeat(np.asarray(v, np.float64)[:n], hq // hkv, axis=1)
  s = np.einsum("hsd,rhd->hsr", np.asarray(gq, np.float64), kk) / np.sqrt(gq.shape[-1])
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  return np.einsum("hsr,rhd->hsd", p / p.sum(-1, keepdims=True), vv), (m[..., 0] + np.log(p.sum(-1)))


def test_merge_rows_equals_one_softmax_over_all_rows():
  rng = np.random.default_rng(0)
  s_all = jnp.asarray(rng.normal(0, 3, (2, 5, 40)), jnp.float32)  # [batch, slots, rows]
  v_all = jnp.asarray(rng.normal(0, 1, (2, 40, 8)), jnp.float32)
  valid = jnp.asarray(rng.random((2, 40)) < 0.7)

  def merge_chunks(out, lse):
    for lo, hi in [(0, 3), (3, 4), (4, 4), (4, 25), (25, 40)]:  # uneven chunks, one empty
      out, lse = merge_rows(out, lse, s_all[..., lo:hi], v_all[:, lo:hi], valid[:, lo:hi])
    return out, lse
  out, lse = compiled(merge_chunks, jnp.zeros((2, 5, 8)), jnp.full((2, 5), -jnp.inf))
  ref_s = np.where(np.asarray(valid)[:, None], np.asarray(s_all, np.float64), -np.inf)  # the reference: numpy
  ref_lse = np.log(np.exp(ref_s - ref_s.max(-1, keepdims=True)).sum(-1)) + ref_s.max(-1)
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.einsum("bsr,brd->bsd", np.exp(ref_s - ref_lse[..., None]),
                                                        np.asarray(v_all, np.float64)), rtol=1e-5, atol=1e-5)
  # No valid row: bit-identical; and the empty summary stays empty without NaNs.
  o2, l2 = compiled(merge_rows, out, lse, s_all[..., :6], v_all[:, :6], jnp.zeros((2, 6), bool))
  np.testing.assert_array_equal(np.asarray(o2), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(l2), np.asarray(lse))
  o3, l3 = compiled(merge_rows, jnp.zeros((2, 5, 8)), jnp.full((2, 5), -jnp.inf), s_all[..., :6], v_all[:, :6],
                    jnp.zeros((2, 6), bool))
  assert np.all(np.asarray(o3) == 0) and np.all(np.isneginf(np.asarray(l3)))


@pytest.mark.parametrize("batch,lengths", [(1, [5]), pytest.param(1, [70], marks=pytest.mark.slow),
                                           pytest.param(4, [3, 40, 17, 90], marks=pytest.mark.slow)])
def test_greedy_longspark_equals_ar(target, longspark, batch, lengths):
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  for k in (1, 7):
    sp = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=longspark, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"


@pytest.mark.slow
@pytest.mark.parametrize("markov_rank", [0, 8])
def test_longspark_sampling_matches_target_distribution(peaky_target, markov_rank):
  d = longspark_from_model(_longspark(peaky_target, seed=2, markov_rank=markov_rank), peaky_target)
  if markov_rank:  # a non-zero Markov term, so that the sequential q matters
    m = nnx.merge(d.spec.graphdef, d.params["drafter"])
    w2 = m.parallel_markov_head.markov_w2.kernel
    w2[...] = jax.random.normal(jax.random.key(5), w2.shape)
    d = longspark_from_model(m, peaky_target)
  marg = _exact_marginals(peaky_target, SamplingParams.make(1.0))
  pvals = _chi2_pvalues(_sample(peaky_target, d, 1.0, 0, 1.0, seed=13), marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def _step_by_step(target_model, drafter, prompts, steps, k):
  """The engine's draft -> verify -> commit loop, unrolled in Python so each state can be inspected. Yields
  (state after update, target cache, committed lengths)."""
  from longspec_jax.inference.engine import pad_prompts
  spec, params = drafter.spec, drafter.params
  tokens, lens = pad_prompts(prompts, 1, max(map(len, prompts)))
  tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
  b, max_len = tokens.shape[0], 256
  out = compiled(target_model, tokens, cache=target_model.init_cache(b, max_len), mode="prefill",
                 logits_at=(lens - 1)[:, None], taps=spec.taps, return_kv=True)
  first = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
  buf = jnp.zeros((b, max_len), jnp.int32).at[:, :tokens.shape[1]].set(tokens).at[jnp.arange(b), lens].set(first)
  cache = out.cache.replace(lengths=lens)
  state = compiled(spec.init_state, params, PrefillResult(prompt_tokens=tokens, tokens=buf, prompt_lens=lens,
                                                         taps=out.taps, new_kv=out.new_kv, target_cache=cache), max_len)
  num_tokens = lens + 1
  yield state, cache, lens
  for step in range(steps):
    ctx = ProposeContext(tokens=buf, num_tokens=num_tokens, sampling=SamplingParams.make(0.0))
    drafts, _, state = compiled(spec.propose, params, state, ctx, jax.random.key(step), k, False)
    start = cache.lengths
    pending = jnp.take_along_axis(buf, start[:, None], axis=1)
    vout = compiled(target_model, jnp.concatenate([pending, drafts], 1), cache=cache, mode="extend", taps=spec.taps,
                    return_kv=True)
    n_acc, committed = compiled(verify_greedy, vout.logits, drafts)
    pos = num_tokens[:, None] + jnp.arange(k + 1)[None, :]
    buf = buf.at[jnp.arange(b)[:, None], jnp.where(jnp.arange(k + 1) <= n_acc[:, None], pos, max_len)].set(
        committed, mode="drop")
    num_tokens = num_tokens + n_acc + 1
    cache = vout.cache.replace(lengths=num_tokens - 1)
    state = compiled(spec.update, params, state, VerifyResult(
        start=start, num_accepted=n_acc, committed=committed, num_committed=n_acc + 1, taps=vout.taps,
        new_kv=vout.new_kv, tokens=buf, num_tokens=num_tokens))
    yield state, cache, num_tokens - 1


@pytest.mark.slow
def test_online_summaries_equal_full_softmax_at_every_decode_step(target):
  """After prefill and after every verification of a real greedy decode (drafts mostly rejected by a random
  drafter), the Global summaries equal a softmax over exactly the committed target K/V rows, the ring holds the
  last W committed rows, and the boundary state is the last committed row's taps."""
  d = longspark_from_model(_longspark(target, seed=3), target)
  ids = d.spec.cfg.target_layer_ids
  gq = np.asarray(nnx.merge(d.spec.graphdef, d.params["drafter"]).learned_query[...])
  prompts = _prompts(2, [9, 30])
  steps, rejected = 0, 0
  for state, cache, length in _step_by_step(target, d, prompts, steps=8, k=4):
    steps += 1
    for b in range(2):
      n = int(length[b])
      assert int(state.length[b]) == n
      for li, tl in enumerate(ids):
        ck, cv = (np.asarray(x[tl][b]).transpose(1, 0, 2) for x in (cache.k, cache.v))  # [S, Hkv, D]
        ref_out, ref_lse = _full_summary(gq[li], ck, cv, n)
        got_out = np.asarray(state.g_out[b, li]).reshape(ref_out.shape)
        np.testing.assert_allclose(got_out, ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(state.g_lse[b, li]).reshape(ref_lse.shape), ref_lse, rtol=1e-5,
                                   atol=1e-5)
        for p in range(max(0, n - W), n):
          np.testing.assert_allclose(np.asarray(state.ring_k[li, b, p % W]), ck[p], atol=1e-6)
          np.testing.assert_allclose(np.asarray(state.ring_v[li, b, p % W]), cv[p], atol=1e-6)
      # Rows written at positions >= n (rejected drafts) sit in the target cache but not in the summaries: the
      # comparison above over rows < n would fail if they had been merged.
      rejected += int(np.any(np.asarray(cache.k[0][b, :, n:n + 4]) != 0))
  assert steps == 9 and rejected > 0


def _abstract_state(loaded, tcfg, context):
  l, hkv, hd, h = tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim, tcfg.hidden_size
  sds = jax.ShapeDtypeStruct
  pre = PrefillResult(prompt_tokens=sds((1, context), jnp.int32), tokens=sds((1, context + 64), jnp.int32),
                      prompt_lens=sds((1,), jnp.int32), taps=sds((1, context, len(loaded.spec.taps), h), jnp.float32),
                      new_kv=(sds((l, 1, context, hkv, hd), jnp.float32),) * 2, target_cache=None)
  return jax.eval_shape(lambda p, pre: loaded.spec.init_state(p, pre, context + 64), loaded.params, pre)


def test_state_is_the_same_at_1k_and_16k_on_the_shipped_target_shape():
  tcfg = default_target_config()
  loaded = longspark_from_model(create_longspark(longspark_config_for(tcfg, num_layers=5, markov_rank=64)),
                                create_model(tcfg, seed=0))
  s1, s16 = _abstract_state(loaded, tcfg, 1024), _abstract_state(loaded, tcfg, 16384)
  shape = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
  assert shape(s1) == shape(s16)
  nbytes = state_nbytes(s1)
  assert nbytes == state_nbytes(s16)
  # L x Hq x G x (D+1) fp32 + 2 x L x W x Hkv x D fp32 + L x H fp32 + length (batch 1).
  assert nbytes == 5 * 4 * 16 * 65 * 4 + 2 * 5 * 256 * 2 * 64 * 4 + 5 * 256 * 4 + 4


def test_update_with_nothing_committed_leaves_the_state_unchanged(target, longspark):
  spec, params = longspark.spec, longspark.params
  (s0, cache, _), *_ = list(_step_by_step(target, longspark, _prompts(2, [12, 40]), steps=0, k=3))
  k1 = 4
  kv = tuple(jax.random.normal(jax.random.key(i), (target.cfg.num_hidden_layers, 2, k1, 2, 12)) for i in (1, 2))
  taps = jax.random.normal(jax.random.key(3), (2, k1, len(spec.taps), target.cfg.hidden_size))
  vr = VerifyResult(start=s0.length, num_accepted=jnp.zeros((2,), jnp.int32), committed=jnp.zeros((2, k1), jnp.int32),
                    num_committed=jnp.zeros((2,), jnp.int32), taps=taps, new_kv=kv,
                    tokens=None, num_tokens=s0.length + 1)
  s1 = compiled(spec.update, params, s0, vr)
  for name in ("g_out", "g_lse", "ring_k", "ring_v", "hidden", "length"):
    np.testing.assert_array_equal(np.asarray(getattr(s1, name)), np.asarray(getattr(s0, name)), err_msg=name)


@pytest.mark.parametrize("pre_len", [0, 10])
def test_training_forward_matches_inference(target, pre_len):
  """Every anchor of the trainer's many-anchor pass gets exactly the logits inference computes after committing the
  rows before it (Markov term teacher-forced), whether its Global rows come from the shared prefix or the tail."""
  model = _longspark(target, seed=4, window=8)
  m = nnx.merge(*nnx.split(model))
  w2 = m.parallel_markov_head.markov_w2.kernel
  w2[...] = 0.1 * jax.random.normal(jax.random.key(6), w2.shape)
  d = longspark_from_model(m, target)
  cfg = m.cfg
  b, t, bs = 2, 40, cfg.block_size
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, t)), jnp.int32)
  out = compiled(target, toks, mode="train", taps=cfg.taps, return_kv=True, return_logits=False)
  ids = jnp.asarray(cfg.target_layer_ids)
  k, v = out.new_kv[0][ids], out.new_kv[1][ids]  # [L, B, T, Hkv, D]
  anchors = jnp.asarray([[11, 17, 30], [12, 20, 31]], jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  g_out = compiled(anchor_summaries, m, k, v, jnp.full((b,), pre_len), k, v, pos, anchors)
  boundary = jnp.take_along_axis(out.taps, (anchors - 1)[..., None, None], axis=1)
  nxt = anchors[..., None] + jnp.arange(bs)
  prev = jnp.take_along_axis(toks[:, None, :], jnp.minimum(nxt, t - 1), axis=2)
  train_logits = compiled(longspark_train_logits, m, target_io(target, final_norm=True), boundary, anchors, g_out, k,
                          v, pos, prev)
  init, block = jax.jit(d.spec.init_state, static_argnums=2), jax.jit(d.spec.block_logits)  # one compile each
  for j in range(anchors.shape[1]):
    a = anchors[:, j]
    pre = PrefillResult(prompt_tokens=toks, tokens=toks, prompt_lens=a, taps=out.taps, new_kv=out.new_kv,
                        target_cache=None)
    inf = block(d.params, init(d.params, pre, t + bs), toks[jnp.arange(b), a]) + m.markov_bias(prev[:, j])
    np.testing.assert_allclose(np.asarray(train_logits[:, j]), np.asarray(inf), atol=2e-4, rtol=2e-4)


def _public_checkpoint(path, cfg, rng):
  """A tiny checkpoint written the way the public LongSpark checkpoints are: Qwen3 config + longspark_config, the
  published tensor names in torch layout, bf16. Built from the layout's names, not from our exporter."""
  a = cfg.arch
  h, hd, hq, hkv, f = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size
  n, bs = len(cfg.target_layer_ids), cfg.block_size
  t = {"draft_state_encoder.proj.net.0.weight": (h, n * h), "draft_state_encoder.proj.net.2.weight": (h, h),
       "draft_state_encoder.norm.weight": (h,), "parallel_shifted_input.position_embedding.weight": (bs, h),
       "parallel_shifted_input.proj.net.0.weight": (h, 2 * h), "parallel_shifted_input.proj.net.2.weight": (h, h),
       "parallel_shifted_input.norm.weight": (h,),
       "global16_raw256_reference.global_query_generator.learned_query": (n, hq, cfg.num_global_slots, hd),
       "parallel_markov_head.markov_w1.weight": (a.vocab_size, cfg.markov_rank),
       "parallel_markov_head.markov_w2.weight": (a.vocab_size, cfg.markov_rank)}
  for i in range(n):
    p = f"parallel_qwen_layers.{i}."
    t.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (hq * hd, h), p + "self_attn.k_proj.weight": (hkv * hd, h),
              p + "self_attn.v_proj.weight": (hkv * hd, h), p + "self_attn.o_proj.weight": (h, hq * hd),
              p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
              p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
  tensors = {k: (1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.1 * rng.standard_normal(s))
             .astype(np.float32) for k, s in t.items()}
  path.mkdir(parents=True)
  config = {"architectures": ["LongSparkDraftModel"], "model_type": "qwen3", "attention_bias": False,
            "hidden_size": h, "intermediate_size": f, "num_hidden_layers": n, "num_attention_heads": hq,
            "num_key_value_heads": hkv, "head_dim": hd, "hidden_act": "silu",
            "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope.theta, "vocab_size": a.vocab_size, "tie_word_embeddings": True,
            "num_target_layers": cfg.num_target_layers, "dtype": "bfloat16",
            "longspark_config": {"block_size": bs, "mask_token_id": cfg.mask_token_id,
                                 "target_layer_ids": list(cfg.target_layer_ids),
                                 "num_global_slots": cfg.num_global_slots, "raw_window": cfg.raw_window,
                                 "markov_rank": cfg.markov_rank}}
  (path / "config.json").write_text(json.dumps(config))
  import ml_dtypes
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
  return tensors


def _draftfreekv_config(cfg):
  """config.json as the published checkpoints hold it: LongSpark's DraftFreeKVConfig saved by transformers (flat
  keys, model_type draftfreekv), Global16 + Raw256 mode, with the other variants' keys at their defaults."""
  a = cfg.arch
  return {"architectures": ["DraftFreeKVModel"], "model_type": "draftfreekv", "dtype": "bfloat16",
          "transformers_version": "4.57.1", "target_model_name_or_path": "Qwen/Qwen3-8B",
          "target_layer_ids": list(cfg.target_layer_ids), "target_layer_policy": None,
          "num_target_layers": cfg.num_target_layers, "block_size": cfg.block_size, "hidden_size": a.hidden_size,
          "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim, "target_kv_window_size": None,
          "target_kv_memory_layout": "direct", "target_kv_memory_query_rank": 16, "vocab_size": a.vocab_size,
          "adapter_rank": 512, "adapter_alpha": 512.0, "transition_rank": 512, "transition_alpha": 512.0,
          "draft_mode": "parallel_shifted_qwen", "mask_token_id": cfg.mask_token_id,
          "parallel_mixer_layers": len(cfg.target_layer_ids), "parallel_mixer_rank": 512,
          "parallel_mixer_alpha": 512.0, "parallel_mixer_num_heads": 8, "parallel_markov_rank": cfg.markov_rank,
          "parallel_markov_head_type": "vanilla", "xpress_num_refinement_steps": 4, "xpress_early_stop": False,
          "xpress_activation": "silu", "qwen_intermediate_size": a.intermediate_size,
          "qwen_num_attention_heads": a.num_attention_heads, "qwen_rope_theta": a.rope.theta,
          "qwen_rms_norm_eps": a.rms_norm_eps, "qwen_gradient_checkpointing": True, "training_objective": "ce",
          "global16_raw256_enabled": True, "global_memory_slots": cfg.num_global_slots,
          "raw_target_rows": cfg.raw_window, "local_draft_rows": cfg.block_size, "max_accepted_tokens": 8,
          "global_memory_source_window": "full", "global_checkpoint_compatibility": "retrain_required",
          "global_query_mode": "learned", "global_query_equicorrelation": 0.4,
          "global_query_slot_mass_mode": "system", "memory_output_slots": None, "memory_source_window": None,
          "memory_query_mode": "hidden_r16", "memory_query_residual_rank": None,
          "memory_external_key_mode": "akav", "memory_attention_backend": "sdpa", "memory_anchor_policy": "recent"}


def test_loads_public_longspark_layout_and_round_trips(target, tmp_path):
  """The published layout: the 65-tensor names (here for 2 layers) in bf16 and the DraftFreeKV config.json; it
  loads through load_drafter, generates equal to AR, and our export writes the same names and shapes back."""
  cfg = longspark_config_for(target.cfg, num_layers=2, markov_rank=8, raw_window=W, num_global_slots=4)
  tensors = _public_checkpoint(tmp_path / "public", cfg, np.random.default_rng(0))
  public = _draftfreekv_config(cfg)
  (tmp_path / "public" / "config.json").write_text(json.dumps(public))
  loaded = load_drafter("longspark", target, tmp_path / "public")
  assert dataclasses.replace(loaded.spec.cfg, arch=cfg.arch) == cfg
  m = nnx.merge(loaded.spec.graphdef, loaded.params["drafter"])
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(m.draft_state_encoder.proj.fc_in.kernel[...]),
                                bf16(tensors["draft_state_encoder.proj.net.0.weight"]).T)
  np.testing.assert_array_equal(np.asarray(m.learned_query[...]),
                                bf16(tensors["global16_raw256_reference.global_query_generator.learned_query"]))
  np.testing.assert_array_equal(np.asarray(m.parallel_markov_head.markov_w2.kernel[...]),
                                bf16(tensors["parallel_markov_head.markov_w2.weight"]).T)
  prompts = _prompts(2, [7, 33])
  ar = generate(target, prompts, max_new_tokens=10, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=10, eos_id=-1, drafter=loaded, num_draft=7).tokens == ar
  # Our export writes the same names and shapes back; reloading gives identical parameters.
  save_longspark_dir(m, tmp_path / "ours")
  from safetensors.numpy import load_file
  ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
  assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in tensors.items()}
  again = nnx.merge(load_longspark(tmp_path / "ours", target).spec.graphdef,
                    load_longspark(tmp_path / "ours", target).params["drafter"])
  for x, y in zip(jax.tree.leaves(nnx.state(m)), jax.tree.leaves(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # Other DraftFreeKV variants and malformed public configs: one clear error each.
  for change, msg in [({"draft_mode": "markov"}, "draft_mode 'markov' is another DraftFreeKV variant"),
                      ({"global16_raw256_enabled": False}, "global16_raw256_enabled False is another"),
                      ({"target_kv_window_size": 64}, r"\['target_kv_window_size'\] must be null"),
                      ({"parallel_mixer_layers": 3}, "parallel_mixer_layers 3 vs 2 target_layer_ids"),
                      ({"qwen_num_attention_heads": None}, r"lacks \['qwen_num_attention_heads'\]"),
                      ({"sink_rows": 4}, r"unknown keys \['sink_rows'\]")]:
    (tmp_path / "public" / "config.json").write_text(json.dumps({**public, **change}))
    with pytest.raises(ValueError, match=msg):
      load_longspark(tmp_path / "public", target)


def test_bad_checkpoints_targets_and_k(target, tmp_path):
  cfg = longspark_config_for(target.cfg, num_layers=2, markov_rank=4, raw_window=W, num_global_slots=4)
  _public_checkpoint(tmp_path / "ok", cfg, np.random.default_rng(1))
  with pytest.raises(ValueError, match="does not match the target.*3"):
    load_longspark(tmp_path / "ok", create_model(_cfg(layers=3), seed=0))
  conf = json.loads((tmp_path / "ok" / "config.json").read_text())
  extra = conf["longspark_config"]
  for change, msg in [({"longspark_config": {"block_size": 7}}, "lacks"),
                      ({"longspark_config": {**extra, "target_layer_ids": [0, 7]}}, "outside"),
                      ({"longspark_config": {**extra, "target_layer_ids": [0]}}, "one drafter layer per"),
                      ({"longspark_config": {**extra, "sink_tokens": 4}}, "unknown longspark_config"),
                      ({"architectures": ["DFlashDraftModel"]}, "not a LongSpark")]:
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(ValueError, match=msg):
      load_longspark(tmp_path / "ok", target)
  (tmp_path / "ok" / "config.json").write_text(json.dumps({**conf, "longspark_config": {**extra, "markov_rank": 8}}))
  with pytest.raises(ValueError, match="shape mismatches.*markov"):
    load_longspark(tmp_path / "ok", target)
  d = longspark_from_model(_longspark(target), target)
  with pytest.raises(ValueError, match="proposes at most 7 tokens per step"):
    generate(target, [[3, 4, 5]], max_new_tokens=4, drafter=d, num_draft=8)
  # Callers that give no K (`longspec bench` without --num-draft) get the block limit, not the rejected 8.
  from longspec_jax.drafters.base import default_num_draft
  assert default_num_draft(d.spec) == 7


@pytest.mark.slow
def test_train_longspark_exports_and_resumes_exactly(env, tmp_path):
  """Trainer on tiny target-generated data (feature cache built once, reused): the loss falls, a stopped + resumed
  run ends bit-identical, and the export loads as a drafter that is lossless against its target."""
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.yaml_config import from_dict
  from longspec_jax.training.train_longspark import LongSparkTrainConfig, train_longspark
  tmp, data_cfg = env

  def cfg(out, **kw):
    return from_dict(LongSparkTrainConfig, dict(
        data_dirs=[data_cfg.out_dir], out_dir=str(tmp_path / out), num_layers=2,
        raw_window=8, num_global_slots=4, markov_rank=8, anchors_per_window=4, batch_size=2, steps=12,
        optim=dict(lr=0.02, warmup_steps=2), val_windows=1, compute_dtype="float32", log_every=1,
        checkpoint_every_minutes=100.0, **kw))

  final = train_longspark(cfg("a"))
  log = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  assert len(log) == 12 and np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
  info = json.loads((final / "drafter.json").read_text())
  assert info["kind"] == "longspark" and len(info["val_top1_per_slot"]) == 7
  assert str(train_longspark(cfg("b", stop_after_steps=5))).endswith("checkpoints")
  resumed = train_longspark(cfg("b"))
  log_b = [json.loads(l) for l in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
  assert log_b[-1] == {**log[-1], "elapsed_s": log_b[-1]["elapsed_s"]}
  assert (final / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
  target = load_model_dir(tmp / "target")
  d = load_longspark(final, target)
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=d, num_draft=7).tokens == \
      generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens


def test_position_shift_is_the_same_text_at_later_positions(target):
  """The trainer's shift augmentation: rotating cached target keys by `shift` gives exactly the keys (and the same
  taps) the target computes for the same text at positions + shift."""
  from longspec_jax.drafters.longspark import shift_window
  m = _longspark(target, seed=5)
  toks = jnp.asarray(np.random.default_rng(1).integers(3, V, (2, 24)), jnp.int32)
  shift = jnp.asarray([0, 1500], jnp.int32)
  ids = jnp.asarray(m.cfg.target_layer_ids)
  base = compiled(target, toks, mode="train", taps=m.cfg.taps, return_kv=True, return_logits=False)
  moved = compiled(target, toks, mode="train", taps=m.cfg.taps, return_kv=True, return_logits=False,
                   positions=jnp.arange(24)[None, :] + shift[:, None])
  k = base.new_kv[0][ids]
  got = compiled(shift_window, m, {"shift": shift, "pre_k": k, "slab_k": k})
  np.testing.assert_allclose(np.asarray(got["pre_k"]), np.asarray(moved.new_kv[0][ids]), atol=2e-4)
  np.testing.assert_allclose(np.asarray(base.taps), np.asarray(moved.taps), atol=2e-4)


def test_boundary_scale_folds_into_the_state_encoder(target):
  """normalize_boundary trains on boundary taps * scale; folding the scale into the state encoder's first linear
  gives the same block input from raw taps, so the exported drafter reads the target's taps unchanged."""
  from longspec_jax.training.drafter_common import fold_input_scale
  m = nnx.merge(*nnx.split(_longspark(target, seed=2)))
  rng = np.random.default_rng(0)
  boundary = jnp.asarray(rng.normal(0, 30, (3, 2, target.cfg.hidden_size)), jnp.float32)  # [B, L, H]
  scale = rng.uniform(0.01, 3.0, boundary.shape[1:]).astype(np.float32)
  pending, io = jnp.asarray([4, 9, 17], jnp.int32), target_io(target, final_norm=True)
  scaled = compiled(LongSparkModel.block_input, m, io, pending, boundary * scale)
  fold_input_scale(m.draft_state_encoder.proj.fc_in, scale)
  np.testing.assert_allclose(np.asarray(compiled(LongSparkModel.block_input, m, io, pending, boundary)),
                             np.asarray(scaled), rtol=1e-4, atol=1e-4)


def test_target_without_mask_token_and_with_yarn(target):
  """A target without a mask token (SmolLM2) takes an explicit one; a target run with YaRN gives the drafter's block
  queries its RoPE (they attend to its rotated keys), without changing the caller's model, and stays lossless."""
  from longspec_jax.targets import with_rope_scaling
  no_mask = target.cfg.replace(mask_token_id=None)
  with pytest.raises(ValueError, match="no mask_token_id"):
    longspark_config_for(no_mask, num_layers=2)
  cfg = longspark_config_for(no_mask, num_layers=2, mask_token_id=5, intermediate_size=24)
  assert cfg.mask_token_id == 5 and cfg.arch.intermediate_size == 24
  yarn_target = create_model(with_rope_scaling(target.cfg, "yarn:2"), seed=0)
  model = _longspark(target)
  d = longspark_from_model(model, yarn_target)
  assert d.spec.cfg.arch.rope == yarn_target.cfg.rope != model.cfg.arch.rope
  assert nnx.merge(d.spec.graphdef, d.params["drafter"]).cfg.arch.rope == yarn_target.cfg.rope
  prompts = _prompts(2, [9, 30])
  assert generate(yarn_target, prompts, max_new_tokens=10, eos_id=-1, drafter=d, num_draft=7).tokens == \
      generate(yarn_target, prompts, max_new_tokens=10, eos_id=-1).tokens


def test_anchor_sampler_cuts_anywhere_in_the_window():
  """anywhere_fraction: a window's cut (prefix | tail) can fall anywhere; the batch then shows every anchor exactly
  the rows before it (prefix summary up to the cut, slab = rows [cut - W, cut + T)) and the window's next tokens.
  With fraction 0 the cut is the prompt's end, as before."""
  from longspec_jax.training.train_longspark import AnchorSampler, LongSparkRows, LongSparkTrainConfig
  lens = [100, 130, 90]

  class RowValuedCache:  # K/V and taps of row r hold the value r (zeros outside the window), like FeatureCache
    def window_kv(self, i, lo, n, layers):
      r = np.arange(lo, lo + n, dtype=np.float32)
      r = np.where((r >= 0) & (r < lens[i]), r, 0)
      k = np.broadcast_to(r[None, :, None, None], (len(layers), n, 1, 2))
      return k, k

    def taps_at(self, i, rows, taps):
      return np.broadcast_to(np.asarray(rows, np.float32)[:, None, None], (len(rows), len(taps), 3))

  rows = [(list(range(1000 * i, 1000 * i + n)), n - 20) for i, n in enumerate(lens)]  # token = 1000 i + row
  cache = LongSparkRows(RowValuedCache(), rows, (0, 1))
  w = 8
  for fraction in (0.0, 1.0):
    cfg = LongSparkTrainConfig(raw_window=w, anchors_per_window=5, anywhere_fraction=fraction)
    sampler = AnchorSampler(cache, np.arange(3), cfg, seed=0)
    cuts = []
    for step in range(25):
      b, wins = sampler.batch(step, 4), np.random.default_rng([0, step]).integers(0, 3, size=4)
      for j, i in enumerate(wins):
        cut, anc = int(b["pre_len"][j]), b["anchors"][j]
        cuts.append(cut - cache.tail_start[i])
        assert cut < anc.min() and anc.max() <= min(lens[i] - 2, cut + sampler.tail - 1)
        assert b["slab_pos"][j, w] == cut and b["slab_k"][0, j, w, 0, 0] == cut
        assert np.all(b["pre_k"][0, j, :cut, 0, 0] == np.arange(cut))
        np.testing.assert_array_equal(b["boundary"][j, :, 0, 0], anc - 1)
        np.testing.assert_array_equal(b["labels"][j, :, 0], 1000 * i + anc + 1)
    if fraction == 0.0:
      assert not np.any(cuts)
    else:
      assert np.mean(np.asarray(cuts) < 0) > 0.5  # most cuts fall inside the prompt


def _cut_head(loaded, ids):
  return dataclasses.replace(loaded, params={**loaded.params, "io": restrict_head(loaded.params["io"], ids)})


def test_draft_vocab_cuts_the_head_and_stays_lossless(target, tmp_path):
  """--draft-vocab N: the LM head covers the first N ids of draft_vocab.json; every other token gets NEG_INF (never
  drafted), the kept tokens keep their logits, and greedy output still equals AR. Bad sizes and files are refused."""
  save_longspark_dir(_longspark(target), tmp_path / "d")
  order = np.random.default_rng(3).permutation(V)
  (tmp_path / "d" / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": order.tolist()}))
  full = load_longspark(tmp_path / "d", target)
  cut = load_drafter("longspark", target, tmp_path / "d", draft_vocab=V // 3)
  kept = order[:V // 3]
  np.testing.assert_array_equal(np.asarray(cut.params["io"]["draft_ids"]), kept)
  h = jax.random.normal(jax.random.key(0), (2, 3, target.cfg.hidden_size))
  ref, small = np.asarray(head_logits(full.params["io"], h)), np.asarray(head_logits(cut.params["io"], h))
  np.testing.assert_allclose(small[..., kept], ref[..., kept], rtol=1e-5, atol=1e-5)
  assert np.all(np.delete(small, kept, axis=-1) == NEG_INF)
  prompts = _prompts(2, [7, 33])
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=cut, num_draft=7).tokens == ar
  with pytest.raises(ValueError, match=f"more than the {V} ids"):
    load_drafter("longspark", target, tmp_path / "d", draft_vocab=V + 1)
  with pytest.raises(ValueError, match="--draft-vocab applies to"):
    load_drafter("eagle3", target, tmp_path / "d", draft_vocab=8)
  (tmp_path / "d" / DRAFT_VOCAB_FILE).unlink()
  with pytest.raises(FileNotFoundError, match="make_draft_vocab.py"):
    load_drafter("longspark", target, tmp_path / "d", draft_vocab=8)
  with pytest.raises(ValueError, match="distinct token ids"):
    restrict_head(full.params["io"], [1, 1, 2])


@pytest.mark.slow
def test_sampling_with_a_cut_head_matches_target_distribution(peaky_target):
  """Tokens outside the draft vocabulary have q = 0: rejection sampling still gives the target's distribution."""
  d = longspark_from_model(_longspark(peaky_target, seed=2), peaky_target)
  d = _cut_head(d, np.random.default_rng(1).permutation(V)[:V // 2])
  marg = _exact_marginals(peaky_target, SamplingParams.make(1.0))
  pvals = _chi2_pvalues(_sample(peaky_target, d, 1.0, 0, 1.0, seed=17), marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_init_from_target_copies_the_layers_it_reads(target):
  """init_from_target: drafter layer i takes target layer target_layer_ids[i]'s attention and norms, and the first
  channels of its MLP; a drafter MLP wider than the target's is refused. The result still drafts losslessly."""
  from longspec_jax.training.train_longspark import init_from_target_layers
  half = target.cfg.intermediate_size // 2
  model = create_longspark(longspark_config_for(target.cfg, num_layers=2, intermediate_size=half), seed=3)
  init_from_target_layers(model, target)
  for layer, ti in zip(model.parallel_qwen_layers, model.cfg.target_layer_ids):
    t = target.layers[ti]
    np.testing.assert_array_equal(layer.self_attn.q_proj.kernel[...], t.self_attn.q_proj.kernel[...])
    np.testing.assert_array_equal(layer.self_attn.o_proj.kernel[...], t.self_attn.o_proj.kernel[...])
    np.testing.assert_array_equal(layer.input_layernorm.scale[...], t.input_layernorm.scale[...])
    np.testing.assert_array_equal(layer.mlp.up_proj.kernel[...], t.mlp.up_proj.kernel[...][:, :half])
    np.testing.assert_array_equal(layer.mlp.down_proj.kernel[...], t.mlp.down_proj.kernel[...][:half])
  wide = create_longspark(longspark_config_for(target.cfg, num_layers=1,
                                               intermediate_size=2 * target.cfg.intermediate_size))
  with pytest.raises(ValueError, match="wider than the target's"):
    init_from_target_layers(wide, target)
  from longspec_jax.drafters.longspark import longspark_from_model
  prompts = _prompts(2, [7, 33])
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=longspark_from_model(model, target),
                  num_draft=7).tokens == generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
