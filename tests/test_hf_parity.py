"""Parity with `transformers` on tiny random Qwen3 / Llama models, both directions."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from longspec_jax.inference.generate import generate  # noqa: E402
from longspec_jax.hf_io import load_model_dir, save_model_dir  # noqa: E402
from tests.compiled import compiled  # noqa: E402

ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


def make_hf(family, rope=None, tie=None, seed=0):
  cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
  kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, eos_token_id=3, bos_token_id=4,
            tie_word_embeddings=(family == "qwen3") if tie is None else tie)
  if rope is not None:
    kw["rope_parameters"] = dict(rope, rope_theta=10000.0)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32).eval()
  # Random norm scales so a dropped norm or a transposed matrix cannot hide behind ones.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
  return model


def torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rope", list(ROPE_VARIANTS))
def test_load_hf_logits_match(tmp_path, family, rope):
  hf = make_hf(family, ROPE_VARIANTS[rope])
  hf.save_pretrained(tmp_path)
  ours = load_model_dir(tmp_path)
  ids = np.random.default_rng(0).integers(0, 128, (2, 48))
  diff = np.abs(torch_logits(hf, ids) - np.asarray(compiled(ours, jnp.asarray(ids), mode="train").logits)).max()
  assert diff <= 1e-4, f"{family}/{rope}: max abs logit diff {diff}"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_continuation_matches_transformers(tmp_path, family):
  hf = make_hf(family)
  hf.save_pretrained(tmp_path)
  ours = load_model_dir(tmp_path)
  prompt = [5, 17, 99, 23, 42, 8, 61]
  with torch.no_grad():
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(prompt):].tolist()
  got = generate(ours, [prompt], max_new_tokens=20, eos_id=-1).tokens[0]
  assert got == ref


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_export_loads_in_transformers(tmp_path, family):
  hf = make_hf(family, seed=1)
  hf.save_pretrained(tmp_path / "src")
  ours = load_model_dir(tmp_path / "src")
  save_model_dir(ours, tmp_path / "out")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, 128, (1, 30))
  diff = np.abs(torch_logits(back, ids) - np.asarray(compiled(ours, jnp.asarray(ids), mode="train").logits)).max()
  assert diff <= 1e-4


def test_sharded_index_and_bf16(tmp_path):
  hf = make_hf("llama", seed=2)
  ours = None
  hf.save_pretrained(tmp_path / "src")
  ours = load_model_dir(tmp_path / "src")
  save_model_dir(ours, tmp_path / "sharded", max_shard_bytes=20_000)
  index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  again = load_model_dir(tmp_path / "sharded")
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (1, 16)))
  assert np.abs(np.asarray(compiled(again, ids).logits) - np.asarray(compiled(ours, ids).logits)).max() == 0
  # bf16 on disk: loads into fp32 params equal to the rounded weights; transformers reads it too.
  save_model_dir(ours, tmp_path / "bf16", dtype=jnp.bfloat16)
  bf = load_model_dir(tmp_path / "bf16")
  hf_bf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
  diff = np.abs(torch_logits(hf_bf, np.asarray(ids)) - np.asarray(compiled(bf, ids).logits)).max()
  assert diff <= 1e-4
