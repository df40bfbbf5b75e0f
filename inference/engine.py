"""The generation engine: one target prefill, a start state, one draft-verify-commit step, and the decode loop over
it, for plain autoregression (no drafter) and speculative decoding alike.

Every front end is built from these public pieces: `generate()` (Python lists in and out), the array function
`generate_arrays` that callers `jax.jit` themselves, `longspec bench` and the bench suite (which share one prefill
among methods). The state is one fixed-shape pytree carried through a `lax.while_loop`:

    config, params, inputs = prepare(model, prompts, max_new_tokens=64, drafter=d)   # host side: checks, buckets
    pre = prefill(config.graphdef, params.target, inputs.tokens, inputs.prompt_lens, max_len=config.max_len,
                  taps=..., return_kv=...)                                          # the target over the prompt
    state = start(config, params, inputs, pre)                                      # first token, drafter state
    state = decode(config, params, inputs, state)                                   # step() until every row is done

Autoregression is the engine without a drafter: each step verifies the pending token alone (one row) and commits
the target's next token. With a drafter, a step proposes K drafts, verifies K+1 rows in one target pass and commits
the accepted drafts plus the target's own token; rejected K/V rows stay in the cache and are overwritten later
(only the length pointer moves).

`config` (`GenerationConfig`) is static and hashable; everything else is a traced array, so every call whose
prompts and new-token count fall in the same buckets reuses one compiled program. `COMPILER_OPTIONS` keeps the
KV-cache updates in place on CPU (without it XLA:CPU copies every layer's cache each step); TPU and GPU ignore it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.draft_tree import DraftTree, gather_path, load_tree, verify_tree_greedy
from longspec_jax.drafters.base import (DrafterSpec, LoadedDrafter, PrefillResult, ProposeContext, VerifyResult,
                                       default_num_draft, max_draft_tokens)
from longspec_jax.drafters.registry import MAX_NUM_DRAFT
from longspec_jax.inference.draft_length import (DraftLengthRule, choose_size_index, default_sizes, initial_rates,
                                                 next_probe_wait, observed_rates, step_counts, update_rates)
from longspec_jax.kv_cache import COMPILER_OPTIONS, KVCache
from longspec_jax.sampling import SamplingParams, sample_token
from longspec_jax.verify import verify_greedy, verify_sampling

if TYPE_CHECKING:
  from longspec_jax.config import ModelConfig
  from longspec_jax.model import ForwardOutput, Transformer

MIN_BUCKET = 64
# Independent random streams of one seed: drafting, acceptance (and AR sampling), the prefill's first token.
DRAFT_STREAM, ACCEPT_STREAM, FIRST_TOKEN_STREAM = 0, 1, 2


# --- host side: shapes, checks, inputs -------------------------------------------------------------------------

def bucket(n: int) -> int:
  """Round up to a size of the form m * 2^e (granularity an eighth of the power of two): <= 12.5% waste."""
  n = max(int(n), MIN_BUCKET)
  gran = max(MIN_BUCKET, (1 << (n.bit_length() - 1)) // 8)
  return -(-n // gran) * gran


def cache_len_for(prompt_len: int, max_new_tokens: int, extra: int = 0) -> tuple[int, int]:
  """(prompt bucket, cache bucket) for a batch whose longest prompt has `prompt_len` tokens."""
  t = bucket(prompt_len)
  return t, bucket(t + max_new_tokens + extra)


def validate_prompts(prompts: Sequence[Sequence[int]] | np.ndarray, vocab_size: int,
                     max_len: int | None = None) -> list[list[int]]:
  if isinstance(prompts, np.ndarray):
    prompts = prompts.tolist()
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  if all(isinstance(t, (int, np.integer)) for t in prompts):
    raise ValueError("prompts must be a list of token-id lists (a batch); wrap a single prompt in a list")
  out = []
  for i, p in enumerate(prompts):
    try:
      p = [int(t) for t in p]
    except (TypeError, ValueError):
      raise ValueError(f"prompt {i} holds something other than token ids: {list(p)[:8]}") from None
    if not p:
      raise ValueError(f"prompt {i} is empty: give at least one token")
    bad = [t for t in p if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if max_len is not None and len(p) > max_len:
      raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the maximum context {max_len}")
    out.append(p)
  return out


def pad_prompts(prompts: list[list[int]], pad_id: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  arr = np.full((len(prompts), length), pad_id, np.int32)
  for i, p in enumerate(prompts):
    arr[i, :len(p)] = p
  return arr, np.asarray([len(p) for p in prompts], np.int32)


def resolve_num_draft(spec: DrafterSpec, num_draft: int | None) -> int:
  """K for a drafter: its default when None; checked against its limit (block drafters) on the host."""
  k = default_num_draft(spec) if num_draft is None else int(num_draft)
  if not 1 <= k <= MAX_NUM_DRAFT:
    raise ValueError(f"num_draft must be in 1..{MAX_NUM_DRAFT} for speculative decoding, got {k} (a verify pass "
                     f"checks K + 1 rows: past a few dozen it costs many decode steps and is never accepted whole)")
  limit = max_draft_tokens(spec)
  if limit is not None and k > limit:
    raise ValueError(f"drafter {spec.name!r} proposes at most {limit} tokens per step (its block), got "
                     f"num_draft={k}")
  return k


def resolve_draft_length(draft_length: DraftLengthRule | str | None, spec: DrafterSpec,
                         num_draft: int | None) -> DraftLengthRule | None:
  if draft_length in (None, "fixed"):
    return None
  if draft_length == "auto":
    return DraftLengthRule(default_sizes(resolve_num_draft(spec, num_draft)))
  if not isinstance(draft_length, DraftLengthRule):
    raise ValueError(f"draft_length must be 'fixed', 'auto' or a DraftLengthRule, got {draft_length!r}")
  resolve_num_draft(spec, draft_length.max_size)  # within the drafter's limit
  if num_draft is not None and num_draft != draft_length.max_size:
    raise ValueError(f"num_draft ({num_draft}) differs from the draft_length rule's largest size "
                     f"({draft_length.max_size})")
  initial_rates(draft_length, draft_classes(spec))  # raises if its priors are for another drafter's classes
  return draft_length


def resolve_tree(tree: DraftTree | str | None, spec: DrafterSpec, temperature: float, num_draft: int | None,
                 rule: DraftLengthRule | None) -> DraftTree | None:
  """The call's draft tree (None: a chain), checked against what tree verification supports."""
  if tree is None:
    return None
  if not isinstance(tree, DraftTree):
    tree = load_tree(tree)
  if not spec.drafts_trees:
    raise ValueError(f"drafter {spec.name!r} drafts chains only; tree drafting needs a drafter that drafts trees "
                     f"(eagle3)")
  if temperature > 0:
    raise ValueError("tree verification is greedy: use temperature 0, or a chain (no tree) to sample")
  if rule is not None:
    raise ValueError("a draft tree has a fixed shape: use draft_length='fixed' with a tree")
  if num_draft is not None and num_draft != tree.depth:
    raise ValueError(f"num_draft ({num_draft}) differs from the tree's depth ({tree.depth}); leave it unset")
  return tree


