"""Greedy tau of token-matching drafters on a bench suite's prompts, without running the target again.

For a drafter whose proposal depends only on the committed tokens (prompt lookup, suffix matching), greedy
speculative decoding is fully determined by the target's greedy continuation: each step accepts the longest prefix
of the proposal that equals the continuation, then commits one more token. So the AR tokens a suite recorded per
prompt are enough to replay any such drafter exactly, and its tau is what the engine would measure (checked: the
replayed tau of our prompt lookup equals the suite's recorded tau on every prompt, printed as `check`).

Drafters compared (K drafts per step):
- `prompt-lookup`: ours (longspec_jax.drafters.prompt_lookup, the jitted lookup itself);
- `suffix-N`: the longest suffix match of up to N tokens anywhere earlier (latest occurrence), its continuation;
- `suffix`: ours (longspec_jax.drafters.suffix, jitted), the prompt and output only; with `--suffix-index FILE`
  also `suffix+index`: the same reading a global n-gram index (`longspec build-suffix-index`);
- `arctic`: Snowflake arctic-inference's SuffixDecodingCache (the suffix tree vLLM uses), if it imports, with its
  defaults (a draft at most as long as the match, tokens of estimated probability >= 0.1), at most K tokens;
  `arctic-factor4`: the same with drafts up to 4x the match length and no probability floor. With
  `--arctic-global`, `arctic+global` / `arctic-factor4+global`: its global tree fed the documents the index was
  built from (the same corpus split, tokenized the same way), each document one past response; each prompt's own
  response is evicted after its replay, as our index never holds the outputs.

  python scripts/compare_suffix_drafters.py --suite results/bench_suite/smollm2_fixed_k --out runs/suffix_drafters.json
  python scripts/compare_suffix_drafters.py --suite results/bench_suite/smollm2_fixed_k --contexts 4096 \
      --suffix-index runs/smollm2_train.idx --arctic-global data/corpus --out runs/suffix_index_4k.json

Paired differences (`--pairs A-B,...`): mean of the per-prompt difference with a bootstrap CI over prompts.

(The table in docs/benchmarks.md was made on the suite `smollm2_draft_classes`, removed from the tree: restore it
with `git checkout 4496eef -- results/bench_suite/smollm2_draft_classes`, see results/README.md.)
"""

from __future__ import annotations

import argparse
import hashlib
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


def bucket(n: int) -> int:
  """Buffer lengths rounded up to 1024, so one compiled lookup serves nearby prompt lengths."""
  return -(-n // 1024) * 1024


def ours_suffix(vocab_size: int, max_len: int, index=None, **options):
  """Our suffix drafter (with `index`, a SuffixIndex, or none; `options`: SuffixDrafter fields), jitted, on a
  token buffer of `max_len`."""
  import jax.numpy as jnp

  from longspec_jax.drafters.base import ProposeContext
  from longspec_jax.drafters.suffix import SuffixDrafter, with_index
  from longspec_jax.sampling import SamplingParams
  loaded = with_index(SuffixDrafter(vocab_size, **options), index)
  search = _compiled_search(loaded.spec)

  def propose(ctx, k):
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :len(ctx)] = ctx
    c = ProposeContext(tokens=jnp.asarray(buf), num_tokens=jnp.asarray([len(ctx)], jnp.int32),
                       sampling=SamplingParams.make(0.0))
    return np.asarray(search(loaded.params, c, k)[0])[0].tolist()
  return propose


_SEARCHES = {}


def _compiled_search(spec):
  """One jitted search per drafter spec (the compiled program is reused for every prompt of a buffer bucket)."""
  import jax
  if spec not in _SEARCHES:
    _SEARCHES[spec] = jax.jit(spec.search, static_argnums=2)
  return _SEARCHES[spec]


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


