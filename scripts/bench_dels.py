"""DFlash vs DFlash + DeLS on held-out long documents: mean tau with 95% bootstrap CIs over prompts, per-position
acceptance and draft ms per step, at several contexts, greedy and sampled.

Prompts: `--cuts` windows of each document per context ([BOS] + `context - 1` tokens starting at evenly spaced
offsets). DeLS carries DFlash's state unchanged, so each prompt is prefilled ONCE (the engine's prefill program,
greedy first token) and that state is decoded by every (method, temperature) pair: the decode loops are the
engine's own (`longspec_jax.inference.speculative`), the comparison is paired, and prefill CPU time is not
repeated. Draft ms per step: `longspec_jax.inference.bench.profile_step` on the first prompt of each context,
both methods in this process.

  python scripts/bench_dels.py --out results/dels/bench.json --plot results/dels/accept_per_position.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.inference.bench import profile_step
from longspec_jax.inference.generate import cache_len_for, pad_prompts
from longspec_jax.inference.speculative import spec_decode_program, spec_prefill_program
from longspec_jax import default_target_dir, long_doc_paths
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import LoadedDrafter, ProposeContext
from longspec_jax.hf_io import load_model_dir
from longspec_jax.sampling import SamplingParams
from longspec_jax.tokenizer import load_tokenizer


def prompts_for(docs: list[list[int]], context: int, cuts: int, bos) -> list[tuple[int, int, list[int]]]:
  head = [bos] if bos is not None else []
  out = []
  for d, ids in enumerate(docs):
    span = len(ids) - (context - len(head))
    if span < 0:
      raise ValueError(f"document {d} has {len(ids)} tokens, fewer than context {context}")
    for j in range(cuts):
      start = int(span * (j + 1) / (cuts + 1))
      out.append((d, start, head + ids[start:start + context - len(head)]))
  return out


def bootstrap_ci(x, n=10000, seed=0):
  x = np.asarray(x, np.float64)
  idx = np.random.default_rng(seed).integers(0, len(x), (n, len(x)))
  means = x[idx].mean(1)
  return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 16384])
  p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
  p.add_argument("--docs", type=int, default=4, help="first N shipped long documents")
  p.add_argument("--cuts", type=int, default=2, help="prompts per document per context")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--num-draft", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dels-dir", help="DeLS drafter dir (default: the shipped one)")
  p.add_argument("--profile-repeats", type=int, default=5)
  p.add_argument("--timing-only", type=int, default=0, metavar="ROUNDS",
                 help="only draft ms per step: ROUNDS interleaved dflash/dels calls on the first prompt per context")
  p.add_argument("--out", required=True)
  p.add_argument("--plot")
  a = p.parse_args()

  model = load_model_dir(default_target_dir())
  tok = load_tokenizer(default_target_dir())
  cfg = model.cfg
  files = long_doc_paths()[:a.docs]
  docs = [tok.encode(f.read_text()).ids for f in files]
  dels = load_drafter("dels", model, a.dels_dir)
  methods = {"dflash": LoadedDrafter(dels.spec.base, dels.params["base"]), "dels": dels}
  graphdef, params = nnx.split(model)
  k = a.num_draft
  if a.timing_only:
    return timing_only(model, methods, docs, files, a)
  records, timing = [], {}
  t_all = time.time()
  for context in a.contexts:
    prompts = prompts_for(docs, context, a.cuts, cfg.bos_token_id)
    t_bucket, max_len = cache_len_for(context, a.new_tokens, extra=k + 1)
    for i, (d, start, ids) in enumerate(prompts):
      tokens, lens = pad_prompts([ids], cfg.pad_token_id or 0, t_bucket)
      t0 = time.time()
      state = spec_prefill_program(graphdef, params, dels.spec, dels.params, jnp.asarray(tokens), jnp.asarray(lens),
                                   jnp.int32(a.new_tokens), SamplingParams.make(0.0), jnp.uint32(a.seed),
                                   jnp.int32(-1), max_len=max_len, num_draft=k)
      jax.block_until_ready(state)
      prefill_s = time.time() - t0
      for temp in a.temperatures:
        sp = SamplingParams.make(temp)
        for name, drafter in methods.items():
          s = spec_decode_program(graphdef, params, drafter.spec, drafter.params, jax.tree.map(jnp.copy, state),
                                  jnp.int32(a.new_tokens), sp, jnp.uint32(a.seed), jnp.int32(-1), num_draft=k,
                                  sample=temp > 0)
          hist = np.asarray(s.accept_hist)
          steps = int(np.asarray(s.active_steps)[0])
          rec = {"context": context, "doc": files[d].name, "start": start, "temperature": temp, "method": name,
                 "tau": (int(np.asarray(s.num_new)[0]) - 1) / max(steps, 1), "steps": steps,
                 "accept_hist": hist.tolist(),
                 "tokens": np.asarray(s.tokens)[0, lens[0]:lens[0] + int(np.asarray(s.num_new)[0])].tolist()}
          records.append(rec)
      print(f"ctx {context} prompt {i + 1}/{len(prompts)} ({files[d].name}@{start}) prefill {prefill_s:.1f}s "
            + " ".join(f"{r['method']}/T{r['temperature']}: {r['tau']:.2f}" for r in records[-len(methods) *
                                                                                         len(a.temperatures):]),
            flush=True)
    # Draft/verify ms per step outside the loop, on the first prompt, both methods (greedy).
    first = [prompts[0][2]]
    timing[context] = {}
    for name, drafter in methods.items():
      draft_ms, verify_ms, state_bytes = profile_step(model, drafter, first, k, SamplingParams.make(0.0),
                                                      repeats=a.profile_repeats)
      timing[context][name] = {"draft_ms_per_step": draft_ms, "verify_ms_per_step": verify_ms,
                               "drafter_state_bytes": state_bytes}
    print(f"ctx {context} draft ms: " + ", ".join(f"{n} {t['draft_ms_per_step']:.2f}"
                                                  for n, t in timing[context].items()), flush=True)

    done = [c for c in a.contexts if c in timing]  # written after every context: a killed run keeps its part
    summary = summarize(records, timing, done, a.temperatures, k)
    out = {"settings": vars(a), "documents": [f.name for f in files], "wall_s": round(time.time() - t_all, 1),
           "summary": summary, "timing": {str(c): t for c, t in timing.items()}, "records": records}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    if a.plot:
      plot(summary, done, a.temperatures, k, a.plot)
  print(json.dumps(summary, indent=1))


def timing_only(model, methods, docs, files, a):
  """Draft ms per step with the two drafters timed alternately (call i of dflash, then call i of dels, ...), so
  load from other processes on a shared machine hits both alike; medians and the median of per-round ratios."""
  cfg, k = model.cfg, a.num_draft
  graphdef, params = nnx.split(model)
  dels = methods["dels"]
  out = {}
  for context in a.contexts:
    ids = prompts_for(docs, context, 1, cfg.bos_token_id)[0][2]
    t_bucket, max_len = cache_len_for(context, a.new_tokens, extra=k + 1)
    tokens, lens = pad_prompts([ids], cfg.pad_token_id or 0, t_bucket)
    state = spec_prefill_program(graphdef, params, dels.spec, dels.params, jnp.asarray(tokens), jnp.asarray(lens),
                                 jnp.int32(a.new_tokens), SamplingParams.make(0.0), jnp.uint32(a.seed),
                                 jnp.int32(-1), max_len=max_len, num_draft=k)
    out[context] = {}
    for temp in a.temperatures:
      ctx = ProposeContext(tokens=state.tokens, num_tokens=state.num_tokens, sampling=SamplingParams.make(temp))
      fns = {n: jax.jit(lambda p, s, c, spec=d.spec, sample=temp > 0: spec.propose(p, s, c, jax.random.key(0), k,
                                                                                   sample)[0])
             for n, d in methods.items()}
      times = {n: [] for n in methods}
      for r in range(a.timing_only + 1):
        for n, d in methods.items():
          t0 = time.perf_counter()
          jax.block_until_ready(fns[n](d.params, state.drafter_state, ctx))
          if r:  # round 0 compiles
            times[n].append(1000 * (time.perf_counter() - t0))
      ratio = np.asarray(times["dels"]) / np.asarray(times["dflash"])
      out[context][str(temp)] = {**{f"{n}_draft_ms": float(np.median(t)) for n, t in times.items()},
                                 "dels_over_dflash_median_ratio": float(np.median(ratio)), "rounds": a.timing_only}
      print(context, temp, out[context][str(temp)], flush=True)
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps({"settings": vars(a), "documents": [f.name for f in files],
                                     "draft_ms": {str(c): v for c, v in out.items()}}, indent=1))


def summarize(records, timing, contexts, temperatures, k):
  rows = []
  for c in contexts:
    for t in temperatures:
      sel = {m: [r for r in records if r["context"] == c and r["temperature"] == t and r["method"] == m]
             for m in ("dflash", "dels")}
      taus = {m: np.asarray([r["tau"] for r in v]) for m, v in sel.items()}
      diff = taus["dels"] - taus["dflash"]
      row = {"context": c, "temperature": t, "prompts": len(taus["dflash"])}
      for m, v in sel.items():
        hist = np.sum([r["accept_hist"] for r in v], axis=0)
        row[m] = {"tau": float(taus[m].mean()), "tau_ci95": bootstrap_ci(taus[m]),
                  "accept_per_position": [float(hist[i + 1:].sum() / max(hist.sum(), 1)) for i in range(k)],
                  "draft_ms_per_step": timing[c][m]["draft_ms_per_step"]}
      if t == 0:  # lossless: both greedy decodes must be the target's greedy output
        row["greedy_outputs_identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(sel["dflash"], sel["dels"]))
      row["tau_gain"] = float(diff.mean())
      row["tau_gain_ci95_paired"] = bootstrap_ci(diff)
      row["draft_time_ratio"] = row["dels"]["draft_ms_per_step"] / row["dflash"]["draft_ms_per_step"]
      rows.append(row)
  return rows


def plot(summary, contexts, temperatures, k, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(len(temperatures), len(contexts), figsize=(3.6 * len(contexts), 3.2 * len(temperatures)),
                           sharey=True, squeeze=False)
  for row in summary:
    ax = axes[temperatures.index(row["temperature"])][contexts.index(row["context"])]
    for m, style in (("dflash", "o-"), ("dels", "s-")):
      ax.plot(range(1, k + 1), row[m]["accept_per_position"], style,
              label=f"{m} (tau {row[m]['tau']:.2f})")
    ax.set_title(f"ctx {row['context']}, T={row['temperature']:g}, n={row['prompts']}")
    ax.set_xlabel("draft position i")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  for ax in axes[:, 0]:
    ax.set_ylabel("P(>= i drafts accepted)")
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
