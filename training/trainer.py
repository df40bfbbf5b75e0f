"""The sharded trainer shared by the target and the drafters: Optax, a `jax.sharding` mesh (data-parallel batch,
logical-axis rules for parameters), orbax checkpoints on a wall-clock interval with exact resume, a progress bar
and a JSONL loss log.

Exact resume holds because a step's batch is a pure function of (seed, step) and the train state (params,
optimizer state, step) is restored bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from longspec_jax import sharding as shd
from longspec_jax.distributed import agree, host_values, is_main_process
from longspec_jax.fileio import write_json_atomic
from longspec_jax.model import param_count
from longspec_jax.training.losses import DISTILL_KINDS

if TYPE_CHECKING:
  from longspec_jax.training.distill_store import DistillStore


@dataclasses.dataclass(frozen=True)
class Stage:
  """One curriculum stage: `steps` optimizer steps on `batch_size` windows of `seq_len` tokens."""
  seq_len: int
  batch_size: int
  steps: int

  def __post_init__(self):
    if min(self.seq_len, self.batch_size, self.steps) <= 0:
      raise ValueError(f"stage fields must be positive: {self}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 3e-3
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What every drafter trainer's config has: the settings `start_run` and `Run` read, the held-out share and a seed
  (a subclass redeclares a field to change its default)."""
  out_dir: str = "runs/drafter"
  target_dir: str = ""  # "" = the target its data (or store) records
  batch_size: int = 8
  steps: int = 500
  optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=50)
  val_fraction: float = 0.05  # held-out share of the rows (or of a store's windows)
  seed: int = 0
  checkpoint_every_minutes: float = 5.0
  log_every: int = 10
  mesh_data: int = 0  # 0 = all devices
  stop_after_steps: int = 0  # >0: stop (after checkpointing) once this many steps are done; rerun to continue
  eval_every: int = 0  # >0: held-out metrics every this many steps, in the log (trainers that define them)
  # >0: train for about this many minutes of the training loop (compilation included) instead of `steps`, which
  # then only caps the count: the first BUDGET_PROBE_STEPS steps time a step, the run's step count (and its
  # learning-rate schedule) is set to what fits, kept in out_dir/budget.json for a resume, and the loop also
  # stops, finished, at the deadline should steps slow down.
  time_budget_minutes: float = 0.0

  def require_positive(self, *names: str) -> None:
    for name in names:
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class StoreRunConfig(RunConfig):
  """RunConfig plus what a trainer reads from a distillation store (`longspec make-distill-store`), which then
  replaces its data_dirs: the labels are the target's own top-k next-token distribution at every position."""
  store_dir: str = ""
  distill: str = ""  # with a store: "kl" (default) | "tv" | "hard" (CE on the target's argmax); training.losses
  # With a store: train on its first N tokens of train windows only (0 = all of them), so a resumed run on a
  # store that has grown since keeps its distinct data (a data-scaling arm).
  max_train_tokens: int = 0
  # With a store: score only the held-out windows within its first N tokens (0 = all of them), so arms started
  # as the store grows are scored on the same windows (distill_store.split_windows).
  held_out_within_tokens: int = 0

  def store_split(self, store: DistillStore) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) windows of `store` for this run (distill_store.split_windows)."""
    from longspec_jax.training.distill_store import split_windows
    return split_windows(store, self.seed, self.val_fraction, self.max_train_tokens, self.held_out_within_tokens)

  def check_store_fields(self, *store_only: str) -> None:
    """The store fields' checks; `store_only` names further fields that need store_dir when set."""
    if self.distill not in ("",) + DISTILL_KINDS:
      raise ValueError(f"distill must be one of {DISTILL_KINDS}, got {self.distill!r}")
    for name in ("max_train_tokens", "held_out_within_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    needs = [n for n in ("distill", "max_train_tokens", "held_out_within_tokens") + store_only if getattr(self, n)]
    if needs and not self.store_dir:
      raise ValueError(f"{', '.join(needs)} need{'s' if len(needs) == 1 else ''} store_dir (soft labels come from a "
                       "distillation store)")



@dataclasses.dataclass(frozen=True)
class DataDirsRunConfig(StoreRunConfig):
  """StoreRunConfig for the trainers that read `make-drafter-data` dirs when no store_dir is given."""
  # make-drafter-data outputs; incomplete ones (no manifest.json + dataset/) are skipped, at least one must exist
  data_dirs: tuple[str, ...] = ("runs/drafter_data",)

def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 1))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup, max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)
  # No weight decay on norms and biases (1-D parameters).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState


