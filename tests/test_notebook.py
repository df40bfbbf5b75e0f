"""examples/quickstart.ipynb runs top to bottom in a fresh kernel (its cells assert what they show: the second
jitted call does not compile, speculative tokens equal AR tokens)."""

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  # The kernel imports this checkout's packages and runs on the CPU like the rest of the suite.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
  t0 = time.perf_counter()
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
  seconds = time.perf_counter() - t0
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  print(text, f"\nnotebook executed in {seconds:.0f} s")
  assert "the second call did not compile" in text and "identical tokens: True" in text
  assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
             for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