def sizes(cfg: ModelConfig, longest: int, max_new_tokens: int, num_draft: int = 0) -> tuple[int, int]:
  """(prompt bucket, cache length); raises if the longest prompt cannot get max_new_tokens. A verify pass writes
  K+1 rows past the last committed token, so speculative decoding needs that headroom."""
  extra = num_draft + 1 if num_draft else 0
  if longest + max_new_tokens + extra > cfg.max_position_embeddings:
    what = f" + K+1 ({extra})" if extra else ""
    hint = "; lower num_draft or max_new_tokens" if extra else ""
    raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}){what} exceeds the model's "
                     f"maximum context {cfg.max_position_embeddings}{hint}")
  return cache_len_for(longest, max_new_tokens, extra=extra)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """The static half of a generation call (a `jax.jit` static argument): it fixes the program's shapes."""
  graphdef: Any  # the target's nnx.GraphDef
  max_len: int  # token buffer and KV cache length (prompt bucket + new tokens [+ K+1 headroom], bucketed)
  drafter: Any = None  # a drafter's static spec (`LoadedDrafter.spec`); None = autoregressive
  num_draft: int = 0  # K drafts per verification (speculative only)
  sample: bool = False  # speculative only: rejection-sampling verification (temperature > 0) vs greedy
  draft_length: DraftLengthRule | None = None  # speculative only: K chosen per step among its sizes (max = K)
  tree: DraftTree | None = None  # speculative only: verify a static draft tree (K = its depth), greedy


@flax.struct.dataclass
class GenerationParams:
  target: Any  # nnx.State of the target (from nnx.split)
  drafter: Any = None  # the drafter's parameter pytree (None for AR or a parameter-free drafter)


@flax.struct.dataclass
class GenerationInputs:
  tokens: jax.Array  # [B, T] int32 right-padded prompts, T = the prompt bucket
  prompt_lens: jax.Array  # [B] int32
  max_new: jax.Array  # [] int32 new tokens per sequence (the buffer holds config.max_len)
  sampling: SamplingParams  # temperature / top-k / top-p, traced
  seed: jax.Array  # [] uint32
  eos_id: jax.Array  # [] int32; -1 = never stop early


def warn_if_not_bit_exact(model: Transformer) -> None:
  """Warns when a quantized KV cache sits under float weights: a verify pass and one-row decode steps then differ
  by float noise (~1e-7) before the cache rounds their K/V rows, so the odd entry on a rounding boundary lands a
  step apart (SmolLM2, fp32 weights, int8 cache: logits ~1e-2 apart) and greedy output can part from AR at a
  near-tie. Int8 weights with an int8 cache agree bit for bit (`attention.materialize`)."""
  kv, int8_weights = model.kv_dtype, model.head_int8 is not None
  if kv in ("int8", "bfloat16") and jnp.dtype(model.dtype) == jnp.float32 and not (int8_weights and kv == "int8"):
    weights = "int8" if int8_weights else "float"
    warnings.warn(f"a {kv} KV cache under {weights} weights: speculative output equals AR's only up to the cache's "
                  "rounding of float noise (rarely, at a near-tie, a greedy token differs); --dtype int8-weights "
                  "with --kv-dtype int8 is exact bit for bit", stacklevel=3)


