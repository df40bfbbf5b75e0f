"""GGUF (llama.cpp) checkpoints -> ordinary HF directories, read with the `gguf` package (no torch).

The result holds `config.json`, `model.safetensors` (dequantized, HF tensor names, Q/K rows in HF order) and an HF
`tokenizer.json` + `tokenizer_config.json` rebuilt from the GGUF `tokenizer.ggml.*` metadata, so both our loader and
`transformers` read it. Only the Llama architecture with a byte-level BPE ("gpt2") vocabulary is supported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from gguf import GGUFReader
  from tokenizers import Tokenizer
  from tqdm import tqdm

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TOKENIZERS = ("gpt2",)
_TOKEN_TYPE_CONTROL = 3

# GGUF tensor name (per block: "blk.{i}.<name>") -> HF name.
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizer splits by `tokenizer.ggml.pre`: which digits are isolated before the byte-level GPT-2 split.
# "smollm" (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM) isolates every digit; "gpt2"/"default" use the GPT-2 regex only.
_DIGIT_SPLITTING_PRE = ("smollm",)
_PLAIN_PRE = ("gpt2", "default")


def _reader(path):
  import gguf
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # the reader raises ValueError/struct errors on a bad magic or truncated file
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def hf_config(reader: GGUFReader) -> dict:
  """The HF Llama config.json for a GGUF file (from its `general.*`, `llama.*` and `tokenizer.ggml.*` keys)."""
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
  p = f"{arch}."
  hidden = int(_field(reader, p + "embedding_length"))
  heads = int(_field(reader, p + "attention.head_count"))
  tokens = reader.fields["tokenizer.ggml.tokens"]
  vocab = int(_field(reader, p + "vocab_size", len(tokens.data)))
  head_dim = int(_field(reader, p + "rope.dimension_count", hidden // heads))
  rope = {"rope_type": "default", "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0))}
  scaling = _field(reader, p + "rope.scaling.type", "none")
  if scaling not in ("none", None):
    if scaling not in ("linear", "yarn"):
      raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (none, linear, yarn)")
    rope.update(rope_type=scaling, factor=float(_field(reader, p + "rope.scaling.factor")))
    orig = _field(reader, p + "rope.scaling.original_context_length")
    if orig is not None:
      rope["original_max_position_embeddings"] = int(orig)
  names = {t.name for t in reader.tensors}
  cfg = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": int(_field(reader, p + "feed_forward_length")),
      "num_hidden_layers": int(_field(reader, p + "block_count")), "num_attention_heads": heads,
      "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)), "head_dim": head_dim,
      "max_position_embeddings": int(_field(reader, p + "context_length")),
      "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_parameters": rope, "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
      "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
  }
  for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("pad_token_id", "padding_token_id")):
    v = _field(reader, f"tokenizer.ggml.{key}")
    if v is not None:
      cfg[ours] = int(v)
  # Our config's bos_token_id is the token prepended to every prompt; a vocabulary that says not to add one
  # (SmolLM2: add_bos_token false, BOS = <|im_start|>, a chat-role marker) keeps it in generation_config only.
  if not _field(reader, "tokenizer.ggml.add_bos_token", False):
    cfg.pop("bos_token_id", None)
  return cfg


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's conversion permutation of Q/K rows ([out, in]): within each head, llama.cpp stores the
  two rotary halves interleaved (row pairs); HF keeps them as two contiguous halves."""
  out = w.shape[0]
  half = out // n_heads // 2
  return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: GGUFReader, cfg: dict, dtype: type = np.float32,
               progress: tqdm | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, dequantized array [out, in] in `dtype`) for every tensor of the file."""
  import gguf
  for t in reader.tensors:
    m = _BLOCK_RE.match(t.name)
    if m and m.group(2) in _BLOCK_NAMES:
      name = f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    elif t.name in _GLOBAL_NAMES:
      name = _GLOBAL_NAMES[t.name]
    else:
      raise ValueError(f"GGUF tensor {t.name!r} has no Llama counterpart (unsupported model variant)")
    try:
      a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"GGUF tensor {t.name} uses quantization {t.tensor_type.name}, which the gguf package "
                       f"cannot dequantize: {e}") from e
    a = np.asarray(a, np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
    if m and m.group(2) == "attn_q.weight":
      a = unpermute_qk(a, cfg["num_attention_heads"])
    elif m and m.group(2) == "attn_k.weight":
      a = unpermute_qk(a, cfg["num_key_value_heads"])
    if progress is not None:
      progress.update(1)
    yield name, a.astype(dtype)


def hf_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict[str, str]]:
  """A `tokenizers.Tokenizer` (byte-level BPE) and the special-token strings, from `tokenizer.ggml.*`."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  kind = _field(reader, "tokenizer.ggml.model")
  if kind not in SUPPORTED_TOKENIZERS:
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: {', '.join(SUPPORTED_TOKENIZERS)}"
                     " (byte-level BPE)")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  try:
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
  except Exception as e:  # tokenizers raises a bare Exception naming the offending token
    raise ValueError(f"GGUF file has an inconsistent BPE vocabulary: {e}") from e
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(_field(reader, "tokenizer.ggml.add_space_prefix",
                                                                     False)), use_regex=True)
  if pre in _DIGIT_SPLITTING_PRE:
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in _PLAIN_PRE:
    tok.pre_tokenizer = byte_level
  else:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                     f"{', '.join(_DIGIT_SPLITTING_PRE + _PLAIN_PRE)}")
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL])
  special = {}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                    ("pad_token", "padding_token_id")):
    v = _field(reader, f"tokenizer.ggml.{key}")
    if v is not None:
      special[name] = tokens[int(v)]
  return tok, special


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32",
                show_progress: bool = True) -> Path:
  """Converts a GGUF file into an HF directory at `out_dir`, written atomically (a temporary sibling directory
  renamed into place), so an interrupted conversion never leaves a half-written model behind."""
  import ml_dtypes
  from safetensors.numpy import save_file
  from tqdm import tqdm
  from transformers import PreTrainedTokenizerFast

  if dtype not in ("fp32", "bf16"):
    raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")
  np_dtype = np.float32 if dtype == "fp32" else ml_dtypes.bfloat16
  reader = _reader(gguf_path)
  cfg = hf_config(reader)
  tok, special = hf_tokenizer(reader)
  if tok.get_vocab_size() > cfg["vocab_size"]:
    raise ValueError(f"GGUF tokenizer has {tok.get_vocab_size()} tokens, more than the model's vocab_size "
                     f"{cfg['vocab_size']}")
  cfg["torch_dtype"] = "float32" if dtype == "fp32" else "bfloat16"
  out_dir = Path(out_dir)
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
  tmp.chmod(0o755)  # mkdtemp's 0700 would make a shared cache unreadable to others
  try:
    with tqdm(total=len(reader.tensors), desc=f"import {Path(gguf_path).name}", unit="tensor",
              disable=not show_progress) as bar:
      tensors = dict(hf_tensors(reader, cfg, np_dtype, bar))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {k: cfg[k] for k in ("eos_token_id", "pad_token_id") if k in cfg}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
      gen["bos_token_id"] = int(bos)
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=cfg["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False, **special)
    template = _field(reader, "tokenizer.chat_template")
    if template:
      fast.chat_template = template
    fast.save_pretrained(str(tmp))
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    tc_path.write_text(json.dumps(tc, indent=2))
    (tmp / "source.json").write_text(json.dumps({"gguf": str(Path(gguf_path).resolve()),
                                                 "gguf_bytes": os.path.getsize(gguf_path), "dtype": dtype},
                                                indent=2))
    if out_dir.exists():
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir
