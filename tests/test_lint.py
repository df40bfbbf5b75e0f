"""The repository lints clean: `ruff check .` from the root, with the rules in pyproject.toml's [tool.ruff] (ruff is
pinned in the test extra, so every machine applies the same rules)."""

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