def prepare(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
            top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
            drafter: LoadedDrafter | DrafterSpec | None = None, num_draft: int | None = None,
            draft_length: DraftLengthRule | str | None = None,
            tree: DraftTree | str | None = None) -> tuple[GenerationConfig, GenerationParams, GenerationInputs]:
  """Validates and buckets a call on the host; returns its (static config, params, inputs). With a drafter,
  `num_draft` None means the drafter's default K. draft_length: None / "fixed" (K every step), "auto"
  (DraftLengthRule over 0, 1, 3 and K with default costs) or a DraftLengthRule whose largest size is K. `tree`: a
  `DraftTree` (its paths "0;1;0.0", or "FILE.json#N") to verify instead of a chain: greedy only, K = its depth."""
  cfg = model.cfg
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompts = validate_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
  eos = cfg.eos_token_id if eos_id is None else eos_id
  sp = SamplingParams.make(temperature, top_k, top_p)
  graphdef, target_params = nnx.split(model)
  longest = max(map(len, prompts))
  if drafter is None:
    if num_draft or draft_length not in (None, "fixed") or tree is not None:
      raise ValueError("num_draft, draft_length and tree apply to speculative decoding: give a drafter too")
    t_bucket, max_len = sizes(cfg, longest, max_new_tokens)
    config, params = GenerationConfig(graphdef, max_len), GenerationParams(target_params)
  else:
    if not isinstance(drafter, LoadedDrafter):
      drafter = LoadedDrafter(drafter)
    if drafter.spec.vocab_size != cfg.vocab_size:
      raise ValueError(f"drafter vocabulary ({drafter.spec.vocab_size}) does not match the target's "
                       f"({cfg.vocab_size}): drafter and target must share one tokenizer")
    warn_if_not_bit_exact(model)
    rule = resolve_draft_length(draft_length, drafter.spec, num_draft)
    tree = resolve_tree(tree, drafter.spec, temperature, num_draft, rule)
    if tree is not None:
      k = tree.depth
    else:
      k = rule.max_size if rule is not None else resolve_num_draft(drafter.spec, num_draft)
    t_bucket, max_len = sizes(cfg, longest, max_new_tokens, k)
    if rule is not None:
      rule = rule.at_context(max_len)  # the costs at this call's cache length
    config = GenerationConfig(graphdef, max_len, drafter.spec, k, sample=temperature > 0, draft_length=rule,
                              tree=tree)
    params = GenerationParams(target_params, drafter.params)
  tokens, lens = pad_prompts(prompts, cfg.pad_token_id or 0, t_bucket)
  inputs = GenerationInputs(tokens=jnp.asarray(tokens), prompt_lens=jnp.asarray(lens),
                            max_new=jnp.int32(max_new_tokens), sampling=sp, seed=jnp.uint32(seed),
                            eos_id=jnp.int32(-1 if eos is None else eos))
  return config, params, inputs


# --- device side: prefill, start, step, decode ----------------------------------------------------------------

@flax.struct.dataclass
class Prefilled:
  """The target's pass over the prompts: everything a start state is built from."""
  cache: KVCache  # lengths = prompt_lens
  last_logits: jax.Array  # [B, V] at each prompt's last token
  taps: jax.Array | None  # [B, T, n_taps, H] at the requested taps (None: none requested)
  new_kv: tuple | None  # target (k, v) rows written by the prefill, [L, B, T, Hkv, D] each (or None)


def prefill(graphdef: nnx.GraphDef, target_params: nnx.State, tokens: jax.Array, prompt_lens: jax.Array, *,
            max_len: int, taps: tuple = (), return_kv: bool = False) -> Prefilled:
  """The one target prefill: the prompts' K/V into a cache of `max_len`, last-row logits, and the taps / K/V
  rows drafters read. The bench suite runs it once per prompt with the union of its methods' taps."""
  model = nnx.merge(graphdef, target_params)
  out = model(tokens, cache=model.init_cache(tokens.shape[0], max_len), mode="prefill",
              logits_at=(prompt_lens - 1)[:, None], taps=taps, return_kv=return_kv)
  return Prefilled(cache=out.cache.replace(lengths=prompt_lens), last_logits=out.logits[:, 0], taps=out.taps,
                   new_kv=out.new_kv)


@flax.struct.dataclass
class EngineState:
  tokens: jax.Array  # [B, S_max] prompt then generated tokens
  num_tokens: jax.Array  # [B] committed tokens; the newest (pending) is not yet in the target cache
  num_new: jax.Array  # [B] generated tokens (the pending one included)
  done: jax.Array  # [B] bool
  target_cache: KVCache  # lengths = num_tokens - 1
  drafter_state: Any  # the drafter's own pytree (None for AR)
  step: jax.Array  # [] target passes after the prefill
  active_steps: jax.Array  # [B] passes in which the sequence was still generating
  accept_hist: jax.Array  # [K+1] how often 0..K drafts were accepted (active sequences, steps verifying drafts)
  accept_rate: jax.Array  # [C, 2] per draft class: P(first draft accepted), P(next | previous accepted)
  idle_steps: jax.Array  # [] consecutive 0-size steps (draft_length rule)
  probe_wait: jax.Array  # [] idle steps before the next probe (draft_length rule; grows after failed probes)
  size_hist: jax.Array  # [n_sizes] steps at each of the rule's sizes ([1]: fixed K)
  class_counts: jax.Array  # [C, 4] what the steps observed per draft class (draft_length.step_counts, summed)
  deferred: Any = None  # DeferredRows: committed rows the drafter's update has not read yet (draft_length rule)


