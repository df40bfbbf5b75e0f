"""Bad input gets one clear error naming the problem."""

import json

import pytest

from longspec_jax.inference.generate import generate
from longspec_jax.config import ModelConfig
from longspec_jax.hf_io import load_model_dir, save_model_dir
from longspec_jax.sampling import SamplingParams


def test_prompt_errors(tiny_model):
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    generate(tiny_model, [[]])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    generate(tiny_model, [[1, 2, 500]])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    generate(tiny_model, [[1, -3]])
  with pytest.raises(ValueError, match="longer than the maximum context"):
    generate(tiny_model, [[1] * 5000])
  with pytest.raises(ValueError, match="exceeds the model's maximum context"):
    generate(tiny_model, [[1] * 4000], max_new_tokens=200)
  with pytest.raises(ValueError, match="list of token-id lists"):
    generate(tiny_model, [1, 2, 3])
  with pytest.raises(ValueError, match="prompt 1 holds something other than token ids"):
    generate(tiny_model, [[1, 2], [None, 5]])  # e.g. a target without BOS prepended as [bos_token_id] + ids
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(tiny_model, [[1, 2]], max_new_tokens=0)


def test_sampling_param_errors():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams.make(temperature=-1)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams.make(top_p=0)
  with pytest.raises(ValueError, match="top_k"):
    SamplingParams.make(top_k=-2)


def test_config_errors(tiny_cfg):
  d = tiny_cfg.to_hf_dict()
  with pytest.raises(ValueError, match=r"unknown config keys \['hiden_size'\]"):
    ModelConfig.from_hf_dict(dict(d, hiden_size=3))
  with pytest.raises(ValueError, match="model_type 'gpt2'"):
    ModelConfig.from_hf_dict(dict(d, model_type="gpt2"))
  with pytest.raises(ValueError, match="multiple of"):
    ModelConfig.from_hf_dict(dict(d, num_key_value_heads=3))
  with pytest.raises(ValueError, match="unsupported rope type"):
    ModelConfig.from_hf_dict(dict(d, rope_parameters={"rope_type": "weird", "rope_theta": 1.0}))
  with pytest.raises(ValueError, match="quantization 'gptq' is not supported"):
    ModelConfig.from_hf_dict(dict(d, quantization_config={"quant_method": "gptq", "bits": 4}))


def test_checkpoint_errors(tmp_path, tiny_model):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_model_dir(tmp_path / "nope")
  d = save_model_dir(tiny_model, tmp_path / "m")
  (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
  with pytest.raises(ValueError, match="corrupt safetensors"):
    load_model_dir(d)
  (d / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    load_model_dir(d)
  d2 = save_model_dir(tiny_model, tmp_path / "m2")
  (d2 / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt config"):
    load_model_dir(d2)
  (d2 / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="missing model config"):
    load_model_dir(d2)
  # Weights for a different shape than the config says.
  d3 = save_model_dir(tiny_model, tmp_path / "m3")
  cfg = json.loads((d3 / "config.json").read_text())
  (d3 / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=80)))
  with pytest.raises(ValueError, match="shape mismatches"):
    load_model_dir(d3)


def test_tokenizer_mismatch(tmp_path, tiny_model):
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  tok = train_bpe(["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 30], vocab_size=300)
  d = save_model_dir(tiny_model, tmp_path / "m")
  save_hf_tokenizer(tok, d)  # 300 tokens > the model's 128
  with pytest.raises(ValueError, match="tokenizer and model do not match"):
    load_model_dir(d)
