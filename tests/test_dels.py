"""DeLS-Spec: lossless through the engine (greedy exact match, sampling statistics), alpha = beta = 0 is DFlash,
training forward == inference forward, the public local-head formats against a torch reference, our checkpoint
round trip, bad input, and the trainer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.inference.generate import generate
from longspec_jax.drafters.base import PrefillResult, ProposeContext
from longspec_jax.drafters.dels import (DeLSConfig, combine, decode_block, dels_from_head, head_shapes, load_dels,
                                        load_public_dels, load_public_local_head, local_block_logits, save_dels_dir,
                                        unigram_log_prior)
from longspec_jax.drafters.dflash import create_dflash, dflash_config_for, dflash_from_model, save_dflash_dir
from longspec_jax.drafters.frozen_target import target_io
from longspec_jax.sampling import SamplingParams, processed_log_probs
from tests.compiled import compiled
from tests.test_speculative import (N_POS, V, _chi2_pvalues, _exact_marginals, _prompts, _sample,
                                    peaky_target, target)  # noqa: F401  (fixtures)
from tests.test_train_drafter import env  # noqa: F401  (fixture: tiny target + target-generated data)
from longspec_jax.training.train_dels import DeLSTrainConfig, init_head_params, merge_head
from longspec_jax.drafters.dflash import dflash_train_logits

BLOCK = 5


def _dflash_model(target_model, seed=1):
  return create_dflash(dflash_config_for(target_model.cfg, num_layers=1, num_target_taps=2, block_size=BLOCK),
                       seed=seed)


def _cfg(alpha=1.0, beta=0.5, gru_start="pending", vocab=V, e=8, g=12, r=6):
  return DeLSConfig(vocab_size=vocab, embed_dim=e, gru_hidden_dim=g, low_rank_dim=r, alpha=(0.0,) * (BLOCK - 1),
                    beta=(0.0,) * (BLOCK - 1), gru_start=gru_start).with_schedule(alpha, beta)


def _head(cfg, seed=0, scale=3.0):
  """Random tables large enough that the local head changes DFlash's drafts."""
  rng = np.random.default_rng(seed)
  head = {k: (scale * rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
          for k, s in head_shapes(cfg).items() if k != "log_prior"}
  head["log_prior"] = unigram_log_prior(rng.integers(0, 40, cfg.vocab_size), cfg.vocab_size)
  return head


def _dels(target_model, cfg=None, seed=0, dflash_seed=1):
  cfg = cfg or _cfg()
  return dels_from_head(dflash_from_model(_dflash_model(target_model, dflash_seed), target_model), cfg,
                        _head(cfg, seed))


def _state_and_ctx(target_model, spec, params, lens, t=40):
  b = len(lens)
  toks = jnp.asarray(np.random.default_rng(5).integers(3, V, (b, t + BLOCK)), jnp.int32)
  taps = compiled(target_model, toks, mode="train", taps=spec.taps, return_logits=False).taps
  pre = PrefillResult(prompt_tokens=toks, tokens=toks, prompt_lens=jnp.asarray(lens), taps=taps, new_kv=None,
                      target_cache=None)
  state = compiled(spec.init_state, params, pre, t + BLOCK)
  ctx = ProposeContext(tokens=toks, num_tokens=jnp.asarray(lens) + 1, sampling=SamplingParams.make(0.0))
  return toks, taps, state, ctx


@pytest.mark.parametrize("gru_start,batch,lengths", [("pending", 1, [9]), ("first_draft", 2, [5, 70])])
def test_greedy_dels_equals_ar(target, gru_start, batch, lengths):
  d = _dels(target, _cfg(gru_start=gru_start))
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=20, eos_id=-1)
  for k in ((1, BLOCK - 1) if batch == 1 else (BLOCK - 1,)):
    sp = generate(target, prompts, max_new_tokens=20, eos_id=-1, drafter=d, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"


def test_zero_weights_give_dflash_drafts_and_probs(target):
  base = dflash_from_model(_dflash_model(target), target)
  _, _, state, ctx = _state_and_ctx(target, base.spec, base.params, [12, 30])
  pending = ctx.tokens[jnp.arange(2), ctx.num_tokens - 1]
  logits = jax.jit(lambda p, s: base.spec.block_logits(p, s, pending, BLOCK - 1))(base.params, state)
  head = {k: jnp.asarray(v) for k, v in _head(_cfg()).items()}
  run = jax.jit(decode_block, static_argnums=0)
  drafts, _ = run(_cfg(0.0, 0.0), head, logits, pending)
  assert np.array_equal(drafts, jnp.argmax(logits, -1))  # DFlash's greedy drafts
  assert not np.array_equal(run(_cfg(1.0, 0.5), head, logits, pending)[0], drafts)  # the test is not vacuous
  # Sampled: DFlash draws all slots at once, DeLS one per step, so the draws differ; q is DFlash's distribution.
  sp = SamplingParams.make(0.7, 10, 0.9)
  _, logq = run(_cfg(0.0, 0.0), head, logits, pending, sp, jax.random.key(3))
  np.testing.assert_allclose(np.exp(logq), np.exp(processed_log_probs(logits, sp)), atol=1e-6)


def test_a_draft_vocabulary_decodes_over_its_columns_alone(target):
  """Over a base with a draft vocabulary the head is cut to its tokens: greedy drafts equal the full-vocabulary
  decode (the base gives -inf elsewhere), sampled q is zero outside it and the first slot's q is the full one's;
  generation stays lossless."""
  from longspec_jax.drafters.frozen_target import restrict_head
  base = dflash_from_model(_dflash_model(target), target)
  ids = np.sort(np.random.default_rng(1).choice(V, V // 3, replace=False))
  base = dataclasses.replace(base, params={**base.params, "io": restrict_head(base.params["io"], ids)})
  cfg, head = _cfg(1.0, 0.5), _head(_cfg(1.0, 0.5))
  d = dels_from_head(base, cfg, head)
  assert d.params["head"]["head"].shape[0] == len(ids)
  _, _, state, ctx = _state_and_ctx(target, base.spec, base.params, [12, 30])
  pending = ctx.tokens[jnp.arange(2), ctx.num_tokens - 1]
  full = compiled(base.spec.block_logits, base.params, state, pending, BLOCK - 1)  # -inf outside ids
  want, _ = compiled(decode_block, cfg, {k: jnp.asarray(x) for k, x in head.items()}, full, pending)
  got, _, _ = compiled(d.spec.propose, d.params, state, ctx, jax.random.key(0), BLOCK - 1, False)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert set(np.asarray(got).ravel().tolist()) <= set(ids.tolist())
  sp = SamplingParams.make(0.8)
  drafts, q, _ = compiled(d.spec.propose, d.params, state, dataclasses.replace(ctx, sampling=sp), jax.random.key(4),
                          BLOCK - 1, True)
  q = np.asarray(q)
  outside = np.setdiff1d(np.arange(V), ids)
  assert q.shape == (2, BLOCK - 1, V) and np.all(q[..., outside] == 0)
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
  assert np.all(np.take_along_axis(q, np.asarray(drafts)[..., None], -1) > 0)
  _, logq = compiled(decode_block, cfg, {k: jnp.asarray(x) for k, x in head.items()}, full, pending, sp,
                     jax.random.key(4))
  np.testing.assert_allclose(q[:, 0], np.exp(np.asarray(logq[:, 0])), atol=1e-6)
  prompts = _prompts(2, [5, 40])
  assert generate(target, prompts, max_new_tokens=16, eos_id=-1, drafter=d, num_draft=BLOCK - 1).tokens == \
      generate(target, prompts, max_new_tokens=16, eos_id=-1).tokens


@pytest.mark.parametrize("gru_start", ["pending", "first_draft"])
def test_training_forward_matches_inference(target, gru_start):
  """Per block: DFlash's many-anchor training logits + the teacher-forced local head on the drafts chosen, combined,
  equal the logits the left-to-right decode used for each position."""
  model = _dflash_model(target, seed=4)
  base = dflash_from_model(model, target)
  params = init_head_params(DeLSTrainConfig(embed_dim=8, gru_hidden_dim=12, low_rank_dim=6), target.cfg.hidden_size,
                            seed=1)
  params["up"] = 0.5 * jax.random.normal(jax.random.key(2), params["up"].shape)  # trained, not the zero init
  io = target_io(target)
  prior = unigram_log_prior(np.arange(V), V)
  cfg = dataclasses.replace(_cfg(gru_start=gru_start), rank_activation="silu")
  cfg = cfg.with_schedule(np.linspace(0.3, 1.5, BLOCK - 1), np.linspace(0.0, 0.4, BLOCK - 1))
  d = dels_from_head(base, cfg, jax.tree.map(np.asarray, merge_head(params, io, prior)))
  b, t = 2, 40
  toks = jnp.asarray(np.random.default_rng(0).integers(3, V, (b, t)), jnp.int32)
  taps = compiled(target, toks, mode="train", taps=base.spec.taps, return_logits=False).taps
  anchors = jnp.asarray([[5, 17, 30], [12, 3, 34]], jnp.int32)
  base_train = compiled(dflash_train_logits, model, io, taps, toks, anchors)  # [B, A, K, V]
  for j in range(anchors.shape[1]):
    a = anchors[:, j]
    pre = PrefillResult(prompt_tokens=toks, tokens=toks, prompt_lens=a, taps=taps, new_kv=None, target_cache=None)
    state = compiled(d.spec.init_state, d.params, pre, t + BLOCK)
    pending = toks[jnp.arange(b), a]
    inf_base = compiled(base.spec.block_logits, base.params, state, pending, BLOCK - 1)
    drafts, z_inf = compiled(decode_block, cfg, d.params["head"], inf_base, pending)
    head = merge_head(params, io, prior)
    prev = jnp.concatenate([pending[:, None], drafts[:, :-1]], 1)
    alpha, beta, _ = cfg.mix_weights(BLOCK - 1)
    z_train = combine(base_train[:, j], compiled(local_block_logits, cfg, head, prev), head["log_prior"], alpha, beta)
    np.testing.assert_allclose(np.asarray(z_train), np.asarray(z_inf), atol=3e-4, rtol=3e-4)
    assert np.array_equal(np.asarray(jnp.argmax(z_train, -1)), np.asarray(drafts))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0),
                                                    pytest.param(0.8, 20, 0.9, marks=pytest.mark.slow)])
