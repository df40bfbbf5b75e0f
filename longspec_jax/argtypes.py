"""argparse value types shared by every `longspec` subcommand. Kept free of jax so that building the parser (and
`longspec --help`) stays fast; a bad value becomes argparse's usage error (exit code 2) before anything loads."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
  """An integer >= 1 (token counts, sizes, batch, repeats)."""
  v = _int(text)
  if v < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
  return v


def nonneg_int(text: str) -> int:
  """An integer >= 0 (seeds; top-k, where 0 means off)."""
  v = _int(text)
  if v < 0:
    raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
  return v


def nonneg_float(text: str) -> float:
  """A finite float >= 0 (temperature, where 0 means greedy)."""
  v = _float(text)
  if v < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
  return v


def unit_float(text: str) -> float:
  """A float in (0, 1] (top-p)."""
  v = _float(text)
  if not 0 < v <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
  return v


def fraction(text: str) -> float:
  """A float in [0, 1] (a share)."""
  v = _float(text)
  if not 0 <= v <= 1:
    raise argparse.ArgumentTypeError(f"must be in [0, 1], got {v}")
  return v


def int_list(text: str) -> tuple[int, ...]:
  """Comma-separated integers >= 0 (layer indices)."""
  return tuple(nonneg_int(p.strip()) for p in text.split(",") if p.strip())


def _int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _float(text: str) -> float:
  try:
    v = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
  if v != v or v in (float("inf"), float("-inf")):
    raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
  return v
