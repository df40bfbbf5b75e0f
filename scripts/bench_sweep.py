"""Benchmark sweep: methods (optionally with a SharpDraft rule, `NAME:fixed`) x contexts x documents, in ONE
process per (document, context): the target's AR is timed once there and every method is compared with it (the
JSON of each run is exactly `longspec bench --json`'s). Finished runs are kept, so a killed sweep resumes. Note:
`peak_rss_bytes` is the sweep process's peak so far, not one method's.

  python scripts/bench_sweep.py --methods prompt-lookup,pard,dflash,dflash:fixed --contexts 1024,4096,16384 \\
      --docs longspec_jax/assets/long_docs/inspect.py.txt --new-tokens 64 --repeats 1 --out results/bench
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLUMNS = ("method", "sharpdraft", "doc", "context", "temperature", "tau", "speedup", "tokens_per_s",
           "ar_tokens_per_s", "draft_ms_per_step", "verify_ms_per_step", "drafter_state_bytes", "exact_match_ar")


def run_path(out: Path, doc: str, ctx: int, variant: str, temperature: float) -> Path:
  return out / f"{Path(doc).stem}_{ctx}_{variant.replace(':', '-')}_t{temperature}.json"


MIN_DECODE_FRACTION = 0.1


def _decode_timed(r: dict, tps_key: str, prefill_key: str) -> bool:
  """For runs timed before generate() timed its decode loop on its own (no `decode_ms` in the JSON), when decode
  time was (full call - 1-token call): whether it stood above that subtraction's noise."""
  if "decode_ms" in r:
    return True
  tps, prefill_s = r.get(tps_key), (r.get(prefill_key) or 0) / 1000
  if not tps:
    return False
  decode_s = r["new_tokens"] * r["batch"] / tps
  return decode_s >= MIN_DECODE_FRACTION * (decode_s + prefill_s)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--methods", required=True, help="comma-separated NAME or NAME:off|fixed|exact")
  p.add_argument("--contexts", required=True)
  p.add_argument("--docs", required=True, help="comma-separated text files")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--num-draft", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--peer", choices=["transformers"], help="also time the peer once per doc x context")
  p.add_argument("--out", required=True)
  a = p.parse_args()
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  variants = a.methods.split(",")
  runs = [(doc, int(ctx)) for doc in a.docs.split(",") for ctx in a.contexts.split(",")]

  model = tok = None
  for doc, ctx in runs:
    todo = [v for v in variants if not run_path(out, doc, ctx, v, a.temperature).exists()]
    peer_path = out / f"{Path(doc).stem}_{ctx}_peer.json"
    if not todo and (not a.peer or peer_path.exists()):
      continue
    if model is None:
      from longspec_jax import default_target_dir
      from longspec_jax.hf_io import load_model_dir
      from longspec_jax.tokenizer import load_tokenizer
      model, tok = load_model_dir(default_target_dir()), load_tokenizer(default_target_dir())
    from inference.bench import bench_prompts, decode_rate, run_bench, transformers_peers
    text = Path(doc).read_text()
    prompts = bench_prompts(tok.encode(text).ids, ctx, 1, model.cfg.bos_token_id)
    if todo:
      print(f"== {Path(doc).stem} context {ctx}: AR baseline", flush=True)
      ar = decode_rate(model, prompts, a.new_tokens, a.repeats, temperature=a.temperature, seed=a.seed)
    for v in todo:
      method, _, rule = v.partition(":")
      print(f"== {Path(doc).stem} context {ctx}: {v}", flush=True)
      try:
        res = run_bench(model, tok, method, text, ctx, a.new_tokens, a.temperature, a.seed, 1, a.num_draft,
                        None, a.repeats, sharpdraft=rule or "off", ar_baseline=ar)
      except Exception as e:  # keep the sweep going; the failure is printed and the run stays missing
        print(f"FAILED: {v} {ctx} {doc}: {type(e).__name__}: {e}", flush=True)
        continue
      res["text_file"] = doc
      run_path(out, doc, ctx, v, a.temperature).write_text(json.dumps(res, indent=2))
      print(json.dumps({k: res[k] for k in ("tau", "speedup", "exact_match_ar", "draft_ms_per_step")}), flush=True)
    if a.peer and not peer_path.exists():
      from longspec_jax import default_target_dir
      from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR
      print(f"== {Path(doc).stem} context {ctx}: transformers peers", flush=True)
      peers = transformers_peers(model, default_target_dir(), SHIPPED_DRAFTERS_DIR / "pard", prompts, a.new_tokens,
                                 a.num_draft, a.temperature, a.seed, a.repeats)
      peer_path.write_text(json.dumps({"context": ctx, "text_file": doc, "temperature": a.temperature,
                                       "peer_tokens_per_s": peers}, indent=2))
      print(json.dumps(peers), flush=True)

  rows = []
  for doc, ctx in runs:
    for v in variants:
      path = run_path(out, doc, ctx, v, a.temperature)
      if path.exists():
        rows.append(dict(json.loads(path.read_text()), doc=Path(doc).stem))
    peer_path = out / f"{Path(doc).stem}_{ctx}_peer.json"
    # Peers come from the sweep's own peer file or from a `longspec bench --peer` JSON.
    peers = json.loads(peer_path.read_text())["peer_tokens_per_s"] if peer_path.exists() else next(
        (r["peer_tokens_per_s"] for r in rows if r.get("context") == ctx and "peer_tokens_per_s" in r), {})
    if peers:
      for name, tps in peers.items():
        rows.append({"method": name, "doc": Path(doc).stem, "context": ctx, "temperature": a.temperature,
                     "tokens_per_s": tps})
  for r in rows:  # runs timed by subtraction (no `decode_ms`): mark those below its noise
    if r.get("speedup") is not None and not (_decode_timed(r, "ar_tokens_per_s", "ar_prefill_ms")
                                            and _decode_timed(r, "tokens_per_s", "prefill_ms")):
      r["speedup"] = "noise"
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  table += ["| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
  (out / "table.md").write_text("\n".join(table) + "\n")
  print("\n".join(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