@flax.struct.dataclass
class DeferredRows:
  """Committed rows whose drafter update has not run yet. A step whose proposal does not read the drafter's state
  (a 0-size step; a hybrid step where every sequence took the lookup) holds its committed rows here instead of
  updating; the update reads them all in one call (as one verify pass that accepted every draft) before the next
  proposal that reads the state, or when the buffer could overflow. Run on every 0-size step, the update cost
  1.01-1.09x a decode step on SmolLM2 (EAGLE-3's most: its layer over K+1 rows), on the very steps where the
  rule chose not to draft."""
  start: jax.Array  # [B] position of the first held row (the sequence's cache length when none is held)
  count: jax.Array  # [B] rows held
  committed: jax.Array  # [B, 2(K+1)] the token each held row committed
  taps: jax.Array | None  # [B, 2(K+1), n_taps, H] the target's taps at the held rows
  new_kv: tuple | None  # target (k, v) of the held rows, [L, B, 2(K+1), Hkv, D] each (drafters that read it)


def defers_update(config: GenerationConfig) -> bool:
  """Whether steps may hold their rows for a later update (DeferredRows): with a draft-length rule, for drafters
  whose update keeps them current (not those that catch up in propose)."""
  d = config.drafter
  return config.draft_length is not None and d is not None and not d.catch_up_in_propose


def _no_deferred_rows(config: GenerationConfig, pre: Prefilled) -> DeferredRows | None:
  """The start state's (empty) DeferredRows: room for two steps' verify rows (2 (K+1))."""
  if not defers_update(config):
    return None
  d, cap = config.drafter, 2 * (config.draft_length.max_size + 1)
  rows = lambda x, axis: jnp.zeros(x.shape[:axis] + (cap,) + x.shape[axis + 1:], x.dtype)
  lens = pre.cache.lengths
  return DeferredRows(start=lens, count=jnp.zeros_like(lens), committed=jnp.zeros((lens.shape[0], cap), jnp.int32),
                      taps=rows(pre.taps, 1) if d.taps else None,
                      new_kv=tuple(rows(x, 2) for x in pre.new_kv) if d.needs_target_kv else None)


def _streams(seed):
  base = jax.random.key(seed)
  return base, jax.random.fold_in(base, DRAFT_STREAM), jax.random.fold_in(base, ACCEPT_STREAM)


def start(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs,
          pre: Prefilled) -> EngineState:
  """The decode loop's start state from a prefill: the first new token (from the prefill's last logits) and,
  with a drafter, its state from the prompt's taps / K/V rows."""
  tokens, lens = inputs.tokens, inputs.prompt_lens
  b, t = tokens.shape
  base, _, _ = _streams(inputs.seed)
  first = sample_token(jax.random.fold_in(base, FIRST_TOKEN_STREAM), pre.last_logits, inputs.sampling)
  buf = jnp.zeros((b, config.max_len), jnp.int32).at[:, :t].set(tokens).at[jnp.arange(b), lens].set(first)
  drafter_state = None
  if config.drafter is not None:
    drafter_state = config.drafter.init_state(
        params.drafter, PrefillResult(prompt_tokens=tokens, tokens=buf, prompt_lens=lens, taps=pre.taps,
                                      new_kv=pre.new_kv, target_cache=pre.cache), config.max_len)
  return EngineState(tokens=buf, num_tokens=lens + 1, num_new=jnp.ones((b,), jnp.int32),
                     done=(first == inputs.eos_id) | (inputs.max_new <= 1), target_cache=pre.cache,
                     drafter_state=drafter_state, step=jnp.int32(0), active_steps=jnp.zeros((b,), jnp.int32),
                     accept_hist=jnp.zeros((config.num_draft + 1,), jnp.int32),
                     accept_rate=(initial_rates(config.draft_length, draft_classes(config.drafter))
                                  if config.draft_length else jnp.zeros((1, 2), jnp.float32)),
                     idle_steps=jnp.int32(0),
                     probe_wait=jnp.int32(config.draft_length.probe_every if config.draft_length else 0),
                     size_hist=jnp.zeros((len(config.draft_length.sizes) if config.draft_length else 1,), jnp.int32),
                     class_counts=jnp.zeros((draft_classes(config.drafter), 4), jnp.int32),
                     deferred=_no_deferred_rows(config, pre))