def arctic(global_cache=None, **speculate_options):
  """arctic-inference's suffix decoding, one request per replay (its prompt tree plus its own response);
  `speculate_options` go to SuffixDecodingCache.speculate (its defaults otherwise). `global_cache`: a
  SuffixDecodingCache whose global tree holds past responses (the request's own response is evicted after it)."""
  from arctic_inference.suffix_decoding import SuffixDecodingCache

  class Arctic:
    def __init__(self):
      self.cache, self.started, self.seen = None, False, 0

    def __call__(self, ctx, k):
      if self.cache is None:  # the prompt is everything before the first generated token
        self.cache = global_cache or SuffixDecodingCache(max_tree_depth=64)
        self.cache.start_request("replay", np.asarray(ctx[:-1], np.int32))
        self.seen = len(ctx) - 1
      if len(ctx) > self.seen:
        self.cache.add_active_response("replay", np.asarray(ctx[self.seen:], np.int32))
        self.seen = len(ctx)
      draft = self.cache.speculate("replay", np.asarray(ctx[-64:], np.int32), max_spec_tokens=k,
                                   **speculate_options)
      return list(draft.token_ids)

    def close(self):
      if self.cache is not None:
        self.cache.stop_request("replay")
        if "replay" in self.cache.cached_requests:
          self.cache.evict_cached_response("replay")
  return Arctic