def test_dels_sampling_matches_target_distribution(peaky_target, temperature, top_k, top_p):
  d = _dels(peaky_target, _cfg(1.0, 0.5), seed=2, dflash_seed=2)
  marg = _exact_marginals(peaky_target, SamplingParams.make(temperature, top_k, top_p))
  samples = _sample(peaky_target, d, temperature, top_k, top_p, seed=17)
  pvals = _chi2_pvalues(samples, marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def _torch_local_head(e, g, r, v, seed, h_target=None):
  """A public-layout local head in torch: nn.GRU(bias=False) + rank_proj + low_rank_lm_head (or rank_to_hidden)."""
  import torch
  torch.manual_seed(seed)
  gru = torch.nn.GRU(e, g, num_layers=1, batch_first=True, bias=False)
  rank = torch.nn.Linear(g, r, bias=False)
  out = torch.nn.Linear(r, v if h_target is None else h_target, bias=False)
  with torch.no_grad():
    out.weight.mul_(4.0)
  return gru, rank, out


def test_public_local_head_formats_match_torch(target, tmp_path):
  import torch
  h = target.cfg.hidden_size
  embed = torch.tensor(np.asarray(target.embed_tokens.embedding[...]))
  tokens = torch.tensor([[5, 9, 40, 7]])
  prev = jnp.asarray(tokens.numpy(), jnp.int32)
  base = dflash_from_model(_dflash_model(target), target)
  for variant in ("direct_vocab", "full_embedding"):
    e, g, r = (8 if variant == "direct_vocab" else h), 12, 6
    gru, rank, out = _torch_local_head(e, g, r, V, seed=1, h_target=None if variant == "direct_vocab" else h)
    sd = {"prefix_gru.weight_ih_l0": gru.weight_ih_l0, "prefix_gru.weight_hh_l0": gru.weight_hh_l0,
          "rank_proj.weight": rank.weight}
    mc = {"vocab_size": V, "embed_dim": e, "gru_hidden_dim": g, "low_rank_dim": r, "rank_activation": "silu"}
    if variant == "direct_vocab":
      emb = torch.randn(V, e)
      sd.update({"embed_tokens.weight": emb, "low_rank_lm_head.weight": out.weight})
      mc.update(rnn_parameterization="direct_vocab", lm_head_mode="low_rank")
      head_w = out.weight
    else:
      emb = embed
      sd.update({"embed_tokens.weight": embed, "rank_to_hidden.weight": out.weight})  # the frozen table is skipped
      mc.update(lm_head_mode="target_lm_head")
      head_w = embed @ out.weight  # tied target: LM head weight = embedding
    path = tmp_path / f"{variant}.pt"
    torch.save({"model_config": mc, "model_state_dict": {k: v.detach().clone() for k, v in sd.items()}}, path)
    with torch.no_grad():
      states, _ = gru(emb[tokens])
      ref = torch.nn.functional.silu(rank(states)) @ head_w.T  # [1, 4, V]
    cfg, head = load_public_local_head(path, target, BLOCK, alpha=0.4, beta=0.1)
    assert cfg.gru_start == "first_draft" and cfg.alpha == (0.4,) * (BLOCK - 1) and cfg.embed_dim == e
    ours = local_block_logits(dataclasses.replace(cfg, gru_start="pending"), head, prev)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=2e-4, rtol=2e-4)
    d = load_public_dels(path, base, target, alpha=0.4, beta=0.1)
    assert d.spec.cfg == cfg and np.array_equal(d.params["head"]["head"], head["head"])
  torch.save({"model_config": mc, "model_state_dict": {**sd, "embed_down_proj.weight": torch.zeros(8, h)}},
             tmp_path / "unmerged.pt")
  with pytest.raises(ValueError, match="unmerged input projection"):
    load_public_local_head(tmp_path / "unmerged.pt", target, BLOCK)
  torch.save({"model_config": mc, "model_state_dict": {k: v for k, v in sd.items() if "hh" not in k}},
             tmp_path / "partial.pt")
  with pytest.raises(ValueError, match="missing local-head tensors"):
    load_public_local_head(tmp_path / "partial.pt", target, BLOCK)


