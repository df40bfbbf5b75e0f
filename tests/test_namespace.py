"""The public import surface: the repository's inference/, training/ and pallas_kernels/ folders are installed only
as longspec_jax.inference / .training / .pallas_kernels, so a user's own folders of those names cannot shadow them,
and no code imports them under their bare names (each module would load twice, with two registries)."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("inference", "training", "pallas_kernels")

USER_SCRIPT = """
import sys
from longspec_jax import generate, load_drafter, load_target
import training.data, inference, pallas_kernels  # the user's own packages, first on sys.path
from longspec_jax.training.data import TokenStream

model = load_target()
ar = generate(model, [[model.cfg.bos_token_id, 5, 6, 7, 5, 6]], max_new_tokens=6)
spec = generate(model, [[model.cfg.bos_token_id, 5, 6, 7, 5, 6]], max_new_tokens=6,
                drafter=load_drafter("prompt-lookup", model), num_draft=3)
assert spec.tokens == ar.tokens and len(ar.tokens[0]) == 6, (ar.tokens, spec.tokens)
print("USER", training.data.__file__, inference.__file__, pallas_kernels.__file__)
print("OURS", TokenStream.__module__, generate.__module__)
print("TOKENS", ar.tokens[0])
"""


def test_user_folders_named_like_ours_do_not_shadow_the_library(tmp_path):
  for name in MAPPED:
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
  (tmp_path / "training" / "data.py").write_text("")  # the file that broke `from training.data import TokenStream`
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the installed package, not the checkout
  p = subprocess.run([sys.executable, "-c", USER_SCRIPT], cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  lines = dict(l.split(" ", 1) for l in p.stdout.splitlines() if l.split(" ", 1)[0] in ("USER", "OURS", "TOKENS"))
  assert all(f.startswith(str(tmp_path)) for f in lines["USER"].split()), lines["USER"]
  assert lines["OURS"].split() == ["longspec_jax.training.data", "longspec_jax.inference.generate"]
  assert len(json.loads(lines["TOKENS"])) == 6


def test_bare_folder_names_refuse_to_import():
  """From the repository root the folders are importable by their bare names; that second copy is refused."""
  for name in MAPPED:
    p = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and f"ImportError: import longspec_jax.{name}, not {name}:" in p.stderr, p.stderr


def _bare_imports(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, what) for every import of a mapped folder by its bare name in `tree`, including module names given as
  strings (importlib, `python -m`) and code strings run by subprocesses (`python -c`)."""
  bad = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      bad += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in MAPPED]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in MAPPED:
      bad.append((node.lineno, f"from {node.module} import ..."))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      s = node.value
      parts = s.split(".")
      if len(parts) > 1 and parts[0] in MAPPED and all(p.isidentifier() for p in parts):
        bad.append((node.lineno, repr(s)))
      elif "import " in s:
        try:
          inner = ast.parse(textwrap.dedent(s))
        except SyntaxError:
          continue
        bad += [(node.lineno + line - 1, what) for line, what in _bare_imports(inner)]
  return bad


def _python_sources():
  for folder in ("longspec_jax", *MAPPED, "scripts", "tests"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path == Path(__file__).resolve():  # this file imports a user's own folders of those names on purpose
        continue
      yield path.relative_to(ROOT), path.read_text()
  nb = json.loads((ROOT / "examples" / "quickstart.ipynb").read_text())
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] == "code":
      yield f"examples/quickstart.ipynb cell {i}", "".join(cell["source"])


def test_no_code_imports_the_bare_folder_names():
  sources = list(_python_sources())
  assert len(sources) > 80  # the walk found the package, scripts, tests and the notebook
  bad = [f"{where}:{line}: {what}" for where, text in sources for line, what in _bare_imports(ast.parse(text))]
  assert not bad, "import these as longspec_jax.<folder>:\n" + "\n".join(bad)
  # The checker itself finds each form it looks for.
  probe = ("import training.data\nfrom inference.cli import main\nimportlib.import_module('training.trainer')\n"
           "subprocess.run(['python', '-c', 'from pallas_kernels import x'])\nfrom . import y\n")
  assert [line for line, _ in _bare_imports(ast.parse(probe))] == [1, 2, 3, 4]


def test_every_package_folder_is_listed_for_the_wheel():
  """A package-dir mapping needs each subpackage listed in pyproject.toml; an editable install would find a missing
  one anyway (it maps whole folders), so only a wheel would lack it."""
  tomllib = pytest.importorskip("tomllib")
  setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  package_dir = setuptools_cfg["package-dir"]
  assert package_dir == {f"longspec_jax.{name}": name for name in MAPPED}
  on_disk = {"longspec_jax"}
  for folder, prefix in (("longspec_jax", "longspec_jax"), *((d, n) for n, d in package_dir.items())):
    for init in (ROOT / folder).rglob("__init__.py"):
      rel = init.parent.relative_to(ROOT / folder)
      on_disk.add(".".join([prefix, *rel.parts]))
  assert sorted(setuptools_cfg["packages"]) == sorted(on_disk)
