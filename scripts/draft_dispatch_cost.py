"""Draft pass timed as a jit call (static config: host dispatch included) and as the AOT-compiled executable, in
one process, SmolLM2 at a 1K prompt (docs/benchmarks.md, "Draft ms without jit dispatch").

  python scripts/draft_dispatch_cost.py longspark 7"""
import statistics
import sys
import time

import jax
from longspec_jax.targets import load_target, resolve_target_dir
from longspec_jax.tokenizer import load_tokenizer
from longspec_jax.drafters import load_drafter
from longspec_jax.inference import engine
from longspec_jax.inference.benchmark import measure

method, K = sys.argv[1], int(sys.argv[2])
model = load_target("smollm2-135m", show_progress=False)
tok = load_tokenizer(resolve_target_dir("smollm2-135m"))
ids = tok.encode(open("longspec_jax/assets/long_docs/inspect.py.txt").read()).ids[:1024]
cfg, params, inputs = engine.prepare(model, [ids], 64, drafter=load_drafter(method, model), num_draft=K)
timer = measure.Timer()
shared = measure.shared_prefill(timer, cfg.graphdef, params.target, inputs, cfg.max_len, [cfg.drafter])
s0 = measure.start_state(cfg, params, inputs, shared)
exe = measure.draft_program.lower(cfg, params, inputs, s0).compile()
jax.block_until_ready(measure.draft_program(cfg, params, inputs, s0))
jax.block_until_ready(exe(params, inputs, s0))
jit_t, aot_t = [], []
for _ in range(31):  # interleaved, so load drift hits both alike
  t0 = time.perf_counter()
  jax.block_until_ready(measure.draft_program(cfg, params, inputs, s0))
  jit_t.append(time.perf_counter() - t0)
  t0 = time.perf_counter()
  jax.block_until_ready(exe(params, inputs, s0))
  aot_t.append(time.perf_counter() - t0)
j, a = 1000 * statistics.median(jit_t), 1000 * statistics.median(aot_t)
print(f"{method} K={K} at 1K: draft pass as a jit call {j:.2f} ms, as the compiled executable {a:.2f} ms "
      f"(dispatch {j - a:.2f} ms), medians of 31 interleaved calls")
