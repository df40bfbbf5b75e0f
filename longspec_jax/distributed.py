"""Multi-process (multi-host) runs: one JAX process per host joined by `jax.distributed`, one mesh over every
process's devices. The same program runs on every host (SPMD); each host builds and feeds only its own rows of
the global batch (`sharding.process_batch`), and orbax checkpoints are written by all processes together.

On a Cloud TPU slice `jax.distributed.initialize()` reads the coordinator, process count and process id from the
TPU environment; elsewhere (CPU or GPU clusters, the two-process test) they come from flags. On CPU the processes
exchange collectives through gloo.
"""

from __future__ import annotations

from typing import Any

SHUTDOWN_TIMEOUT_SECONDS = 3600


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Joins this process to the job (call before any other JAX work). With no arguments the cluster is detected
  from the environment (Cloud TPU, SLURM, ...)."""
  import jax

  given = [coordinator is None, num_processes is None, process_id is None]
  if any(given) and not all(given):
    raise ValueError("give all of coordinator, num_processes and process_id, or none (to detect them from the "
                     "TPU / cluster environment)")
  if process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
  # Cross-process collectives on CPU devices (a no-op for TPU and GPU devices).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Process 0 exports and validates a trained drafter while the others wait at the shutdown barrier, which can take
  # minutes on a busy host; a process that really dies is caught by the heartbeat (100 s), not by this timeout.
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS)


def is_main_process() -> bool:
  """Process 0 writes logs, exports and reports; every process computes."""
  import jax
  return jax.process_index() == 0


def agree(flag: bool) -> bool:
  """Process 0's value of `flag` on every process (decisions taken from a local clock must agree, or one process
  would enter a collective the others skip)."""
  import jax
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(flag))


def host_values(tree: Any) -> Any:
  """Every leaf as a numpy array holding its global value on every process (an all-gather when the leaves span
  processes). All processes must call it together."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
