"""`longspec bench`, `bench-suite` and `calibrate-draft-length`: methods timed against jitted AR in one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.argtypes import add_command, ascending_lengths, positive_int
from longspec_jax.drafters.registry import DEFAULT_NUM_DRAFT
from longspec_jax.inference.cli.flags import (add_method_flags, add_output_flags, add_sampling_flags, add_target_flags,
                                              check_draft_length_target, check_method_flags, check_output_file,
                                              draft_length_arg, drafter_options, model_dir, num_draft_int, progress,
                                              read_text_file, target_from_flags, write_json)

if TYPE_CHECKING:
  import argparse

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


def cmd_bench(a: argparse.Namespace) -> int:
  import importlib.util

  from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, drafter_entry, drafter_path

  # Every check that needs only the flags and files runs before the model loads.
  path = Path(a.text_file)
  text = read_text_file(a.text_file, "text file")
  a.peer = a.peer or []
  check_method_flags(a, peer_drafter="transformers" in a.peer)
  check_output_file(a.json, "--json")
  if "transformers" in a.peer and importlib.util.find_spec("torch") is None:
    raise ValueError("--peer transformers needs torch: pip install -e \".[test]\"")
  if "llama.cpp" in a.peer:
    from longspec_jax.inference.benchmark.llamacpp import check_peer
    gguf = check_peer(a.model, a.rope_scaling)
  log = progress(a)
  log("importing jax")
  from longspec_jax.config import ModelConfig
  from longspec_jax.inference.bench import run_bench
  from longspec_jax.inference.benchmark.peers import transformers_peers
  from longspec_jax.inference.benchmark.prompts import bench_prompts
  from longspec_jax.tokenizer import load_tokenizer

  target_dir = model_dir(a.model)
  check_draft_length_target(a, target_dir)
  cfg = ModelConfig.from_json_file(target_dir / "config.json")
  if a.method != "ar" and drafter_entry(a.method).checkpoint:
    drafter_path(a.method, a.drafter, cfg, a.learned)  # raises if the checkpoint is missing
  tok = load_tokenizer(target_dir)
  ids = tok.encode(text).ids
  bench_prompts(ids, a.context, a.batch, cfg.bos_token_id)  # raises if the text is too short for the flags
  log(f"loading the target from {target_dir}")
  model, tok, target_dir = target_from_flags(a)
  log(f"prompt: first {a.context} tokens of {path} (of {len(ids)}), batch {a.batch}, {a.new_tokens} new tokens; "
      f"method {a.method} vs AR, {a.repeats} timed repeats each after a compiling call")
  res = run_bench(model, tok, a.method, text, a.context, a.new_tokens, a.temperature, a.seed, a.batch,
                  a.num_draft, a.drafter, a.repeats, log=log, draft_length=draft_length_arg(a), tree=a.tree,
                  **drafter_options(a))
  peer_prompt = bench_prompts(ids, a.context, 1, model.cfg.bos_token_id)[0]  # the peers run the first sequence
  peer_k = res["num_draft_tokens"] or DEFAULT_NUM_DRAFT
  if "transformers" in a.peer:
    log("transformers peers on the same weights: AR, assisted generation, prompt lookup")
    drafter_dir = Path(a.drafter) if a.drafter else SHIPPED_DRAFTERS_DIR / "pard"
    peers = transformers_peers(model, target_dir, drafter_dir if drafter_dir.exists() else None, [peer_prompt],
                               a.new_tokens, peer_k, a.temperature, a.seed, a.repeats)
    res.setdefault("peer_tokens_per_s", {}).update({name: p["tokens_per_s"] for name, p in peers.items()})
    res.setdefault("peer_timing", {}).update(peers)  # prefill and decode ms per peer, timed inside each call
  if "llama.cpp" in a.peer:
    from longspec_jax.inference.benchmark.llamacpp import agreement, run_peers
    log("llama.cpp peers on the GGUF the target comes from: AR, prompt lookup (each in a child process)")
    peers = run_peers(gguf, peer_prompt, a.new_tokens, peer_k, temperature=a.temperature,
                      seed=a.seed, repeats=a.repeats, rope_scaling=a.rope_scaling)
    res.setdefault("peer_tokens_per_s", {}).update({name: p["tokens_per_s"] for name, p in peers.items()})
    res.setdefault("peer_timing", {}).update({name: {k: v for k, v in p.items() if k != "tokens"}
                                              for name, p in peers.items()})
    if a.temperature == 0:  # where llama.cpp's greedy tokens (4-bit weights) part from ours (fp32)
      res["peer_agreement_with_ar"] = {name: agreement(res["ar_tokens"], p["tokens"]) for name, p in peers.items()}
  res.update(text_file=str(path), model=str(a.model or target_dir), rope_scaling=a.rope_scaling)
  print(json.dumps(res, indent=2))
  write_json(a.json, res)
  return 0


def cmd_bench_suite(a: argparse.Namespace) -> int:
  from longspec_jax.inference.benchmark.config import load_config
  from longspec_jax.inference.benchmark.suite import run_suite
  cfg = load_config(a.config, a.set)
  out = Path(a.out) if a.out else Path("results/bench_suite") / Path(a.config).stem
  command = " ".join(["longspec bench-suite", "--config", a.config, *(f"--set {s}" for s in a.set),
                      *(["--out", a.out] if a.out else [])])
  res = run_suite(cfg, out, command=command, progress=not a.quiet)
  print((out / "results.md").read_text())
  return 1 if res["runs"][-1]["failed"] else 0  # a method that could not be built


def cmd_calibrate_draft_length(a: argparse.Namespace) -> int:
  text = read_text_file(a.prompt_file, "prompt file")
  from longspec_jax.drafters import check_drafter_options
  check_drafter_options(a.method)
  check_output_file(a.out, "--out")
  log = progress(a)
  log("importing jax")
  from longspec_jax.drafters import load_drafter
  from longspec_jax.inference.benchmark.measure import calibrate_draft_length
  from longspec_jax.inference.benchmark.prompts import prompt_ids, spread_ends
  from longspec_jax.inference.benchmark.provenance import machine_info
  from longspec_jax.inference.draft_length import default_sizes
  from longspec_jax.inference.engine import resolve_num_draft
  from longspec_jax.tokenizer import encode_prompt

  model, tok, target_dir = target_from_flags(a)
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
         "measured": {"method": a.method, "drafter": a.drafter, "model": str(a.model or target_dir.name),
                      "dtype": a.dtype, "prompt_file": a.prompt_file, "prompt_tokens": len(ids),
                      "cost_prompt_tokens": timed_at, "steps": a.steps, "repeats": a.repeats,
                      "ar_step_ms": ar_ms if a.cost_contexts else ar_ms[0], "new_tokens": a.new_tokens,
                      "prior_prompt_ends": ends, "observed_rates_per_class": observed, "machine": machine_info()}}
  write_json(a.out, out)
  print(json.dumps(out["rule"]))
  per_context = rule.costs if rule.cost_contexts else (rule.costs,)
  costs = "; ".join(f"{dict(zip(sizes, row))} at cache length {n} (AR step {ms:.2f} ms)"
                    for row, n, ms in zip(per_context, rule.cost_contexts or ["-"], ar_ms))
  log(f"wrote {a.out}: costs per size {costs}, (first, next) acceptance per draft class {observed}; use it with "
      f"--draft-length {a.out}")
  return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
  from longspec_jax.drafters import method_names

  bn = add_command(sub, "bench", "a speculative method vs jitted AR in the same process",
      "Benchmark one method against this project's jitted AR in the same process,\n"
      "on the first --context tokens of a text file.", epilog=BENCH_EPILOG)
  add_method_flags(bn, required=True, help="drafting method ('ar' = AR alone)")
  bn.add_argument("--text-file", required=True, help="the prompt is the start of this file")
  bn.add_argument("--context", type=positive_int, required=True, help="prompt = first N tokens of the file")
  bn.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per prompt")
  add_sampling_flags(bn, nucleus=False)
  bn.add_argument("--batch", type=positive_int, default=1, help="prompts per call (each starts 64 tokens later)")
  add_target_flags(bn)
  bn.add_argument("--repeats", type=positive_int, default=3, help="timed calls per method after a compiling one")
  bn.add_argument("--peer", choices=["transformers", "llama.cpp"], action="append",
                  help="also time peers (repeat the flag for both): transformers on the same weights (AR, assisted, "
                       "prompt lookup), or llama.cpp on the GGUF a named target comes from (AR, prompt lookup; "
                       "needs the llamacpp extra)")
  add_output_flags(bn)
  bn.set_defaults(fn=cmd_bench)

  bs = add_command(sub, "bench-suite", "methods x contexts x prompts vs AR: tau with CIs, speedup, plots",
      "Methods x contexts x prompts (cut points in several held-out documents) for one\n"
      "target, each against jitted AR on the same prompts in the same process: mean tau\n"
      "with bootstrap CIs, speedup, step costs, state bytes; results.json, results.md\n"
      "and plots in --out. Resumable. How to read them: docs/benchmarks.md.")
  bs.add_argument("--config", required=True, help="YAML (configs/bench/*.yaml; keys: docs/benchmarks.md)")
  bs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
  bs.add_argument("--out", help="output directory (default results/bench_suite/<config name>); reruns resume")
  add_output_flags(bs, json_help="", quiet="no progress bar on stderr")
  bs.set_defaults(fn=cmd_bench_suite)

  cd = add_command(
      sub, "calibrate-draft-length", "measure a drafter's step cost per draft length (for --draft-length)",
      "Time the engine's step at each draft length (0, 1, 3 and K) and AR's step on held-out text, on\n"
      "this machine, measure the drafter's acceptance per draft class there (first draft, and each next one\n"
      "after an accepted one) at K, and write the draft-length rule with those costs and priors for\n"
      "--draft-length RULE.json (for this target and dtype only).")
  cd.add_argument("--method", required=True, choices=[m for m in method_names() if m != "ar"],
                  help="drafting method")
  cd.add_argument("--prompt-file", required=True, help="held-out text (not the bench prompts) to time on")
  cd.add_argument("--max-prompt-tokens", type=positive_int, default=1024,
                  help="context the steps run at: the first N tokens of the file")
  cd.add_argument("--cost-contexts", metavar="N,N,...", type=ascending_lengths,
                  help="time the step costs at each of these prompt lengths (the first N tokens of the file; "
                       "ascending) instead of at --max-prompt-tokens: the rule then interpolates its costs at each "
                       "call's cache length")
  cd.add_argument("--num-draft", type=num_draft_int, help="K, the largest size (default: the drafter's)")
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
  add_target_flags(cd)
  cd.add_argument("--out", required=True, help="the rule JSON to write")
  add_output_flags(cd, json_help="")
  cd.set_defaults(fn=cmd_calibrate_draft_length)
