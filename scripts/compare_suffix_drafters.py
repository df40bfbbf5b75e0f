"""Greedy tau of token-matching drafters on a bench suite's prompts, without running the target again.

For a drafter whose proposal depends only on the committed tokens (prompt lookup, suffix matching), greedy
speculative decoding is fully determined by the target's greedy continuation: each step accepts the longest prefix
of the proposal that equals the continuation, then commits one more token. So the AR tokens a suite recorded per
prompt are enough to replay any such drafter exactly, and its tau is what the engine would measure (checked: the
replayed tau of our prompt lookup equals the suite's recorded tau on every prompt, printed as `check`).

Drafters compared (K drafts per step):
- `prompt-lookup`: ours (longspec_jax.drafters.prompt_lookup, the jitted lookup itself);
- `suffix-N`: the longest suffix match of up to N tokens anywhere earlier (latest occurrence), its continuation;
- `arctic`: Snowflake arctic-inference's SuffixDecodingCache (the suffix tree vLLM uses), if it imports, with its
  defaults (a draft at most as long as the match, tokens of estimated probability >= 0.1), at most K tokens;
  `arctic-factor4`: the same with drafts up to 4x the match length and no probability floor.

  python scripts/compare_suffix_drafters.py --suite results/bench_suite/smollm2_fixed_k --out runs/suffix_drafters.json

(The table in docs/benchmarks.md was made on the suite `smollm2_draft_classes`, removed from the tree: restore it
with `git checkout 4496eef -- results/bench_suite/smollm2_draft_classes`, see results/README.md.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def replay(prompt: list[int], continuation: list[int], propose, k: int) -> tuple[float, int]:
  """(tau, steps) of greedy speculative decoding of `continuation` after `prompt` with `propose(ctx, k)`."""
  ctx = list(prompt) + continuation[:1]  # the first token comes from the prefill
  pos, steps, n = 1, 0, len(continuation)
  while pos < n:
    drafts = list(propose(ctx, k))[:k]
    accepted = 0
    while accepted < len(drafts) and pos + accepted < n and drafts[accepted] == continuation[pos + accepted]:
      accepted += 1
    commit = min(accepted + 1, n - pos)
    ctx += continuation[pos:pos + commit]
    pos += commit
    steps += 1
  return (n - 1) / max(steps, 1), steps


def ours_lookup(vocab_size: int, max_len: int):
  """Our prompt lookup, jitted, on a token buffer of `max_len`."""
  import jax
  import jax.numpy as jnp

  from longspec_jax.drafters.base import ProposeContext
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
  from longspec_jax.sampling import SamplingParams
  drafter = PromptLookupDrafter(vocab_size)
  cache = {}

  def propose(ctx, k):
    if k not in cache:
      cache[k] = jax.jit(lambda tokens, n: drafter.lookup(
          ProposeContext(tokens=tokens, num_tokens=n, sampling=SamplingParams.make(0.0)), k)[0])
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :len(ctx)] = ctx
    return np.asarray(cache[k](jnp.asarray(buf), jnp.asarray([len(ctx)], jnp.int32)))[0].tolist()
  return propose


def suffix_match(max_match: int):
  """The longest earlier match (<= max_match tokens) of the sequence's suffix, latest occurrence; its continuation
  (cut at the sequence end)."""
  def propose(ctx, k):
    seq = np.asarray(ctx)
    n = len(seq)
    best_end = -1
    ends = np.arange(n - 1)  # candidate end positions strictly before the last token
    alive = np.ones(n - 1, bool)
    for m in range(1, min(max_match, n - 1) + 1):
      ok = ends - (m - 1) >= 0
      alive &= ok & (seq[np.clip(ends - (m - 1), 0, None)] == seq[n - m])
      if not alive.any():
        break
      best_end = int(ends[alive].max())
    if best_end < 0:
      return []
    return seq[best_end + 1:best_end + 1 + k].tolist()
  return propose


def arctic(**speculate_options):
  """arctic-inference's suffix decoding, one request per replay (its prompt tree plus its own response);
  `speculate_options` go to SuffixDecodingCache.speculate (its defaults otherwise)."""
  from arctic_inference.suffix_decoding import SuffixDecodingCache

  class Arctic:
    def __init__(self):
      self.cache, self.started, self.seen = None, False, 0

    def __call__(self, ctx, k):
      if self.cache is None:  # the prompt is everything before the first generated token
        self.cache = SuffixDecodingCache(max_tree_depth=64)
        self.cache.start_request(0, np.asarray(ctx[:-1], np.int32))
        self.seen = len(ctx) - 1
      if len(ctx) > self.seen:
        self.cache.add_active_response(0, np.asarray(ctx[self.seen:], np.int32))
        self.seen = len(ctx)
      draft = self.cache.speculate(0, np.asarray(ctx[-64:], np.int32), max_spec_tokens=k, **speculate_options)
      return list(draft.token_ids)
  return Arctic


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--suite", required=True, help="a bench-suite output directory (results.json with AR records)")
  p.add_argument("--num-draft", type=int, default=7)
  p.add_argument("--check-method", default="prompt-lookup:num_draft=7",
                 help="the suite method whose recorded tau the replay of our prompt lookup must equal")
  p.add_argument("--suffix", type=int, nargs="*", default=[8, 32], help="suffix-N drafters to replay")
  p.add_argument("--out", help="write the per-prompt taus here (JSON)")
  a = p.parse_args()

  from longspec_jax import long_doc_paths
  from longspec_jax.config import ModelConfig
  from longspec_jax.inference.benchmark.prompts import prompt_ids
  from longspec_jax.inference.benchmark.statistics import bootstrap_ci
  from longspec_jax.inference.benchmark.suite import load_records
  from longspec_jax.targets import resolve_target_dir
  from longspec_jax.tokenizer import load_tokenizer

  res = json.loads((Path(a.suite) / "results.json").read_text())
  cfg = res["config"]
  model_dir = resolve_target_dir(cfg["model"] or None)  # the tokenizer and config only: no target pass here
  tok, mcfg = load_tokenizer(model_dir), ModelConfig.from_json_file(model_dir / "config.json")
  paths = {p.name: p for p in ([Path(d) for d in cfg["docs"]] or long_doc_paths())}
  docs = {name: tok.encode(path.read_text()).ids for name, path in paths.items()}
  prompts = {p["index"]: p for p in res["prompts"]}
  records = load_records(Path(a.suite))  # the per-prompt records, cells/*.jsonl
  ar = {(r["context"], r["prompt"]): r["tokens"] for r in records if r["method"] == "ar"}
  recorded = {(r["context"], r["prompt"]): r["tau"] for r in records if r["method"] == a.check_method}
  try:
    make_arctic = {"arctic": arctic(), "arctic-factor4": arctic(max_spec_factor=4.0, min_token_prob=0.0)}
  except ImportError:
    make_arctic = {}
    print("arctic-inference is not installed: its column is skipped")
  k = a.num_draft
  rows = []
  for (ctx_len, i), cont in sorted(ar.items()):
    pr = prompts[i]
    ids = prompt_ids(docs[pr["doc"]], pr["end_token"], ctx_len, mcfg.bos_token_id)
    drafters = {"prompt-lookup": ours_lookup(mcfg.vocab_size, len(ids) + len(cont) + k + 1)}
    drafters.update({f"suffix-{m}": suffix_match(m) for m in a.suffix})
    drafters.update({name: make() for name, make in make_arctic.items()})
    row = {"context": ctx_len, "prompt": i, "recorded": recorded.get((ctx_len, i))}
    for name, fn in drafters.items():
      row[name] = replay(ids, cont, fn, k)[0]
    rows.append(row)
    print(json.dumps(row))
  names = [n for n in rows[0] if n not in ("context", "prompt", "recorded")]
  summary = {}
  for ctx_len in sorted({r["context"] for r in rows}):
    sel = [r for r in rows if r["context"] == ctx_len]
    summary[ctx_len] = {n: {"tau_mean": float(np.mean([r[n] for r in sel])),
                            "tau_ci": list(bootstrap_ci(np.asarray([r[n] for r in sel]), 10000, 0.95))}
                        for n in names}
    checked = [r for r in sel if r["recorded"] is not None]
    summary[ctx_len]["check"] = {"prompts": len(checked),
                                 "max_abs_diff_vs_recorded": max((abs(r["recorded"] - r["prompt-lookup"])
                                                                 for r in checked), default=None)}
    print(ctx_len, json.dumps(summary[ctx_len]))
  if a.out:
    Path(a.out).write_text(json.dumps({"num_draft": k, "suite": a.suite, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