def _truncate(committed, num_commit, num_new, max_new, eos_id):
  """Cap a committed block at max_new_tokens and at the first EOS. Returns (count, hit_eos)."""
  k1 = committed.shape[1]
  pos = jnp.arange(k1)[None, :]
  num_commit = jnp.minimum(num_commit, max_new - num_new)
  is_eos = (committed == eos_id) & (pos < num_commit[:, None])
  first_eos = jnp.min(jnp.where(is_eos, pos, k1), axis=1)
  hit_eos = first_eos < k1
  return jnp.where(hit_eos, first_eos + 1, num_commit), hit_eos


def step(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs,
         state: EngineState) -> EngineState:
  """One target pass: draft K tokens (none for AR), verify [pending, drafts], commit the accepted prefix plus the
  target's own token, and let the drafter read the verified rows. With `config.draft_length`, K is chosen for this
  step among the rule's sizes (one compiled branch each, `lax.switch`) from the running acceptance rate."""
  rule = config.draft_length
  if rule is None:
    return step_at(config, params, inputs, state, config.num_draft)[0]
  drafter, active = config.drafter, ~state.done
  classes = jnp.zeros(state.done.shape, jnp.int32)
  if draft_classes(drafter) > 1:
    classes = drafter.draft_class(ProposeContext(tokens=state.tokens, num_tokens=state.num_tokens,
                                                 sampling=inputs.sampling), params.drafter)
  scale = jnp.asarray(drafter.proposal_cost_scale, jnp.float32)
  proposal_scale = jnp.max(jnp.where(active, scale[jnp.minimum(classes, scale.shape[0] - 1)], 0.0))
  index = choose_size_index(rule, state.accept_rate[classes], active, state.idle_steps, proposal_scale,
                            state.probe_wait)
  # The branches leave the target cache and the drafter's update alone and return the verified rows, padded to K+1;
  # both happen here, after the switch, so the caches stay in place (written inside the branches, XLA copied every
  # cache whole on every step).
  branches = [functools.partial(_step_rows, config, params, inputs, size=size, pad_rows=rule.max_size + 1)
              for size in rule.sizes]
  size = jnp.asarray(rule.sizes, jnp.int32)[index]
  # A proposal reads the drafter's state unless it drafts nothing or every active sequence's class proposes for
  # free (scale 0: the hybrid's lookup); otherwise the step's rows wait for a later update.
  reads_state = (size > 0) & (proposal_scale > 0)
  if defers_update(config):
    state = _flush_before(config, params, state, reads_state)
  new, n_acc, rows = jax.lax.switch(index, branches, state)
  new = _apply_rows(config, params, state, new, rows, defer=~reads_state if defers_update(config) else None)
  counts = step_counts(state.accept_rate.shape[0], size, n_acc, active, classes)
  probed = (size > 0) & (state.idle_steps >= state.probe_wait)
  accepted_any = jnp.any(active & (n_acc >= 1))
  return new.replace(accept_rate=update_rates(rule, state.accept_rate, counts),
                     idle_steps=jnp.where(size == 0, state.idle_steps + 1, 0),
                     probe_wait=next_probe_wait(rule, state.probe_wait, probed, accepted_any),
                     size_hist=state.size_hist.at[index].add(1), class_counts=state.class_counts + counts)


def draft_classes(drafter: DrafterSpec | None) -> int:
  """How many classes the drafter sorts sequences into before it proposes (draft_length rates; 1 = no classes)."""
  return drafter.draft_classes if drafter is not None else 1


def step_at(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs, state: EngineState,
            size: int) -> tuple[EngineState, jax.Array]:
  """`step` verifying `size` drafts (static); 0 is a decode step, in which the drafter proposes nothing (unless
  it catches up on committed tokens only in propose) and still reads the verified row. Returns (state, accepted
  drafts [B])."""
  new, n_acc, rows = _step_rows(config, params, inputs, state, size, size + 1)
  return _apply_rows(config, params, state, new, rows), n_acc


def _apply_rows(config: GenerationConfig, params: GenerationParams, state: EngineState, new: EngineState,
                rows, defer=None) -> EngineState:
  """`new` (a `_step_rows` state) with the verified rows written into the target cache of `state` and read by the
  drafter's update; with `defer` (traced bool), the committed rows are held in `new.deferred` instead, for a later
  update (`_flush_before`)."""
  target_rows, verify = rows
  new = new.replace(target_cache=_write_rows(state.target_cache, target_rows, new.num_tokens))
  if verify is None:
    return new
  update = lambda ds: config.drafter.update(params.drafter, ds, verify)
  if defer is None:
    return new.replace(drafter_state=update(new.drafter_state))
  return new.replace(drafter_state=_apply_if(~defer, update, new.drafter_state),
                     deferred=_apply_if(defer, lambda held: _hold_rows(held, verify), new.deferred))


def _apply_if(pred, fn, operand):
  """fn(operand) if pred else operand, as a while loop of 0 or 1 trips: a loop updates its carry in place, where
  lax.cond copied the operand for the branch that returns it unchanged (a drafter's whole cache, every step)."""
  return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])), (pred, operand))[1]