def test_public_release_in_a_dflash_directory_generates_equal_to_ar(target, tmp_path):
  """DeLS-Spec's released files (local_head.pt: the full target embedding into the GRU, rank_to_hidden into the
  target's LM head; loss_mask_unigram.pt: {"counts": [V]}) copied into a z-lab-layout DFlash directory load as
  `dels` (alpha = beta = 0.3, the prior from the counts) and generate equal to AR; missing files are named."""
  import torch
  from longspec_jax.drafters import load_drafter
  d = tmp_path / "dflash"
  save_dflash_dir(_dflash_model(target), d)
  with pytest.raises(ValueError, match="DeLS-Spec's local_head.pt and loss_mask_unigram.pt beside its config"):
    load_drafter("dels", target, d)
  h = target.cfg.hidden_size
  gru, rank, out = _torch_local_head(h, 12, 6, V, seed=3, h_target=h)
  sd = {"prefix_gru.weight_ih_l0": gru.weight_ih_l0, "prefix_gru.weight_hh_l0": gru.weight_hh_l0,
        "rank_proj.weight": rank.weight, "rank_to_hidden.weight": out.weight}
  mc = {"vocab_size": V, "embed_dim": h, "gru_hidden_dim": 12, "low_rank_dim": 6, "lm_head_mode": "target_lm_head",
        "rank_activation": "identity"}
  torch.save({"model_config": mc, "model_state_dict": {k: v.detach().clone() for k, v in sd.items()}},
             d / "local_head.pt")
  with pytest.raises(FileNotFoundError, match="loss_mask_unigram.pt is missing"):
    load_drafter("dels", target, d)
  counts = torch.arange(V, dtype=torch.float64)
  torch.save({"counts": counts}, d / "loss_mask_unigram.pt")
  dels = load_drafter("dels", target, d)
  assert dels.spec.cfg.alpha == (0.3,) * (BLOCK - 1) and dels.spec.cfg.gru_start == "first_draft"
  smoothed = counts.numpy() + 1.0
  np.testing.assert_allclose(np.asarray(dels.params["head"]["log_prior"]), np.log(smoothed / smoothed.sum()),
                             rtol=1e-5)
  prompts = _prompts(2, [7, 20])
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=dels, num_draft=BLOCK - 1).tokens == ar


