"""No import cycle among the project's modules, counting imports inside functions too (a deferred import that
closes a cycle hides a tangle, it does not remove it)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Repository folder -> the package it is installed as (pyproject.toml's package-dir mapping).
PACKAGES = {"longspec_jax": "longspec_jax", "inference": "longspec_jax.inference",
            "training": "longspec_jax.training", "pallas_kernels": "longspec_jax.pallas_kernels"}


def _modules() -> dict[str, Path]:
  mods = {}
  for folder, package in PACKAGES.items():
    for path in (ROOT / folder).rglob("*.py"):
      parts = path.relative_to(ROOT / folder).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join((package, *parts))] = path
  return mods


def _imports(name: str, path: Path, modules: dict) -> set[str]:
  """The project modules `name` imports anywhere in its file."""
  is_package = path.name == "__init__.py"
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    else:
      continue
    out.update(t for t in targets if t in modules and t != name)
  return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one module (Tarjan)."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_cycle_finder_sees_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
  modules = _modules()
  assert "longspec_jax.inference.engine" in modules and "longspec_jax.drafters.base" in modules
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  assert sum(map(len, graph.values())) > 50, "the scan found too few imports to be reading the code"
  assert _cycles(graph) == []


# The floors, lowest first (issue 57): a module imports only from its own floor or below. The first pattern a module
# name matches (exactly, or as a package prefix ending in ".") gives its floor; the rest is the core.
FLOORS = (
    ("core", ()),  # config, model, KV cache, attention, RoPE, checkpoint and tokenizer IO, sampling, verification
    ("kernels", ("longspec_jax.pallas_kernels.",)),
    ("drafters", ("longspec_jax.drafters.", "longspec_jax.sharpdraft", "longspec_jax.draft_tree")),
    ("engine", ("longspec_jax.inference", "longspec_jax.inference.engine", "longspec_jax.inference.generate",
                "longspec_jax.inference.functional", "longspec_jax.inference.draft_length")),
    ("training and benchmarks", ("longspec_jax.training.", "longspec_jax.inference.")),
    ("cli", ("longspec_jax.inference.cli.",)),
)


def _floor(module: str) -> int:
  """The floor of the most specific pattern: an exact name, else the longest package prefix ("pkg." matches pkg
  itself and everything in it)."""
  best, level = (-1, 0), 0
  for i, (_, patterns) in enumerate(FLOORS):
    for p in patterns:
      if module == p:
        score = (10**6, 0)
      elif p.endswith(".") and (module.startswith(p) or module == p[:-1]):
        score = (len(p), 0)
      else:
        continue
      if score > best:
        best, level = score, i
  return level


def _floor_breaches(graph: dict[str, set[str]]) -> list[str]:
  """Imports up a floor, and imports between training and benchmarking code (same floor, two sides that meet
  only through the floors below)."""
  side = lambda m: m.split(".")[1] if m.startswith(("longspec_jax.training", "longspec_jax.inference")) else None
  out = []
  for m, targets in sorted(graph.items()):
    for t in sorted(targets):
      up = _floor(t) > _floor(m)
      across = _floor(t) == _floor(m) == 4 and side(m) != side(t)
      if up or across:
        out.append(f"{m} ({FLOORS[_floor(m)][0]}) imports {t} ({FLOORS[_floor(t)][0]})")
  return out


def test_floor_checker_sees_a_breach():
  assert _floor("longspec_jax.model") == 0 and _floor("longspec_jax.drafters.eagle3") == 2
  assert _floor("longspec_jax.inference.engine") == 3 and _floor("longspec_jax.inference.benchmark.suite") == 4
  assert _floor("longspec_jax.inference.cli") == 5 and _floor("longspec_jax.training.trainer") == 4
  assert _floor_breaches({"longspec_jax.model": {"longspec_jax.drafters.base"},
                          "longspec_jax.training.trainer": {"longspec_jax.inference.bench"},
                          "longspec_jax.training.drafter_data": {"longspec_jax.inference.generate"}}) == [
      "longspec_jax.model (core) imports longspec_jax.drafters.base (drafters)",
      "longspec_jax.training.trainer (training and benchmarks) imports longspec_jax.inference.bench "
      "(training and benchmarks)"]


def test_modules_import_only_their_floor_or_below():
  modules = _modules()
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  assert _floor_breaches(graph) == []