def _hold_rows(held: DeferredRows, verify: VerifyResult) -> DeferredRows:
  """`held` with each sequence's committed rows of `verify` appended (the caller keeps room for them)."""
  b, r = verify.committed.shape
  j = jnp.arange(r)[None, :]
  slot = jnp.where(j < verify.num_committed[:, None], held.count[:, None] + j, held.committed.shape[1])  # else dropped
  rows = jnp.arange(b)[:, None]
  put = lambda buf, new, axis: buf.at[(slice(None),) * axis + (rows, slot)].set(new, mode="drop")
  return DeferredRows(start=jnp.where(held.count == 0, verify.start, held.start),
                      count=held.count + verify.num_committed, committed=put(held.committed, verify.committed, 0),
                      taps=None if held.taps is None else put(held.taps, verify.taps, 0),
                      new_kv=None if held.new_kv is None else tuple(
                          put(buf, x, 1) for buf, x in zip(held.new_kv, verify.new_kv)))


def _flush_before(config: GenerationConfig, params: GenerationParams, state: EngineState, reads_state
                  ) -> EngineState:
  """The drafter's update over the held rows, when this step's proposal reads the drafter's state or the step's
  rows might not fit beside them; the state unchanged otherwise."""
  held = state.deferred
  room = held.committed.shape[1] - (config.draft_length.max_size + 1)
  due = jnp.any(held.count > 0) & (reads_state | jnp.any(held.count > room))
  verify = VerifyResult(start=held.start, num_accepted=jnp.maximum(held.count - 1, 0), committed=held.committed,
                        num_committed=held.count, taps=held.taps, new_kv=held.new_kv, tokens=state.tokens,
                        num_tokens=state.num_tokens)
  ds = _apply_if(due, lambda ds: config.drafter.update(params.drafter, ds, verify), state.drafter_state)
  return state.replace(drafter_state=ds, deferred=held.replace(
      start=jnp.where(due, state.num_tokens - 1, held.start), count=jnp.where(due, 0, held.count)))


def _write_rows(cache: KVCache, target_rows, num_tokens) -> KVCache:
  """The target cache with a step's verified rows written ((k, v) [L, B, R, Hkv, D], positions [B, R]; padding
  rows at positions >= max_len are dropped) and its lengths at the new committed count."""
  k, v, positions = target_rows
  for layer in range(cache.num_layers):
    cache = cache.write(layer, k[layer], v[layer], positions)
  return cache.replace(lengths=num_tokens - 1)


def _step_rows(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs, state: EngineState,
               size: int, pad_rows: int) -> tuple[EngineState, jax.Array, tuple]:
  """`step_at` but for the writes of the verified rows: returns (state with target_cache=None and the drafter
  state as propose left it, accepted drafts [B], (the target cache's new rows (k, v, positions) for `_write_rows`,
  the `VerifyResult` for the drafter's update or None)), rows padded to `pad_rows` (past num_committed, what a
  drafter's update reads is junk anyway)."""
  model = nnx.merge(config.graphdef, params.target)
  drafter, k, sp, s = config.drafter, config.num_draft, inputs.sampling, state
  b, max_len = s.tokens.shape
  _, draft_stream, accept_stream = _streams(inputs.seed)
  start_pos = s.target_cache.lengths  # = num_tokens - 1
  pending = jnp.take_along_axis(s.tokens, start_pos[:, None], axis=1)
  accept_key = jax.random.fold_in(accept_stream, s.step)
  dstate = s.drafter_state
  taps = drafter.taps if drafter is not None else ()
  if drafter is not None and (size > 0 or drafter.catch_up_in_propose):
    drafts, q, dstate = draft(config, params, inputs, s, size, jax.random.fold_in(draft_stream, s.step))
  if config.tree is not None:
    out = verify_pass(model, s.target_cache, jnp.concatenate([pending, drafts], axis=1), taps=taps, tree=config.tree)
    n_acc, committed, path = verify_tree_greedy(out.logits, drafts, config.tree)
    # Past this point the accepted path is a verified chain of depth rows: written and read as a chain's.
    out = out.replace(taps=gather_path(out.taps, path, 1), new_kv=tuple(gather_path(x, path, 2) for x in out.new_kv))
  elif size == 0:
    out = verify_pass(model, s.target_cache, pending, taps=taps)
    n_acc, committed = jnp.zeros((b,), jnp.int32), sample_token(accept_key, out.logits[:, 0], sp)[:, None]
  else:
    out = verify_pass(model, s.target_cache, jnp.concatenate([pending, drafts], axis=1), taps=taps)
    if config.sample:
      n_acc, committed = verify_sampling(accept_key, out.logits, drafts, q, sp)
    else:
      n_acc, committed = verify_greedy(out.logits, drafts)
  active = ~s.done
  n_commit, hit_eos = _truncate(committed, n_acc + 1, s.num_new, inputs.max_new, inputs.eos_id)
  n_commit = jnp.where(active, n_commit, 0)
  rows = jnp.arange(size + 1)[None, :]
  write_pos = jnp.where(rows < n_commit[:, None], s.num_tokens[:, None] + rows, max_len)  # others dropped
  tokens = s.tokens.at[jnp.arange(b)[:, None], write_pos].set(committed, mode="drop")
  num_tokens = s.num_tokens + n_commit
  num_new = s.num_new + n_commit
  hist = s.accept_hist  # counts the steps that verified drafts (AR: every step in [1])
  if size > 0 or drafter is None:
    hist = hist + jnp.sum(jax.nn.one_hot(n_acc, k + 1, dtype=jnp.int32) * active[:, None], axis=0)
  pad = lambda x, axis: None if x is None else jnp.pad(x, [(0, pad_rows - size - 1) if a == axis else (0, 0)
                                                          for a in range(x.ndim)])
  # All size+1 verified rows go into the cache (rejected ones are overwritten later); padding rows are dropped.
  k_new, v_new = (pad(x, 2) for x in out.new_kv)
  positions = jnp.where(jnp.arange(pad_rows)[None, :] <= size, start_pos[:, None] + jnp.arange(pad_rows)[None, :],
                        max_len)
  verify = None
  if drafter is not None:
    verify = VerifyResult(start=start_pos, num_accepted=n_acc, committed=pad(committed, 1), num_committed=n_commit,
                          taps=pad(out.taps, 1), new_kv=(k_new, v_new) if drafter.needs_target_kv else None,
                          tokens=tokens, num_tokens=num_tokens)
  return s.replace(tokens=tokens, num_tokens=num_tokens, num_new=num_new,
                   done=s.done | (active & (hit_eos | (num_new >= inputs.max_new))), target_cache=None,
                   drafter_state=dstate, step=s.step + 1, active_steps=s.active_steps + active,
                   accept_hist=hist), n_acc, ((k_new, v_new, positions), verify)