def test_checkpoint_round_trip_and_bad_input(target, tmp_path):
  save_dflash_dir(_dflash_model(target), tmp_path / "dflash")
  cfg = _cfg(alpha=0.0, beta=0.0).with_schedule(np.linspace(0.1, 0.8, BLOCK - 1), [0.05] * (BLOCK - 1))
  head = _head(cfg)
  save_dels_dir(cfg, head, tmp_path / "dels", base_drafter="../dflash")
  d = load_dels(tmp_path / "dels", target)
  assert d.spec.cfg == cfg
  for k, x in head.items():  # tables ship in bf16, the prior in fp32
    want = x if k == "log_prior" else np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(d.params["head"][k]), want)
  prompts = _prompts(1, [21])
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=d, num_draft=4).tokens == \
      generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  with pytest.raises(ValueError, match="exceeds the 4 positions"):
    cfg.mix_weights(5)
  with pytest.raises(ValueError, match="at most 4 tokens per step"):  # DeLS declares its base's block limit
    generate(target, prompts, max_new_tokens=4, drafter=d, num_draft=5)
  with pytest.raises(ValueError, match="vocabulary"):
    dels_from_head(dflash_from_model(_dflash_model(target), target), _cfg(vocab=V + 1), _head(_cfg(vocab=V + 1)))
  bad = dict(head, w_hh=head["w_hh"][:, :-1])
  with pytest.raises(ValueError, match="shapes"):
    dels_from_head(dflash_from_model(_dflash_model(target), target), cfg, bad)
  with pytest.raises(ValueError, match="gru_start"):
    _cfg(gru_start="anchor")
  conf = json.loads((tmp_path / "dels" / "config.json").read_text())
  (tmp_path / "dels" / "config.json").write_text(json.dumps({**conf, "architectures": ["DFlashDraftModel"]}))
  with pytest.raises(ValueError, match="not a DeLS"):
    load_dels(tmp_path / "dels", target)


