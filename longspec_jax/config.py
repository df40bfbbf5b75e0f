"""Model configs: a frozen, validated dataclass built from (and written back to) an HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

FAMILIES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# HF keys that carry no information for inference here; accepted and dropped.
_HF_IGNORED_KEYS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range",
    "attention_dropout", "pretraining_tp", "max_window_layers", "layer_types", "output_attentions",
    "output_hidden_states", "return_dict", "is_encoder_decoder", "tie_encoder_decoder", "_name_or_path",
    "id2label", "label2id", "problem_type", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "bos_token_id", "eos_token_id", "model_type", "head_dim", "hidden_act", "sliding_window", "use_sliding_window",
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "max_position_embeddings", "rms_norm_eps", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "mask_token_id", "chunk_size_feed_forward",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "add_cross_attention", "output_scores", "return_dict_in_generate", "torchscript", "partial_rotary_factor",
    "quantization_config",
})
# The target's KV cache dtypes (`kv_cache.KVCache`): int8 has a scale per token and KV head.
KV_DTYPES = ("float32", "bfloat16", "int8")
# The one quantized storage read here: hf_io's int8 matrices with a scale per output row.
INT8_QUANT_METHOD = "longspec_int8_per_row"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  rope_type: str = "default"
  theta: float = 10000.0
  factor: float = 1.0
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0  # yarn
  beta_slow: float = 1.0  # yarn
  attention_factor: float | None = None  # yarn; None = derived from factor
  mscale: float | None = None  # yarn (DeepSeek form)
  mscale_all_dim: float | None = None
  truncate: bool = True  # yarn
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if self.theta <= 0 or self.factor <= 0:
      raise ValueError(f"rope theta and factor must be positive, got theta={self.theta}, factor={self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  max_position_embeddings: int
  rope: RopeConfig = RopeConfig()
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  mlp_bias: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  mask_token_id: int | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                       f"num_key_value_heads ({self.num_key_value_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
      v = getattr(self, name)
      if v is not None and not 0 <= v < self.vocab_size:
        raise ValueError(f"{name}={v} is outside the vocabulary [0, {self.vocab_size})")

  @property
  def q_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  # ---- HF config.json <-> ours ----
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    unknown = sorted(set(d) - _HF_IGNORED_KEYS)
    if unknown:
      raise ValueError(f"unknown config keys {unknown} (a Qwen3 / Llama config.json was expected)")
    family = d.get("model_type")
    if family not in FAMILIES:
      raise ValueError(f"config.json model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
    if d.get("use_sliding_window", False):
      raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError("partial_rotary_factor != 1 is not supported")
    quant = (d.get("quantization_config") or {}).get("quant_method", INT8_QUANT_METHOD)
    if quant != INT8_QUANT_METHOD:
      raise ValueError(f"quantization {quant!r} is not supported (only {INT8_QUANT_METHOD!r}, hf_io.write_int8_copy)")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim") or hidden // heads
    max_pos = d.get("max_position_embeddings", 32768)

    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rp.values()):
      raise ValueError("per-layer-type rope parameters are not supported")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    known_rope = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                  "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate", "low_freq_factor",
                  "high_freq_factor", "partial_rotary_factor"}
    if set(rp) - known_rope:
      raise ValueError(f"unknown rope parameter keys {sorted(set(rp) - known_rope)}")
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    factor = rp.get("factor")
    orig = rp.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and orig is None:
      orig = max_pos
    if rope_type == "yarn" and factor is None:
      factor = max_pos / orig
    rope = RopeConfig(
        rope_type=rope_type, theta=float(theta), factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=orig,
        beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
        attention_factor=rp.get("attention_factor"), mscale=rp.get("mscale"),
        mscale_all_dim=rp.get("mscale_all_dim"), truncate=bool(rp.get("truncate", True)),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)))

    def first(v):
      return v[0] if isinstance(v, (list, tuple)) else v

    return cls(
        family=family, vocab_size=d["vocab_size"], hidden_size=hidden, intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads, head_dim=head_dim,
        max_position_embeddings=max_pos, rope=rope, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=d.get("tie_word_embeddings", family == "qwen3"),
        attention_bias=d.get("attention_bias", False), mlp_bias=d.get("mlp_bias", False),
        bos_token_id=first(d.get("bos_token_id")), eos_token_id=first(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"), mask_token_id=d.get("mask_token_id"))

  def to_hf_dict(self) -> dict[str, Any]:
    r = self.rope
    rope_parameters: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type != "default":
      rope_parameters["factor"] = r.factor
    if r.rope_type in ("yarn", "llama3") and r.original_max_position_embeddings is not None:
      rope_parameters["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.rope_type == "yarn":
      rope_parameters.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
      for k in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(r, k) is not None:
          rope_parameters[k] = getattr(r, k)
    if r.rope_type == "llama3":
      rope_parameters.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    d = {
        "architectures": [FAMILIES[self.family]], "model_type": self.family, "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
        "rope_parameters": rope_parameters, "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias, "torch_dtype": "float32",
    }
    if self.family == "llama":
      d["mlp_bias"] = self.mlp_bias
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
      if getattr(self, k) is not None:
        d[k] = getattr(self, k)
    return d

  @classmethod
  def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
    return cls.from_hf_dict(read_config_json(path))

  def replace(self, **kw: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


def read_config_json(path: str | os.PathLike, what: str = "model") -> dict:
  """A config.json file as a dict; a missing or corrupt file is an error that names it."""
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"missing {what} config {path}")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"corrupt config file {path}: {e}") from e
