"""Multi-host for real: two local CPU processes joined by jax.distributed on localhost (gloo collectives) train a
drafter (EAGLE-3) with the batch sharded across them, each building only its own rows, through the real CLI
(`longspec --coordinator ... train-drafter`). Losses and final parameters must equal a single-process run on the
same global batches (one process with two devices: the same mesh shape). The two-process run is stopped after 3 of
its 6 steps (an orbax checkpoint written by both processes) and resumed by a second two-process launch, so one
comparison covers both the data-parallel steps and the multi-process checkpoint's exact resume (the checkpointing
is the trainer's, shared by every drafter; each drafter's single-process resume is tested in its own file, and
each drafter's sampler builds only its process's rows: test_each_process_builds_only_its_rows)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.test_train_drafter import env  # noqa: F401  (the tiny target + drafter data fixture)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def _config(env, tmp_path) -> Path:
  """A tiny EAGLE-3 config on the env fixture's data: batches of 4 rows split over 2 data devices."""
  _, data_cfg = env
  cfg = dict(out_dir=str(tmp_path / "unused"), batch_size=4, steps=STEPS, optim=dict(lr=0.02, warmup_steps=2),
             val_fraction=0.2, compute_dtype="float32", log_every=1, checkpoint_every_minutes=100.0, mesh_data=2,
             data_dirs=[data_cfg.out_dir], context_len=16, ttt_steps=2, val_windows=2, attn_block=16,
             model=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64))
  path = tmp_path / "eagle3.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _train(drafter: str, config: Path, out: Path, processes: int, *extra: str) -> list[str]:
  """Runs `longspec train-drafter` as `processes` processes (one CPU device each) or, for 1, one process with two
  CPU devices. Returns each process's output."""
  devices = 2 if processes == 1 else 1
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["XLA_FLAGS"]
             + f" --xla_force_host_platform_device_count={devices}")
  cmd = ["train-drafter", "--drafter", drafter, "--config", str(config), "--set", f"out_dir={out}", *extra]
  if processes == 1:
    launches = [[]]
  else:
    port = _free_port()
    launches = [["--coordinator", f"localhost:{port}", "--num-processes", str(processes), "--process-id", str(i)]
                for i in range(processes)]
  procs = [subprocess.Popen([sys.executable, "-m", "longspec_jax.inference.cli", *dist, *cmd], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for dist in launches]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  # On a failure show every process: the one that fails first often reports only that its peer went away.
  report = "\n".join(f"--- process {i} exited {p.returncode}:\n{o[-3000:]}"
                     for i, (p, o) in enumerate(zip(procs, outs)))
  assert all(p.returncode == 0 for p in procs), report
  return outs


def _log(out: Path) -> list[dict]:
  rows = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]


def _params(out: Path) -> dict:
  from safetensors.numpy import load_file
  return load_file(out / "final" / "model.safetensors")


@pytest.mark.slow
def test_two_processes_train_like_one(env, tmp_path):
  """Two processes of one device each train what one process of two devices does, bit for bit, across a resume.
  What differs between the drafters under several processes is only which rows each process builds, and every
  drafter's sampler is checked for that in test_each_process_builds_only_its_rows; the gradient all-reduce, process
  0's export and the resume are the trainer's, run here through EAGLE-3."""
  config = _config(env, tmp_path)
  single, multi = tmp_path / "single", tmp_path / "multi"
  _train("eagle3", config, single, 1)
  assert "checkpoints" in _train("eagle3", config, multi, 2, "--set", "stop_after_steps=3")[0]
  assert len(_log(multi)) == 3
  outs = _train("eagle3", config, multi, 2)
  assert all("resumed from step 3" in o for o in outs)
  assert (multi / "final" / "drafter.json").exists()  # written by process 0 only (process 1 returns before it)

  log_1, log_2 = _log(single), _log(multi)
  print("single process, 2 devices:", json.dumps(log_1))
  print("two processes, 1 device each (steps 4-6 after a resume):", json.dumps(log_2))
  # Same global batches, same mesh shape: the gradient all-reduce (gloo across processes, in-process otherwise)
  # sums the same two shards, so losses and gradient norms agree bit for bit.
  assert len(log_1) == STEPS and log_1 == log_2
  p1, p2 = _params(single), _params(multi)
  assert p1.keys() == p2.keys()
  worst = max(float(np.max(np.abs(p1[k].astype(np.float32) - p2[k].astype(np.float32)))) for k in p1)
  print(f"final parameters: max |single - two-process| = {worst:.3g} over {len(p1)} tensors (exported)")
  assert all(np.array_equal(p1[k], p2[k]) for k in p1)