@pytest.mark.slow
def test_train_dels_tunes_exports_and_resumes(env, tmp_path):
  """Trainer on tiny target-generated data over a frozen DFlash: the loss falls, a stopped + resumed run ends
  bit-identical, alpha/beta land in the config, and the export is lossless through the engine."""
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.yaml_config import from_dict
  from longspec_jax.training.train_dels import train_dels
  tmp, data_cfg = env
  target = load_model_dir(tmp / "target")
  save_dflash_dir(create_dflash(dflash_config_for(target.cfg, num_layers=1, num_target_taps=2, block_size=4)),
                  tmp_path / "dflash")

  def cfg(out, **kw):
    return from_dict(DeLSTrainConfig, dict(
        data_dirs=[data_cfg.out_dir], base=str(tmp_path / "dflash"), out_dir=str(tmp_path / out), embed_dim=4,
        gru_hidden_dim=8, low_rank_dim=4, context_len=32, anchors_per_window=3, batch_size=2, steps=12,
        optim=dict(lr=0.03, warmup_steps=2), val_fraction=0.5, val_windows=2, val_anchors=4, tune_num_draft=3,
        alpha_grid=[0.0, 0.5], beta_grid=[0.0, 0.2], log_every=1, checkpoint_every_minutes=100.0, **kw))

  final = train_dels(cfg("a"))
  log = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  assert len(log) == 12 and np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
  info = json.loads((final / "drafter.json").read_text())
  conf = json.loads((final / "config.json").read_text())
  assert info["kind"] == "dels" and len(conf["alpha"]) == len(conf["beta"]) == 3
  assert set(conf["alpha"]) <= {0.0, 0.5} and info["held_out_greedy_blocks"] > 0
  assert str(train_dels(cfg("b", stop_after_steps=5))).endswith("checkpoints")
  resumed = train_dels(cfg("b"))
  assert (final / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
  d = load_dels(final, target)
  prompts = [[0, 5, 9, 33, 7, 5, 9], [0, 40, 41]]
  assert generate(target, prompts, max_new_tokens=8, eos_id=-1, drafter=d, num_draft=3).tokens == \
      generate(target, prompts, max_new_tokens=8, eos_id=-1).tokens


def test_shipped_dels_loads_and_matches_its_base():
  """The shipped head names the shipped DFlash and was tuned on exactly its weights (retraining DFlash makes the
  head stale: retrain it with `longspec train-drafter --drafter dels --base dflash`)."""
  from longspec_jax import default_target_dir
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, load_drafter
  from longspec_jax.hf_io import load_model_dir, weights_sha256
  info = json.loads((SHIPPED_DRAFTERS_DIR / "dels" / "drafter.json").read_text())
  assert weights_sha256(SHIPPED_DRAFTERS_DIR / "dflash") == info["base_weights_sha256"]
  d = load_drafter("dels", load_model_dir(default_target_dir()))
  assert d.spec.cfg.alpha == tuple(info["alpha"]) and len(d.spec.cfg.alpha) == d.spec.base.cfg.block_size - 1
  for head, base in (("dels-smollm2-135m", "dflash-smollm2-135m"),
                     ("longspark-dels-smollm2-135m", "longspark-smollm2-135m")):  # SmolLM2's: tuned on these bases
    info = json.loads((SHIPPED_DRAFTERS_DIR / head / "drafter.json").read_text())
    conf = json.loads((SHIPPED_DRAFTERS_DIR / head / "config.json").read_text())
    assert conf["base_drafter"] == base and weights_sha256(SHIPPED_DRAFTERS_DIR / base) == info["base_weights_sha256"]


def _longspark_dels(target_model, cfg=None, seed=0, markov_rank=0):
  """The local head over a fresh LongSpark (block of BLOCK - 1 drafts, so cfg's schedule covers it)."""
  from longspec_jax.drafters.longspark import create_longspark, longspark_config_for, longspark_from_model
  base = longspark_from_model(create_longspark(longspark_config_for(
      target_model.cfg, num_layers=1, raw_window=16, num_global_slots=4, block_size=BLOCK - 1,
      markov_rank=markov_rank), seed=3), target_model)
  cfg = cfg or _cfg()
  return dels_from_head(base, cfg, _head(cfg, seed), name="longspark-dels")


@pytest.mark.parametrize("batch,lengths", [(1, [9]), (2, [5, 70])])
def test_greedy_longspark_dels_equals_ar(target, batch, lengths):
  d = _longspark_dels(target)
  assert d.spec.needs_target_kv and d.spec.max_draft_tokens == BLOCK - 1
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=20, eos_id=-1)
  for k in ((1, BLOCK - 1) if batch == 1 else (BLOCK - 1,)):
    assert generate(target, prompts, max_new_tokens=20, eos_id=-1, drafter=d, num_draft=k).tokens == ar.tokens
  with pytest.raises(ValueError, match="Markov head"):
    _longspark_dels(target, markov_rank=4)


