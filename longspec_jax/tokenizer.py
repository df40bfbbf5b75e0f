"""Byte-level BPE tokenizer in HF `tokenizer.json` format (trained with `tokenizers`, loads in transformers)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
  from tokenizers import Tokenizer

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"  # reserved for block drafters (DFlash / PARD mask slots)
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=True,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | os.PathLike, model_max_length: int = 32768) -> None:
  """Writes tokenizer.json + tokenizer_config.json + special_tokens_map.json (AutoTokenizer-loadable)."""
  from transformers import PreTrainedTokenizerFast

  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok,
      eos_token=EOS_TOKEN,
      bos_token=EOS_TOKEN,
      pad_token=PAD_TOKEN,
      mask_token=MASK_TOKEN,
      model_max_length=model_max_length,
  )
  fast.save_pretrained(str(out_dir))


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
  """Loads `tokenizer.json` as a `tokenizers.Tokenizer` (fast, no torch) with clear errors."""
  from tokenizers import Tokenizer

  path = Path(model_dir) / "tokenizer.json"
  if not path.exists():
    raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"corrupt tokenizer file {path}: {e}") from e


def encode_prompt(tok: Tokenizer, text: str, bos_token_id: int | None) -> list[int]:
  """The token ids of a prompt: `bos_token_id` first when the target has one (ours: the id prepended to every
  prompt; SmolLM2's vocabulary says to prepend none, so its config has no BOS), then the text."""
  return ([bos_token_id] if bos_token_id is not None else []) + tok.encode(text).ids


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
  ids = {name: tok.token_to_id(t) for name, t in (("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("mask", MASK_TOKEN))}
  return {k: v for k, v in ids.items() if v is not None}


def eos_token_of(model_dir: str | os.PathLike) -> str:
  """The EOS string a checkpoint's `tokenizer_config.json` names (ours: `<|endoftext|>`; SmolLM2: `<|im_end|>`)."""
  path = Path(model_dir) / "tokenizer_config.json"
  eos = read_json(path).get("eos_token") if path.exists() else None
  if isinstance(eos, dict):  # older transformers write AddedToken dicts
    eos = eos.get("content")
  return eos or EOS_TOKEN


def check_tokenizer_matches(tok: Tokenizer, vocab_size: int, eos_token_id: int | None, where: str = "",
                            eos_token: str = EOS_TOKEN) -> None:
  """A tokenizer whose ids exceed the model's vocabulary, or whose EOS differs, is the wrong tokenizer."""
  n = tok.get_vocab_size()
  if n > vocab_size:
    raise ValueError(f"tokenizer{where} has {n} tokens but the model's vocab_size is {vocab_size}: "
                     "tokenizer and model do not match")
  if eos_token_id is not None and tok.token_to_id(eos_token) not in (None, eos_token_id):
    raise ValueError(f"tokenizer{where} maps {eos_token} to {tok.token_to_id(eos_token)} but the model's "
                     f"eos_token_id is {eos_token_id}: tokenizer and model do not match")


def read_json(path: Path) -> dict:
  try:
    return json.loads(Path(path).read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"corrupt JSON file {path}: {e}") from e
