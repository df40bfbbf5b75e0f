"""`longspec bench-suite`: methods x contexts x prompts x temperatures for one target, in one process.

Prompts: `num_prompts` cut points drawn (seeded) from at least `min_docs` held-out documents. A cut point is the
end of a prompt in its document; the prompt at context C is BOS + the C-1 tokens before that end, so every context
continues the same text and only the amount of history differs. Per prompt and context the target prefill runs
once and every method and temperature starts its decode loop from it (`measure`). AR is timed for every prompt in
the same process as the methods it is compared with.

Each finished (method, context, temperature, prompt) is appended to `cells/*.jsonl` under the output directory
at once, so a killed sweep loses at most one prompt, and a rerun skips what is there. The llama.cpp peers
(`llama.cpp-ar`, `llama.cpp-lookup`) are methods too: on the same prompt tokens, in a child process each. Every
run of the command rewrites `results.json` (everything), `results.md` (tables) and the plots from all records on
disk (`report`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from longspec_jax.drafters.registry import DEFAULT_NUM_DRAFT
from longspec_jax.inference import engine
from longspec_jax.inference.benchmark import llamacpp, measure, provenance, report
from longspec_jax.inference.benchmark.llamacpp import PEER_METHODS
from longspec_jax.inference.benchmark.config import MethodSpec, SuiteConfig, validate
from longspec_jax.inference.benchmark.prompts import prompt_ids, select_cuts
from longspec_jax.inference.draft_length import read_draft_length

if TYPE_CHECKING:
  from collections.abc import Callable

  from longspec_jax.model import Transformer


def cell_path(out: Path, method: MethodSpec, context: int, temperature: float) -> Path:
  return out / "cells" / f"{method.slug}__ctx{context}__t{temperature:g}.jsonl"


def load_records(out: Path) -> list[dict]:
  recs = []
  for path in sorted((out / "cells").glob("*.jsonl")):
    for line in path.read_text().splitlines():
      if line.strip():
        try:
          recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: that prompt is simply run again
          continue
  return recs


def load_runs(out: Path) -> list[dict]:
  path = out / "runs.jsonl"
  return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


@dataclasses.dataclass(frozen=True)
class Method:
  """A method ready to run: its drafter (None for AR) and its engine config at the longest context (K resolved)."""
  spec: MethodSpec
  drafter: object = None  # LoadedDrafter
  config: engine.GenerationConfig | None = None

  @property
  def num_draft(self) -> int:
    if self.config is not None:
      return self.config.num_draft
    return (self.spec.num_draft or DEFAULT_NUM_DRAFT) if self.spec.name == "llama.cpp-lookup" else 0


def load_methods(methods: list[MethodSpec], model: Transformer, cfg: SuiteConfig,
                 log: Callable[[str], None]) -> tuple[dict[str, Method], dict]:
  """(method text -> Method, method text -> why it was skipped). `engine.prepare` on a prompt of the longest
  context checks each drafter as a generation call would (vocabulary, K against its limit, fit in the target's
  context) and resolves its default K."""
  from longspec_jax.drafters import load_drafter
  longest = [[model.cfg.pad_token_id or 0] * max(cfg.contexts)]
  ready, failed = {}, {}
  for m in methods:
    if m.name == "ar":
      ready[m.text] = Method(m)
      continue
    try:
      if m.name in PEER_METHODS:
        llamacpp.check_peer(cfg.model, cfg.rope_scaling or None)
        ready[m.text] = Method(m)
        continue
      d = load_drafter(m.name, model, m.drafter_dir, **dict(m.options))
      config, _, _ = engine.prepare(model, longest, cfg.new_tokens, drafter=d, num_draft=m.num_draft,
                                    draft_length=read_draft_length(m.draft_length), tree=m.tree)
      ready[m.text] = Method(m, d, config)
    except (ValueError, FileNotFoundError) as e:
      failed[m.text] = f"{type(e).__name__}: {e}"
      log(f"bench-suite: {m.text} skipped: {failed[m.text]}")
  return ready, failed


def run_suite(cfg: SuiteConfig, out: Path, command: str = "", progress: bool = True) -> dict:
  """Runs every (method, context, temperature, prompt) not yet on disk under `out`, then writes the outputs."""
  from tqdm import tqdm

  from longspec_jax import long_doc_paths
  from longspec_jax.sampling import SamplingParams

  methods = validate(cfg)
  out = Path(out)
  (out / "cells").mkdir(parents=True, exist_ok=True)
  model, tok, target = provenance.target_with_provenance(cfg.model, cfg.rope_scaling, cfg.dtype, cfg.kv_dtype)
  mcfg = model.cfg
  engine.sizes(mcfg, max(cfg.contexts), cfg.new_tokens)  # raises if even AR does not fit
  doc_paths = [Path(d) for d in cfg.docs] or long_doc_paths()
  docs = [tok.encode(p.read_text()).ids for p in doc_paths]
  cuts = select_cuts([len(d) for d in docs], cfg.num_prompts, cfg.min_docs, cfg.cut_min_tokens, cfg.prompt_seed)
  prompts = [{"index": i, "doc": doc_paths[d].name, "doc_sha256": hashlib.sha256(doc_paths[d].read_bytes()).hexdigest(),
              "end_token": end, "doc_tokens": len(docs[d])} for i, (d, end) in enumerate(cuts)]
  ready, failed = load_methods(methods, model, cfg, lambda msg: tqdm.write(msg, file=sys.stderr))
  peers = [m for m in ready.values() if m.spec.name in PEER_METHODS]
  gguf = llamacpp.check_peer(cfg.model, cfg.rope_scaling or None) if peers else None
  peer_checkpoint = llamacpp.gguf_checkpoint(gguf) if peers else None
  checkpoints = {m.text: peer_checkpoint if m.name in PEER_METHODS else provenance.drafter_checkpoint(m, model)
                 for m in methods}
  # A RoPE override or a dtype changes the target but not its weights file.
  target_id = (target["weights_sha256"] + (f"+{cfg.rope_scaling}" if cfg.rope_scaling else "")
               + (f"+{cfg.dtype}" if cfg.dtype != "float32" else "")
               + (f"+kv-{cfg.kv_dtype}" if cfg.kv_dtype else ""))

  def fp(m: Method, ctx: int, temp: float, p: dict) -> str:
    # A tree named by its file (FILE.json#N) is fingerprinted by its paths, so an edited file reruns its cells.
    tree = (str(m.config.tree),) if m.config is not None and m.config.tree is not None else ()
    return provenance.fingerprint(target_id, m.spec.text, m.num_draft, checkpoints[m.spec.text], ctx, temp,
                                  p["doc_sha256"], p["end_token"], cfg.new_tokens, cfg.seed, cfg.repeats, *tree)

  done = {(r["method"], r["context"], r["temperature"], r["prompt"]): r for r in load_records(out)}
  todo = []
  for ctx in cfg.contexts:
    for p in prompts:
      for temp in map(float, cfg.temperatures):
        for m in ready.values():
          r = done.get((m.spec.text, ctx, temp, p["index"]))
          if r is None:
            todo.append((ctx, p["index"], temp, m))
          elif r["fingerprint"] != fp(m, ctx, temp, p):
            raise ValueError(f"{out} holds a result for {m.spec.text} at context {ctx}, T={temp:g}, prompt "
                             f"{p['index']} from a different configuration (target, drafter checkpoint, prompts, "
                             "new_tokens, seed, repeats or K): use another --out")

  run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  run_info = {"run_id": run_id, "command": command, "git": provenance.git_state(),
              "machine": provenance.machine_info(), "loadavg_1min_start": os.getloadavg()[0], "todo": len(todo)}
  snap0, wall0, cpu0, loads = provenance.cpu_snapshot(), time.perf_counter(), time.process_time(), [os.getloadavg()[0]]
  timer = measure.Timer()
  bar = tqdm(total=len(todo), file=sys.stderr, disable=not progress, desc="bench-suite", unit="run")
  # One cache size per context for every method, so that all of them start from one prefill.
  max_k = max((m.num_draft for m in ready.values()), default=0)
  for ctx in cfg.contexts:
    _, max_len = engine.cache_len_for(ctx, cfg.new_tokens, extra=max_k + 1 if max_k else 0)
    for p in prompts:
      units = [u for u in todo if u[0] == ctx and u[1] == p["index"]]
      if not units:
        continue
      ids = prompt_ids(docs[cuts[p["index"]][0]], p["end_token"], ctx, mcfg.bos_token_id)
      ar_config, ar_params, inputs = engine.prepare(model, [ids], cfg.new_tokens, seed=cfg.seed + p["index"])
      ar_config = dataclasses.replace(ar_config, max_len=max_len)
      graphdef, target_params = ar_config.graphdef, ar_params.target
      shared = measure.shared_prefill(timer, graphdef, target_params, inputs, max_len,
                                      [u[3].drafter.spec for u in units if u[3].drafter is not None])
      for temp in dict.fromkeys(u[2] for u in units):
        inputs_t = inputs.replace(sampling=SamplingParams.make(temp))
        ar = measure.measure(timer, ar_config, ar_params, inputs_t, shared, cfg.repeats)
        for m in [u[3] for u in units if u[2] == temp]:
          rec = {"method": m.spec.text, "name": m.spec.name, "options": dict(m.spec.options),
                 "num_draft": m.num_draft, "drafter_checkpoint": checkpoints[m.spec.text], "context": ctx,
                 "temperature": temp, "prompt": p["index"], "run_id": run_id, "fingerprint": fp(m, ctx, temp, p),
                 "prefill_ms": 1000 * shared.seconds, "ar_new_tokens": ar["new_tokens"],
                 "ar_decode_s": ar["decode_s"], "ar_target_forwards": ar["target_forwards"]}
          if m.spec.name in PEER_METHODS:  # llama.cpp on the same prompt tokens, in a child process
            r = llamacpp.run_peers(gguf, ids, cfg.new_tokens, m.num_draft, [m.spec.name], temp,
                                   cfg.seed + p["index"], cfg.repeats, rope_scaling=cfg.rope_scaling or None,
                                   kv_cache=dict(m.spec.options).get("kv_cache", "f16"))
            r = r[m.spec.name]
            rec.update(new_tokens=r["decode_tokens"] + 1, decode_s=r["decode_ms"] / 1000,
                       target_forwards=r["target_forwards"], tau=r["tau"], accept_hist=[], draft_ms_per_step=0.0,
                       verify_ms_per_step=None, drafter_state_bytes=0, diagnostics={}, tokens=r["tokens"],
                       prefill_ms=r["prefill_ms"], agreement_with_ar=llamacpp.agreement(ar["tokens"], r["tokens"]))
          elif m.drafter is None:  # AR timed again as if it were a method: its speedup shows the timing noise
            rec.update(measure.measure(timer, ar_config, ar_params, inputs_t, shared, cfg.repeats))
          else:
            config = dataclasses.replace(m.config, max_len=max_len, sample=temp > 0)
            params = engine.GenerationParams(target_params, m.drafter.params)
            rec.update(measure.measure(timer, config, params, inputs_t, shared, cfg.repeats,
                                       diagnostics=_has_diagnostics(m.spec.name)))
          rec.update(exact_match_ar=(rec["tokens"] == ar["tokens"]) if temp == 0 else None,
                     peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     rss_bytes=provenance.rss_bytes())
          with open(cell_path(out, m.spec, ctx, temp), "a") as f:
            f.write(json.dumps(rec) + "\n")
          loads.append(os.getloadavg()[0])
          bar.set_postfix_str(f"ctx {ctx} T={temp:g} {m.spec.text} tau {rec['tau']:.2f}", refresh=False)
          bar.update()
    # No program is reused at another context (the cache shapes differ). Dropping them bounds the process's
    # memory mappings: a 9-method x 6-context sweep kept every compiled program and LLVM ran out of mappings
    # ("Cannot allocate memory", then a crash) at Linux's default vm.max_map_count of 65530.
    jax.clear_caches()
  bar.close()
  run_info.update(loadavg_1min_end=os.getloadavg()[0], wall_s=time.perf_counter() - wall0,
                  loadavg_1min_samples={"min": min(loads), "max": max(loads), "mean": float(np.mean(loads)),
                                        "n": len(loads)},
                  own_cpu_s=time.process_time() - cpu0,
                  other_processes_cpu_s=provenance.other_cpu_s(snap0, provenance.cpu_snapshot()), failed=failed)
  with open(out / "runs.jsonl", "a") as f:
    f.write(json.dumps(run_info) + "\n")
  results = report.summarize(cfg, methods, prompts, target, load_records(out), load_runs(out))
  report.write_outputs(results, out)
  return results


def _has_diagnostics(name: str) -> bool:
  from longspec_jax.drafters import drafter_entry
  return drafter_entry(name).diagnostics