def test_projected_head_round_trip(target, tmp_path):
  """A head saved as projections of the target's tables (what the trainers export) loads as the direct-vocab tables
  fused from the bf16 projections; half a pair is refused."""
  from safetensors.numpy import load_file, save_file
  from longspec_jax.training.train_dels import HEAD_PARAMS, shipped_head
  save_dflash_dir(_dflash_model(target), tmp_path / "dflash")
  cfg = _cfg(alpha=0.3, beta=0.1)
  rng = np.random.default_rng(0)
  h = target.cfg.hidden_size
  trained = {k: rng.standard_normal(s).astype(np.float32) for k, s in
             {"proj": (8, h), "w_ih": (36, 8), "w_hh": (36, 12), "rank": (6, 12), "up": (h, 6)}.items()}
  assert set(trained) == set(HEAD_PARAMS)
  prior = unigram_log_prior(rng.integers(0, 9, V), V)
  saved, head = shipped_head(trained, target_io(target), prior)
  saved["proj"] = np.asfortranarray(saved["proj"])  # a transposed view is written in its logical order
  save_dels_dir(cfg, saved, tmp_path / "dels", base_drafter="../dflash")
  d = load_dels(tmp_path / "dels", target)
  for k, x in head.items():
    np.testing.assert_allclose(np.asarray(d.params["head"][k]), x, rtol=1e-6, atol=1e-6)
  embed = np.asarray(target_io(target)["embed"], np.float32)
  np.testing.assert_allclose(head["emb"], embed @ saved["proj"].T, rtol=1e-5, atol=1e-5)
  tensors = load_file(str(tmp_path / "dels" / "model.safetensors"))
  save_file({k: v for k, v in tensors.items() if k != "rank_to_hidden.weight"},
            str(tmp_path / "dels" / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match="both projections"):
    load_dels(tmp_path / "dels", target)


def _budget_dels(target_model, cfg=None, seed=0, budget=16, tail_tokens=24):
  """The local head over BudgetDraft's sparse view of a fresh DFlash (`dels --budget N`): budget 16 keeps two
  chunks of the longer prompts below, and 40 new tokens wrap the 24-row ring."""
  from longspec_jax.drafters.budget import DFlashBudgetDrafter
  base = dflash_from_model(_dflash_model(target_model), target_model)
  base = dataclasses.replace(base, spec=DFlashBudgetDrafter(graphdef=base.spec.graphdef, cfg=base.spec.cfg,
                                                            budget=budget, tail_tokens=tail_tokens))
  cfg = cfg or _cfg()
  return dels_from_head(base, cfg, _head(cfg, seed))


@pytest.mark.parametrize("batch,lengths", [(1, [70]), (2, [45, 13])])
def test_greedy_budget_dels_equals_ar(target, batch, lengths):
  d = _budget_dels(target)
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=40, eos_id=-1)
  for k in ((1, BLOCK - 1) if batch == 1 else (BLOCK - 1,)):
    sp = generate(target, prompts, max_new_tokens=40, eos_id=-1, drafter=d, num_draft=k)
    assert sp.tokens == ar.tokens, f"K={k}"
  # The sparse view changes the drafts: over the 70-token prompt the base sees 16 + ring rows, not 70.
  full = dels_from_head(dflash_from_model(_dflash_model(target), target), _cfg(), _head(_cfg(), 0))
  toks, _, s_budget, ctx = _state_and_ctx(target, d.spec, d.params, [70] * batch, t=72)
  _, _, s_full, _ = _state_and_ctx(target, full.spec, full.params, [70] * batch, t=72)
  z_budget = compiled(d.spec.base.block_logits, d.params["base"], s_budget, ctx.pending, BLOCK - 1)
  z_full = compiled(full.spec.base.block_logits, full.params["base"], s_full, ctx.pending, BLOCK - 1)
  assert not np.allclose(np.asarray(z_budget), np.asarray(z_full), atol=1e-3)


