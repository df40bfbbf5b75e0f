"""Files the commands write: whole or not at all, and checked before the work that fills them."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: Any, indent: int = 2) -> None:
  """Writes `obj` as JSON under a temporary name, then renames it: a reader (another process, a crash, an
  interrupt) sees the old file or the new one, never a half-written one."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=indent))
  os.replace(tmp, path)


def check_writable_file(path: Path, what: str) -> None:
  """Raises ValueError naming `what` (e.g. "--json") when `path` could not be written: its folder cannot be made or
  written to, or it is a directory. Creates the missing folders, as the later write would."""
  if path.is_dir():
    raise ValueError(f"{what} {path} is a directory, not a file")
  parent = path.parent
  existing = next(p for p in (parent, *parent.parents) if p.exists())
  if not existing.is_dir():
    raise ValueError(f"{what} {path} cannot be written: {existing} is a file, not a folder")
  try:
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".check"):
      pass  # a real write, not os.access (which says yes to root on a read-only file system)
  except OSError as e:
    raise ValueError(f"{what} {path} cannot be written: {(e.strerror or str(e)).lower()}"
                     + (f" ({e.filename})" if getattr(e, "filename", None) else "")) from None
