"""Autoregressive generation: a jitted prefill program, then a jitted `lax.while_loop` decode program over a
single state dataclass. Prompt lengths and cache sizes are bucketed so a second call in the same bucket reuses
both programs."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.kv_cache import COMPILER_OPTIONS, KVCache
from longspec_jax.sampling import SamplingParams, sample_token

MIN_BUCKET = 64


def bucket(n: int) -> int:
  """Round up to a size of the form m * 2^e (granularity an eighth of the power of two): <= 12.5% waste."""
  n = max(int(n), MIN_BUCKET)
  gran = max(MIN_BUCKET, (1 << (n.bit_length() - 1)) // 8)
  return -(-n // gran) * gran


@flax.struct.dataclass
class DecodeState:
  tokens: jax.Array  # [B, S_max] prompt then generated tokens
  cache: KVCache  # cache.lengths[b] = tokens whose K/V are cached; tokens[b, lengths[b]] is pending
  num_new: jax.Array  # [B] generated tokens so far (the pending one included)
  done: jax.Array  # [B] bool
  rng: jax.Array
  steps: jax.Array  # [] target forwards after prefill


def validate_prompts(prompts, vocab_size: int, max_len: int | None = None) -> list[list[int]]:
  if isinstance(prompts, np.ndarray):
    prompts = prompts.tolist()
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  if all(isinstance(t, (int, np.integer)) for t in prompts):
    raise ValueError("prompts must be a list of token-id lists (a batch); wrap a single prompt in a list")
  out = []
  for i, p in enumerate(prompts):
    p = [int(t) for t in p]
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


def ar_start_state(tokens, prompt_lens, cache, last_logits, max_new, sp, seed, eos_id, *, max_len: int) -> DecodeState:
  """The decode loop's start state from a prefill's cache (lengths = prompt_lens) and last-row logits [B, V]. Split
  from the prefill so that the bench suite can start AR from a prefill it shares with speculative methods."""
  b, t = tokens.shape
  key_prefill, key_loop = jax.random.split(jax.random.key(seed))
  first = sample_token(key_prefill, last_logits, sp)
  buf = jnp.zeros((b, max_len), jnp.int32).at[:, :t].set(tokens)
  buf = buf.at[jnp.arange(b), prompt_lens].set(first)
  return DecodeState(tokens=buf, cache=cache, num_new=jnp.ones((b,), jnp.int32),
                     done=(first == eos_id) | (max_new <= 1), rng=key_loop, steps=jnp.int32(0))


def _ar_prefill(graphdef, params, tokens, prompt_lens, max_new, sp, seed, eos_id, *, max_len: int) -> DecodeState:
  model = nnx.merge(graphdef, params)
  out = model(tokens, cache=model.init_cache(tokens.shape[0], max_len), mode="prefill",
              logits_at=(prompt_lens - 1)[:, None])
  return ar_start_state(tokens, prompt_lens, out.cache.replace(lengths=prompt_lens), out.logits[:, 0], max_new, sp,
                        seed, eos_id, max_len=max_len)


def _ar_decode(graphdef, params, state: DecodeState, max_new, sp, eos_id) -> DecodeState:
  model = nnx.merge(graphdef, params)
  b, max_len = state.tokens.shape

  def body(s: DecodeState):
    lengths = s.cache.lengths
    pending = jnp.take_along_axis(s.tokens, lengths[:, None], axis=1)
    out = model(pending, cache=s.cache, mode="extend")
    rng, key = jax.random.split(s.rng)
    nxt = sample_token(key, out.logits[:, 0], sp)
    active = ~s.done
    new_lengths = jnp.where(active, lengths + 1, lengths)
    write_at = jnp.where(active, new_lengths, max_len)  # out of range -> dropped
    toks = s.tokens.at[jnp.arange(b), write_at].set(nxt, mode="drop")
    num_new = s.num_new + active
    done = s.done | (active & ((nxt == eos_id) | (num_new >= max_new)))
    return DecodeState(tokens=toks, cache=out.cache.replace(lengths=new_lengths), num_new=num_new, done=done,
                       rng=rng, steps=s.steps + 1)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


# Prefill and decode are two programs so that each is timed on its own (one sync between them, none per step);
# the decode program takes over the prefill's buffers (donated), so the split costs no memory.
ar_prefill_program = jax.jit(_ar_prefill, static_argnames=("graphdef", "max_len"), compiler_options=COMPILER_OPTIONS)
ar_decode_program = jax.jit(_ar_decode, static_argnames=("graphdef",), donate_argnames=("state",),
                             compiler_options=COMPILER_OPTIONS)


def timed_prefill_decode(prefill_fn, decode_fn):
  """Runs prefill_fn() then decode_fn(state); returns (final state, prefill seconds, decode seconds)."""
  t0 = time.perf_counter()
  state = jax.block_until_ready(prefill_fn())
  t1 = time.perf_counter()
  state = jax.block_until_ready(decode_fn(state))
  return state, t1 - t0, time.perf_counter() - t1


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]  # generated tokens per prompt (EOS included when produced)
  prompt_lengths: list[int]
  target_forwards: int  # forwards after prefill
  wall_s: float  # the whole call
  prefill_s: float  # prefill program (the first generated token included)
  decode_s: float  # decode loop program
  stats: dict = dataclasses.field(default_factory=dict)


def cache_len_for(prompt_len: int, max_new_tokens: int, extra: int = 0) -> tuple[int, int]:
  """(prompt bucket, cache bucket) for a batch whose longest prompt has `prompt_len` tokens."""
  t = bucket(prompt_len)
  return t, bucket(t + max_new_tokens + extra)


def ar_sizes(cfg, longest: int, max_new_tokens: int) -> tuple[int, int]:
  """(prompt bucket, cache length) for AR generation; raises if the longest prompt cannot get max_new_tokens."""
  if longest + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                     f"model's maximum context {cfg.max_position_embeddings}")
  return cache_len_for(longest, max_new_tokens)


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             drafter=None, num_draft_tokens: int = 0) -> GenerationResult:
  """Generates up to `max_new_tokens` per prompt (stops per sequence at EOS). Greedy when temperature == 0.

  With `drafter`, runs speculative decoding (lossless) instead of plain autoregression.
  """
  cfg = model.cfg
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  prompts = validate_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
  eos = cfg.eos_token_id if eos_id is None else eos_id
  eos = -1 if eos is None else eos
  sp = SamplingParams.make(temperature, top_k, top_p)
  if drafter is not None:
    from longspec_jax.inference.speculative import speculative_generate
    from longspec_jax.drafters.base import LoadedDrafter
    if not isinstance(drafter, LoadedDrafter):
      drafter = LoadedDrafter(drafter)
    return speculative_generate(model, drafter, prompts, max_new_tokens, sp, seed, eos, num_draft_tokens)
  t_bucket, max_len = ar_sizes(cfg, max(map(len, prompts)), max_new_tokens)
  tokens, lens = pad_prompts(prompts, cfg.pad_token_id or 0, t_bucket)
  graphdef, params = nnx.split(model)
  t0 = time.perf_counter()
  state, prefill_s, decode_s = timed_prefill_decode(
      lambda: ar_prefill_program(graphdef, params, jnp.asarray(tokens), jnp.asarray(lens), jnp.int32(max_new_tokens),
                                 sp, jnp.uint32(seed), jnp.int32(eos), max_len=max_len),
      lambda st: ar_decode_program(graphdef, params, st, jnp.int32(max_new_tokens), sp, jnp.int32(eos)))
  buf, num_new = np.asarray(state.tokens), np.asarray(state.num_new)
  wall = time.perf_counter() - t0
  out = [buf[i, lens[i]:lens[i] + num_new[i]].tolist() for i in range(len(prompts))]
  return GenerationResult(tokens=out, prompt_lengths=lens.tolist(), target_forwards=int(state.steps), wall_s=wall,
                          prefill_s=prefill_s, decode_s=decode_s)
