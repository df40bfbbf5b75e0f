"""Greedy agreement of SmolLM2-135M over an int8 / bf16 KV cache with the fp32 cache, over 256 generated positions.

Prompts: the first PROMPT tokens of two held-out long documents. Two numbers per cache dtype:
  forced: the fp32 cache's greedy continuation is fed to the target over the other cache (one causal pass, which
          attends as that cache stores the rows); share of the 256 positions whose argmax equals the fp32 one;
  free:   AR decoding over that cache (the engine); positions equal to the fp32 cache's tokens before the first
          difference (after it the two texts differ and are no longer comparable).

  python results/kv_cache_dtype/greedy_agreement.py --out results/kv_cache_dtype/greedy_agreement.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import long_doc_paths
from longspec_jax.inference.generate import generate
from longspec_jax.targets import load_target, load_tokenizer

PROMPT, NEW = 2048, 256


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True)
  a = p.parse_args()
  target = load_target("smollm2-135m")
  tok = load_tokenizer("smollm2-135m")
  prompts = [tok.encode(path.read_text()).ids[:PROMPT] for path in long_doc_paths()[:2]]
  graphdef, params = nnx.split(target)
  models = {kv: nnx.merge(graphdef, params).with_kv_dtype(kv) for kv in ("float32", "int8", "bfloat16")}
  ref = generate(models["float32"], prompts, max_new_tokens=NEW, eos_id=-1).tokens
  full = jnp.asarray([pr + r for pr, r in zip(prompts, ref)], jnp.int32)

  at = jnp.broadcast_to(PROMPT - 1 + jnp.arange(NEW), (len(prompts), NEW))

  def argmax_at_new(model):
    gd, st = nnx.split(model)
    logits = jax.jit(lambda st, x: nnx.merge(gd, st)(x, logits_at=at).logits)(st, full)
    return np.asarray(jnp.argmax(logits, -1))

  ref_forced = argmax_at_new(models["float32"])
  out = {"prompt_tokens": PROMPT, "new_tokens": NEW, "docs": [path.name for path in long_doc_paths()[:2]],
         "forced_fp32_matches_engine": float(np.mean(ref_forced == np.asarray(ref)))}
  for kv in ("int8", "bfloat16"):
    forced = float(np.mean(argmax_at_new(models[kv]) == ref_forced))
    free = generate(models[kv], prompts, max_new_tokens=NEW, eos_id=-1).tokens
    first_diff = [next((i for i, (x, y) in enumerate(zip(f, r)) if x != y), NEW) for f, r in zip(free, ref)]
    out[kv] = {"forced_agreement": forced, "free_run_first_difference": first_diff}
    print(kv, out[kv], flush=True)
  Path(a.out).write_text(json.dumps(out, indent=1))
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