# --- a step's two halves (the benchmark times each alone) ------------------------------------------------------

def draft(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs, state: EngineState,
          size: int, key: jax.Array) -> tuple[jax.Array, jax.Array | None, object]:
  """The draft half of a step: the drafter's proposal from `state`, (drafts [B, size], their probabilities q or
  None, the drafter state after proposing); with `config.tree`, the tree's node tokens [B, N] (greedy, q None). A
  size of 0 still runs the proposal for drafters that catch up on committed tokens there (one token, unused)."""
  ctx = ProposeContext(tokens=state.tokens, num_tokens=state.num_tokens, sampling=inputs.sampling)
  if config.tree is not None:
    nodes, drafter_state = config.drafter.propose_tree(params.drafter, state.drafter_state, ctx, config.tree)
    return nodes, None, drafter_state
  return config.drafter.propose(params.drafter, state.drafter_state, ctx, key, max(size, 1), config.sample)


def verify_pass(model: Transformer, cache: KVCache, block: jax.Array, *, taps: tuple = (),
                tree: DraftTree | None = None) -> ForwardOutput:
  """The verify half: the target's one pass over `block` = [pending, drafts] [B, R] on `cache`, which it only reads
  (the step writes the verified rows after): logits, the drafter's taps and the rows' K/V. With `tree`, block holds
  a tree's rows, row i at the cache length plus its depth, seeing the cache and its ancestors."""
  if tree is None:
    return model(block, cache=cache, mode="extend", taps=taps, return_kv=True, write_cache=False)
  return model(block, cache=cache, mode="extend", positions=cache.lengths[:, None] + jnp.asarray(tree.depths)[None],
               taps=taps, return_kv=True, write_cache=False, tree_mask=tree.ancestor_mask())


NO_STEP_LIMIT = np.iinfo(np.int32).max


def decode(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs, state: EngineState,
           stop_step: int | jax.Array = NO_STEP_LIMIT) -> EngineState:
  """`step` until every sequence is done (EOS or max_new tokens), or until `state.step` reaches `stop_step` (a
  traced bound: a caller that streams text runs the loop a few steps at a time with one compiled program)."""
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.step < stop_step),
                            lambda s: step(config, params, inputs, s), state)


def prefill_and_start(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs) -> EngineState:
  d = config.drafter
  pre = prefill(config.graphdef, params.target, inputs.tokens, inputs.prompt_lens, max_len=config.max_len,
                taps=d.taps if d is not None else (), return_kv=d is not None and d.needs_target_kv)
  return start(config, params, inputs, pre)


@flax.struct.dataclass
class GenerationOutput:
  tokens: jax.Array  # [B, max_len]: prompt b in [0, prompt_lens[b]), then num_new[b] generated tokens
  num_new: jax.Array  # [B] generated tokens (EOS included when produced)
  target_forwards: jax.Array  # [] target passes after the prefill
  accept_hist: jax.Array | None = None  # [K+1] how often 0..K drafts were accepted (speculative only)
  active_steps: jax.Array | None = None  # [B] verification passes per sequence while generating (speculative)


def output_of(config: GenerationConfig, state: EngineState) -> GenerationOutput:
  if config.drafter is None:
    return GenerationOutput(tokens=state.tokens, num_new=state.num_new, target_forwards=state.step)
  return GenerationOutput(tokens=state.tokens, num_new=state.num_new, target_forwards=state.step,
                          accept_hist=state.accept_hist, active_steps=state.active_steps)