def test_each_process_builds_only_its_rows():
  """A process builds only its rows of a step's batch, and they equal those rows of the whole batch (every random
  draw is made for the whole batch), so splitting a batch over processes does not change it."""
  from longspec_jax.training.data import TokenStream
  from longspec_jax.training.train_dflash import BlockSampler, DFlashTrainConfig
  from longspec_jax.training.train_pard import PardTrainConfig, WindowSampler
  from longspec_jax.training.train_eagle3 import Windows

  rows = [list(range(3, 3 + n)) for n in (5, 9, 30, 40, 12, 17)]
  stream = TokenStream(np.arange(500), 1)
  samplers = {
      "pard": WindowSampler(rows, PardTrainConfig(context_len=16, num_masks=3, anchors_per_window=4), 0, 1).batch,
      "dflash": BlockSampler([(r, 3) for r in rows], DFlashTrainConfig(context_len=16, block_size=4,
                                                                       anchors_per_window=3), 0, 1).batch,
      "eagle3": Windows(rows, 16, 0, 1).batch,
      "target": lambda step, size, part=slice(None): {"tokens": stream.batch(step, size, 16, part)},
  }
  for name, batch in samplers.items():
    whole = batch(5, 6)
    for lo, hi in ((0, 3), (3, 6), (2, 5)):
      part = batch(5, 6, slice(lo, hi))
      assert part.keys() == whole.keys(), name
      for k in whole:
        assert len(part[k]) == hi - lo and np.array_equal(part[k], whole[k][lo:hi]), (name, k, lo, hi)


MULTI_PROCESS_GENERATE = """
import json, sys
from longspec_jax.distributed import host_values, initialize, is_main_process
initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax
from longspec_jax.inference.engine import output_stats, output_tokens, prepare
from longspec_jax.inference.functional import place_generation
from longspec_jax import sharding as shd
from longspec_jax.drafters.pard import standalone_from_model
from longspec_jax.model import create_model
from tests.test_functional import _cfg, _prompts

assert jax.process_count() == 2 and jax.device_count() == 2 and jax.local_device_count() == 1
target = create_model(_cfg(), seed=0)
drafter = standalone_from_model(create_model(_cfg(layers=1), seed=7), "pard")
mesh = shd.make_mesh(2, 1)  # the batch split over the two processes' devices
res = {}
for method, kw in (("ar", {}), ("pard", dict(drafter=drafter, num_draft=3))):
  config, params, inputs = prepare(target, _prompts([5, 30, 14, 22], 0), max_new_tokens=12, eos_id=-1,
                                              **kw)
  fn, placed_params, placed_inputs = place_generation(mesh, config, params, inputs)
  out = host_values(fn(placed_params, placed_inputs))  # every process gathers the global output
  res[method] = output_tokens(out, inputs)
  if method == "pard":
    res["tau"] = output_stats(out)["tau"]
print("TOKENS", json.dumps(res))
"""


