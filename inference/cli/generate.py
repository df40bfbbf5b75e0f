"""`longspec generate`: a prompt's continuation, plain or speculative, streamed; with --compare-ar, AR timed beside."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from longspec_jax.argtypes import add_command, positive_int
from longspec_jax.inference.cli.flags import (COMPILE_CACHE_HELP, add_method_flags, add_output_flags,
                                              add_sampling_flags, add_target_flags, check_draft_length_target,
                                              check_method_flags, check_output_file, draft_length_arg, drafter_options,
                                              model_dir, progress, read_text_file, target_from_flags, write_json)

if TYPE_CHECKING:
  import argparse

GENERATE_EPILOG = """\
output: the text on stdout; on stderr, the new tokens, decode tokens/s (the decode loop's tokens over its time,
compilation and prefill excluded), tau for speculative methods, and with --compare-ar the AR tokens/s, the speedup
and whether the tokens equal AR's. --json OUT also writes: prompt_tokens, output_tokens, text, method,
num_draft_tokens, compile_s (tracing, lowering, and compiling or loading the programs), programs_compiled and
programs_from_cache (XLA programs compiled, or loaded from the persistent cache), prefill_ms,
decode_tokens_per_s (= tokens_per_s), tau,
ar_tokens_per_s, speedup, exact_match_ar. Compiled programs are cached on disk (see --compile-cache), so a second
identical run does not compile again."""
CACHE_EVENTS = {"programs_compiled": "/jax/compilation_cache/cache_misses",
                "programs_from_cache": "/jax/compilation_cache/cache_hits"}


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


def cmd_generate(a: argparse.Namespace) -> int:
  from longspec_jax.compile_cache import enable_compile_cache
  if (a.prompt is None) == (a.prompt_file is None):
    raise ValueError("give exactly one of --prompt TEXT or --prompt-file F")
  text = a.prompt if a.prompt is not None else read_text_file(a.prompt_file, "prompt file")
  if not text:
    raise ValueError("the prompt is empty")
  check_method_flags(a)
  if a.suffix_index_update and not a.suffix_index:
    raise ValueError("--suffix-index-update adds this generation to the index of --suffix-index FILE: give one")
  if a.compare_ar and a.method == "ar":
    raise ValueError("--compare-ar compares a speculative --method with AR; --method ar is AR already")
  check_output_file(a.json, "--json")
  log = progress(a)
  cache = enable_compile_cache(a.compile_cache)
  log("importing jax" + (f"; compiled programs are cached in {cache}" if cache else ""))
  import statistics

  import jax

  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference import engine
  from longspec_jax.tokenizer import encode_prompt

  log(f"loading the target from {model_dir(a.model)}")
  model, tok, target_dir = target_from_flags(a)
  ids = encode_prompt(tok, text, model.cfg.bos_token_id)
  if a.max_prompt_tokens is not None and len(ids) > a.max_prompt_tokens:
    log(f"prompt cut by --max-prompt-tokens: its first {a.max_prompt_tokens:,} of {len(ids):,} tokens kept")
    ids = ids[:a.max_prompt_tokens]
  check_draft_length_target(a, target_dir)
  options = drafter_options(a)
  if a.suffix_index:  # loaded here to check it against the target's tokenizer too
    from longspec_jax.suffix_index import load_index
    options["suffix_index"] = load_index(a.suffix_index, model.cfg.vocab_size, tok)
  drafter = load_drafter(a.method, model, a.drafter, **options)
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
  # The text streams from a first run of the method. Alone (no --compare-ar, --repeats 1) that run is the timed
  # one; otherwise it is a warm-up, AR gets one too, and the timed runs follow unstreamed (the decode loop in one
  # call), the modes alternating: both are timed the same way, warm, on the same machine state.
  stream = TextStream(tok, len(ids), model.cfg.eos_token_id)
  streamed = engine.run(config, params, inputs, on_steps=stream, programs=programs["method"])
  stream.finish()
  runs = {name: [] for name, *_ in modes}
  if len(modes) == 1 and a.repeats == 1:
    runs["method"].append(streamed)
  else:
    for name, c, p, i in modes[1:]:
      engine.run(c, p, i, programs=programs[name])  # warm-up
    for _ in range(a.repeats):
      for name, c, p, i in modes:
        runs[name].append(engine.run(c, p, i, programs=programs[name]))
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
  if a.suffix_index_update:
    from longspec_jax.suffix_index import read_header, save_index, update_index
    index = options["suffix_index"]
    # the prompt's last tokens give the first generated tokens their contexts; the file keeps its cap
    save_index(update_index(index, [ids[-index.orders[-1]:] + out_ids]), a.suffix_index,
               read_header(a.suffix_index)["cap_bytes"])
    log(f"added the {len(out_ids)} generated tokens to {a.suffix_index}")
  text_out = tok.decode([t for t in out_ids if t != model.cfg.eos_token_id])
  write_json(a.json, {"prompt_tokens": ids, "output_tokens": out_ids, "text": text_out, **stats})
  return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
  g = add_command(sub, "generate", "generate text with the target, plain or speculative (--method)",
      "Generate a continuation of a prompt with the target model, autoregressively or\n"
      "with a speculative --method (lossless: greedy output equals AR's). The text\n"
      "streams to stdout; progress and a tokens/s summary go to stderr.", epilog=GENERATE_EPILOG)
  g.add_argument("--prompt", help="the prompt text (or --prompt-file)")
  g.add_argument("--prompt-file", help="read the prompt from this UTF-8 text file (or --prompt)")
  g.add_argument("--max-new-tokens", type=positive_int, default=64, help="stop after this many new tokens (or EOS)")
  add_method_flags(g)
  g.add_argument("--suffix-index-update", action="store_true",
                 help="after generating, add the output to the --suffix-index file (rewritten whole; its size "
                      "stays fixed)")
  g.add_argument("--compare-ar", action="store_true",
                 help="also run plain AR on the same prompt: its tokens/s, the speedup, and whether the tokens are "
                      "equal")
  add_sampling_flags(g)
  add_target_flags(g)
  g.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                 help="keep only the first N prompt tokens (BOS included); default: the whole prompt")
  g.add_argument("--repeats", type=positive_int, default=1,
                 help="timed runs per mode, tokens/s is their median; the text streams from a first run, which is "
                      "the timed one only when it is the only run (with --compare-ar or --repeats > 1 it is a "
                      "warm-up, and the timed runs of the method and AR alternate, unstreamed)")
  g.add_argument("--stats", action="store_true", help="print the timings and counts as JSON on stderr")
  g.add_argument("--compile-cache", metavar="DIR|off", help=COMPILE_CACHE_HELP)
  add_output_flags(g, json_help="also write prompt and output tokens, text and timings here")
  g.set_defaults(fn=cmd_generate)
