"""What a result depends on and where it ran: the target and drafter checkpoints (hashes), the git commit, the
machine and library versions, and how loaded the machine was (other processes' CPU time, load average)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from tokenizers import Tokenizer

  from longspec_jax.config import ModelConfig
  from longspec_jax.inference.benchmark.config import MethodSpec
  from longspec_jax.model import Transformer

ROOT = Path(__file__).resolve().parents[2]


def target_with_provenance(model: str, rope_scaling: str = "", dtype: str = "float32", kv_dtype: str = ""
                           ) -> tuple[Transformer, Tokenizer, dict]:
  """(model, tokenizer, description) for a suite config's `model:` (a named target such as smollm2-135m, a model
  directory, or "" for the shipped default), `rope_scaling:` (e.g. "yarn:2"; "" = none), `dtype:` and `kv_dtype:`
  ("" = the activations' dtype)."""
  from longspec_jax.hf_io import weights_sha256
  from longspec_jax.targets import load_target as load, resolve_target_dir
  from longspec_jax.tokenizer import load_tokenizer
  path = resolve_target_dir(model or None)
  target = load(path, rope_scaling=rope_scaling or None, dtype=dtype, kv_dtype=kv_dtype or None)
  return (target, load_tokenizer(path),
          {"model": model or "shipped default", "dir": str(path), "rope_scaling": rope_scaling or None,
           "dtype": dtype, "kv_dtype": target.kv_dtype, "weights_sha256": weights_sha256(path)})


def drafter_checkpoint(method: MethodSpec, target: Transformer | ModelConfig | None = None) -> dict | None:
  """The checkpoint a method's drafter loads (directory and a hash of its weights, config.json and, when the
  method turns SharpDraft on, sharpdraft.json; with a draft vocabulary, draft_vocab.json), so that results of a
  retrained drafter are never mixed with the old ones; None for methods without a checkpoint (AR, prompt lookup).
  `method`: a config.MethodSpec."""
  from longspec_jax.drafters import drafter_path
  from longspec_jax.drafters.frozen_target import DRAFT_VOCAB_FILE
  from longspec_jax.hf_io import weights_sha256
  if method.name == "ar":
    return None
  try:
    path = drafter_path(method.name, method.drafter_dir, target, dict(method.options).get("learned"))
  except FileNotFoundError:
    return None
  h = hashlib.sha256(weights_sha256(path).encode())
  options = dict(method.options)
  files = ["config.json"] + (["sharpdraft.json"] if options.get("sharpdraft", "off") != "off" else []) + (
      [DRAFT_VOCAB_FILE] if options.get("draft_vocab") else [])
  for name in files:
    if (path / name).exists():
      h.update((path / name).read_bytes())
  return {"dir": str(path), "sha256": h.hexdigest()}


def fingerprint(*parts: Any) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_state() -> dict:
  def run(*args):
    try:
      return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return None
  status = run("status", "--porcelain", "--untracked-files=no")  # tracked files changed since the commit
  return {"commit": run("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def machine_info() -> dict:
  import flax
  import jax
  import jaxlib
  import numpy as np
  cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
              if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else None
  return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "jax_devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
          "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                       "numpy": np.__version__}}


def cpu_snapshot() -> dict[str, float] | None:
  """The machine's busy CPU seconds so far (every process, including those that end before the next snapshot:
  /proc/stat) and this process's own (os.times, its children included)."""
  try:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
  except (OSError, IndexError, ValueError):
    return None
  busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system [idle iowait] irq softirq steal
  own = os.times()
  return {"busy_s": busy / os.sysconf("SC_CLK_TCK"),
          "own_s": own.user + own.system + own.children_user + own.children_system}


def other_cpu_s(before: dict | None, after: dict | None) -> float | None:
  """CPU seconds used by other processes between two `cpu_snapshot`s (clamped at 0: the two clocks tick apart)."""
  if not before or not after:
    return None
  return max(0.0, (after["busy_s"] - before["busy_s"]) - (after["own_s"] - before["own_s"]))


def rss_bytes() -> int | None:
  try:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return None
