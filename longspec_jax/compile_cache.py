"""JAX's persistent compilation cache for the `longspec` commands: a second identical run loads its compiled
programs from disk instead of compiling them again.

Where: `--compile-cache DIR` (a command-line flag), else $LONGSPEC_COMPILE_CACHE, else `<cache dir>/jax_cache`
(beside the converted targets: $LONGSPEC_CACHE, $XDG_CACHE_HOME/longspec_jax or ~/.cache/longspec_jax). The value
`off` disables it. Library calls (`generate()` from Python) leave JAX's own setting alone."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "LONGSPEC_COMPILE_CACHE"
OFF = "off"


def compile_cache_dir(flag: str | None = None) -> Path | None:
  """The directory the CLI caches compiled programs in, or None when disabled."""
  from longspec_jax.targets import cache_dir
  value = flag if flag is not None else os.environ.get(ENV_VAR)
  if value is not None and value.strip().lower() in (OFF, "0", "none", ""):
    return None
  return Path(value) if value else cache_dir() / "jax_cache"


def enable_compile_cache(flag: str | None = None) -> Path | None:
  """Turns the persistent cache on for this process (every program, however quickly it compiled); returns its
  directory (None: disabled)."""
  path = compile_cache_dir(flag)
  if path is None:
    return None
  source = "--compile-cache" if flag is not None else f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the cache"
  if path.exists() and not path.is_dir():
    raise ValueError(f"compiled-program cache {path} (from {source}) is a file, not a directory: give a directory, "
                     "or 'off'")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"compiled-program cache {path} (from {source}) cannot be made: {(e.strerror or str(e)).lower()}"
                     "; give another directory, or 'off'") from None
  import jax
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