@pytest.mark.parametrize("make,seed", [(_longspark_dels, 19), (_budget_dels, 23)])
def test_sampling_over_other_bases_matches_target_distribution(peaky_target, make, seed):
  """The head over LongSpark and over BudgetDraft's sparse DFlash view."""
  d = make(peaky_target, _cfg(1.0, 0.5), seed=2)
  marg = _exact_marginals(peaky_target, SamplingParams.make(1.0))
  pvals = _chi2_pvalues(_sample(peaky_target, d, 1.0, 0, 1.0, seed=seed), marg)
  assert min(pvals) > 0.01 / N_POS, f"chi-square p-values {pvals}"


def test_budget_option_loads_the_sparse_base_and_refuses_what_does_not_apply(target, tmp_path):
  from longspec_jax.drafters import load_drafter
  from longspec_jax.drafters.budget import DFlashBudgetDrafter
  from longspec_jax.drafters.dflash import DFlashDrafter
  save_dflash_dir(_dflash_model(target), tmp_path / "dflash")
  save_dels_dir(_cfg(), _head(_cfg()), tmp_path / "dels", base_drafter="../dflash")
  full = load_drafter("dels", target, drafter_dir=tmp_path / "dels")
  sparse = load_drafter("dels", target, drafter_dir=tmp_path / "dels", budget=16)
  assert type(full.spec.base) is DFlashDrafter
  assert isinstance(sparse.spec.base, DFlashBudgetDrafter) and sparse.spec.base.budget == 16
  prompts = _prompts(1, [50])
  assert generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=sparse, num_draft=4).tokens == \
      generate(target, prompts, max_new_tokens=12, eos_id=-1).tokens
  with pytest.raises(ValueError, match="budget must be a multiple of 8"):
    load_drafter("dels", target, drafter_dir=tmp_path / "dels", budget=12)
  with pytest.raises(ValueError, match="a budget view's is fixed"):
    load_dels(tmp_path / "dels", target, sharpdraft=object(), budget=16)
  with pytest.raises(ValueError, match="--budget applies to"):
    load_drafter("longspark-dels", target, drafter_dir=tmp_path / "dels", budget=16)
