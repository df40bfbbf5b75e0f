"""The target's commands: `corpus`, `tokenizer`, `train-target`, `eval-target`, `export-hf`, `import-gguf` and
`memory` (how a target fits a TPU slice)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax import ASSETS_DIR
from longspec_jax.argtypes import add_command, positive_int
from longspec_jax.inference.cli.flags import (add_output_flags, add_target_flags, check_output_file, dtype_arg,
                                              read_text_file, target_from_flags, write_json)

if TYPE_CHECKING:
  import argparse


def cmd_corpus(a: argparse.Namespace) -> int:
  from longspec_jax.training.data import CorpusConfig, build_corpus
  out = build_corpus(a.out, CorpusConfig())
  print((out / "manifest.json").read_text())
  return 0


def cmd_tokenizer(a: argparse.Namespace) -> int:
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  from longspec_jax.training.data import load_corpus
  texts = load_corpus(a.corpus)["train"]["text"]
  save_hf_tokenizer(train_bpe(texts, a.vocab_size), a.out)
  print(f"wrote {a.out}/tokenizer.json")
  return 0


def cmd_train_target(a: argparse.Namespace) -> int:
  from longspec_jax.training.train_target import TargetTrainConfig, train_target
  from longspec_jax.yaml_config import load_yaml
  cfg = load_yaml(TargetTrainConfig, a.config, a.set)
  print(train_target(cfg, resume=not a.no_resume))
  return 0


def cmd_export_hf(a: argparse.Namespace) -> int:
  from longspec_jax.hf_io import save_model_dir
  out = Path(a.out)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out {out} exists and is not an empty directory; choose a new one (export-hf never writes "
                     "beside other files)")
  model, _, src = target_from_flags(a)
  save_model_dir(model, a.out, tokenizer_dir=src)
  print(f"wrote {a.out}")
  return 0


def cmd_import_gguf(a: argparse.Namespace) -> int:
  from longspec_jax.gguf_import import import_gguf
  out = import_gguf(a.gguf, a.out, dtype={"float32": "fp32", "bfloat16": "bf16"}[a.dtype])
  print(f"wrote {out}")
  return 0


def cmd_eval_target(a: argparse.Namespace) -> int:
  from longspec_jax import long_doc_paths

  files = [Path(f) for f in a.text_file] if a.text_file else long_doc_paths()
  if not files:
    raise ValueError("no text files to evaluate")
  texts = [read_text_file(f, "text file") for f in files]  # before the model loads
  check_output_file(a.json, "--json")
  from longspec_jax.tokenizer import encode_prompt
  from longspec_jax.training.eval_target import evaluate_position_buckets, load_unigram, unigram_log_probs

  model, tok, model_dir = target_from_flags(a)
  docs = [encode_prompt(tok, t, model.cfg.bos_token_id) for t in texts]
  unigram = load_unigram(model_dir, model.cfg.vocab_size)
  source = "model_dir/unigram.npy (training-split counts)"
  if unigram is None:
    unigram, source = unigram_log_probs(docs, model.cfg.vocab_size), "in-sample counts of the evaluated text"
  t0 = time.time()
  res = evaluate_position_buckets(model, docs, unigram, max_len=a.max_len)
  res.update(files=[str(f) for f in files], unigram_source=source, eval_s=round(time.time() - t0, 1),
             model=str(a.model or model_dir), rope_scaling=a.rope_scaling, dtype=a.dtype, kv_dtype=model.kv_dtype)
  print(json.dumps(res, indent=2))
  write_json(a.json, res)
  return 0


def cmd_memory(a: argparse.Namespace) -> int:
  path = Path(a.config)
  path = path / "config.json" if path.is_dir() else path
  if not path.is_file():
    raise FileNotFoundError(f"HF config {path} not found")
  check_output_file(a.json, "--json")
  from longspec_jax.config import ModelConfig
  from longspec_jax.inference.memory import estimate, table

  res = estimate(ModelConfig.from_json_file(path), a.slice, a.context, a.batch, a.dtype)
  print(table(res))
  write_json(a.json, {"config": str(path), **res})
  return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
  c = add_command(sub, "corpus", "build the stdlib-source corpus (datasets/Arrow, split by document)",
      "Collect every UTF-8 .py file of this CPython's standard library (no site-packages)\n"
      "into a datasets/Arrow corpus, split train/validation/test/long_test by a hash of\n"
      "each path, with manifest.json (sources, version, licence, counts).")
  c.add_argument("--out", default="data/corpus", help="output directory")
  c.set_defaults(fn=cmd_corpus)

  t = add_command(sub, "tokenizer", "train the byte-level BPE tokenizer on the corpus train split",
      "Train a byte-level BPE tokenizer (the shipped target's) on the corpus train split\n"
      "and write it as an HF tokenizer.json.")
  t.add_argument("--corpus", default="data/corpus", help="corpus directory (from `longspec corpus`)")
  t.add_argument("--out", default="data/tokenizer", help="output directory")
  t.add_argument("--vocab-size", type=positive_int, default=8192, help="vocabulary size, special tokens included")
  t.set_defaults(fn=cmd_tokenizer)

  tt = add_command(sub, "train-target", "train the target with a sequence-length curriculum",
      "Train the default target (sharded, orbax checkpoints) with the curriculum in the\n"
      "YAML config; rerunning resumes from the last checkpoint.")
  tt.add_argument("--config", default=str(ASSETS_DIR / "configs" / "target_default.yaml"),
                  help="YAML run config (unknown keys are errors; default: the shipped target's, "
                       "longspec_jax/assets/configs/target_default.yaml)")
  tt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  tt.add_argument("--no-resume", action="store_true", help="start over instead of resuming the last checkpoint")
  tt.set_defaults(fn=cmd_train_target)


  ev = add_command(sub, "eval-target", "next-token loss per position bucket on long documents",
      "Mean next-token loss (nats) of the target per position bucket (0-1K, 1-2K, 2-4K,\n"
      "4-8K, 8-16K) on long documents, beside a unigram baseline; JSON on stdout.")
  add_target_flags(ev)
  ev.add_argument("--text-file", action="append", default=[],
                  help="a document to evaluate (repeatable; default: the shipped held-out long documents)")
  ev.add_argument("--max-len", type=positive_int, default=16384, help="tokens read from each document")
  add_output_flags(ev, quiet="")
  ev.set_defaults(fn=cmd_eval_target)

  e = add_command(sub, "export-hf", "write config.json + safetensors + tokenizer (transformers-loadable)",
      "Write the target as an HF directory (config.json, safetensors, tokenizer files)\n"
      "that transformers loads.")
  e.add_argument("--out", required=True, help="output directory (new, or empty)")
  add_target_flags(e, dtype=False)
  e.set_defaults(fn=cmd_export_hf)

  ig = add_command(sub, "import-gguf", "convert a llama.cpp GGUF (Llama) into an HF directory (no torch)",
      "Convert a llama.cpp GGUF file (Llama architecture, byte-level BPE) into an HF\n"
      "directory: config from the metadata, dequantized tensors under HF names,\n"
      "tokenizer.json rebuilt from the GGUF vocabulary.")
  ig.add_argument("--gguf", required=True, help="path to the .gguf file")
  ig.add_argument("--out", required=True, help="output HF directory (written atomically)")
  ig.add_argument("--dtype", type=dtype_arg(("float32", "bfloat16")), default="float32", metavar="{float32,bfloat16}",
                  help="dtype of the dequantized weights")
  ig.set_defaults(fn=cmd_import_gguf)

  mem = add_command(sub, "memory", "how a target (HF config.json) fits a Cloud TPU slice, per mesh",
      "Parameter and KV-cache bytes per chip for generation on a TPU slice, for every\n"
      "(data, model) mesh, under the tensor-parallel sharding rules.")
  mem.add_argument("--config", required=True, help="an HF config.json, or a model directory holding one")
  mem.add_argument("--slice", required=True, metavar="TYPE", help="accelerator type, e.g. v5litepod-16, v5p-32, v4-32")
  mem.add_argument("--context", type=positive_int, default=32768, help="KV-cache length per sequence")
  mem.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
  mem.add_argument("--dtype", type=dtype_arg(("bfloat16", "float32")), default="bfloat16",
                   metavar="{bfloat16,float32}", help="parameter and cache dtype")
  add_output_flags(mem, quiet="")
  mem.set_defaults(fn=cmd_memory)
