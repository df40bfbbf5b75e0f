"""llama.cpp as a bench peer (`longspec bench --peer llama.cpp`, suite methods `llama.cpp-ar` / `llama.cpp-lookup`):
the GGUF a named target is converted from, run by `llama-cpp-python` (the optional `llamacpp` extra) with its own
AR decoding and its prompt-lookup mode (`LlamaPromptLookupDecoding`), on our prompt tokens.

Each measurement runs in a child process (`python -m longspec_jax.inference.benchmark.llamacpp`, a JSON request
on stdin, a JSON answer on stdout): a crash in native code must not take the bench and its unsaved results down.
One such crash is real: ggml built with `-march=native` on a CPU that advertises AMX inside a VM that does not
enable AMX tiles segfaults in `ggml_backend_amx_mul_mat` on the first token (see AMX_HINT).

Timing is inside each call, as for the transformers peers: prefill = prompt handed in to first token, decode =
first token to last over the tokens after the first, tau = those tokens over the target passes that made them
(`Llama.eval` calls after the prompt's). The KV cache is reset before every call, so every prefill is a real one.
The target reads 4-bit weights (Q4_1 for SmolLM2-135M) with 8-bit activations, where our target runs the same
weights dequantized to fp32: its greedy tokens can part from ours, and each record says where.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from collections.abc import Sequence

PEER_METHODS = ("llama.cpp-ar", "llama.cpp-lookup")
INSTALL_HINT = 'pip install -e ".[llamacpp]" (it builds llama.cpp from source: about 5 minutes on 2 cores)'
AMX_HINT = ('if this CPU advertises AMX inside a VM, rebuild without it: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON '
            '-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" pip install --force-reinstall --no-deps '
            '--no-cache-dir llama-cpp-python')
# llama.cpp's enum llama_rope_scaling_type
ROPE_SCALING_TYPES = {"linear": 1, "yarn": 2}
# llama.cpp's KV cache types (enum ggml_type): its default f16, and q8_0 (a scale per 32 values), which for V needs
# flash attention
PEER_KV_CACHES = {"f16": 1, "q8_0": 8}


def available() -> bool:
  return importlib.util.find_spec("llama_cpp") is not None


def check_peer(model: str | None, rope_scaling: str | None = None) -> Path:
  """The GGUF the peer runs for `--model` (a named target), or one ValueError saying what is missing."""
  from longspec_jax.targets import NAMED_TARGETS, gguf_path, parse_rope_scaling
  if not available():
    raise ValueError(f"the llama.cpp peer needs llama-cpp-python: {INSTALL_HINT}")
  if str(model) not in NAMED_TARGETS:
    raise ValueError(f"the llama.cpp peer runs the GGUF a named target comes from ({', '.join(NAMED_TARGETS)}); "
                     f"--model {model} is not one")
  parsed = parse_rope_scaling(rope_scaling)
  if parsed and parsed[0] not in ROPE_SCALING_TYPES:
    raise ValueError(f"the llama.cpp peer supports RoPE scaling {', '.join(ROPE_SCALING_TYPES)}, not {parsed[0]}")
  return gguf_path(str(model))


def gguf_checkpoint(gguf: Path) -> dict:
  """The peer's provenance: its GGUF and the llama-cpp-python version (results of another build never mix)."""
  from importlib.metadata import version
  h = hashlib.sha256()
  with open(gguf, "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
      h.update(block)
  return {"dir": str(gguf), "sha256": h.hexdigest(), "llama_cpp_python": version("llama-cpp-python")}


def run_peers(gguf: Path, ids: list[int], new_tokens: int, num_draft: int, methods: Sequence[str] = PEER_METHODS,
              temperature: float = 0.0, seed: int = 0, repeats: int = 3, threads: int = 2,
              rope_scaling: str | None = None, kv_cache: str = "f16", timeout_s: float = 1800) -> dict:
  """method -> {"tokens_per_s", "prefill_ms", "decode_ms", "decode_tokens", "target_forwards", "tau", "tokens"}
  (medians over `repeats` timed calls after a short warm-up; tokens of the last call) for each llama.cpp method on
  one prompt, measured in a child process. RuntimeError when the child fails or crashes."""
  from longspec_jax.targets import parse_rope_scaling
  if kv_cache not in PEER_KV_CACHES:
    raise ValueError(f"llama.cpp KV cache must be one of {', '.join(PEER_KV_CACHES)}, got {kv_cache!r}")
  request = {"parent_pid": os.getpid(), "gguf": str(gguf), "ids": list(map(int, ids)), "new_tokens": new_tokens,
             "num_draft": num_draft, "methods": list(methods), "temperature": temperature, "seed": seed,
             "repeats": repeats, "threads": threads, "rope_scaling": parse_rope_scaling(rope_scaling),
             "kv_cache": kv_cache}
  unknown = sorted(set(methods) - set(PEER_METHODS))
  if unknown:
    raise ValueError(f"unknown llama.cpp peer methods {unknown}; known: {', '.join(PEER_METHODS)}")
  proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), capture_output=True, text=True,
                        timeout=timeout_s)
  if proc.returncode != 0:
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    hint = f"; {AMX_HINT}" if proc.returncode < 0 else ""
    raise RuntimeError(f"the llama.cpp peer failed (exit {proc.returncode}){hint}:\n{tail}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def agreement(ours: list[int], theirs: list[int]) -> dict:
  """How far two greedy continuations agree: the common prefix and the share of equal positions."""
  n = min(len(ours), len(theirs))
  prefix = next((i for i in range(n) if ours[i] != theirs[i]), n)
  return {"common_prefix": prefix, "equal_share": sum(a == b for a, b in zip(ours, theirs)) / max(n, 1)}


# --- the child process --------------------------------------------------------------------------------------------

def _model(req: dict, lookup: bool):
  from llama_cpp import Llama
  from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
  kw = {}
  if req["rope_scaling"]:
    kind, factor = req["rope_scaling"]
    kw = dict(rope_scaling_type=ROPE_SCALING_TYPES[kind], rope_freq_scale=1.0 / factor)
  if req["kv_cache"] != "f16":
    kv_type = PEER_KV_CACHES[req["kv_cache"]]
    kw.update(type_k=kv_type, type_v=kv_type, flash_attn=True)
  n_ctx = len(req["ids"]) + req["new_tokens"] + req["num_draft"] + 8
  # logits_all: the lookup mode reads the logits of every drafted row, and past one batch of prompt tokens
  # (n_batch) llama-cpp-python keeps them only with logits_all.
  return Llama(model_path=req["gguf"], n_ctx=n_ctx, n_threads=req["threads"], n_threads_batch=req["threads"],
               seed=req["seed"], logits_all=lookup, verbose=False,
               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=req["num_draft"]) if lookup else None, **kw)


