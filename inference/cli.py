"""`longspec` command line. Flags and JSON keys named in the issues are a contract: add, never rename."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _model_dir(arg: str | None) -> Path:
  from longspec_jax import default_target_dir
  return Path(arg) if arg else default_target_dir()


def _write_json(path: str | None, obj: dict) -> None:
  if path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2))


def encode_prompt(tok, text: str, bos_id: int | None) -> list[int]:
  ids = tok.encode(text).ids
  return ([bos_id] if bos_id is not None else []) + ids


def cmd_generate(a) -> int:
  from inference.generate import generate
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.tokenizer import load_tokenizer

  if (a.prompt is None) == (a.prompt_file is None):
    raise SystemExit("error: give exactly one of --prompt TEXT or --prompt-file F")
  text = a.prompt if a.prompt is not None else Path(a.prompt_file).read_text()
  if not text:
    raise SystemExit("error: the prompt is empty")
  model_dir = _model_dir(a.model)
  model = load_model_dir(model_dir)
  tok = load_tokenizer(model_dir)
  ids = encode_prompt(tok, text, model.cfg.bos_token_id)
  if a.max_prompt_tokens:
    ids = ids[:a.max_prompt_tokens]
  sampling = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
  stats = {}
  if a.stats:
    from inference.bench import decode_rate
    # A compiling call, then medians of 3 (prefill and decode programs timed apart).
    res, tps, prefill_s, _ = decode_rate(model, [ids], a.max_new_tokens, 3, **sampling)
    stats = {"prompt_len": len(ids), "new_tokens": len(res.tokens[0]), "prefill_ms": 1000 * prefill_s,
             "decode_tokens_per_s": tps, "total_s": res.wall_s}
  else:
    res = generate(model, [ids], max_new_tokens=a.max_new_tokens, **sampling)
  out_ids = res.tokens[0]
  text_out = tok.decode([t for t in out_ids if t != model.cfg.eos_token_id])
  print(text_out)
  if a.stats:
    print(json.dumps(stats, indent=2), file=sys.stderr)
  _write_json(a.json, {"prompt_tokens": ids, "output_tokens": out_ids, "text": text_out,
                       "prefill_ms": stats.get("prefill_ms"),
                       "decode_tokens_per_s": stats.get("decode_tokens_per_s"), **stats})
  return 0


def cmd_corpus(a) -> int:
  from training.data import CorpusConfig, build_corpus
  out = build_corpus(a.out, CorpusConfig())
  print((out / "manifest.json").read_text())
  return 0


def cmd_tokenizer(a) -> int:
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  from training.data import load_corpus
  texts = load_corpus(a.corpus)["train"]["text"]
  save_hf_tokenizer(train_bpe(texts, a.vocab_size), a.out)
  print(f"wrote {a.out}/tokenizer.json")
  return 0


def cmd_train_target(a) -> int:
  from longspec_jax.yaml_config import load_yaml
  from training.train_target import TargetTrainConfig, train_target
  cfg = load_yaml(TargetTrainConfig, a.config, a.set)
  print(train_target(cfg, resume=not a.no_resume))
  return 0


def cmd_export_hf(a) -> int:
  from longspec_jax.hf_io import load_model_dir, save_model_dir
  src = _model_dir(a.model)
  model = load_model_dir(src)
  save_model_dir(model, a.out, tokenizer_dir=src)
  print(f"wrote {a.out}")
  return 0


def cmd_eval_target(a) -> int:
  from inference.eval_target import evaluate_position_buckets, load_unigram, unigram_log_probs
  from longspec_jax import long_doc_paths
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.tokenizer import load_tokenizer

  model_dir = _model_dir(a.model)
  model = load_model_dir(model_dir)
  tok = load_tokenizer(model_dir)
  files = [Path(f) for f in a.text_file] if a.text_file else long_doc_paths()
  if not files:
    raise SystemExit("error: no text files to evaluate")
  for f in files:
    if not f.exists():
      raise SystemExit(f"error: text file {f} not found")
  docs = [encode_prompt(tok, f.read_text(), model.cfg.bos_token_id) for f in files]
  unigram = load_unigram(model_dir, model.cfg.vocab_size)
  source = "model_dir/unigram.npy (training-split counts)"
  if unigram is None:
    unigram, source = unigram_log_probs(docs, model.cfg.vocab_size), "in-sample counts of the evaluated text"
  t0 = time.time()
  res = evaluate_position_buckets(model, docs, unigram, max_len=a.max_len)
  res.update(files=[str(f) for f in files], unigram_source=source, eval_s=round(time.time() - t0, 1))
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def cmd_bench(a) -> int:
  from inference.bench import bench_prompts, run_bench, transformers_peers
  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, method_names
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.tokenizer import load_tokenizer

  if a.method not in method_names():
    raise SystemExit(f"error: unknown method {a.method!r}; known methods: {', '.join(method_names())}")
  path = Path(a.text_file)
  if not path.exists():
    raise SystemExit(f"error: text file {path} not found")
  model_dir = _model_dir(a.model)
  model = load_model_dir(model_dir)
  tok = load_tokenizer(model_dir)
  text = path.read_text()
  res = run_bench(model, tok, a.method, text, a.context, a.new_tokens, a.temperature, a.seed, a.batch,
                  a.num_draft, a.drafter, a.repeats, sharpdraft=a.sharpdraft, budget=a.budget)
  if a.peer == "transformers":
    drafter_dir = Path(a.drafter) if a.drafter else SHIPPED_DRAFTERS_DIR / "pard"
    prompts = bench_prompts(tok.encode(text).ids, a.context, 1, model.cfg.bos_token_id)
    res["peer_tokens_per_s"] = transformers_peers(model_dir, drafter_dir if drafter_dir.exists() else None,
                                                  prompts, a.new_tokens, a.num_draft, a.temperature, a.seed,
                                                  a.repeats)
  res["text_file"] = str(path)
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="longspec", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="generate text with the target (shipped default unless --model)")
  g.add_argument("--prompt")
  g.add_argument("--prompt-file")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-k", type=int, default=0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--model")
  g.add_argument("--max-prompt-tokens", type=int, default=0, help="truncate the prompt to this many tokens")
  g.add_argument("--stats", action="store_true", help="print prefill ms and decode tokens/s to stderr")
  g.add_argument("--json")
  g.set_defaults(fn=cmd_generate)

  c = sub.add_parser("corpus", help="build the stdlib-source corpus (datasets/Arrow, split by document)")
  c.add_argument("--out", default="data/corpus")
  c.set_defaults(fn=cmd_corpus)

  t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the corpus train split")
  t.add_argument("--corpus", default="data/corpus")
  t.add_argument("--out", default="data/tokenizer")
  t.add_argument("--vocab-size", type=int, default=8192)
  t.set_defaults(fn=cmd_tokenizer)

  tt = sub.add_parser("train-target", help="train the target with a sequence-length curriculum")
  tt.add_argument("--config", default="configs/target_default.yaml")
  tt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  tt.add_argument("--no-resume", action="store_true")
  tt.set_defaults(fn=cmd_train_target)

  e = sub.add_parser("export-hf", help="write config.json + safetensors + tokenizer (transformers-loadable)")
  e.add_argument("--out", required=True)
  e.add_argument("--model")
  e.set_defaults(fn=cmd_export_hf)

  ev = sub.add_parser("eval-target", help="next-token loss per position bucket on long documents")
  ev.add_argument("--model")
  ev.add_argument("--text-file", action="append", default=[])
  ev.add_argument("--max-len", type=int, default=16384)
  ev.add_argument("--json")
  ev.set_defaults(fn=cmd_eval_target)
  bn = sub.add_parser("bench", help="a speculative method vs jitted AR in the same process")
  bn.add_argument("--method", required=True, help="ar, prompt-lookup, standalone, pard, ...")
  bn.add_argument("--text-file", required=True)
  bn.add_argument("--context", type=int, required=True, help="prompt = first N tokens of the file")
  bn.add_argument("--new-tokens", type=int, default=128)
  bn.add_argument("--temperature", type=float, default=0.0)
  bn.add_argument("--seed", type=int, default=0)
  bn.add_argument("--batch", type=int, default=1)
  bn.add_argument("--num-draft", type=int, default=8, help="K drafted tokens per verification")
  bn.add_argument("--model")
  bn.add_argument("--drafter", help="drafter directory (default: the shipped one for the method)")
  bn.add_argument("--repeats", type=int, default=3)
  bn.add_argument("--peer", choices=["transformers"])
  bn.add_argument("--sharpdraft", choices=["off", "fixed", "exact"], default="off",
                  help="SharpDraft query scaling of the drafter (needs sharpdraft.json: calibrate-sharpdraft)")
  bn.add_argument("--budget", type=int,
                  help="BudgetDraft (--method budget): drafter KV entries kept from the prompt (default 256)")
  bn.add_argument("--json")
  bn.set_defaults(fn=cmd_bench)

  from training.calibrate_sharpdraft import add_subcommand
  add_subcommand(sub)  # calibrate-sharpdraft

  from training.cli_drafter import add_subcommands
  add_subcommands(sub)  # make-drafter-data, train-drafter
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.fn(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
