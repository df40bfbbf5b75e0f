"""Session 10: does a two-reduction argmax speed up the verify pass? The target's T-row extend pass followed by
jnp.argmax, by the same result as two plain reductions (max, then the first index equal to it), and by nothing
(logits only), compiled apart and timed interleaved in one process (medians of 21).
  python results/verify_pass/session10/argmax_in_verify.py "" 4096 1,9
  python results/verify_pass/session10/argmax_in_verify.py smollm2-135m 4096 1,9
Standalone, over [9, 49152] fp32 logits, jnp.argmax took ~2.1 ms and the two reductions ~0.4 ms; inside the pass the
difference is within the noise (argmax_in_verify.log), so the library keeps jnp.argmax."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from profile_verify import filled_cache, interleaved_medians
from longspec_jax.kv_cache import COMPILER_OPTIONS
from longspec_jax.targets import load_target


def two_reduction_argmax(logits):
  v = logits.shape[-1]
  largest = (logits == jnp.max(logits, axis=-1, keepdims=True)) | jnp.isnan(logits)
  return jnp.min(jnp.where(largest, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


name, ctx, rows = sys.argv[1] or None, int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
model = load_target(name)
graphdef, params = nnx.split(model)


def make(pick):
  def f(params, cache, tokens):
    out = nnx.merge(graphdef, params)(tokens, cache=cache, mode="extend")
    return pick(out.logits), out.cache
  return jax.jit(f, donate_argnums=(1,), compiler_options=COMPILER_OPTIONS)


progs = {"jnp.argmax": make(lambda l: jnp.argmax(l, -1).astype(jnp.int32)),
         "two reductions": make(two_reduction_argmax), "logits only": make(lambda l: l)}
for t in rows:
  tokens = jnp.ones((1, t), jnp.int32)
  state = {k: filled_cache(model, ctx, t) for k in progs}

  def call(k):
    def go():
      out, state[k] = progs[k](params, state[k], tokens)
      return out
    return go
  ms = interleaved_medians({k: call(k) for k in progs}, 21)
  print(f"{name or 'shipped'} ctx {ctx} rows {t}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