@pytest.mark.slow
def test_two_process_generate_equals_single_process():
  from longspec_jax.inference.generate import generate
  from longspec_jax.drafters.pard import standalone_from_model
  from longspec_jax.model import create_model
  from tests.test_functional import _cfg, _prompts

  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["XLA_FLAGS"]
             + " --xla_force_host_platform_device_count=1")
  coordinator = f"localhost:{_free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", MULTI_PROCESS_GENERATE, coordinator, str(i)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, o in zip(procs, outs):
    assert p.returncode == 0, o[-3000:]
  results = [json.loads(o.split("TOKENS ", 1)[1].splitlines()[0]) for o in outs]
  assert results[0] == results[1]  # both processes gathered the same global output
  target = create_model(_cfg(), seed=0)
  drafter = standalone_from_model(create_model(_cfg(layers=1), seed=7), "pard")
  prompts = _prompts([5, 30, 14, 22], 0)
  ar = generate(target, prompts, max_new_tokens=12, eos_id=-1)
  spec = generate(target, prompts, max_new_tokens=12, eos_id=-1, drafter=drafter, num_draft=3)
  print(f"two processes: AR tokens == single-process AR: {results[0]['ar'] == ar.tokens}; speculative tokens == "
        f"single-process: {results[0]['pard'] == spec.tokens}; tau {results[0]['tau']:.3f} vs {spec.stats['tau']:.3f}")
  assert results[0]["ar"] == ar.tokens and results[0]["pard"] == spec.tokens == ar.tokens
  assert results[0]["tau"] == spec.stats["tau"]


QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False}


def test_memory_estimate_qwen3_8b(tmp_path, capsys):
  from longspec_jax.inference.cli import main
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
  out = tmp_path / "m.json"
  assert main(["memory", "--config", str(tmp_path), "--slice", "v5litepod-16", "--context", "32768", "--batch",
               "16", "--json", str(out)]) == 0
  print(capsys.readouterr().out)
  res = json.loads(out.read_text())
  assert res["chips"] == 16 and res["hbm_gib_per_chip"] == 16
  assert 8.1e9 < res["parameters"] < 8.3e9  # Qwen3-8B: 8.2B with its untied LM head
  # KV cache: 36 layers x (K, V) x 8 heads x 128 x 2 bytes per token.
  assert res["kv_cache_gib_per_sequence"] == pytest.approx(36 * 2 * 8 * 128 * 2 * 32768 / 2**30, rel=1e-3)
  meshes = {(r["data"], r["model"]): r for r in res["meshes"]}
  assert set(meshes) == {(16, 1), (8, 2), (4, 4), (2, 8)}  # model <= 8 KV heads
  assert not meshes[(16, 1)]["fits"] and meshes[(8, 2)]["fits"]  # 16.4 GB of bf16 weights need 2+ chips
  assert meshes[(4, 4)]["params_gib_per_chip"] == pytest.approx(meshes[(16, 1)]["params_gib_per_chip"] / 4, rel=0.01)
  for bad in (["--slice", "v9-8"], ["--slice", "v4-7"]):
    assert main(["memory", "--config", str(tmp_path), *bad]) == 2


def test_distributed_flags_are_checked(capsys):
  from longspec_jax.inference.cli import main
  assert main(["--coordinator", "localhost:1", "generate", "--prompt", "x"]) == 2
  assert "give all of coordinator, num_processes and process_id" in capsys.readouterr().err
  assert main(["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2", "generate",
               "--prompt", "x"]) == 2
  assert "process_id must be in [0, 2)" in capsys.readouterr().err


def test_tpu_scripts_pass_shellcheck():
  import shutil
  scripts = sorted((ROOT / "scripts" / "tpu").glob("*.sh"))
  assert {p.name for p in scripts} == {"env.sh", "create.sh", "launch.sh", "run.sh", "teardown.sh"}
  for p in scripts:
    text = p.read_text()
    assert text.startswith("#!/usr/bin/env bash") and (p.name == "env.sh" or "set -euo pipefail" in text)
  assert "--worker=all" in (ROOT / "scripts/tpu/env.sh").read_text()
  assert "longspec --distributed" in (ROOT / "scripts/tpu/run.sh").read_text()
  if shutil.which("shellcheck") is None:
    pytest.skip("shellcheck not installed (apt-get install shellcheck)")
  r = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stdout
