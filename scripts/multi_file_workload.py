"""Issue 55's multi-file workload: generations over related held-out files, continued one after another, each run
seeing what the runs before it saw and wrote (a notebook session or a batch job over one package).

Files: the CPython test-suite modules (`test/...`) in the corpus's held-out splits (test, validation, long_test;
`longspec corpus`), one package whose modules share their idioms (unittest classes, assertion calls, imports), in
path order, each of at least --context tokens. No drafter here was trained on them (EAGLE-3 saw the train split).
Prompt i is the first --context tokens of file i; every method generates --new-tokens greedy tokens.

Methods (the same target and EAGLE-3 drafter, `draft_length` auto):
  hybrid           prompt lookup + EAGLE-3, no memory
  hybrid+suffix    the suffix drafter in place of prompt lookup, its index empty (its own search, no memory)
  hybrid+memory    the same drafter reading an index that starts empty and, after each file, counts that file's
                   prompt and output (suffix_index.update_index); the index is the drafter's traced parameter, so
                   a grown index does not recompile
The memory never holds the file being continued, only the ones before it.

Prints and writes (--out) per file tokens/s (median decode time over --repeats) and tau of each method, whether its
tokens equal AR's, and the paired ratio hybrid+memory / hybrid with a bootstrap CI over the files.

  python scripts/multi_file_workload.py --dtype int8-weights --out results/suffix_index/multi_file.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def held_out_package_files(corpus: Path, package: str, min_chars: int) -> list[tuple[str, str]]:
  """(path, text) of the package's modules in the corpus's held-out splits, in path order."""
  from datasets import load_from_disk
  files = {}
  for split in ("test", "validation", "long_test"):
    if (corpus / split).exists():
      for row in load_from_disk(str(corpus / split)):
        if row["path"].startswith(package + "/") and len(row["text"]) >= min_chars:
          files[row["path"]] = row["text"]
  return sorted(files.items())


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2-135m")
  p.add_argument("--dtype", default="int8-weights")
  p.add_argument("--corpus", default="data/corpus")
  p.add_argument("--package", default="test")
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--max-files", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--slots", type=int, default=2 ** 20)
  p.add_argument("--out")
  a = p.parse_args()

  from longspec_jax import encode_prompt, generate, load_drafter, load_target, load_tokenizer
  from longspec_jax.inference.benchmark.statistics import bootstrap_ci, ratio_of_rates
  from longspec_jax.inference.benchmark.provenance import machine_info
  from longspec_jax.suffix_index import build_index, tokenizer_sha256, update_index

  model, tok = load_target(a.model, dtype=a.dtype), load_tokenizer(a.model)
  files = held_out_package_files(Path(a.corpus), a.package, min_chars=3 * a.context)
  prompts = []
  for path, text in files:
    ids = encode_prompt(tok, text, model.cfg.bos_token_id)
    if len(ids) >= a.context:
      prompts.append((path, ids[:a.context]))
  prompts = prompts[:a.max_files]
  if len(prompts) < 3:
    raise SystemExit(f"only {len(prompts)} held-out {a.package}/ files of {a.context} tokens in {a.corpus}")
  print(f"{len(prompts)} files: {[p for p, _ in prompts]}", flush=True)

  memory = build_index([], model.cfg.vocab_size, tokenizer_sha256(tok), a.slots)  # grows after each file
  hybrid = load_drafter("hybrid", model)
  hybrid_suffix = load_drafter("hybrid", model, suffix_index=memory)  # the empty index, kept empty

  def run(ids, drafter):
    kw = dict(drafter=drafter, draft_length="auto") if drafter is not None else {}
    times, out = [], None
    for _ in range(a.repeats):
      out = generate(model, [ids], max_new_tokens=a.new_tokens, eos_id=-1, **kw)
      times.append(out.decode_s)
    return out, statistics.median(times)

  # Compile every program once (the index is a traced parameter: one program for any index of these slots).
  for drafter in (None, hybrid, hybrid_suffix):
    generate(model, [prompts[0][1]], max_new_tokens=a.new_tokens, eos_id=-1,
             **(dict(drafter=drafter, draft_length="auto") if drafter is not None else {}))

  rows = []
  for i, (path, ids) in enumerate(prompts):
    t0 = time.time()
    ar, ar_s = run(ids, None)
    row = {"file": path, "prompt_tokens": len(ids), "ar_tok_s": a.new_tokens / ar_s}
    for name, drafter in (("hybrid", hybrid), ("hybrid+suffix", hybrid_suffix),
                          ("hybrid+memory", load_drafter("hybrid", model, suffix_index=memory))):
      out, s = run(ids, drafter)
      row[name] = {"tok_s": a.new_tokens / s, "decode_s": s, "tau": out.stats["tau"],
                   "exact_match_ar": out.tokens == ar.tokens}
    memory = update_index(memory, [ids + ar.tokens[0]])  # what this run saw and wrote, for the runs after it
    rows.append(row)
    print(f"[{i + 1}/{len(prompts)}] {path}: AR {row['ar_tok_s']:.1f} tok/s; "
          + "; ".join(f"{n} {row[n]['tok_s']:.1f} tok/s tau {row[n]['tau']:.2f}"
                      f"{'' if row[n]['exact_match_ar'] else ' NOT EXACT'}"
                      for n in ("hybrid", "hybrid+suffix", "hybrid+memory"))
          + f" ({time.time() - t0:.0f} s)", flush=True)

  def paired(num: str, den: str) -> dict:
    x = np.array([[a.new_tokens, r[num]["decode_s"], a.new_tokens, r[den]["decode_s"]] for r in rows])
    lo, hi = bootstrap_ci(x, stat=ratio_of_rates)
    tau = np.array([r[num]["tau"] - r[den]["tau"] for r in rows])
    tlo, thi = bootstrap_ci(tau)
    return {"speedup": float(ratio_of_rates(x)), "ci95": [lo, hi], "tau_difference": float(tau.mean()),
            "tau_difference_ci95": [tlo, thi]}

  summary = {"memory_vs_hybrid": paired("hybrid+memory", "hybrid"),
             "memory_vs_suffix_without_memory": paired("hybrid+memory", "hybrid+suffix"),
             "all_exact": all(r[n]["exact_match_ar"] for r in rows for n in ("hybrid", "hybrid+suffix",
                                                                              "hybrid+memory"))}
  print(json.dumps(summary, indent=1))
  if a.out:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"settings": vars(a), "rows": rows, "summary": summary,
                                       "machine": machine_info()}, indent=1))
    print(f"wrote {a.out}")
  return 0 if summary["all_exact"] else 1


if __name__ == "__main__":
  raise SystemExit(main())
