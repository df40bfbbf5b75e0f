"""longspec-jax: long-context speculative decoding in JAX.

    from longspec_jax import encode_prompt, generate, load_target, load_drafter, load_tokenizer

    model = load_target()                      # the shipped target; or "smollm2-135m", or an HF directory
    tok = load_tokenizer()                     # the same name or directory as load_target
    ids = encode_prompt(tok, "import os\\n", model.cfg.bos_token_id)   # BOS first when the target has one
    out = generate(model, [ids], max_new_tokens=32, drafter=load_drafter("prompt-lookup", model))

Subpackages: `longspec_jax.inference` (generate, the engine and its jit-able `generate_arrays`, benchmarks, CLI),
`longspec_jax.training` (data, sharded trainer, drafter trainers), `longspec_jax.pallas_kernels`.
"""

import importlib
from pathlib import Path

ASSETS_DIR = Path(__file__).parent / "assets"
DEFAULT_TARGET_DIR = ASSETS_DIR / "target"
LONG_DOCS_DIR = ASSETS_DIR / "long_docs"

# The user-facing entry points, imported on first use: they pull in jax (about 1-2 s), which `import longspec_jax`
# (and so `longspec --help`) must not pay for.
_PUBLIC = {
    "generate": "longspec_jax.inference.generate",
    "load_target": "longspec_jax.targets",
    "load_drafter": "longspec_jax.drafters",
    "load_tokenizer": "longspec_jax.targets",
    "encode_prompt": "longspec_jax.tokenizer",
}
__all__ = ["default_target_dir", "long_doc_paths", *_PUBLIC]


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'longspec_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))


def long_doc_paths() -> list[Path]:
  """Held-out long documents (>= 26K tokens each, never trained on) shipped with the package."""
  return sorted(LONG_DOCS_DIR.glob("*.txt"))


def default_target_dir() -> Path:
  if not (DEFAULT_TARGET_DIR / "config.json").exists():
    raise FileNotFoundError(
        f"the shipped default target is missing from {DEFAULT_TARGET_DIR}; pass --model DIR or retrain it "
        "(README: 'Retraining the default target')")
  return DEFAULT_TARGET_DIR


def check_namespaced(module_name: str) -> None:
  """Called by the repository's inference/, training/ and pallas_kernels/ packages, which are installed as
  longspec_jax.<folder>. Imported by their bare folder name (e.g. from the repository root) every module would
  load a second time, with its own registries and jit caches, so that is refused."""
  folder = module_name.rpartition(".")[2]
  if module_name != f"longspec_jax.{folder}":
    raise ImportError(f"import longspec_jax.{folder}, not {module_name}: the repository's {folder}/ folder is "
                      f"installed as longspec_jax.{folder} (pip install -e .)")