def stage_at(stages: tuple[Stage, ...], step: int) -> Stage:
  for s in stages:
    if step < s.steps:
      return s
    step -= s.steps
  return stages[-1]


class Checkpointer:
  """Orbax CheckpointManager saving at most every `every_minutes` (and on demand), keeping the last two."""

  def __init__(self, directory: str | Path, every_minutes: float = 5.0):
    self.directory = Path(directory).absolute()
    self.every_s = every_minutes * 60
    self.last_save = time.monotonic()
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def maybe_save(self, step: int, state: TrainState, force: bool = False) -> bool:
    # Every process saves (orbax writes each one's shards, process 0 the metadata), so all follow process 0's clock.
    if not agree(force or time.monotonic() - self.last_save >= self.every_s):
      return False
    if self.manager.latest_step() == step:  # already saved (e.g. a periodic save on the last step)
      return False
    self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
    self.manager.wait_until_finished()
    self.last_save = time.monotonic()
    return True

  def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
    step = self.latest_step() if step is None else step
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

  def close(self) -> None:
    self.manager.close()


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, mesh: Mesh,
                     rules: Iterable[tuple[str, str | None]] = shd.DATA_PARALLEL_RULES) -> TrainState:
  p_shard = shd.param_shardings(params, mesh, rules)
  # From host values: every process holds the same initial parameters, and a mesh may span processes.
  params = jax.device_put(jax.tree.map(np.asarray, params), p_shard)
  opt_state = jax.jit(optimizer.init)(params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """loss_fn(params, batch) -> (loss, metrics dict). Returns a jitted (state, batch) -> (state, metrics)."""

  @jax.jit
  def train_step(state: TrainState, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def train_loop(state: TrainState, train_step: Callable[[TrainState, dict], tuple[TrainState, dict]],
               batch_fn: Callable[[int], dict], total_steps: int, checkpointer: Checkpointer, log_path: str | Path, *,
               log_every: int = 10,
               tokens_fn: Callable[[int], int] = lambda step: 0, desc: str = "train",
               evaluate: Callable[[Any], dict] | None = None, eval_every: int = 0,
               deadline: float | None = None, save_at_end: bool = True) -> TrainState:
  """Runs steps [state.step, total_steps), checkpointing on the clock and at the end. Safe to kill: a rerun
  resumes from the last checkpoint and replays the same batches. evaluate(params) -> held-out metrics, logged
  (with the step's training metrics) every `eval_every` steps and at the end. deadline: a time.monotonic() value
  after which no further step starts."""
  log_path = Path(log_path)
  log_path.parent.mkdir(parents=True, exist_ok=True)
  start = int(state.step)
  t0 = time.time()
  tokens_seen = sum(tokens_fn(s) for s in range(start))
  main = is_main_process()  # process 0 writes the log and shows the bar; every process trains
  bar = tqdm(total=total_steps, initial=start, desc=desc, dynamic_ncols=True, disable=not main)
  with open(log_path, "a") if main else contextlib.nullcontext() as log:
    for step in range(start, total_steps):
      if deadline is not None and agree(time.monotonic() >= deadline):
        break
      batch = batch_fn(step)
      state, metrics = train_step(state, batch)
      tokens_seen += tokens_fn(step)
      at_eval = evaluate is not None and eval_every > 0 and ((step + 1) % eval_every == 0
                                                             or step + 1 == total_steps)
      held_out = evaluate(state.params) if at_eval else {}  # every process takes part
      if main and ((step + 1) % log_every == 0 or step + 1 == total_steps or at_eval):
        m = {k: float(v) for k, v in metrics.items()} | held_out
        rec = {"step": step + 1, "tokens": tokens_seen, "elapsed_s": round(time.time() - t0, 1), **m}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{m['loss']:.3f}")
      bar.update(1)
      if checkpointer.maybe_save(step + 1, state):
        bar.write(f"checkpoint saved at step {step + 1}")
  bar.close()
  if save_at_end:
    checkpointer.maybe_save(int(state.step), state, force=True)
  return state


@dataclasses.dataclass
class Run:
  """One training run as every trainer sets it up (`start_run`): the output directory, a data-parallel mesh over
  every process's devices, the optimizer and the train state. The same program runs on every process; each builds
  only its own rows of a batch (`batch`), process 0 writes the log and the exports."""
  cfg: Any  # the trainer's config (out_dir, mesh_data, optim, checkpoint_every_minutes, log_every, stop_after_steps)
  out: Path
  mesh: Mesh
  optimizer: optax.GradientTransformation
  state: TrainState
  checkpointer: Checkpointer
  total_steps: int

  def batch(self, build_rows: Callable[[slice], dict], batch_size: int) -> dict:
    """The global batch sharded on the mesh: build_rows(rows) gives rows[lo:hi] of it, this process's rows."""
    return shd.process_batch(build_rows, batch_size, self.mesh)

  def replicate(self, tree: Any) -> Any:
    """A copy of `tree` on every device of the mesh (every process must pass the same values, e.g. a frozen
    target); jitted steps take it as an argument."""
    return jax.device_put(jax.tree.map(np.asarray, tree), shd.replicated(self.mesh))

  def train_step(self, loss_fn: Callable) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    return make_train_step(loss_fn, self.optimizer)

  def train(self, train_step: Callable[[TrainState, dict], tuple[TrainState, dict]],
            batch_fn: Callable[[int], dict], *, tokens_fn: Callable[[int], int], desc: str,
            evaluate: Callable[[Any], dict] | None = None, loss_fn: Callable | None = None) -> bool:
    """Trains to total_steps, or stops (checkpointed) after cfg.stop_after_steps when that is set and smaller.
    Returns whether the run is finished. With cfg.time_budget_minutes the step count is fitted to the budget
    first (fit_budget), which remakes the train step from `loss_fn` (that of train_step) for the fitted count."""
    kw = dict(log_every=self.cfg.log_every, tokens_fn=tokens_fn, desc=desc, evaluate=evaluate,
              eval_every=getattr(self.cfg, "eval_every", 0))
    deadline = None
    with jax.set_mesh(self.mesh):
      if getattr(self.cfg, "time_budget_minutes", 0) > 0:
        if loss_fn is None:
          raise ValueError("time_budget_minutes is not supported by this trainer")
        train_step, deadline = self.fit_budget(train_step, batch_fn, loss_fn, kw)
      steps = self.total_steps
      end = min(steps, self.cfg.stop_after_steps or steps)
      self.state = train_loop(self.state, train_step, batch_fn, end, self.checkpointer, self.out / "train_log.jsonl",
                              deadline=deadline, **kw)
      if deadline is not None and int(self.state.step) < end:  # out of time: finished where it stands
        print(f"time budget spent at step {int(self.state.step)} of {steps}")
        self.total_steps = steps = end = int(self.state.step)
        if is_main_process():
          write_json_atomic(self.out / BUDGET_FILE, {**json.loads((self.out / BUDGET_FILE).read_text()),
                                                       "steps": end, "stopped_at_deadline": True})
    self.checkpointer.close()
    if end < steps:
      print(f"stopped after step {end} of {steps}; rerun the same command to continue")
    return end == steps

  def fit_budget(self, train_step: Callable, batch_fn: Callable[[int], dict], loss_fn: Callable,
                 kw: dict) -> tuple[Callable, float]:
    """cfg.time_budget_minutes: (the train step for the fitted step count, the loop's deadline). A first start
    times BUDGET_PROBE_STEPS steps after the first (which compiles), sets total_steps to what fits in the rest of
    the budget (at most cfg.steps) and records it in out_dir/budget.json; a resume takes the recorded count. The
    optimizer is remade for the count: its state has the same structure, and the probe's steps are warmup steps
    of either schedule while the probe is shorter than the warmup."""
    budget_s = self.cfg.time_budget_minutes * 60
    t0 = time.monotonic()
    path = self.out / BUDGET_FILE
    if path.exists() and int(self.state.step) > 0:
      self.total_steps = json.loads(path.read_text())["steps"]
    else:
      log = self.out / "train_log.jsonl"
      probe_kw = {**kw, "evaluate": None}  # held-out scoring at the probe's ends would count as step time
      compiled = min(int(self.state.step) + 1, self.total_steps)
      self.state = train_loop(self.state, train_step, batch_fn, compiled, self.checkpointer, log,
                              save_at_end=False, **probe_kw)
      jax.block_until_ready(self.state)
      t1 = time.monotonic()
      probe_end = min(compiled + BUDGET_PROBE_STEPS, self.total_steps)
      self.state = train_loop(self.state, train_step, batch_fn, probe_end, self.checkpointer, log,
                              save_at_end=False, **probe_kw)
      jax.block_until_ready(self.state)
      step_s = (time.monotonic() - t1) / max(probe_end - compiled, 1)
      fits = probe_end + int(max(budget_s - (time.monotonic() - t0), 0) / max(step_s, 1e-9))
      self.total_steps = max(min(self.total_steps, fits), probe_end)
      if is_main_process():
        write_json_atomic(path, {"budget_minutes": self.cfg.time_budget_minutes, "step_s": round(step_s, 5),
                                 "first_step_s": round(t1 - t0, 2), "probe_steps": probe_end - compiled,
                                 "steps": self.total_steps, "steps_cap": self.cfg.steps})
      print(f"time budget {self.cfg.time_budget_minutes} min: first step {t1 - t0:.1f} s, then {step_s * 1e3:.1f} "
            f"ms per step -> {self.total_steps} steps")
    self.optimizer = make_optimizer(self.cfg.optim, self.total_steps)
    return make_train_step(loss_fn, self.optimizer), t0 + budget_s

  def local_params(self) -> Any:
    """The trained parameters as single-device arrays on every process (gathered where the mesh spans several),
    for export and validation outside the mesh. All processes must call it together."""
    return jax.tree.map(jnp.asarray, host_values(self.state.params))


BUDGET_FILE = "budget.json"  # a time-budgeted run's fitted step count (Run.fit_budget)
BUDGET_PROBE_STEPS = 5  # steps timed, after the compiling first one, to fit a time budget


# Settings a resumed run may change: they do not alter what is trained (DeLS's tuning grid acts after training).
RESUME_FREE_KEYS = frozenset({"stop_after_steps", "checkpoint_every_minutes", "log_every", "eval_every",
                              "alpha_grid", "beta_grid", "tune_num_draft"})


def start_run(cfg: Any, params: Any, *, resume: bool, total_steps: int | None = None,
              batch_sizes: tuple[int, ...] | None = None, record: dict | None = None) -> Run:
  """The setup every trainer shares: `cfg.out_dir` with train_config.json (`record`, default the config; written
  by process 0), a mesh of `cfg.mesh_data` (0 = all) data devices that divides every batch size (default
  `cfg.batch_size`), the optimizer for `total_steps` (default `cfg.steps`), and the train state: fresh, or the
  latest checkpoint in out_dir/checkpoints when `resume`."""
  out = Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  record = json.loads(json.dumps(record or dataclasses.asdict(cfg)))
  ckpt = Checkpointer(out / "checkpoints", cfg.checkpoint_every_minutes)
  if resume and ckpt.latest_step() is not None and (out / "train_config.json").exists():
    old = json.loads((out / "train_config.json").read_text())
    # (keys the old record lacks are options added since, at their old behaviour by default)
    changed = sorted(k for k in old if k not in RESUME_FREE_KEYS and old[k] != record.get(k))
    if changed:  # resuming would silently mix two runs
      raise ValueError(f"{out} holds a checkpoint of a run with other settings ({', '.join(changed)}): rerun with "
                       "the same config, or start over with --no-resume or another out_dir")
  if is_main_process():
    # atomically: on a resume the other processes may be reading the previous copy right now
    write_json_atomic(out / "train_config.json", record)
  mesh = shd.make_mesh(cfg.mesh_data or None)
  for size in batch_sizes or (cfg.batch_size,):
    if size % mesh.shape["data"]:
      raise ValueError(f"batch size {size} is not divisible by the {mesh.shape['data']} data devices")
  total_steps = total_steps or cfg.steps
  optimizer = make_optimizer(cfg.optim, total_steps)
  with jax.set_mesh(mesh):
    state = init_train_state(params, optimizer, mesh)
  if resume and ckpt.latest_step() is not None:
    state = ckpt.restore(state)
    print(f"resumed from step {int(state.step)}")
  return Run(cfg, out, mesh, optimizer, state, ckpt, total_steps)


def start_store_run(cfg: Any, model: nnx.Module, *, resume: bool, what: str, store: DistillStore,
                    train_w: np.ndarray, val_w: np.ndarray, train_tokens: int,
                    details: str) -> tuple[nnx.GraphDef, Any, Run]:
  """Says what a run on a distillation store trains (`what`, then `details`) and starts it (trainer.start_run):
  (graphdef, the initial parameters, the run)."""
  print(f"{what} from the distillation store {store.dir}: {param_count(model) / 1e6:.2f}M parameters, "
        f"{len(train_w)} train windows ({train_tokens} tokens) / {len(val_w)} held-out, {details}")
  graphdef, params = nnx.split(model)
  return graphdef, params, start_run(cfg, params, resume=resume)
