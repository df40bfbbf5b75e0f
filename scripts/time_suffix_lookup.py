"""Per-step cost of the token-matching drafters' in-graph search on this machine: prompt lookup, the suffix drafter
without and with a global index, each jitted alone over a token buffer of --context tokens (B sequences, K
drafts). Medians of --repeats timed calls, all in one process, arms interleaved (a shared machine's load moves them
together).

  python scripts/time_suffix_lookup.py --index runs/smollm2_train.idx --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--index", required=True, help="a `longspec build-suffix-index` file")
  p.add_argument("--context", type=int, default=4096)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--num-draft", type=int, default=7)
  p.add_argument("--repeats", type=int, default=200)
  a = p.parse_args()

  import jax
  import jax.numpy as jnp

  from longspec_jax.drafters.base import ProposeContext
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter
  from longspec_jax.drafters.suffix import SuffixDrafter, with_index
  from longspec_jax.sampling import SamplingParams
  from longspec_jax.suffix_index import load_index

  index = load_index(a.index)
  vocab = index.vocab_size
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (a.batch, a.context + 64)), jnp.int32)
  ctx = ProposeContext(tokens=tokens, num_tokens=jnp.full((a.batch,), a.context, jnp.int32),
                       sampling=SamplingParams.make(0.0))
  with_idx = with_index(SuffixDrafter(vocab), index)
  arms = {"prompt-lookup": (PromptLookupDrafter(vocab), None), "suffix": (SuffixDrafter(vocab), None),
          "suffix+index": (with_idx.spec, with_idx.params)}
  fns = {name: jax.jit(spec.search, static_argnums=2) for name, (spec, _) in arms.items()}
  for name, (_, params) in arms.items():
    jax.block_until_ready(fns[name](params, ctx, a.num_draft))
  times = {name: [] for name in arms}
  for _ in range(a.repeats):
    for name, (_, params) in arms.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](params, ctx, a.num_draft))
      times[name].append(time.perf_counter() - t0)
  out = {"context": a.context, "batch": a.batch, "num_draft": a.num_draft, "index_slots": index.slots,
         "index_mib": index.nbytes / 2 ** 20, "loadavg": os.getloadavg(),
         "median_ms": {n: 1000 * statistics.median(t) for n, t in times.items()}}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
