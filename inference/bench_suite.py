"""`longspec bench-suite`: methods x contexts x prompts x temperatures for one target, in one process.

Prompts: `num_prompts` cut points drawn (seeded) from at least `min_docs` held-out documents. A cut point is the
end of a prompt in its document; the prompt at context C is BOS + the C-1 tokens before that end, so every context
continues the same text and only the amount of history differs. Per prompt and context the target prefill runs
once (one program over the union of the drafters' taps and K/V needs) and every method and temperature starts its
decode loop from it: the prefill is deterministic, so this is exactly the state each method's own prefill would
build. The decode loops are the engine's own jitted programs (`ar_decode_program`, `spec_decode_program`), timed
alone (medians over `repeats` calls; the first call of each shape compiles and is not timed). AR is timed for every
prompt in the same process as the methods it is compared with.

Each finished (method, context, temperature, prompt) is appended to `cells/*.jsonl` under the output directory
at once, so a killed sweep loses at most one prompt, and a rerun skips what is there. Every run of the command
rewrites `results.json` (everything), `results.md` (tables) and the PNG plots from all records on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from longspec_jax.inference.generate import ar_decode_program, ar_start_state, cache_len_for
from longspec_jax.inference.speculative import spec_decode_program, spec_sizes, spec_start_state, spec_stats
from longspec_jax.drafters.base import ProposeContext, state_nbytes
from longspec_jax.kv_cache import COMPILER_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = (8, 4)  # the measurement protocol asks for >= 8 prompts from >= 4 documents per context


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  model: str = ""  # the target: a name (smollm2-135m), a model directory, or "" = the shipped default target
  rope_scaling: str = ""  # e.g. "yarn:2" to run the target past its trained context ("" = none)
  methods: tuple[str, ...] = ("prompt-lookup",)  # NAME or NAME:key=value,key=value (see parse_method)
  contexts: tuple[int, ...] = (1024,)  # prompt lengths in tokens, BOS included
  temperatures: tuple[float, ...] = (0.0,)
  num_prompts: int = 8  # cut points, shared by every context
  min_docs: int = 4  # the cut points come from at least this many documents
  docs: tuple[str, ...] = ()  # text files; () = the shipped held-out long documents
  cut_min_tokens: int = 16384  # cut points lie at or past this token of their document (>= every context)
  prompt_seed: int = 0
  new_tokens: int = 64
  num_draft: int = 8  # K for methods that do not set num_draft
  repeats: int = 1  # timed decode calls per prompt (median)
  seed: int = 0  # sampling seed of prompt i is seed + i
  bootstrap: int = 10000  # bootstrap resamples for the confidence intervals
  ci: float = 0.95
  reference_context: int = 0  # tau at every context is compared with tau here (paired); 0 = the shortest context


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  text: str  # as written in the config; the method's label everywhere
  name: str  # a `longspec_jax.drafters` method name, or "ar"
  num_draft: int
  drafter_dir: str | None
  options: tuple[tuple[str, object], ...]  # keyword arguments of load_drafter

  @property
  def slug(self) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", self.text.replace(":", "__").replace("=", "-"))


def _drafter_options() -> tuple[set[str], bool]:
  """load_drafter's keyword options (besides the method name, the target and the drafter directory), and whether
  it takes any keyword (**kwargs): methods added later bring their own options without a change here."""
  from longspec_jax.drafters import load_drafter
  params = inspect.signature(load_drafter).parameters
  named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return named - {"name", "target", "drafter_dir"}, any(p.kind == p.VAR_KEYWORD for p in params.values())


def parse_method(text: str, default_num_draft: int) -> MethodSpec:
  """`NAME[:key=value[,key=value...]]`, values read as YAML scalars. `num_draft=K` sets K for this method,
  `drafter=DIR` its checkpoint; every other key goes to `load_drafter` (e.g. `dflash:sharpdraft=fixed`)."""
  from longspec_jax.drafters import method_names
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"a method must be a non-empty string like 'dflash' or 'dflash:sharpdraft=fixed', got {text!r}")
  name, _, rest = text.strip().partition(":")
  if name not in method_names():
    raise ValueError(f"method {text!r}: unknown method {name!r}; known methods: {', '.join(method_names())}")
  named, any_kw = _drafter_options()
  num_draft, drafter_dir, options = default_num_draft, None, {}
  for item in filter(None, re.split(r"[,:]", rest)):
    key, eq, raw = item.partition("=")
    if not eq or not key:
      raise ValueError(f"method {text!r}: option {item!r} is not of the form key=value")
    value = yaml.safe_load(raw)
    if key in options or (key == "num_draft" and num_draft != default_num_draft):
      raise ValueError(f"method {text!r}: option {key!r} given twice")
    if key == "num_draft":
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"method {text!r}: num_draft must be an integer >= 1, got {raw!r}")
      num_draft = value
    elif key == "drafter":
      drafter_dir = str(value)
    elif key in named or any_kw:
      options[key] = value
    else:
      raise ValueError(f"method {text!r}: unknown option {key!r}; options: num_draft, drafter, "
                       f"{', '.join(sorted(named))}")
  if name == "ar" and (options or drafter_dir):
    raise ValueError(f"method {text!r}: ar takes no drafter options")
  return MethodSpec(text=text.strip(), name=name, num_draft=num_draft, drafter_dir=drafter_dir,
                    options=tuple(sorted(options.items())))


def _check(ok: bool, msg: str) -> None:
  if not ok:
    raise ValueError(f"bench-suite config: {msg}")


def validate(cfg: SuiteConfig) -> list[MethodSpec]:
  """One clear error for a bad config (before anything is loaded); returns the parsed methods."""
  _check(isinstance(cfg.model, str), f"model must be a directory or name (a string), got {cfg.model!r}")
  _check(isinstance(cfg.rope_scaling, str), f"rope_scaling must be a string like yarn:2, got {cfg.rope_scaling!r}")
  if cfg.rope_scaling:
    from longspec_jax.targets import parse_rope_scaling
    parse_rope_scaling(cfg.rope_scaling)
  for key in ("methods", "contexts", "temperatures", "docs"):
    _check(isinstance(getattr(cfg, key), tuple), f"{key} must be a list, got {getattr(cfg, key)!r}")
  _check(len(cfg.methods) > 0, "methods is empty")
  methods = [parse_method(m, cfg.num_draft) for m in cfg.methods]
  _check(len({m.text for m in methods}) == len(methods), f"methods has duplicates: {list(cfg.methods)}")
  _check(len(cfg.contexts) > 0 and all(isinstance(c, int) and c >= 2 for c in cfg.contexts),
         f"contexts must be a non-empty list of integers >= 2, got {list(cfg.contexts)}")
  _check(len(set(cfg.contexts)) == len(cfg.contexts), f"contexts has duplicates: {list(cfg.contexts)}")
  _check(len(cfg.temperatures) > 0 and all(isinstance(t, (int, float)) and t >= 0 for t in cfg.temperatures),
         f"temperatures must be a non-empty list of numbers >= 0, got {list(cfg.temperatures)}")
  _check(len(set(cfg.temperatures)) == len(cfg.temperatures), "temperatures has duplicates")
  for key, lo in (("num_prompts", 2), ("min_docs", 1), ("new_tokens", 1), ("num_draft", 1), ("repeats", 1),
                  ("bootstrap", 100), ("cut_min_tokens", 2)):
    v = getattr(cfg, key)
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{key} must be an integer >= {lo}, got {v!r}")
  _check(isinstance(cfg.ci, float) and 0 < cfg.ci < 1, f"ci must be in (0, 1), got {cfg.ci!r}")
  _check(cfg.reference_context == 0 or cfg.reference_context in cfg.contexts,
         f"reference_context {cfg.reference_context!r} is not one of the contexts {list(cfg.contexts)} (0 = the "
         "shortest)")
  _check(cfg.min_docs <= cfg.num_prompts, f"min_docs ({cfg.min_docs}) > num_prompts ({cfg.num_prompts})")
  _check(max(cfg.contexts) <= cfg.cut_min_tokens,
         f"the longest context ({max(cfg.contexts)}) exceeds cut_min_tokens ({cfg.cut_min_tokens}): every cut "
         "point must have that much text before it")
  for d in cfg.docs:
    _check(Path(d).is_file(), f"document {d} not found")
  return methods


def load_config(path, overrides: list[str] | None = None) -> SuiteConfig:
  from longspec_jax.yaml_config import load_yaml
  cfg = load_yaml(SuiteConfig, path, overrides)
  validate(cfg)
  return cfg


def load_target(model: str, rope_scaling: str = ""):
  """(model, tokenizer, description) for the config's `model:` (a named target such as smollm2-135m, a model
  directory, or "" for the shipped default) and `rope_scaling:` (e.g. "yarn:2"; "" = none)."""
  from longspec_jax.hf_io import weights_sha256
  from longspec_jax.targets import load_target as load, resolve_target_dir
  from longspec_jax.tokenizer import load_tokenizer
  path = resolve_target_dir(model or None)
  return (load(path, rope_scaling=rope_scaling or None), load_tokenizer(path),
          {"model": model or "shipped default", "dir": str(path), "rope_scaling": rope_scaling or None,
           "weights_sha256": weights_sha256(path)})


def drafter_checkpoint(m: MethodSpec, target=None) -> dict | None:
  """The checkpoint a method's drafter loads (directory and a hash of its weights, config.json and, when the
  method turns SharpDraft on, sharpdraft.json), so that results of a retrained drafter are never mixed with the old
  ones; None for methods without a checkpoint (AR, prompt lookup)."""
  from longspec_jax.drafters import drafter_path
  from longspec_jax.hf_io import weights_sha256
  if m.name == "ar":
    return None
  try:
    path = drafter_path(m.name, m.drafter_dir, target)
  except FileNotFoundError:
    return None
  h = hashlib.sha256(weights_sha256(path).encode())
  sharp = dict(m.options).get("sharpdraft", "off") != "off"
  for name in ("config.json", "sharpdraft.json") if sharp else ("config.json",):
    if (path / name).exists():
      h.update((path / name).read_bytes())
  return {"dir": str(path), "sha256": h.hexdigest()}


# ---- prompts


def select_cuts(doc_lens: list[int], num_prompts: int, min_docs: int, cut_min: int, seed: int) -> list[tuple]:
  """(doc index, end token) per prompt: documents taken round-robin in a seeded order (so >= min_docs of them
  when there are enough), each end uniform in [cut_min, doc length], distinct within a document. The list is
  prefix-stable: asking for more prompts keeps the first ones."""
  eligible = [i for i, n in enumerate(doc_lens) if n >= cut_min]
  if len(eligible) < min_docs:
    raise ValueError(f"only {len(eligible)} document(s) have at least cut_min_tokens = {cut_min} tokens (lengths "
                     f"{doc_lens}); min_docs = {min_docs}")
  rng = np.random.default_rng(seed)
  order = [eligible[i] for i in rng.permutation(len(eligible))]
  cuts, used = [], set()
  for i in range(num_prompts):
    doc = order[i % len(order)]
    if doc_lens[doc] - cut_min + 1 <= sum(d == doc for d, _ in used):
      raise ValueError(f"document {doc} has too few cut points for {num_prompts} prompts")
    while (doc, end := int(rng.integers(cut_min, doc_lens[doc] + 1))) in used:
      pass
    used.add((doc, end))
    cuts.append((doc, end))
  return cuts


def prompt_ids(doc_ids: list[int], end: int, context: int, bos: int | None) -> list[int]:
  head = [bos] if bos is not None else []
  return head + doc_ids[end - (context - len(head)):end]


# ---- statistics


def bootstrap_ci(values, n_boot: int = 10000, ci: float = 0.95, seed: int = 0, stat=None) -> tuple[float, float]:
  """Percentile bootstrap CI over the first axis of `values` (prompts). `stat` maps a resampled array [n_boot, n,
  ...] to [n_boot] (default: the mean over prompts)."""
  values = np.asarray(values, np.float64)
  n = values.shape[0]
  idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
  boot = stat(values[idx]) if stat is not None else values[idx].mean(axis=1)
  lo, hi = np.quantile(boot, [(1 - ci) / 2, 1 - (1 - ci) / 2])
  return float(lo), float(hi)


def ratio_of_rates(x) -> np.ndarray:
  """x [..., n, 4] = (tokens, seconds, AR tokens, AR seconds) per prompt -> (sum tok / sum s) / (AR same)."""
  s = x.sum(axis=-2)
  return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


# ---- the run


def _git() -> dict:
  def run(*args):
    try:
      return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return None
  status = run("status", "--porcelain", "--untracked-files=no")  # tracked files changed since the commit
  return {"commit": run("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _cpu_ticks() -> dict[int, int]:
  """utime + stime (clock ticks) of every process now, by pid."""
  out = {}
  for d in Path("/proc").glob("[0-9]*"):
    try:
      fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
      out[int(d.name)] = int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
      continue
  return out


def _other_cpu_s(before: dict, after: dict) -> float | None:
  """CPU seconds used by other processes between two snapshots (processes that ended meanwhile are missed)."""
  if not before or not after:
    return None
  me = os.getpid()
  ticks = sum(t - before.get(pid, 0) for pid, t in after.items() if pid != me)
  return ticks / os.sysconf("SC_CLK_TCK")


def machine_info() -> dict:
  import flax
  import jaxlib
  cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
              if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else None
  return {"host": platform.node(), "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "jax_devices": [str(d) for d in jax.devices()], "python": platform.python_version(),
          "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                       "numpy": np.__version__}}


def _rss_bytes() -> int | None:
  try:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return None


def _fingerprint(*parts) -> str:
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cell_path(out: Path, method: MethodSpec, context: int, temperature: float) -> Path:
  return out / "cells" / f"{method.slug}__ctx{context}__t{temperature:g}.jsonl"


def load_records(out: Path) -> list[dict]:
  recs = []
  for path in sorted((out / "cells").glob("*.jsonl")):
    for line in path.read_text().splitlines():
      if line.strip():
        try:
          recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: that prompt is simply run again
          continue
  return recs


def _prefill(graphdef, params, tokens, prompt_lens, *, max_len: int, taps: tuple, return_kv: bool):
  """The one target prefill of a prompt, with everything any method needs from it."""
  m = nnx.merge(graphdef, params)
  out = m(tokens, cache=m.init_cache(tokens.shape[0], max_len), mode="prefill",
          logits_at=(prompt_lens - 1)[:, None], taps=taps, return_kv=return_kv)
  return out.cache.replace(lengths=prompt_lens), out.logits[:, 0], out.taps, out.new_kv


def _draft(drafter, dparams, dstate, ctx, key, *, num_draft: int, sample: bool):
  return drafter.propose(dparams, dstate, ctx, key, num_draft, sample)[0]


def _diagnostics(drafter, dparams, dstate, ctx):
  return drafter.diagnostics(dparams, dstate, ctx)


def _verify(graphdef, params, cache, block, *, taps: tuple, return_kv: bool):
  m = nnx.merge(graphdef, params)
  return m(block, cache=cache, mode="extend", taps=taps, return_kv=return_kv).logits


# Module-level programs: a second suite run in the same process (a notebook, the tests) reuses their compilations.
prefill_program = jax.jit(_prefill, static_argnames=("graphdef", "max_len", "taps", "return_kv"),
                          compiler_options=COMPILER_OPTIONS)
draft_program = jax.jit(_draft, static_argnames=("drafter", "num_draft", "sample"), compiler_options=COMPILER_OPTIONS)
diagnostics_program = jax.jit(_diagnostics, static_argnames=("drafter",))
verify_program = jax.jit(_verify, static_argnames=("graphdef", "taps", "return_kv"), compiler_options=COMPILER_OPTIONS)
ar_start_program = jax.jit(ar_start_state, static_argnames=("max_len",))
spec_start_program = jax.jit(spec_start_state, static_argnames=("drafter", "max_len", "num_draft"),
                             compiler_options=COMPILER_OPTIONS)


class _Timer:
  """Medians of timed calls; the first call of each program shape (compilation) is not timed."""

  def __init__(self):
    self.warm: set = set()

  def timed(self, key, fn, repeats: int):
    """(last result, median seconds) of `repeats` calls; an untimed first call the first time `key` is seen."""
    if key not in self.warm:
      jax.block_until_ready(fn())
      self.warm.add(key)
    times, out = [], None
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn())
      times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def _fresh(state):
  """A copy of a start state: the decode programs donate (consume) their input."""
  return jax.block_until_ready(jax.tree.map(lambda x: jnp.array(x, copy=True), state))


def _decode(timer: _Timer, key, state0, run, repeats: int):
  """Times `run(state)` on fresh copies of state0; the copies are made before the clock starts."""
  copies = iter([_fresh(state0) for _ in range(repeats + (key not in timer.warm))])
  return timer.timed(key, lambda: run(next(copies)), repeats)


@dataclasses.dataclass(frozen=True)
class _Prefilled:
  """One prompt's shared prefill and what every method's start state is built from."""
  tokens: jax.Array  # [1, T bucket]
  lens: jax.Array  # [1]
  max_len: int
  cache: object
  last_logits: jax.Array
  taps: tuple  # the tap indices all_taps holds, in order
  all_taps: jax.Array | None
  new_kv: tuple | None
  prefill_s: float


def _prefill_prompt(timer: _Timer, graphdef, params, ids: list[int], pad_id: int, ctx: int, max_len: int,
                    t_bucket: int, specs: list) -> _Prefilled:
  taps = tuple(sorted({t for s in specs for t in s.taps}))
  return_kv = any(s.needs_target_kv for s in specs)
  tokens = np.full((1, t_bucket), pad_id, np.int32)
  tokens[0, :len(ids)] = ids
  tokens, lens = jnp.asarray(tokens), jnp.asarray([len(ids)], jnp.int32)
  (cache, last_logits, all_taps, new_kv), prefill_s = timer.timed(
      ("prefill", ctx, taps, return_kv),
      lambda: prefill_program(graphdef, params, tokens, lens, max_len=max_len, taps=taps, return_kv=return_kv), 1)
  return _Prefilled(tokens, lens, max_len, cache, last_logits, taps, all_taps, new_kv, prefill_s)


def _generated(state, prompt_len: int) -> list[int]:
  return np.asarray(state.tokens[0, prompt_len:prompt_len + int(state.num_new[0])]).tolist()


def _measure_ar(timer: _Timer, graphdef, params, pre: _Prefilled, ctx: int, sp, seed, cfg: SuiteConfig, eos: int):
  """AR from the shared prefill: (final state, median decode seconds)."""
  max_new, eos = jnp.int32(cfg.new_tokens), jnp.int32(eos)
  start = ar_start_program(pre.tokens, pre.lens, pre.cache, pre.last_logits, max_new, sp, seed, eos,
                           max_len=pre.max_len)
  run = lambda st: ar_decode_program(graphdef, params, st, max_new, sp, eos)
  return _decode(timer, ("ar", ctx, bool(sp.temperature > 0)), start, run, cfg.repeats)


def _measure_spec(timer: _Timer, graphdef, params, pre: _Prefilled, drafter, m: MethodSpec, ctx: int, sp, seed,
                  cfg: SuiteConfig, eos: int) -> dict:
  """A speculative method from the shared prefill: the decode loop (timed), then its first draft and verify passes
  timed apart (profiling mode)."""
  spec, dparams, k = drafter.spec, drafter.params, m.num_draft
  sample = bool(sp.temperature > 0)
  max_new, eos = jnp.int32(cfg.new_tokens), jnp.int32(eos)
  sel = jnp.asarray([pre.taps.index(t) for t in spec.taps], jnp.int32)
  start = spec_start_program(spec, dparams, pre.tokens, pre.lens, pre.cache, pre.last_logits,
                             pre.all_taps[:, :, sel] if spec.taps else None,
                             pre.new_kv if spec.needs_target_kv else None, max_new, sp, seed, eos,
                             max_len=pre.max_len, num_draft=k)
  run = lambda st: spec_decode_program(graphdef, params, spec, dparams, st, max_new, sp, seed, eos, num_draft=k,
                                       sample=sample)
  state, decode_s = _decode(timer, (m.text, ctx, sample), start, run, cfg.repeats)
  ctx_now = ProposeContext(tokens=start.tokens, num_tokens=start.num_tokens, sampling=sp)
  drafts, draft_s = timer.timed(("draft", m.text, ctx, sample), lambda: draft_program(
      spec, dparams, start.drafter_state, ctx_now, jax.random.key(0), num_draft=k, sample=sample), cfg.repeats)
  n = int(pre.lens[0])
  block = jnp.concatenate([start.tokens[:, n:n + 1], drafts], axis=1)  # [pending, drafts]
  _, verify_s = timer.timed(("verify", ctx, k, spec.taps, spec.needs_target_kv), lambda: verify_program(
      graphdef, params, start.target_cache, block, taps=spec.taps, return_kv=spec.needs_target_kv), cfg.repeats)
  stats = spec_stats(state.accept_hist, state.active_steps, state.num_new, state.step)
  diagnostics = ({k: np.round(np.asarray(v, np.float64), 5).tolist() for k, v in
                  diagnostics_program(spec, dparams, start.drafter_state, ctx_now).items()}
                 if hasattr(spec, "diagnostics") else {})
  return dict(new_tokens=int(state.num_new[0]), decode_s=decode_s, target_forwards=stats["target_forwards"],
              tau=stats["tau"], accept_hist=stats["accept_hist"], draft_ms_per_step=1000 * draft_s,
              verify_ms_per_step=1000 * verify_s, drafter_state_bytes=state_nbytes(start.drafter_state),
              diagnostics=diagnostics, tokens=_generated(state, n))


def run_suite(cfg: SuiteConfig, out: Path, command: str = "", progress: bool = True) -> dict:
  """Runs every (method, context, temperature, prompt) not yet on disk under `out`, then writes the outputs."""
  from tqdm import tqdm

  from longspec_jax import long_doc_paths
  from longspec_jax.drafters import load_drafter
  from longspec_jax.sampling import SamplingParams

  methods = validate(cfg)
  out = Path(out)
  (out / "cells").mkdir(parents=True, exist_ok=True)
  model, tok, target = load_target(cfg.model, cfg.rope_scaling)
  mcfg = model.cfg
  doc_paths = [Path(d) for d in cfg.docs] or long_doc_paths()
  docs = [tok.encode(p.read_text()).ids for p in doc_paths]
  cuts = select_cuts([len(d) for d in docs], cfg.num_prompts, cfg.min_docs, cfg.cut_min_tokens, cfg.prompt_seed)
  prompts = [{"index": i, "doc": doc_paths[d].name, "doc_sha256": hashlib.sha256(doc_paths[d].read_bytes()).hexdigest(),
              "end_token": end, "doc_tokens": len(docs[d])} for i, (d, end) in enumerate(cuts)]
  max_k = max(m.num_draft for m in methods)
  if max(cfg.contexts) + cfg.new_tokens + max_k + 1 > mcfg.max_position_embeddings:
    raise ValueError(f"context {max(cfg.contexts)} + new_tokens {cfg.new_tokens} + K+1 {max_k + 1} exceeds the "
                     f"target's maximum context {mcfg.max_position_embeddings}")
  eos = -1 if mcfg.eos_token_id is None else mcfg.eos_token_id
  checkpoints = {m.text: drafter_checkpoint(m, model) for m in methods}
  # A RoPE override changes the target but not its weights.
  target_id = target["weights_sha256"] + (f"+{cfg.rope_scaling}" if cfg.rope_scaling else "")

  def fp(m: MethodSpec, ctx: int, temp: float, p: dict) -> str:
    return _fingerprint(target_id, m.text, m.num_draft, checkpoints[m.text], ctx, temp, p["doc_sha256"],
                        p["end_token"], cfg.new_tokens, cfg.seed, cfg.repeats)

  done = {(r["method"], r["context"], r["temperature"], r["prompt"]): r for r in load_records(out)}
  todo = []
  for ctx in cfg.contexts:
    for p in prompts:
      for temp in map(float, cfg.temperatures):
        for m in methods:
          r = done.get((m.text, ctx, temp, p["index"]))
          if r is None:
            todo.append((ctx, p["index"], temp, m))
          elif r["fingerprint"] != fp(m, ctx, temp, p):
            raise ValueError(f"{out} holds a result for {m.text} at context {ctx}, T={temp:g}, prompt {p['index']} "
                             "from a different configuration (target, drafter checkpoint, prompts, new_tokens, seed, "
                             "repeats or K): use another --out")

  run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
  run_info = {"run_id": run_id, "command": command, "git": _git(), "machine": machine_info(),
              "loadavg_1min_start": os.getloadavg()[0], "todo": len(todo)}
  ticks0, wall0, cpu0, loads = _cpu_ticks(), time.perf_counter(), time.process_time(), [os.getloadavg()[0]]
  timer = _Timer()
  graphdef, params = nnx.split(model)
  drafters, failed = {}, {}
  bar = tqdm(total=len(todo), file=sys.stderr, disable=not progress, desc="bench-suite", unit="run")
  for ctx in cfg.contexts:
    t_bucket, max_len = cache_len_for(ctx, cfg.new_tokens, extra=max_k + 1)  # one cache size for all methods
    for p in prompts:
      units = [u for u in todo if u[0] == ctx and u[1] == p["index"]]
      for m in {u[3].text: u[3] for u in units if u[3].name != "ar"}.values():
        if m.text not in drafters and m.text not in failed:
          try:
            d = load_drafter(m.name, model, m.drafter_dir, **dict(m.options))
            spec_sizes(mcfg, d.spec, max(cfg.contexts), cfg.new_tokens, m.num_draft)  # vocabulary, fit
            drafters[m.text] = d
          except (ValueError, FileNotFoundError) as e:
            failed[m.text] = f"{type(e).__name__}: {e}"
            tqdm.write(f"bench-suite: {m.text} skipped: {failed[m.text]}", file=sys.stderr)
            bar.update(sum(u[3].text == m.text for u in todo))
      units = [u for u in units if u[3].text not in failed]
      if not units:
        continue
      ids = prompt_ids(docs[cuts[p["index"]][0]], p["end_token"], ctx, mcfg.bos_token_id)
      pre = _prefill_prompt(timer, graphdef, params, ids, mcfg.pad_token_id or 0, ctx, max_len, t_bucket,
                            [drafters[u[3].text].spec for u in units if u[3].name != "ar"])
      seed = jnp.uint32(cfg.seed + p["index"])
      for temp in dict.fromkeys(u[2] for u in units):
        sp = SamplingParams.make(temp)
        ar_state, ar_s = _measure_ar(timer, graphdef, params, pre, ctx, sp, seed, cfg, eos)
        ar_tokens = _generated(ar_state, len(ids))
        for m in [u[3] for u in units if u[2] == temp]:
          rec = {"method": m.text, "name": m.name, "options": dict(m.options), "num_draft": m.num_draft,
                 "drafter_checkpoint": checkpoints[m.text], "context": ctx, "temperature": temp,
                 "prompt": p["index"], "run_id": run_id, "fingerprint": fp(m, ctx, temp, p),
                 "prefill_ms": 1000 * pre.prefill_s, "ar_new_tokens": len(ar_tokens), "ar_decode_s": ar_s,
                 "ar_target_forwards": int(ar_state.steps)}
          if m.name == "ar":  # AR timed again as if it were a method: its speedup shows the timing noise
            st, s = _measure_ar(timer, graphdef, params, pre, ctx, sp, seed, cfg, eos)
            rec.update(new_tokens=int(st.num_new[0]), decode_s=s, target_forwards=int(st.steps), tau=1.0,
                       accept_hist=[], draft_ms_per_step=0.0, verify_ms_per_step=None, drafter_state_bytes=0,
                       tokens=_generated(st, len(ids)))
          else:
            rec.update(_measure_spec(timer, graphdef, params, pre, drafters[m.text], m, ctx, sp, seed, cfg, eos))
          rec.update(exact_match_ar=(rec["tokens"] == ar_tokens) if temp == 0 else None,
                     peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_bytes=_rss_bytes())
          with open(_cell_path(out, m, ctx, temp), "a") as f:
            f.write(json.dumps(rec) + "\n")
          loads.append(os.getloadavg()[0])
          bar.set_postfix_str(f"ctx {ctx} T={temp:g} {m.text} tau {rec['tau']:.2f}", refresh=False)
          bar.update()
    # No program is reused at another context (the cache shapes differ). Dropping them bounds the process's
    # memory mappings: a 9-method x 6-context sweep kept every compiled program and LLVM ran out of mappings
    # ("Cannot allocate memory", then a crash) at Linux's default vm.max_map_count of 65530.
    jax.clear_caches()
  bar.close()
  run_info.update(loadavg_1min_end=os.getloadavg()[0], wall_s=time.perf_counter() - wall0,
                  loadavg_1min_samples={"min": min(loads), "max": max(loads), "mean": float(np.mean(loads)),
                                        "n": len(loads)},
                  own_cpu_s=time.process_time() - cpu0, other_processes_cpu_s=_other_cpu_s(ticks0, _cpu_ticks()),
                  failed=failed)
  with open(out / "runs.jsonl", "a") as f:
    f.write(json.dumps(run_info) + "\n")
  results = summarize(cfg, methods, prompts, target, out)
  write_outputs(results, out)
  return results


# ---- outputs


def _cell_summary(recs: list[dict], cfg: SuiteConfig) -> dict:
  recs = sorted(recs, key=lambda r: r["prompt"])
  tau = np.asarray([r["tau"] for r in recs])
  rates = np.asarray([[r["new_tokens"] - 1, r["decode_s"], r["ar_new_tokens"] - 1, r["ar_decode_s"]]
                      for r in recs], np.float64)
  hist = np.sum([r["accept_hist"] for r in recs], axis=0) if recs[0]["accept_hist"] else np.zeros(0)
  k = len(hist) - 1
  exact = [r["exact_match_ar"] for r in recs]
  ok = (rates[:, 1] > 0).all() and (rates[:, 3] > 0).all() and rates[:, 0].sum() > 0 and rates[:, 2].sum() > 0
  r0 = recs[0]
  return {
      "method": r0["method"], "name": r0["name"], "options": r0["options"], "num_draft": r0["num_draft"],
      "context": r0["context"], "temperature": r0["temperature"], "prompts": [r["prompt"] for r in recs],
      "n_prompts": len(recs), "tau_per_prompt": tau.tolist(), "tau_mean": float(tau.mean()),
      "tau_ci": list(bootstrap_ci(tau, cfg.bootstrap, cfg.ci)),
      "accept_per_position": [float(hist[i + 1:].sum() / max(hist.sum(), 1)) for i in range(k)],
      "accept_hist": hist.tolist(),
      "tokens_per_s": float(rates[:, 0].sum() / rates[:, 1].sum()) if ok else None,
      "ar_tokens_per_s": float(rates[:, 2].sum() / rates[:, 3].sum()) if ok else None,
      "speedup": float(ratio_of_rates(rates)) if ok else None,
      "speedup_ci": list(bootstrap_ci(rates, cfg.bootstrap, cfg.ci, stat=ratio_of_rates)) if ok else None,
      "ms_per_step": float(1000 * rates[:, 1].sum() / max(sum(r["target_forwards"] for r in recs), 1)),
      "ar_ms_per_step": float(1000 * rates[:, 3].sum() / max(sum(r["ar_target_forwards"] for r in recs), 1)),
      "draft_ms_per_step": float(np.median([r["draft_ms_per_step"] for r in recs])),
      "verify_ms_per_step": (float(np.median([r["verify_ms_per_step"] for r in recs]))
                             if r0["verify_ms_per_step"] is not None else None),
      "prefill_ms": float(np.median([r["prefill_ms"] for r in recs])),
      "drafter_state_bytes": int(max(r["drafter_state_bytes"] for r in recs)),
      "peak_rss_bytes": int(max(r["peak_rss_bytes"] for r in recs)),
      "exact_match_ar": None if exact[0] is None else all(exact),
      "exact_match_ar_count": None if exact[0] is None else f"{sum(exact)}/{len(exact)}",
      "run_ids": sorted({r["run_id"] for r in recs}),
      # Mean over the prompts that recorded them (records made before diagnostics existed have none).
      "diagnostics": {k: np.mean([r["diagnostics"][k] for r in recs if k in r.get("diagnostics", {})],
                                 0).round(4).tolist() for k in r0.get("diagnostics", {})},
  }


def _paired(cells: dict, a: tuple, b: tuple, cfg: SuiteConfig) -> dict | None:
  """Paired bootstrap over the prompts both measured (same prompts, same cut points) of mean tau(a) - tau(b) and
  of mean tau(a) / mean tau(b)."""
  ta = dict(zip(cells[a]["prompts"], cells[a]["tau_per_prompt"]))
  tb = dict(zip(cells[b]["prompts"], cells[b]["tau_per_prompt"]))
  common = sorted(set(ta) & set(tb))
  if len(common) < 2:
    return None
  pair = np.asarray([[ta[i], tb[i]] for i in common])
  diff = pair[:, 0] - pair[:, 1]
  lo, hi = bootstrap_ci(diff, cfg.bootstrap, cfg.ci)
  ratio_ci = bootstrap_ci(pair, cfg.bootstrap, cfg.ci, stat=lambda x: x[..., 0].mean(-1) / x[..., 1].mean(-1))
  return {"diff": float(diff.mean()), "ci": [lo, hi], "ratio": float(pair[:, 0].mean() / pair[:, 1].mean()),
          "ratio_ci": list(ratio_ci), "prompts": len(common), "exceeds_ci": bool(lo > 0 or hi < 0)}


def summarize(cfg: SuiteConfig, methods: list[MethodSpec], prompts: list[dict], target: dict, out: Path) -> dict:
  wanted = {(m.text, c, float(t)) for m in methods for c in cfg.contexts for t in cfg.temperatures}
  by_cell: dict[tuple, list] = {}
  for r in load_records(out):
    key = (r["method"], r["context"], r["temperature"])
    if key in wanted and r["prompt"] < cfg.num_prompts:
      by_cell.setdefault(key, []).append(r)
  order = {m.text: i for i, m in enumerate(methods)}
  keys = sorted(by_cell, key=lambda k: (k[2], k[1], order[k[0]]))
  cells = {k: _cell_summary(by_cell[k], cfg) for k in keys}
  for k, c in cells.items():
    c["complete"] = c["n_prompts"] == cfg.num_prompts
  pairs = []
  for t in cfg.temperatures:
    for ctx in cfg.contexts:
      present = [m.text for m in methods if (m.text, ctx, float(t)) in cells]
      for i, a in enumerate(present):
        for b in present[i + 1:]:
          d = _paired(cells, (a, ctx, float(t)), (b, ctx, float(t)), cfg)
          if d:
            pairs.append({"temperature": float(t), "context": ctx, "a": a, "b": b, **d})
  trends = []
  ref = cfg.reference_context or min(cfg.contexts)
  for t in cfg.temperatures:
    for m in methods:
      if (m.text, ref, float(t)) not in cells:
        continue
      for c in sorted(cfg.contexts):
        d = (_paired(cells, (m.text, c, float(t)), (m.text, ref, float(t)), cfg)
             if c != ref and (m.text, c, float(t)) in cells else None)
        if d:
          trends.append({"temperature": float(t), "method": m.text, "context": c, "from_context": ref, **d})
  runs = [json.loads(ln) for ln in (out / "runs.jsonl").read_text().splitlines() if ln.strip()] \
      if (out / "runs.jsonl").exists() else []
  docs = sorted({p["doc"] for p in prompts})
  return {"config": dataclasses.asdict(cfg), "target": target, "prompts": prompts, "documents": docs,
          "protocol_met": cfg.num_prompts >= PROTOCOL[0] and len(docs) >= PROTOCOL[1], "runs": runs,
          "cells": list(cells.values()), "tau_differences": pairs, "tau_vs_reference_context": trends,
          "records": [r for k in keys for r in sorted(by_cell[k], key=lambda r: r["prompt"])]}


def _fmt(v, digits=3) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.{digits}g}"
  return str(v)


def _bytes(n) -> str:
  if not n:
    return "0"
  for unit in ("B", "KB", "MB", "GB"):
    if n < 1024 or unit == "GB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def markdown(results: dict) -> str:
  cfg = results["config"]
  md = [f"# Bench suite: {results['target']['model']}", ""]
  for run in (r for r in results["runs"] if r["todo"]):  # reruns that only re-summarized stay in results.json
    m = run["machine"]
    md.append(f"- run {run['run_id']}: `{run['command']}`; git {run['git']['commit']}"
              f"{' (dirty)' if run['git']['dirty'] else ''}; {m['cpu']} x{m['cpu_count']}, {m['jax_devices'][0]}; "
              f"load avg (1 min) {run['loadavg_1min_start']:.2f} at start, {run.get('loadavg_1min_end', 0):.2f} at "
              f"end (max {run.get('loadavg_1min_samples', {}).get('max', 0):.2f}); other processes used "
              f"{_fmt(run.get('other_processes_cpu_s'))} CPU-s during its {_fmt(run.get('wall_s'))} s "
              f"({run['todo']} runs)")
  docs = results["documents"]
  md += ["", f"Target `{results['target']['dir']}` (weights sha256 {results['target']['weights_sha256'][:12]}). "
         f"{cfg['num_prompts']} prompts per context from {len(docs)} documents ({', '.join(docs)}), cut points in "
         f"`results.json`; {cfg['new_tokens']} new tokens; AR timed on the same prompts in the same process. "
         f"{int(100 * cfg['ci'])}% CIs: percentile bootstrap over prompts ({cfg['bootstrap']} resamples)."]
  if not results["protocol_met"]:
    md += ["", f"**Below the measurement protocol** (>= {PROTOCOL[0]} prompts from >= {PROTOCOL[1]} documents)."]
  md += ["", "| method | T | context | prompts | tau [CI] | accept@1,2,3 | tok/s | AR tok/s | speedup [CI] | "
         "draft ms | verify ms | AR ms/step | drafter state | peak RSS | greedy = AR |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for c in results["cells"]:
    acc = ", ".join(f"{a:.2f}" for a in c["accept_per_position"][:3]) or "-"
    sp = (f"{c['speedup']:.2f} [{c['speedup_ci'][0]:.2f}, {c['speedup_ci'][1]:.2f}]" if c["speedup"] is not None
          else "-")
    md.append(f"| {c['method']} | {c['temperature']:g} | {c['context']} | {c['n_prompts']}"
              f"{'' if c['complete'] else ' (incomplete)'} | {c['tau_mean']:.2f} [{c['tau_ci'][0]:.2f}, "
              f"{c['tau_ci'][1]:.2f}] | {acc} | {_fmt(c['tokens_per_s'])} | {_fmt(c['ar_tokens_per_s'])} | {sp} | "
              f"{_fmt(c['draft_ms_per_step'])} | {_fmt(c['verify_ms_per_step'])} | {_fmt(c['ar_ms_per_step'])} | "
              f"{_bytes(c['drafter_state_bytes'])} | {_bytes(c['peak_rss_bytes'])} | "
              f"{_fmt(c['exact_match_ar_count'])} |")
  md += ["", "draft ms / verify ms: one draft pass and one verify pass (K+1 rows) at the prompt's context, timed "
         "apart (median over prompts). AR ms/step: AR decode time per token. Peak RSS: the process's peak so far "
         "(it only grows over a sweep).", "",
         "## Which tau differences exceed their confidence interval", "",
         "Paired bootstrap over the prompts both methods ran (same prompts, same cut points): the CI of the mean "
         "difference excludes 0.", "",
         "| T | context | A | B | tau A - B [CI] | exceeds CI |", "|---|---|---|---|---|---|"]
  for d in results["tau_differences"]:
    md.append(f"| {d['temperature']:g} | {d['context']} | {d['a']} | {d['b']} | {d['diff']:+.2f} "
              f"[{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}] | {'yes' if d['exceeds_ci'] else 'no'} |")
  md += ["", f"## tau change from the reference context ({cfg.get('reference_context') or min(cfg['contexts'])}; "
         "paired over the same cut points)", "",
         "| T | method | context | tau(context) - tau(ref) [CI] | difference exceeds CI | tau(context) / tau(ref) [CI] |",
         "|---|---|---|---|---|---|"]
  for d in results["tau_vs_reference_context"]:
    md.append(f"| {d['temperature']:g} | {d['method']} | {d['from_context']} -> {d['context']} | {d['diff']:+.2f} "
              f"[{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}] | {'yes' if d['exceeds_ci'] else 'no'} | {d['ratio']:.2f} "
              f"[{d['ratio_ci'][0]:.2f}, {d['ratio_ci'][1]:.2f}] |")
  diag = [c for c in results["cells"] if c.get("diagnostics")]
  if diag:
    md += ["", "## Drafter diagnostics (mean over prompts, at the prompt's end; per-layer values averaged)", "",
           "| method | T | context | diagnostic | value |", "|---|---|---|---|---|"]
    for c in diag:
      for k, v in c["diagnostics"].items():
        v = np.asarray(v)
        shown = v.reshape(-1, v.shape[-1]).mean(0) if v.ndim else v.reshape(1)
        md.append(f"| {c['method']} | {c['temperature']:g} | {c['context']} | {k} | "
                  f"{' '.join(f'{x:.3f}' for x in shown)} |")
  md += ["", "## Plots", ""] + [f"![{name}]({name}.png)" for name in PLOTS]
  return "\n".join(md) + "\n"


PLOTS = ("tau_vs_context", "speedup_vs_context", "draft_ms_vs_context", "state_bytes_vs_context")


def plot(results: dict, out: Path) -> list[Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullLocator

  cells = results["cells"]
  methods = list(dict.fromkeys(c["method"] for c in cells))
  temps = list(dict.fromkeys(c["temperature"] for c in cells))
  colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 8))
  markers = dict(zip(methods, "osD^vPX*<>" * 8))  # distinct, so coinciding lines stay visible
  styles = ["-", "--", ":", "-."]
  contexts = sorted({c["context"] for c in cells})
  specs = {"tau_vs_context": ("tau_mean", "tau_ci", "tau (tokens per target forward)", "linear"),
           "speedup_vs_context": ("speedup", "speedup_ci", "speedup vs AR (decode tokens/s)", "linear"),
           "draft_ms_vs_context": ("draft_ms_per_step", None, "draft ms per step", "log"),
           "state_bytes_vs_context": ("drafter_state_bytes", None, "drafter state bytes", "log")}
  paths = []
  for name in PLOTS:
    key, ci_key, ylabel, yscale = specs[name]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
      for ti, t in enumerate(temps):
        cs = sorted((c for c in cells if c["method"] == m and c["temperature"] == t and c[key] is not None
                     and not (yscale == "log" and c[key] <= 0)), key=lambda c: c["context"])
        if not cs:
          continue
        x = [c["context"] for c in cs]
        label = m if len(temps) == 1 else f"{m} T={t:g}"
        ax.plot(x, [c[key] for c in cs], styles[ti % 4], marker=markers[m], color=colors[m], label=label,
                markerfacecolor="none")
        if ci_key:
          ax.fill_between(x, [c[ci_key][0] for c in cs], [c[ci_key][1] for c in cs], color=colors[m], alpha=0.15)
    if name == "speedup_vs_context":
      ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c) for c in contexts])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yscale(yscale)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ci = f" ({int(100 * results['config']['ci'])}% CI bands)" if ci_key else ""
    ax.set_title(f"{results['target']['model']}: {ylabel}{ci}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
    paths.append(out / f"{name}.png")
  return paths


def write_outputs(results: dict, out: Path) -> None:
  (out / "results.json").write_text(json.dumps(results, indent=1))
  (out / "results.md").write_text(markdown(results))
  plot(results, out)
