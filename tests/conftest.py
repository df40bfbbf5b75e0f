import gc
import os
import shutil
import tempfile
from pathlib import Path

# Tests run on the host CPU; keep XLA from grabbing every core thread-pool wise for many tiny programs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling dominates this suite on 2 cores, and the tests' programs are tiny: skip LLVM's expensive optimisation
# passes (about a quarter off the wall time). Subprocesses inherit it; tests that set XLA_FLAGS for a subprocess
# append to it.
SPEED_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *SPEED_XLA_FLAGS]))
# One persistent compilation cache per test run, shared by the xdist workers and every subprocess (the CLI reads
# it from $LONGSPEC_COMPILE_CACHE): many tests compile the same programs, and each module drops its in-memory
# caches (below). Never the user's cache; removed when the run ends. tests/test_cli.py checks the cache itself with
# its own directory.
RUN_ID = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()  # xdist workers: the controller
COMPILE_CACHE = Path(tempfile.gettempdir()) / f"longspec-tests-jax-cache-{RUN_ID}"
os.environ["LONGSPEC_COMPILE_CACHE"] = str(COMPILE_CACHE)


import jax  # noqa: E402
import pytest  # noqa: E402

from longspec_jax.compile_cache import enable_compile_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
enable_compile_cache(str(COMPILE_CACHE))


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")  # measured: scripts/mark_slow_tests.py
MODULE_SECONDS = Path(__file__).with_name("module_seconds.txt")  # the same run


def slow_test_ids() -> set[str]:
  return {line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip() and not line.startswith("#")}


def module_seconds() -> dict[str, float]:
  rows = (line.split(maxsplit=1) for line in MODULE_SECONDS.read_text().splitlines() if line and line[0] != "#")
  return {module.strip(): float(secs) for secs, module in rows}


def pytest_collection_modifyitems(config, items):
  """The tests listed in slow_tests.txt are slow too: `-m "not slow"` (the quick subset) leaves them out.

  Modules run longest first (measured, module_seconds.txt; a module not measured yet counts as longest), each kept
  whole so its module fixtures are set up once per worker. xdist's work stealing (`--dist worksteal`, pyproject)
  hands the idle worker the end of the other's queue, so the run ends on short tests: with the default `load`
  scheduling and modules in name order, one worker once ran 120 s alone at the end."""
  slow = slow_test_ids()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  measured = module_seconds()
  items.sort(key=lambda item: -measured.get(item.nodeid.split("::")[0], float("inf")))  # stable: order within kept


def pytest_sessionfinish(session):
  if not hasattr(session.config, "workerinput"):  # the controller, after every worker has finished
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


MAX_MAPPINGS_KEPT = 30_000  # of the kernel's default vm.max_map_count of 65,530: room for one more module


def _memory_mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # no procfs: drop them after every module
    return MAX_MAPPINGS_KEPT + 1


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drop JAX's compiled programs after a test module once the worker holds many memory mappings. XLA:CPU maps
  every executable's code into its own memory regions, and the caches keep them all alive: a long-lived xdist
  worker reached 64,297 mappings against the kernel's vm.max_map_count of 65,530, and past it a compile segfaults
  (CI crashed that way twice). Kept below that, later modules reuse what earlier ones compiled."""
  yield
  if _memory_mappings() > MAX_MAPPINGS_KEPT:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_cfg():
  from tests.tiny_target import tiny_model_config
  return tiny_model_config()


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
  from longspec_jax.model import create_model
  return create_model(tiny_cfg, seed=0)