def arctic_global_cache(docs: list[list[int]], depth: int):
  """A SuffixDecodingCache whose global tree holds `docs`, each as one finished request's response."""
  from arctic_inference.suffix_decoding import SuffixDecodingCache
  from tqdm import tqdm
  cache = SuffixDecodingCache(max_tree_depth=depth)
  for i, d in enumerate(tqdm(docs, desc="arctic global tree", unit="doc")):
    cache.start_request(("doc", i), np.zeros(0, np.int32))
    cache.add_active_response(("doc", i), np.asarray(d, np.int32))
    cache.stop_request(("doc", i))
  return cache


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--suite", required=True, help="a bench-suite output directory (results.json with AR records)")
  p.add_argument("--num-draft", type=int, default=7)
  p.add_argument("--check-method", default="prompt-lookup:num_draft=7",
                 help="the suite method whose recorded tau the replay of our prompt lookup must equal")
  p.add_argument("--suffix", type=int, nargs="*", default=[8, 32], help="suffix-N drafters to replay")
  p.add_argument("--contexts", type=int, nargs="*", help="only these contexts of the suite (default: all)")
  p.add_argument("--suffix-index", help="a `longspec build-suffix-index` file: adds the suffix+index column")
  p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=V,KEY=V",
                 help="another suffix+index column with SuffixDrafter options, e.g. l3:local_max=3")
  p.add_argument("--arctic-global", metavar="CORPUS", help="feed arctic's global tree this corpus's --split "
                 "documents (the index's) and add its +global columns")
  p.add_argument("--split", default="train", help="the corpus split of --arctic-global and the held-out check")
  p.add_argument("--arctic-depth", type=int, default=24, help="arctic's max_tree_depth for the global cache")
  p.add_argument("--memory", action="store_true",
                 help="add suffix+index+memory: the index updated with each earlier prompt's continuation (the "
                      "prompts replayed in order as one session of generations; never a prompt's own)")
  p.add_argument("--pairs", default="suffix+index-prompt-lookup",
                 help="comma-separated A-B column pairs: mean paired difference with a bootstrap CI")
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
  index, corpus_docs = None, None
  if a.suffix_index:
    from longspec_jax.suffix_index import load_index, update_index
    index = load_index(a.suffix_index, mcfg.vocab_size, tok)
  memory = index
  if a.arctic_global:
    from longspec_jax.training.data import load_corpus
    split = load_corpus(a.arctic_global)[a.split]
    # Held out: no prompt's document is one of the indexed documents (same text hash).
    indexed = set(split["sha256"])
    shared = {p["doc"] for p in res["prompts"]} & {
        name for name, path in paths.items() if hashlib.sha256(path.read_text().encode()).hexdigest() in indexed}
    if shared:
      raise SystemExit(f"prompt documents {sorted(shared)} are in the corpus split {a.split}: not held out")
    print(f"held out: none of the {len(paths)} prompt documents is among the {len(split)} {a.split} documents")
    corpus_docs = [tok.encode(t).ids for t in split["text"]]
  records = load_records(Path(a.suite))  # the per-prompt records, cells/*.jsonl
  ar = {(r["context"], r["prompt"]): r["tokens"] for r in records if r["method"] == "ar"}
  recorded = {(r["context"], r["prompt"]): r["tau"] for r in records if r["method"] == a.check_method}
  try:
    make_arctic = {"arctic": arctic(), "arctic-factor4": arctic(max_spec_factor=4.0, min_token_prob=0.0)}
    if corpus_docs is not None:
      cache = arctic_global_cache(corpus_docs, a.arctic_depth)
      make_arctic.update({"arctic+global": arctic(cache),
                          "arctic-factor4+global": arctic(cache, max_spec_factor=4.0, min_token_prob=0.0)})
  except ImportError:
    make_arctic = {}
    print("arctic-inference is not installed: its column is skipped")
  k = a.num_draft
  rows = []
  for (ctx_len, i), cont in sorted(ar.items()):
    if a.contexts and ctx_len not in a.contexts:
      continue
    pr = prompts[i]
    ids = prompt_ids(docs[pr["doc"]], pr["end_token"], ctx_len, mcfg.bos_token_id)
    drafters = {"prompt-lookup": ours_lookup(mcfg.vocab_size, len(ids) + len(cont) + k + 1)}
    drafters.update({f"suffix-{m}": suffix_match(m) for m in a.suffix})
    buf = bucket(len(ids) + len(cont) + k + 1)
    drafters["suffix"] = ours_suffix(mcfg.vocab_size, buf)
    if index is not None:
      drafters["suffix+index"] = ours_suffix(mcfg.vocab_size, buf, index)
      if a.memory:
        drafters["suffix+index+memory"] = ours_suffix(mcfg.vocab_size, buf, memory)
      for v in a.variant:
        name, opts = v.split(":", 1)
        opts = {k: float(x) if "." in x else int(x) for k, x in (o.split("=") for o in opts.split(","))}
        drafters[f"suffix+index:{name}"] = ours_suffix(mcfg.vocab_size, buf, index, **opts)
    drafters.update({name: make() for name, make in make_arctic.items()})
    row = {"context": ctx_len, "prompt": i, "recorded": recorded.get((ctx_len, i))}
    for name, fn in drafters.items():
      row[name] = replay(ids, cont, fn, k)[0]
      if hasattr(fn, "close"):
        fn.close()
    if a.memory:  # this generation becomes a past output for the next prompts
      memory = update_index(memory, [ids[-memory.orders[-1]:] + cont])
    rows.append(row)
    print(json.dumps(row))
  names = [n for n in rows[0] if n not in ("context", "prompt", "recorded")]
  summary = {}
  for ctx_len in sorted({r["context"] for r in rows}):
    sel = [r for r in rows if r["context"] == ctx_len]
    summary[ctx_len] = {n: {"tau_mean": float(np.mean([r[n] for r in sel])),
                            "tau_ci": list(bootstrap_ci(np.asarray([r[n] for r in sel]), 10000, 0.95))}
                        for n in names}
    for pair in a.pairs.split(","):
      x, y = _pair(pair, names)
      if x:
        diff = np.asarray([r[x] - r[y] for r in sel])
        summary[ctx_len][f"{x} - {y}"] = {"mean": float(diff.mean()),
                                          "ci": list(bootstrap_ci(diff, 10000, 0.95)),
                                          "wins": int((diff > 0).sum()), "losses": int((diff < 0).sum())}
    checked = [r for r in sel if r["recorded"] is not None]
    summary[ctx_len]["check"] = {"prompts": len(checked),
                                 "max_abs_diff_vs_recorded": max((abs(r["recorded"] - r["prompt-lookup"])
                                                                 for r in checked), default=None)}
    print(ctx_len, json.dumps(summary[ctx_len]))
  if a.out:
    Path(a.out).write_text(json.dumps({"num_draft": k, "suite": a.suite, "summary": summary, "rows": rows}, indent=1))


def _pair(text: str, names: list[str]) -> tuple[str | None, str | None]:
  """"A-B" split at the hyphen that leaves two known column names (names hold hyphens)."""
  for j, ch in enumerate(text):
    if ch == "-" and text[:j] in names and text[j + 1:] in names:
      return text[:j], text[j + 1:]
  return None, None


if __name__ == "__main__":
  main()
