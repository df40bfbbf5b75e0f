"""YAML -> frozen dataclass with strict keys (unknown keys are errors) and `key=value` CLI overrides."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import TypeVar

import yaml

_T = TypeVar("_T")


def _coerce(tp, value, where):
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp) and isinstance(value, dict):
    return from_dict(tp, value, where)
  if origin is tuple and isinstance(value, (list, tuple)):
    (item_tp, *_rest) = typing.get_args(tp)
    return tuple(_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
  if tp is float and isinstance(value, int):
    return float(value)
  return value


def from_dict(cls: type[_T], d: dict, where: str = "config") -> _T:
  if not isinstance(d, dict):
    raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ValueError(f"{where}: unknown config keys {unknown}; known keys: {sorted(fields)}")
  hints = typing.get_type_hints(cls)
  return cls(**{k: _coerce(hints[k], v, f"{where}.{k}") for k, v in d.items()})


def apply_overrides(d: dict, overrides: list[str]) -> dict:
  """`a.b=3` style overrides; values parsed as YAML scalars."""
  d = dict(d)
  for item in overrides or []:
    if "=" not in item:
      raise ValueError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    node = d
    *parents, last = key.split(".")
    for p in parents:
      node[p] = dict(node.get(p) or {})
      node = node[p]
    node[last] = yaml.safe_load(raw)
  return d


def load_yaml(cls: type[_T], path: str | os.PathLike, overrides: list[str] | None = None) -> _T:
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"config file {path} not found")
  try:
    raw = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ValueError(f"config file {path} is not valid YAML: {e}") from e
  return from_dict(cls, apply_overrides(raw, overrides or []), where=str(path))
