"""argparse value types shared by every `longspec` subcommand. Kept free of jax so that building the parser (and
`longspec --help`) stays fast; a bad value becomes argparse's usage error (exit code 2) before anything loads."""

from __future__ import annotations

import argparse


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


def _checked(parse, ok, requirement: str):
  """An argparse type: `parse(text)`, refused with "must be <requirement>" unless `ok(value)`."""
  def convert(text: str):
    v = parse(text)
    if not ok(v):
      raise argparse.ArgumentTypeError(f"must be {requirement}, got {v}")
    return v
  convert.__name__ = requirement
  return convert


# Token counts, sizes, batch, repeats.
positive_int = _checked(_int, lambda v: v >= 1, "a positive integer")
# Seeds; top-k, where 0 means off.
nonneg_int = _checked(_int, lambda v: v >= 0, "an integer >= 0")
# Temperature, where 0 means greedy.
nonneg_float = _checked(_float, lambda v: v >= 0, ">= 0")
# Top-p.
unit_float = _checked(_float, lambda v: 0 < v <= 1, "in (0, 1]")
# A share.
fraction = _checked(_float, lambda v: 0 <= v <= 1, "in [0, 1]")


def int_list(text: str) -> tuple[int, ...]:
  """Comma-separated integers >= 0 (layer indices)."""
  return tuple(nonneg_int(p.strip()) for p in text.split(",") if p.strip())


def ascending_lengths(text: str) -> list[int]:
  """Comma-separated ascending distinct integers >= 1 (context lengths)."""
  values = [positive_int(p.strip()) for p in text.split(",") if p.strip()]
  if not values or values != sorted(set(values)):
    raise argparse.ArgumentTypeError(f"must be ascending distinct positive integers, got {text!r}")
  return values


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions and epilogs kept as written; a flag's help ends with its default when it has a meaningful one."""

  def _get_help_string(self, action):
    h = action.help or ""
    default = action.default
    shown = not (default is None or default is False or default is argparse.SUPPRESS)  # 0 and 0.0 are shown
    if shown and action.option_strings and "default" not in h:
      h += " (default: %(default)s)"
    return h


def add_command(subparsers, name: str, summary: str, description: str):
  """A subcommand whose --help shows `description` as written and every flag's default."""
  return subparsers.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)
