"""argparse value types shared by every `longspec` subcommand. Kept free of jax so that building the parser (and
`longspec --help`) stays fast; a bad value becomes argparse's usage error (exit code 2) before anything loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn


def int_arg(text: str) -> int:
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


def checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], requirement: str) -> Callable[[str], Any]:
  """An argparse type: `parse(text)`, refused with "must be <requirement>" unless `ok(value)`."""
  def convert(text: str):
    v = parse(text)
    if not ok(v):
      raise argparse.ArgumentTypeError(f"must be {requirement}, got {v}")
    return v
  convert.__name__ = requirement
  return convert


# Token counts, sizes, batch, repeats.
positive_int = checked(int_arg, lambda v: v >= 1, "a positive integer")
# Seeds; top-k, where 0 means off.
nonneg_int = checked(int_arg, lambda v: v >= 0, "an integer >= 0")
# Temperature, where 0 means greedy.
nonneg_float = checked(_float, lambda v: v >= 0, ">= 0")
# Top-p.
unit_float = checked(_float, lambda v: 0 < v <= 1, "in (0, 1]")
# A share.
fraction = checked(_float, lambda v: 0 <= v <= 1, "in [0, 1]")


def int_list(text: str) -> tuple[int, ...]:
  """Comma-separated integers >= 0 (layer indices)."""
  return tuple(nonneg_int(p.strip()) for p in text.split(",") if p.strip())


def ascending_lengths(text: str) -> list[int]:
  """Comma-separated ascending distinct integers >= 1 (context lengths)."""
  values = [positive_int(p.strip()) for p in text.split(",") if p.strip()]
  if not values or values != sorted(set(values)):
    raise argparse.ArgumentTypeError(f"must be ascending distinct positive integers, got {text!r}")
  return values


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose usage errors are one line naming the problem (not the whole usage block), exit code 2.
  Subcommand parsers are of the same class (argparse makes them with the parent's type)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Descriptions and epilogs kept as written; a flag's help ends with its default when it has a meaningful one."""

  def _get_help_string(self, action):
    h = action.help or ""
    default = action.default
    shown = not (default is None or default is False or default is argparse.SUPPRESS)  # 0 and 0.0 are shown
    if shown and action.option_strings and "default" not in h:
      h += " (default: %(default)s)"
    return h


def add_command(subparsers: argparse._SubParsersAction, name: str, summary: str, description: str,
                epilog: str | None = None) -> argparse.ArgumentParser:
  """A subcommand whose --help shows `description` (and `epilog`) as written and every flag's default."""
  return subparsers.add_parser(name, help=summary, description=description, epilog=epilog,
                               formatter_class=HelpFormatter)
