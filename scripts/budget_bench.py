"""BudgetDraft measurement: full-cache drafter vs naive sparse vs BudgetDraft-trained sparse, per context and budget.

Per context and cut point, one batch holds one prompt from each document (prompt = BOS + the document's tokens
from that cut on). The target prefills the batch ONCE; AR greedy and every drafter variant decode from copies of
that prefill (the engine's own decode programs: `ar_decode_program`, `spec_decode_program`), so the expensive
long-context prefill is not repeated per variant. Greedy, no EOS stop (every sequence makes --new-tokens tokens).
Per prompt: tau = tokens committed after the first / verification passes. Per batch: decode-loop time vs AR's
(same process, same prompts, same batch), draft ms per step (one jitted propose at this context), drafter state
bytes per sequence, exact match with AR. Each (context, cut, variant) is one JSON file; finished ones are skipped.

  PYTHONPATH=. python scripts/budget_bench.py --contexts 1024,4096,8192,16384 --variants full,naive-256,budget-256 \\
      --trained longspec_jax/assets/drafters/budgetdraft --out results/budget/runs
Variants: full | trained-full | naive-B | naive-B-drop | budget-B | budget-B-drop (B = budget; -drop = paper rule,
the partial last prompt chunk dropped; naive = the shipped PARD/standalone drafter, budget = --trained).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.inference.generate import ar_decode_program, ar_prefill_program, cache_len_for, pad_prompts
from longspec_jax.inference.speculative import SpecState, spec_decode_program
from longspec_jax import default_target_dir, long_doc_paths
from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
from longspec_jax.drafters.base import PrefillResult, ProposeContext, state_nbytes
from longspec_jax.drafters.budget import load_budget
from longspec_jax.drafters.standalone import load_standalone
from longspec_jax.hf_io import load_model_dir
from longspec_jax.sampling import SamplingParams
from longspec_jax.tokenizer import load_tokenizer

CUTS = (0.2, 0.7)  # prompt start as a fraction of (document tokens - context)


def build_variant(name: str, trained: Path):
  kind, _, rest = name.partition("-")
  if name == "full":
    return load_standalone(SHIPPED_DRAFTERS_DIR / "pard", "classic")
  if name == "trained-full":
    return load_standalone(trained, "classic")
  budget, _, drop = rest.partition("-")
  src = {"naive": SHIPPED_DRAFTERS_DIR / "pard", "budget": trained}[kind]
  return load_budget(src, int(budget), keep_recent=drop != "drop")


def make_start():
  @partial(jax.jit, static_argnames=("drafter", "max_len", "num_draft"))
  def spec_start(dparams, drafter, tokens, lens, cache, first, max_len, num_draft):
    # What the engine's spec prefill builds after its target prefill
    # (longspec_jax.inference.speculative._spec_prefill); the target cache and first token come from the AR
    # prefill of the same prompts (greedy: identical).
    b, t = tokens.shape
    buf = jnp.zeros((b, max_len), jnp.int32).at[:, :t].set(tokens).at[jnp.arange(b), lens].set(first)
    cache = jax.tree.map(jnp.copy, cache)  # the decode program donates its state
    pre = PrefillResult(prompt_tokens=tokens, tokens=buf, prompt_lens=lens, taps=None, new_kv=None,
                        target_cache=cache)
    return SpecState(tokens=buf, num_tokens=lens + 1, num_new=jnp.ones((b,), jnp.int32),
                     done=jnp.zeros((b,), bool), target_cache=cache,
                     drafter_state=drafter.init_state(dparams, pre, max_len), step=jnp.int32(0),
                     active_steps=jnp.zeros((b,), jnp.int32), accept_hist=jnp.zeros((num_draft + 1,), jnp.int32))

  return spec_start


def timed(fn):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--contexts", required=True)
  p.add_argument("--variants", required=True)
  p.add_argument("--docs", default="", help="comma-separated text files (default: the 4 longest held-out docs)")
  p.add_argument("--trained", default=str(SHIPPED_DRAFTERS_DIR / "budgetdraft"))
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--num-draft", type=int, default=8)
  p.add_argument("--out", required=True)
  a = p.parse_args()
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  model = load_model_dir(default_target_dir())
  tok = load_tokenizer(default_target_dir())
  cfg = model.cfg
  docs = [Path(d) for d in a.docs.split(",")] if a.docs else long_doc_paths()
  ids = {d.stem: tok.encode(d.read_text()).ids for d in docs}
  if not a.docs:
    ids = dict(sorted(ids.items(), key=lambda kv: -len(kv[1]))[:4])
  graphdef, params = nnx.split(model)
  spec_start = make_start()
  k, new = a.num_draft, a.new_tokens
  sp = SamplingParams.make(0.0)
  max_new, eos, seed = jnp.int32(new), jnp.int32(-1), jnp.uint32(0)
  variants = a.variants.split(",")
  for ctx in [int(c) for c in a.contexts.split(",")]:
    for cut in CUTS:
      todo = [v for v in variants if not (out / f"{ctx}_{cut}_{v}.json").exists()]
      if not todo:
        continue
      starts = {d: int(cut * (len(x) - ctx)) for d, x in ids.items()}
      prompts = [[cfg.bos_token_id] + x[starts[d]:starts[d] + ctx - 1] for d, x in ids.items()]
      t_bucket, max_len = cache_len_for(ctx, new, extra=k + 1)
      tokens, lens = (jnp.asarray(x) for x in pad_prompts(prompts, cfg.pad_token_id or 0, t_bucket))
      print(f"== context {ctx} cut {cut}: AR", flush=True)
      # Compiled ahead of time (lower + compile), so no program runs twice just to warm up.
      ar_pre = ar_prefill_program.lower(graphdef, params, tokens, lens, max_new, sp, seed, eos,
                                        max_len=max_len).compile()(params, tokens, lens, max_new, sp, seed, eos)
      # The decode program donates its state: keep a copy of the prefilled cache for the drafters.
      cache = jax.tree.map(jnp.copy, ar_pre.cache)
      first = ar_pre.tokens[jnp.arange(len(prompts)), lens]
      ar_decode = ar_decode_program.lower(graphdef, params, ar_pre, max_new, sp, eos).compile()
      ar_state, ar_decode_s = timed(lambda: ar_decode(params, ar_pre, max_new, sp, eos))
      ar_tokens = np.asarray(ar_state.tokens)
      for v in todo:
        print(f"== context {ctx} cut {cut}: {v}", flush=True)
        d = build_variant(v, Path(a.trained))
        start = spec_start.lower(d.params, d.spec, tokens, lens, cache, first, max_len=max_len,
                                 num_draft=k).compile()
        state0, init_s = timed(lambda: start(d.params, tokens, lens, cache, first))
        state_bytes = state_nbytes(state0.drafter_state) // len(prompts)
        ctx_p = ProposeContext(tokens=state0.tokens, num_tokens=state0.num_tokens, sampling=sp)
        draft = jax.jit(lambda dp, st: d.spec.propose(dp, st, ctx_p, jax.random.key(0), k, False)[0])
        jax.block_until_ready(draft(d.params, state0.drafter_state))
        _, draft_s = timed(lambda: draft(d.params, state0.drafter_state))
        decode = spec_decode_program.lower(graphdef, params, d.spec, d.params, state0, max_new, sp, seed, eos,
                                           num_draft=k, sample=False).compile()
        st, decode_s = timed(lambda: decode(params, d.params, state0, max_new, sp, seed, eos))
        num_new, steps = np.asarray(st.num_new), np.asarray(st.active_steps)
        toks = np.asarray(st.tokens)
        exact = [bool((toks[i, lens[i]:lens[i] + new] == ar_tokens[i, lens[i]:lens[i] + new]).all())
                 for i in range(len(prompts))]
        res = {"variant": v, "context": ctx, "cut": cut, "docs": list(ids), "starts": list(starts.values()),
               "new_tokens": new, "num_draft": k, "batch": len(prompts),
               "tau": [float((n - 1) / max(s, 1)) for n, s in zip(num_new, steps)],
               "exact_match_ar": exact, "decode_s": decode_s, "ar_decode_s": ar_decode_s,
               "speedup_decode": ar_decode_s / decode_s, "draft_ms_per_step": 1000 * draft_s,
               "drafter_init_ms": 1000 * init_s, "drafter_state_bytes_per_seq": state_bytes}
        (out / f"{ctx}_{cut}_{v}.json").write_text(json.dumps(res, indent=2))
        print(json.dumps({x: res[x] for x in ("tau", "speedup_decode", "draft_ms_per_step",
                                              "drafter_state_bytes_per_seq", "exact_match_ar")}), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
