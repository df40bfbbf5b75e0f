"""LongSpark vs DFlash vs jitted AR over held-out long documents at several contexts, in one process.

Prompts: for each context, `--prompts` cut points spread over the documents (doc i % n_docs, its (i // n_docs)-th of
evenly spaced offsets), each [BOS] + the next context-1 tokens. Per prompt and method: one greedy (or sampled)
generation of --new-tokens (the first prompt of each context is run once more first, untimed, to compile): tau,
per-position acceptance, decode tokens/s, exact match with AR. Per context and method, on the first prompt: draft
and verify ms per step (`longspec_jax.inference.bench.profile_step`), drafter state bytes, and for LongSpark the
attention mass its block queries put on each view (Global, Raw, Local). Mean tau with a 95% bootstrap interval over
prompts.

  python scripts/bench_longspark.py --contexts 512 1024 4096 8192 16384 --prompts 8 --out results/longspark/greedy
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
from longspec_jax.inference.generate import cache_len_for, generate, pad_prompts
from longspec_jax import ASSETS_DIR, default_target_dir
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import PrefillResult, ProposeContext, state_nbytes
from longspec_jax.hf_io import load_model_dir
from longspec_jax.sampling import SamplingParams
from longspec_jax.tokenizer import load_tokenizer

DOCS_DIR = ASSETS_DIR / "long_docs"


def cut_prompts(docs: list[list[int]], context: int, n: int, bos) -> list[dict]:
  head = [bos] if bos is not None else []
  docs = [d for d in docs if len(d) >= context]
  if not docs:
    raise ValueError(f"no document has {context} tokens")
  per_doc = -(-n // len(docs))
  out = []
  for i in range(n):
    d, c = i % len(docs), i // len(docs)
    offs = np.linspace(0, len(docs[d]) - context, per_doc + 1).astype(int)  # + 1: spread, never the very end
    out.append({"doc": d, "offset": int(offs[c]), "ids": head + docs[d][offs[c]:offs[c] + context - len(head)]})
  return out


def bootstrap_ci(x, reps=2000, seed=0):
  x = np.asarray(x, np.float64)
  if len(x) < 2:
    return [float(x.mean()), float(x.mean())]
  means = np.random.default_rng(seed).choice(x, (reps, len(x))).mean(1)
  return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def view_mass(model, drafter, prompt):
  """LongSpark: mean attention mass of the block queries on (Global, Raw, Local), per layer, after prefill."""
  spec, dparams = drafter.spec, drafter.params
  tokens, lens = pad_prompts([prompt], model.cfg.pad_token_id or 0, cache_len_for(len(prompt), 8)[0])
  tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
  graphdef, params = nnx.split(model)

  @jax.jit
  def fn(params, dparams):
    m = nnx.merge(graphdef, params)
    out = m(tokens, mode="train", taps=spec.taps, return_kv=True, return_logits=False)
    pre = PrefillResult(prompt_tokens=tokens, tokens=tokens, prompt_lens=lens, taps=out.taps, new_kv=out.new_kv,
                        target_cache=None)
    state = spec.init_state(dparams, pre, tokens.shape[1])
    rec = []
    spec.block_logits(dparams, state, tokens[jnp.arange(1), lens - 1], record=rec)
    return jnp.stack([r.mean((0, 1, 2)) for r in rec])  # [L, 3]

  return [[round(float(x), 4) for x in layer] for layer in np.asarray(fn(params, dparams))]


def run_context(model, drafters, prompts, args, sp) -> dict:
  rows = {m: [] for m in ["ar"] + list(drafters)}
  ar_tokens = []
  for i, p in enumerate(prompts):
    kw = dict(max_new_tokens=args.new_tokens, temperature=args.temperature, seed=args.seed + i)
    for name in rows:
      d = drafters.get(name)
      extra = dict(drafter=d, num_draft_tokens=args.num_draft) if d is not None else {}
      if i == 0:
        generate(model, [p["ids"]], **kw, **extra)  # compile
      res = generate(model, [p["ids"]], **kw, **extra)
      n = len(res.tokens[0]) - 1
      row = {"doc": p["doc"], "offset": p["offset"], "decode_s": res.decode_s, "decoded": n,
             "tokens_per_s": n / res.decode_s if n else None}
      if d is not None:
        row.update(tau=res.stats["tau"], accept_per_position=res.stats["accept_per_position"])
        if args.temperature == 0:
          row["exact_match_ar"] = res.tokens == ar_tokens[i]
      else:
        ar_tokens.append(res.tokens)
      rows[name].append(row)
    print(f"  prompt {i}: " + ", ".join(f"{m} tau={r[-1].get('tau', 1.0):.2f}" for m, r in rows.items()), flush=True)
  out = {}
  ar_rate = sum(r["decoded"] for r in rows["ar"]) / sum(r["decode_s"] for r in rows["ar"])
  for name, d in drafters.items():
    taus = [r["tau"] for r in rows[name]]
    draft_ms, verify_ms, nbytes = profile_step(model, d, [prompts[0]["ids"]], args.num_draft, sp)
    rate = sum(r["decoded"] for r in rows[name]) / sum(r["decode_s"] for r in rows[name])
    out[name] = {"tau_mean": float(np.mean(taus)), "tau_ci95": bootstrap_ci(taus),
                 "accept_per_position": [round(float(x), 4) for x in np.mean([r["accept_per_position"] for r in rows[name]], 0)],
                 "draft_ms_per_step": draft_ms, "verify_ms_per_step": verify_ms, "drafter_state_bytes": nbytes,
                 "decode_tokens_per_s": rate, "speedup_vs_ar": rate / ar_rate,
                 "exact_match_ar": all(r.get("exact_match_ar", True) for r in rows[name]), "prompts": rows[name]}
    if name == "longspark":
      out[name]["view_mass_per_layer_global_raw_local"] = view_mass(model, d, prompts[0]["ids"])
  out["ar"] = {"decode_tokens_per_s": ar_rate, "prompts": rows["ar"]}
  return out


def draft_timing(model, drafter, prompts: dict, num_draft: int, repeats: int) -> dict:
  """Draft ms per step on real post-prefill states at several contexts, timed interleaved (round-robin over the
  contexts, `repeats` rounds, median) so that load from other jobs hits every context alike."""
  import statistics
  spec, dparams = drafter.spec, drafter.params
  graphdef, params = nnx.split(model)
  sp = SamplingParams.make(0.0)
  runs = {}
  for c, prompt in prompts.items():
    tokens, lens = pad_prompts([prompt], model.cfg.pad_token_id or 0, cache_len_for(len(prompt), 8)[0])
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
    out = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, mode="train", taps=spec.taps, return_kv=True,
                                                      return_logits=False))(params, tokens)
    pre = PrefillResult(prompt_tokens=tokens, tokens=tokens, prompt_lens=lens, taps=out.taps, new_kv=out.new_kv,
                        target_cache=None)
    state = jax.jit(spec.init_state, static_argnums=2)(dparams, pre, tokens.shape[1] + 8)
    ctx = ProposeContext(tokens=jnp.concatenate([tokens, jnp.zeros((1, 8), jnp.int32)], 1), num_tokens=lens + 1,
                         sampling=sp)
    fn = jax.jit(lambda d, s, ctx: spec.propose(d, s, ctx, jax.random.key(0), num_draft, False)[0])
    jax.block_until_ready(fn(dparams, state, ctx))
    runs[c] = (fn, state, ctx)
  times = {c: [] for c in runs}
  for _ in range(repeats):
    for c, (fn, state, ctx) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(dparams, state, ctx))
      times[c].append(1000 * (time.perf_counter() - t0))
  return {str(c): {"draft_ms_median": statistics.median(t), "draft_ms_min": min(t),
                   "state_bytes": state_nbytes(runs[c][1])} for c, t in times.items()}


def report(result: dict, prefix: str) -> None:
  """<prefix>.md (table) and <prefix>.png (tau with 95% CI, draft ms per step, drafter state bytes vs context)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ctxs = sorted(result["contexts"], key=int)
  methods = [m for m in result["contexts"][ctxs[0]] if m not in ("ar", "wall_s")]
  lines = [f"`{result['command']}`", "",
           "| context | method | prompts | mean tau [95% CI] | accept per position | draft ms/step | verify ms/step "
           "| state bytes | decode speedup vs AR | exact match |", "|---|---|---|---|---|---|---|---|---|---|"]
  for c in ctxs:
    for m in methods:
      r = result["contexts"][c][m]
      lines.append(f"| {c} | {m} | {len(r['prompts'])} | {r['tau_mean']:.2f} [{r['tau_ci95'][0]:.2f}, "
                   f"{r['tau_ci95'][1]:.2f}] | {' '.join(f'{x:.2f}' for x in r['accept_per_position'])} | "
                   f"{r['draft_ms_per_step']:.1f} | {r['verify_ms_per_step']:.1f} | {r['drafter_state_bytes']:,} | "
                   f"{r['speedup_vs_ar']:.2f} | {r['exact_match_ar']} |")
  if "longspark" in methods:
    lines += ["", "LongSpark attention mass on (Global, Raw, Local), mean over layers (first prompt per context):", ""]
    for c in ctxs:
      mass = np.mean(result["contexts"][c]["longspark"]["view_mass_per_layer_global_raw_local"], 0)
      lines.append(f"- {c}: " + ", ".join(f"{n} {x:.3f}" for n, x in zip(("Global", "Raw", "Local"), mass)))
  Path(prefix + ".md").write_text("\n".join(lines) + "\n")
  x = [int(c) for c in ctxs]
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  for m in methods:
    rs = [result["contexts"][c][m] for c in ctxs]
    tau = np.asarray([r["tau_mean"] for r in rs])
    ci = np.asarray([r["tau_ci95"] for r in rs]).T
    ax[0].errorbar(x, tau, yerr=[tau - ci[0], ci[1] - tau], marker="o", capsize=3, label=m)
    ax[1].plot(x, [r["draft_ms_per_step"] for r in rs], marker="o", label=m)
    ax[2].plot(x, [r["drafter_state_bytes"] / 2 ** 20 for r in rs], marker="o", label=m)
  for a, title in zip(ax, ("mean tau (95% CI)", "draft ms per step (CPU, shared machine)",
                           "drafter state MiB per sequence")):
    a.set_xscale("log", base=2)
    a.set_xlabel("context tokens")
    a.set_title(title)
    a.legend()
  ax[2].set_yscale("log")
  fig.suptitle(f"LongSpark vs DFlash, shipped 8.4M target, K={result['num_draft']}, T={result['temperature']}")
  fig.tight_layout()
  fig.savefig(prefix + ".png", dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 8192, 16384])
  ap.add_argument("--prompts", type=int, default=8, help="prompts per context")
  ap.add_argument("--prompts-at", type=str, default="", help="per-context overrides, e.g. 16384:4")
  ap.add_argument("--methods", nargs="+", default=["longspark", "dflash"])
  ap.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR", help="non-shipped drafter dirs")
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--num-draft", type=int, default=7)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", required=True, help="output prefix (writes .json, .md, .png)")
  ap.add_argument("--combine", nargs="+", metavar="JSON",
                  help="no runs: merge the methods of earlier result files (contexts they share) into one report")
  ap.add_argument("--draft-timing", type=int, default=0, metavar="REPEATS",
                  help="no runs: interleaved draft timing of the first method at --contexts (first prompt each)")
  args = ap.parse_args(argv)
  if args.combine:
    parts = [json.loads(Path(f).read_text()) for f in args.combine]
    shared = sorted(set.intersection(*(set(p["contexts"]) for p in parts)), key=int)
    merged = dict(parts[0], command=" ; ".join(p["command"] for p in parts),
                  contexts={c: {k: v for p in parts for k, v in p["contexts"][c].items()} for c in shared})
    Path(args.out + ".json").write_text(json.dumps(merged, indent=1))
    report(merged, args.out)
    return
  overrides = {int(k): int(v) for k, v in (x.split(":") for x in args.prompts_at.split(",") if x)}
  dirs = dict(x.split("=", 1) for x in args.drafter)
  model_dir = default_target_dir()
  model, tok = load_model_dir(model_dir), load_tokenizer(model_dir)
  docs = [tok.encode(p.read_text()).ids for p in sorted(DOCS_DIR.glob("*.txt"))]
  drafters = {m: load_drafter(m, model, dirs.get(m)) for m in args.methods}
  if args.draft_timing:
    m = args.methods[0]
    prompts = {c: cut_prompts(docs, c, 1, model.cfg.bos_token_id)[0]["ids"] for c in args.contexts}
    res = {"command": "python scripts/bench_longspark.py " + " ".join(argv or __import__("sys").argv[1:]),
           "method": m, "num_draft": args.num_draft,
           "contexts": draft_timing(model, drafters[m], prompts, args.num_draft, args.draft_timing)}
    Path(args.out + ".json").parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return
  sp = SamplingParams.make(args.temperature)
  out_path = Path(args.out + ".json")
  out_path.parent.mkdir(parents=True, exist_ok=True)
  result = {"command": "python scripts/bench_longspark.py " + " ".join(argv or __import__("sys").argv[1:]),
            "docs": [p.name for p in sorted(DOCS_DIR.glob("*.txt"))], "num_draft": args.num_draft,
            "new_tokens": args.new_tokens, "temperature": args.temperature, "contexts": {}}
  for c in args.contexts:
    t0 = time.time()
    prompts = cut_prompts(docs, c, overrides.get(c, args.prompts), model.cfg.bos_token_id)
    print(f"context {c}: {len(prompts)} prompts", flush=True)
    result["contexts"][str(c)] = run_context(model, drafters, prompts, args, sp)
    result["contexts"][str(c)]["wall_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1))
    report(result, args.out)
    summary = {m: {k: v for k, v in r.items() if k not in ("prompts",)} for m, r in result["contexts"][str(c)].items()
               if isinstance(r, dict)}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  main()