def _call(llm, req: dict, n: int) -> dict:
  evals = [0]
  real_eval = llm.eval

  def counted_eval(tokens):
    evals[0] += 1
    return real_eval(tokens)

  llm.eval = counted_eval
  llm.reset()  # no prefix reuse from the previous call: every prefill is timed
  t = req["temperature"]
  sampling = dict(temp=t, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
  times, tokens = [time.perf_counter()], []
  for tok in llm.generate(req["ids"], **sampling):
    times.append(time.perf_counter())
    tokens.append(int(tok))
    if len(tokens) >= n:
      break
  llm.eval = real_eval
  decode_tokens, decode_s = len(tokens) - 1, times[-1] - times[1]
  return {"tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
          "prefill_ms": 1000 * (times[1] - times[0]), "decode_ms": 1000 * decode_s, "decode_tokens": decode_tokens,
          "target_forwards": evals[0] - 1, "tau": decode_tokens / max(evals[0] - 1, 1), "tokens": tokens}


def serve(req: dict) -> dict:
  out = {}
  for method in req["methods"]:
    llm = _model(req, lookup=method == "llama.cpp-lookup")
    _call(llm, {**req, "ids": req["ids"][:32]}, 2)  # warm-up (first-call allocations) on a short prompt
    calls = [_call(llm, req, req["new_tokens"]) for _ in range(req["repeats"])]
    med = {k: statistics.median(c[k] for c in calls) for k in ("prefill_ms", "decode_ms", "tau")}
    last = calls[-1]
    out[method] = {**med, "decode_tokens": last["decode_tokens"], "target_forwards": last["target_forwards"],
                   "tokens_per_s": last["decode_tokens"] / (med["decode_ms"] / 1000), "tokens": last["tokens"]}
    del llm
  return out


def die_with_parent(parent_pid: int) -> None:
  """Linux: this child is killed when the bench process ends. The CLI leaves at once on Ctrl-C (`os._exit`), and a
  SIGINT sent to it alone (not to the terminal's process group) would otherwise leave llama.cpp running for
  minutes."""
  try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: the terminal's Ctrl-C still reaches the whole process group
    return
  if os.getppid() != parent_pid:  # the parent was gone before the line above took effect
    os._exit(1)


if __name__ == "__main__":
  request = json.loads(sys.stdin.read())
  die_with_parent(request["parent_pid"])
  print(json.dumps(serve(request)))
