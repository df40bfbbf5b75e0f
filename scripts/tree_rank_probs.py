"""How often the target's next token is an EAGLE-3 drafter's rank-r candidate, teacher-forced over held-out text,
and the best-first draft trees (`DraftTree.best_first`) those rates give, for `--tree` / bench-suite `tree=`:

  python scripts/tree_rank_probs.py --text runs/calibration_text.py.txt --tokens 1024 --windows 8 --generated 256 \\
      --sizes 8,12,16,24,32 --out configs/trees/smollm2_eagle3.json

Each window's first tokens are a prompt the target continues greedily for `--generated` tokens (the text a
speculative step drafts is the target's own; 0: score the natural text itself). One target pass over the window
gives its features; the drafter's layer over them gives, at every scored position, the first draft's candidates
(the tree's depth-1 nodes). Deeper drafts read the drafter's own outputs and are
accepted less often, so the trees are built with those rates at every depth capped by `--max-depth`, and their
engine tau (bench-suite) is what counts.
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.draft_tree import DraftTree
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.eagle3 import run_cached
from longspec_jax.kv_cache import KVCache
from longspec_jax.targets import load_target, load_tokenizer


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2-135m")
  p.add_argument("--drafter", default=None, help="EAGLE-3 checkpoint directory (default: the shipped one)")
  p.add_argument("--text", required=True, help="held-out text file")
  p.add_argument("--tokens", type=int, default=4096, help="positions per window")
  p.add_argument("--windows", type=int, default=4)
  p.add_argument("--generated", type=int, default=256, help="greedy target tokens scored after each window's prompt")
  p.add_argument("--ranks", type=int, default=8)
  p.add_argument("--sizes", default="8,12,16,24,32", help="tree sizes (nodes) to build")
  p.add_argument("--max-depth", type=int, default=8)
  p.add_argument("--out", required=True)
  a = p.parse_args()

  model, tok = load_target(a.model), load_tokenizer(a.model)
  drafter = load_drafter("eagle3", model, a.drafter)
  ids = tok.encode(Path(a.text).read_text()).ids
  need = a.windows * (a.tokens + 1)
  if len(ids) < need:
    raise SystemExit(f"{a.text}: {len(ids)} tokens, need {need} for {a.windows} windows of {a.tokens}")
  windows = np.asarray(ids[:need], np.int32).reshape(a.windows, a.tokens + 1)
  spec, params = drafter.spec, drafter.params

  @jax.jit
  def ranks_of(tokens):
    """The drafter's rank of the target's argmax next token at every position [B, T-2] (ranks >= R: R)."""
    out = model(tokens, mode="train", taps=spec.taps)
    target_next = jnp.argmax(out.logits, -1)  # [B, T]: the target's token after position p
    b, t = tokens.shape
    net = spec._net(params)
    cache = KVCache.zeros(1, b, t, spec.cfg.num_key_value_heads, spec.cfg.head_dim, spec.dtype)
    feat = net.feature(out.taps[:, :t - 1].astype(spec.dtype))
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    h, _ = run_cached(net, spec._embed(params, tokens[:, 1:]), feat, pos, cache, "prefill")
    logits = net.logits(h[:, :-1])  # row p predicts token p + 2
    top = spec.draft_ids(params)[jax.lax.top_k(logits, a.ranks)[1]]  # [B, T-2, R]
    hit = top == target_next[:, 1:-1, None]
    return jnp.where(hit.any(-1), jnp.argmax(hit, -1), a.ranks)

  if a.generated:
    from longspec_jax.inference.generate import generate
    prompts = [w[:a.tokens + 1 - a.generated].tolist() for w in windows]
    cont = generate(model, prompts, max_new_tokens=a.generated, eos_id=-1).tokens
    windows = np.asarray([p + c for p, c in zip(prompts, cont)], np.int32)
  # Row p of ranks_of scores the token at p + 2: keep the generated tokens only.
  first = 0 if not a.generated else a.tokens + 1 - a.generated - 2
  ranks = np.concatenate([np.asarray(ranks_of(jnp.asarray(w[None])))[0, first:] for w in windows])
  probs = [float(np.mean(ranks == r)) for r in range(a.ranks)]
  trees = {}
  for n in map(int, a.sizes.split(",")):
    tree = DraftTree.best_first([max(q, 1e-6) for q in probs], n, max_depth=a.max_depth)
    trees[str(n)] = {"tree": str(tree), "depth": tree.depth, "model_tau": round(tree.expected_accepted(probs), 3)}
  out = {"rank_probs": [round(q, 4) for q in probs], "positions": int(ranks.size), "trees": trees,
         "command": {"model": a.model, "drafter": a.drafter or "shipped eagle3", "text": a.text,
                     "tokens": a.tokens, "windows": a.windows, "generated": a.generated, "max_depth": a.max_depth}}
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
  print(json.dumps({"rank_probs": out["rank_probs"], "positions": out["positions"]}))
  for n, t in trees.items():
    print(f"{n:>3} nodes, depth {t['depth']}, model tau {t['model_tau']}: {t['tree']}")


if __name__ == "__main__":
  main()
