"""The repository lints clean: `ruff check .` from the root, with the rules in pyproject.toml's [tool.ruff] (ruff is
pinned in the test extra, so every machine applies the same rules)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_reports_nothing():
  res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=ROOT, capture_output=True, text=True)
  assert "No module named ruff" not in res.stderr, 'ruff is not installed: pip install -e ".[test]"'
  assert res.returncode == 0, f"ruff check . found problems (rc {res.returncode}):\n{res.stdout}{res.stderr}"


def test_tracked_tree_is_small():
  """Everything git tracks (weights included) fits 70 MB, and no file is over 15 MB (a hosting limit)."""
  res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
  if res.returncode != 0:
    import pytest
    pytest.skip("not a git checkout")
  sizes = {p: (ROOT / p).stat().st_size for p in res.stdout.decode().split("\0") if p and (ROOT / p).is_file()}
  assert len(sizes) > 100, "git listed too few files to be this repository"
  big = {p: s for p, s in sizes.items() if s > 15 * 10**6}
  assert not big, f"files over 15 MB: {big}"
  assert sum(sizes.values()) <= 70 * 10**6, f"tracked tree {sum(sizes.values()) / 1e6:.1f} MB > 70 MB"


def _untyped(path: Path) -> list[str]:
  """Public functions and methods (module or class level; not nested, not _private) lacking a parameter or return
  annotation."""
  out = []

  def visit(body, owner):
    for node in body:
      if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
        visit(node.body, node.name)
      elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        if owner is not None and args and args[0].arg in ("self", "cls"):
          args = args[1:]
        args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
        if node.returns is None or any(a.annotation is None for a in args):
          out.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner + '.' if owner else ''}{node.name}")

  visit(ast.parse(path.read_text(), str(path)).body, None)
  return out


def test_untyped_finder_sees_a_missing_hint(tmp_path, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  f = tmp_path / "m.py"
  f.write_text("def a(x: int) -> int: ...\ndef b(x) -> int: ...\ndef c(x: int): ...\ndef _d(x): ...\n"
               "class K:\n  def m(self, y: int) -> None: ...\n  def n(self, y): ...\n")
  assert _untyped(f) == ["m.py:2 b", "m.py:3 c", "m.py:7 K.n"]


def test_public_functions_have_type_hints():
  found = [u for folder in ("longspec_jax", "inference", "training", "pallas_kernels")
           for p in sorted((ROOT / folder).rglob("*.py")) if "assets" not in p.parts for u in _untyped(p)]
  assert not found, f"{len(found)} public functions without full type hints:\n" + "\n".join(found)


def test_slow_list_names_existing_tests():
  """Every test tests/slow_tests.txt names exists (a renamed test would otherwise drop back into the quick subset
  unnoticed)."""
  from tests.conftest import slow_test_ids
  ids = slow_test_ids()
  assert len(ids) > 20
  missing = []
  for node in sorted(ids):
    path, _, name = node.partition("::")
    func = name.split("[")[0].split("::")[-1]
    source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    if f"def {func}(" not in source:
      missing.append(node)
  assert missing == [], f"slow_tests.txt names tests that do not exist: {missing}"


def test_module_seconds_name_existing_modules():
  """tests/module_seconds.txt (the modules' measured order) names test modules that exist, and most of them."""
  from tests.conftest import module_seconds
  measured = module_seconds()
  modules = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
  assert set(measured) <= modules, sorted(set(measured) - modules)
  assert len(measured) >= 0.8 * len(modules) and all(secs >= 0 for secs in measured.values())