def generate_arrays(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs
                    ) -> GenerationOutput:
  """Prefill and decode in one pure function; wrap it in `jax.jit(..., static_argnums=0)` (or jit a
  `functools.partial(generate_arrays, config)` with in/out shardings: `longspec_jax.inference.functional`)."""
  return output_of(config, decode(config, params, inputs, prefill_and_start(config, params, inputs)))


# Prefill and decode are two programs so that each is timed on its own (one sync between them, none per step); the
# decode program takes over the prefill's buffers (donated), so the split costs no memory. Module-level: a second
# call in the same bucket, from any front end, reuses their compilations.
prefill_program = jax.jit(prefill_and_start, static_argnums=0, compiler_options=COMPILER_OPTIONS)
decode_program = jax.jit(decode, static_argnums=0, donate_argnums=3, compiler_options=COMPILER_OPTIONS)


def compile_programs(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs
                     ) -> tuple[Callable[..., EngineState], Callable[..., EngineState]]:
  """The (prefill, decode) executables for this call's shapes, compiled ahead of time (or loaded from JAX's
  persistent cache when it is on), so that a caller can time compilation apart from generation. `run` takes
  them; without them it uses the module-level jitted programs, which compile on first use."""
  prefill_lowered = prefill_program.lower(config, params, inputs)
  decode_exe = decode_program.lower(config, params, inputs, prefill_lowered.out_info, jnp.int32(0)).compile()
  prefill_exe = prefill_lowered.compile()
  return (lambda p, i: prefill_exe(p, i)), (lambda p, i, st, stop: decode_exe(p, i, st, stop))


def run(config: GenerationConfig, params: GenerationParams, inputs: GenerationInputs,
        on_steps: Callable[[EngineState], None] | None = None, steps_per_call: int = 4,
        programs: tuple[Callable[..., EngineState], Callable[..., EngineState]] | None = None
        ) -> tuple[EngineState, float, float]:
  """Both programs back to back: (final state, prefill seconds, decode seconds). With `on_steps(state)`, the
  decode loop runs `steps_per_call` steps per call and `on_steps` sees the state after the prefill and after each
  call (to stream text); the same compiled program serves every call. `programs`: from `compile_programs`."""
  if programs is None:
    programs = (functools.partial(prefill_program, config), functools.partial(decode_program, config))
  prefill_fn, decode_fn = programs
  t0 = time.perf_counter()
  state = jax.block_until_ready(prefill_fn(params, inputs))
  t1 = time.perf_counter()
  if on_steps is None:
    state = jax.block_until_ready(decode_fn(params, inputs, state, jnp.int32(NO_STEP_LIMIT)))
    return state, t1 - t0, time.perf_counter() - t1
  on_steps(state)
  while not bool(np.all(np.asarray(state.done))):
    state = decode_fn(params, inputs, state, state.step + jnp.int32(steps_per_call))
    on_steps(state)
  return state, t1 - t0, time.perf_counter() - t1


# --- outputs ---------------------------------------------------------------------------------------------------

def output_tokens(out: GenerationOutput | EngineState, inputs: GenerationInputs) -> list[list[int]]:
  """The generated tokens of each sequence, as `generate()` returns them."""
  buf, num_new, lens = np.asarray(out.tokens), np.asarray(out.num_new), np.asarray(inputs.prompt_lens)
  return [buf[b, lens[b]:lens[b] + num_new[b]].tolist() for b in range(len(lens))]


def spec_stats(accept_hist: jax.Array, active_steps: jax.Array, num_new: jax.Array, steps: jax.Array | int) -> dict:
  """tau (tokens committed per verification pass of an active sequence), per-position acceptance and counts."""
  hist, active_steps, num_new = np.asarray(accept_hist), np.asarray(active_steps), np.asarray(num_new)
  k = len(hist) - 1
  # P(at least i+1 drafts accepted | verification pass), i = 0..K-1.
  at_least = [float(hist[i + 1:].sum() / max(hist.sum(), 1)) for i in range(k)]
  committed_after_prefill = int((num_new - 1).sum())
  return {"target_forwards": int(steps), "tau": committed_after_prefill / max(int(active_steps.sum()), 1),
          "accept_per_position": at_least, "accept_hist": hist.tolist(), "num_draft_tokens": k}


def length_stats(config: GenerationConfig, state: EngineState) -> dict:
  """With a draft_length rule: its sizes, the share of steps at each, and the rows verified per step."""
  rule = config.draft_length
  if rule is None:
    return {}
  hist = np.asarray(state.size_hist, np.float64)
  steps = max(hist.sum(), 1.0)
  return {"draft_sizes": list(rule.sizes), "size_share": (hist / steps).round(4).tolist(),
          "rows_per_step": float((hist * (np.asarray(rule.sizes) + 1)).sum() / steps),
          "class_rates": np.asarray(state.accept_rate, np.float64).round(4).tolist(),
          "class_observed": observed_rates(state.class_counts)}


def output_stats(out: GenerationOutput) -> dict:
  """tau, per-position acceptance and target passes of a speculative call (as `generate().stats`)."""
  if out.accept_hist is None:
    return {"target_forwards": int(out.target_forwards)}
  return spec_stats(out.accept_hist, out.active_steps, out.num_new, out.target_forwards)
