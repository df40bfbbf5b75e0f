"""longspec-jax: long-context speculative decoding in JAX."""

from pathlib import Path

ASSETS_DIR = Path(__file__).parent / "assets"
DEFAULT_TARGET_DIR = ASSETS_DIR / "target"
LONG_DOCS_DIR = ASSETS_DIR / "long_docs"


def long_doc_paths() -> list[Path]:
  """Held-out long documents (>= 26K tokens each, never trained on) shipped with the package."""
  return sorted(LONG_DOCS_DIR.glob("*.txt"))


def default_target_dir() -> Path:
  if not (DEFAULT_TARGET_DIR / "config.json").exists():
    raise FileNotFoundError(
        f"the shipped default target is missing from {DEFAULT_TARGET_DIR}; pass --model DIR or retrain it "
        "(README: 'Retraining the default target')")
  return DEFAULT_TARGET_DIR
