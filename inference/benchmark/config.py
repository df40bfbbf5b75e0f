"""The bench suite's config (YAML, strict keys, `--set key=value` overrides) and its method strings."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import yaml

from longspec_jax.inference.benchmark.llamacpp import PEER_KV_CACHES, PEER_METHODS

PROTOCOL = (8, 4)  # the measurement protocol asks for >= 8 prompts from >= 4 documents per context


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  model: str = ""  # the target: a name (smollm2-135m), a model directory, or "" = the shipped default target
  rope_scaling: str = ""  # e.g. "yarn:2" to run the target past its trained context ("" = none)
  dtype: str = "float32"  # the target's dtype: float32 | bfloat16 | bf16-weights | int8-weights (targets.TARGET_DTYPES)
  kv_dtype: str = ""  # the target's KV cache: float32 | bfloat16 | int8 (config.KV_DTYPES); "" = the activations'
  methods: tuple[str, ...] = ("prompt-lookup",)  # NAME or NAME:key=value,key=value (see parse_method)
  contexts: tuple[int, ...] = (1024,)  # prompt lengths in tokens, BOS included
  temperatures: tuple[float, ...] = (0.0,)
  num_prompts: int = 8  # cut points, shared by every context
  min_docs: int = 4  # the cut points come from at least this many documents
  docs: tuple[str, ...] = ()  # text files; () = the shipped held-out long documents
  cut_min_tokens: int = 16384  # cut points lie at or past this token of their document (>= every context)
  prompt_seed: int = 0
  new_tokens: int = 64
  num_draft: int | None = None  # K for methods that do not set num_draft; None = each drafter's default
  repeats: int = 1  # timed decode calls per prompt (median)
  seed: int = 0  # sampling seed of prompt i is seed + i
  bootstrap: int = 10000  # bootstrap resamples for the confidence intervals
  ci: float = 0.95
  reference_context: int = 0  # tau at every context is compared with tau here (paired); 0 = the shortest context


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  text: str  # as written in the config; the method's label everywhere
  name: str  # a drafter registry method name, or "ar"
  num_draft: int | None  # None: the drafter's default K
  drafter_dir: str | None
  options: tuple[tuple[str, object], ...]  # keyword options of load_drafter (the registry entry's)
  draft_length: str = "fixed"  # fixed | auto | a rule JSON (engine.prepare's draft_length)
  tree: str | None = None  # a draft tree: its paths ("0;1;0.0") or FILE.json#N (engine.prepare's tree); None: chain

  @property
  def slug(self) -> str:
    """The label as a file name; a long one (a tree's paths) is cut and keeps a hash of the whole label."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", self.text.replace(":", "__").replace("=", "-"))
    if len(slug) > 96:
      slug = slug[:80] + "-" + hashlib.sha256(self.text.encode()).hexdigest()[:12]
    return slug


def method_options(name: str) -> tuple[str, ...]:
  """The load_drafter options a method takes, as its registry entry declares them."""
  from longspec_jax.drafters import drafter_entry
  if name == "ar":
    return ()
  if name in PEER_METHODS:
    return ("kv_cache",)  # llama.cpp's KV cache type (PEER_KV_CACHES)
  entry = drafter_entry(name)
  return tuple(entry.options) + (("sharpdraft",) if entry.sharpdraft else ())


def parse_method(text: str, default_num_draft: int | None = None) -> MethodSpec:
  """`NAME[:key=value[,key=value...]]`, values read as YAML scalars. `num_draft=K` sets K for this method,
  `drafter=DIR` its checkpoint, `draft_length=auto` (or a rule JSON) its drafts per step, `tree=0;1;0.0` (or
  `tree=FILE.json#N`) a draft tree (greedy tree verification; eagle3) instead of a chain; the other keys are the
  method's own options (e.g. `dflash:sharpdraft=fixed`, `budget:budget=256`). The llama.cpp peers
  (`llama.cpp-ar`, `llama.cpp-lookup`, its n-gram length from num_draft; `kv_cache=q8_0` for llama.cpp's 8-bit
  cache instead of f16) run beside ours on the same prompts."""
  from longspec_jax.drafters import method_names
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"a method must be a non-empty string like 'dflash' or 'dflash:sharpdraft=fixed', got {text!r}")
  name, _, rest = text.strip().partition(":")
  known = method_names() + list(PEER_METHODS)
  if name not in known:
    raise ValueError(f"method {text!r}: unknown method {name!r}; known methods: {', '.join(known)}")
  own = method_options(name)
  given: dict[str, object] = {}
  for item in filter(None, re.split(r"[,:]", rest)):
    key, eq, raw = item.partition("=")
    if not eq or not key:
      raise ValueError(f"method {text!r}: option {item!r} is not of the form key=value")
    if key in given:
      raise ValueError(f"method {text!r}: option {key!r} given twice")
    if name == "ar" or (name in PEER_METHODS and key not in ("num_draft", *own)):
      raise ValueError(f"method {text!r}: {name} takes no drafter options"
                       + (f" (its options: num_draft, {', '.join(own)})" if own else ""))
    if key not in ("num_draft", "drafter", "draft_length", "tree", *own):
      raise ValueError(f"method {text!r}: unknown option {key!r}; options: "
                       f"{', '.join(('num_draft', 'drafter', 'draft_length', 'tree', *own))}")
    given[key] = raw if key == "tree" else yaml.safe_load(raw)
  num_draft = given.pop("num_draft", default_num_draft)
  if num_draft is not None and (not isinstance(num_draft, int) or isinstance(num_draft, bool) or num_draft < 1):
    raise ValueError(f"method {text!r}: num_draft must be an integer >= 1, got {num_draft!r}")
  drafter_dir = given.pop("drafter", None)
  draft_length = str(given.pop("draft_length", "fixed"))
  if draft_length not in ("fixed", "auto") and not Path(draft_length).is_file():
    raise ValueError(f"method {text!r}: draft_length must be fixed, auto or a rule JSON file, got {draft_length!r}")
  if given.get("kv_cache", "f16") not in PEER_KV_CACHES:
    raise ValueError(f"method {text!r}: kv_cache must be one of {', '.join(PEER_KV_CACHES)}, got {given['kv_cache']!r}")
  tree = given.pop("tree", None)
  if tree is not None:
    from longspec_jax.draft_tree import load_tree
    try:
      load_tree(tree)
    except (ValueError, FileNotFoundError) as e:
      raise ValueError(f"method {text!r}: {e}") from None
  return MethodSpec(text=text.strip(), name=name, num_draft=None if name in ("ar", "llama.cpp-ar") else num_draft,
                    drafter_dir=None if drafter_dir is None else str(drafter_dir),
                    options=tuple(sorted(given.items())), draft_length=draft_length, tree=tree)


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
  from longspec_jax.targets import TARGET_DTYPES
  _check(cfg.dtype in TARGET_DTYPES, f"dtype must be one of {', '.join(TARGET_DTYPES)}, got {cfg.dtype!r}")
  from longspec_jax.config import KV_DTYPES
  _check(cfg.kv_dtype in ("",) + KV_DTYPES,
         f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or empty: the activations' dtype), got {cfg.kv_dtype!r}")
  for key in ("methods", "contexts", "temperatures", "docs"):
    _check(isinstance(getattr(cfg, key), tuple), f"{key} must be a list, got {getattr(cfg, key)!r}")
  _check(len(cfg.methods) > 0, "methods is empty")
  _check(cfg.num_draft is None or (isinstance(cfg.num_draft, int) and not isinstance(cfg.num_draft, bool)
                                   and cfg.num_draft >= 1),
         f"num_draft must be an integer >= 1 or null (each drafter's default), got {cfg.num_draft!r}")
  methods = [parse_method(m, cfg.num_draft) for m in cfg.methods]
  _check(len({m.text for m in methods}) == len(methods), f"methods has duplicates: {list(cfg.methods)}")
  _check(len(cfg.contexts) > 0 and all(isinstance(c, int) and c >= 2 for c in cfg.contexts),
         f"contexts must be a non-empty list of integers >= 2, got {list(cfg.contexts)}")
  _check(len(set(cfg.contexts)) == len(cfg.contexts), f"contexts has duplicates: {list(cfg.contexts)}")
  _check(len(cfg.temperatures) > 0 and all(isinstance(t, (int, float)) and t >= 0 for t in cfg.temperatures),
         f"temperatures must be a non-empty list of numbers >= 0, got {list(cfg.temperatures)}")
  _check(len(set(cfg.temperatures)) == len(cfg.temperatures), "temperatures has duplicates")
  for key, lo in (("num_prompts", 2), ("min_docs", 1), ("new_tokens", 1), ("repeats", 1), ("bootstrap", 100),
                  ("cut_min_tokens", 2)):
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


def load_config(path: str | Path, overrides: list[str] | None = None) -> SuiteConfig:
  from longspec_jax.yaml_config import load_yaml
  cfg = load_yaml(SuiteConfig, path, overrides)
  validate(cfg)
  return cfg
