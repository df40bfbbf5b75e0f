"""How far a row's logits from a one-row decode step are from the same row's logits as row 0 of an 8-row verify
pass (same prompt cache, same token), per target dtype: the noise that a greedy tie must fall inside for
speculative output to part from AR. SmolLM2-135M, 6 prompts of 4096 tokens from a held-out long document; for
int8-weights also with the activations split into 2 int8 parts instead of 3 (`model.INT8_PARTS`).

  python results/verify_pass/decode_vs_verify_logits.py > results/verify_pass/decode_vs_verify_logits.log
"""
import jax
import jax.numpy as jnp
import numpy as np

import longspec_jax.model as model_lib
from longspec_jax import long_doc_paths
from longspec_jax.targets import load_target, load_tokenizer

PROMPT = 4096
tok = load_tokenizer("smollm2-135m", show_progress=False)
doc = next(p for p in long_doc_paths() if p.name == "inspect.py.txt")
ids = tok.encode(doc.read_text()).ids
for dtype, parts in (("float32", None), ("bf16-weights", None), ("int8-weights", 2), ("int8-weights", 3)):
  model_lib.INT8_PARTS = parts or 3
  m = load_target("smollm2-135m", dtype=dtype, show_progress=False)
  prefill = jax.jit(lambda t, c: m(t, cache=c, mode="prefill", return_logits=False).cache)
  extend = jax.jit(lambda t, c: m(t, cache=c, mode="extend").logits)
  diffs = []
  for start in range(0, 6000, 1000):
    cache = prefill(jnp.asarray([ids[start:start + PROMPT]]), m.init_cache(1, PROMPT + 16))
    cache = cache.replace(lengths=jnp.asarray([PROMPT]))
    rows = jnp.asarray([ids[start + PROMPT:start + PROMPT + 8]])
    one, eight = np.asarray(extend(rows[:, :1], cache)[0, 0]), np.asarray(extend(rows, cache)[0, 0])
    diffs.append(float(np.abs(one - eight).max()))
  label = dtype + (f" ({parts} parts)" if parts else "")
  print(f"{label:22s} max |logit(decode) - logit(verify row 0)| per prompt: "
        + " ".join(f"{d:.1e}" for d in diffs), flush=True)
model_lib.INT8_PARTS = 3
