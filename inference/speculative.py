"""Speculative decoding: prefill, then one `lax.while_loop` of draft -> verify (K+1 rows in one target pass) ->
commit, over a single fixed-shape state. Sequences in a batch advance by their own accepted counts; rejected
target K/V rows are left in place and overwritten later (only the length pointer moves)."""

from __future__ import annotations

import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.inference.generate import GenerationResult, cache_len_for, pad_prompts, timed_prefill_decode
from longspec_jax.drafters.base import LoadedDrafter, PrefillResult, ProposeContext, VerifyResult
from longspec_jax.kv_cache import COMPILER_OPTIONS, KVCache
from longspec_jax.sampling import SamplingParams, sample_token
from longspec_jax.verify import verify_greedy, verify_sampling

DRAFT_STREAM, ACCEPT_STREAM, FIRST_TOKEN_STREAM = 0, 1, 2


@flax.struct.dataclass
class SpecState:
  tokens: jax.Array  # [B, S_max]
  num_tokens: jax.Array  # [B] committed tokens (prompt + generated); the newest is not yet in the target cache
  num_new: jax.Array  # [B] generated tokens
  done: jax.Array  # [B]
  target_cache: KVCache
  drafter_state: object
  step: jax.Array  # [] target verification passes
  active_steps: jax.Array  # [B] passes in which the sequence was still generating
  accept_hist: jax.Array  # [K+1] how often 0..K drafts were accepted (active sequences)


def _truncate(committed, num_commit, num_new, max_new, eos_id):
  """Cap a committed block at max_new_tokens and at the first EOS. Returns (count, hit_eos)."""
  k1 = committed.shape[1]
  pos = jnp.arange(k1)[None, :]
  num_commit = jnp.minimum(num_commit, max_new - num_new)
  is_eos = (committed == eos_id) & (pos < num_commit[:, None])
  first_eos = jnp.min(jnp.where(is_eos, pos, k1), axis=1)
  hit_eos = first_eos < k1
  return jnp.where(hit_eos, first_eos + 1, num_commit), hit_eos


def _streams(seed):
  base = jax.random.key(seed)
  return base, jax.random.fold_in(base, DRAFT_STREAM), jax.random.fold_in(base, ACCEPT_STREAM)


def spec_start_state(drafter, drafter_params, tokens, prompt_lens, target_cache, last_logits, taps, new_kv, max_new,
                     sp, seed, eos_id, *, max_len: int, num_draft: int) -> SpecState:
  """The draft-verify loop's start state from a target prefill: cache (lengths = prompt_lens), last-row logits
  [B, V], and the drafter's taps / K/V rows. Split from the prefill so that the bench suite can start every
  method from one shared prefill."""
  b, t = tokens.shape
  base, _, _ = _streams(seed)
  first = sample_token(jax.random.fold_in(base, FIRST_TOKEN_STREAM), last_logits, sp)
  buf = jnp.zeros((b, max_len), jnp.int32).at[:, :t].set(tokens).at[jnp.arange(b), prompt_lens].set(first)
  pre = PrefillResult(prompt_tokens=tokens, tokens=buf, prompt_lens=prompt_lens, taps=taps, new_kv=new_kv,
                      target_cache=target_cache)
  return SpecState(
      tokens=buf, num_tokens=prompt_lens + 1, num_new=jnp.ones((b,), jnp.int32),
      done=(first == eos_id) | (max_new <= 1), target_cache=target_cache,
      drafter_state=drafter.init_state(drafter_params, pre, max_len), step=jnp.int32(0),
      active_steps=jnp.zeros((b,), jnp.int32), accept_hist=jnp.zeros((num_draft + 1,), jnp.int32))


def _spec_prefill(graphdef, params, drafter, drafter_params, tokens, prompt_lens, max_new, sp, seed, eos_id, *,
                  max_len: int, num_draft: int) -> SpecState:
  model = nnx.merge(graphdef, params)
  out = model(tokens, cache=model.init_cache(tokens.shape[0], max_len), mode="prefill",
              logits_at=(prompt_lens - 1)[:, None], taps=drafter.taps, return_kv=drafter.needs_target_kv)
  return spec_start_state(drafter, drafter_params, tokens, prompt_lens, out.cache.replace(lengths=prompt_lens),
                          out.logits[:, 0], out.taps, out.new_kv, max_new, sp, seed, eos_id, max_len=max_len,
                          num_draft=num_draft)


def _spec_decode(graphdef, params, drafter, drafter_params, state: SpecState, max_new, sp, seed, eos_id, *,
                 num_draft: int, sample: bool) -> SpecState:
  model = nnx.merge(graphdef, params)
  b, max_len = state.tokens.shape
  k = num_draft
  _, draft_stream, accept_stream = _streams(seed)

  def body(s: SpecState):
    ctx = ProposeContext(tokens=s.tokens, num_tokens=s.num_tokens, sampling=sp)
    drafts, q, dstate = drafter.propose(drafter_params, s.drafter_state, ctx,
                                        jax.random.fold_in(draft_stream, s.step), k, sample)
    start = s.target_cache.lengths  # = num_tokens - 1
    pending = jnp.take_along_axis(s.tokens, start[:, None], axis=1)
    vout = model(jnp.concatenate([pending, drafts], axis=1), cache=s.target_cache, mode="extend",
                 taps=drafter.taps, return_kv=drafter.needs_target_kv)
    if sample:
      n_acc, committed = verify_sampling(jax.random.fold_in(accept_stream, s.step), vout.logits, drafts, q, sp)
    else:
      n_acc, committed = verify_greedy(vout.logits, drafts)
    active = ~s.done
    n_commit, hit_eos = _truncate(committed, n_acc + 1, s.num_new, max_new, eos_id)
    n_commit = jnp.where(active, n_commit, 0)
    pos = s.num_tokens[:, None] + jnp.arange(k + 1)[None, :]
    write_pos = jnp.where(jnp.arange(k + 1)[None, :] < n_commit[:, None], pos, max_len)  # others dropped
    toks = s.tokens.at[jnp.arange(b)[:, None], write_pos].set(committed, mode="drop")
    num_tokens = s.num_tokens + n_commit
    num_new = s.num_new + n_commit
    done = s.done | (active & (hit_eos | (num_new >= max_new)))
    tcache = vout.cache.replace(lengths=num_tokens - 1)
    vr = VerifyResult(start=start, num_accepted=n_acc, committed=committed, num_committed=n_commit,
                      taps=vout.taps, new_kv=vout.new_kv, target_cache=tcache, tokens=toks, num_tokens=num_tokens)
    dstate = drafter.update(drafter_params, dstate, vr)
    hist = s.accept_hist + jnp.sum(jax.nn.one_hot(n_acc, k + 1, dtype=jnp.int32) * active[:, None], axis=0)
    return SpecState(tokens=toks, num_tokens=num_tokens, num_new=num_new, done=done, target_cache=tcache,
                     drafter_state=dstate, step=s.step + 1, active_steps=s.active_steps + active,
                     accept_hist=hist)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


# Two programs, as in AR generate: each is timed on its own and the decode loop takes over the prefill's buffers.
spec_prefill_program = jax.jit(_spec_prefill, static_argnames=("graphdef", "drafter", "max_len", "num_draft"),
                               compiler_options=COMPILER_OPTIONS)
spec_decode_program = jax.jit(_spec_decode, static_argnames=("graphdef", "drafter", "num_draft", "sample"),
                              donate_argnames=("state",), compiler_options=COMPILER_OPTIONS)


def spec_sizes(cfg, spec, longest: int, max_new_tokens: int, k: int) -> tuple[int, int]:
  """(prompt bucket, cache length) for speculative decoding with K = k drafts; raises on a bad K, a drafter of
  another vocabulary, or a prompt that cannot get max_new_tokens."""
  if k < 1:
    raise ValueError(f"num_draft_tokens must be >= 1 for speculative decoding, got {k}")
  if spec.vocab_size != cfg.vocab_size:
    raise ValueError(f"drafter vocabulary ({spec.vocab_size}) does not match the target's ({cfg.vocab_size}): "
                     "drafter and target must share one tokenizer")
  if longest + max_new_tokens + k + 1 > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + K+1 ({k + 1}) exceeds the model's "
                     f"maximum context {cfg.max_position_embeddings}; lower num_draft_tokens or max_new_tokens")
  # The verify pass writes K+1 rows past the last committed token: the cache needs that headroom.
  return cache_len_for(longest, max_new_tokens, extra=k + 1)


def speculative_generate(model, drafter: LoadedDrafter, prompts, max_new_tokens: int, sp: SamplingParams, seed: int,
                         eos: int, num_draft_tokens: int) -> GenerationResult:
  cfg = model.cfg
  spec, dparams = drafter.spec, drafter.params
  k = int(num_draft_tokens)
  t_bucket, max_len = spec_sizes(cfg, spec, max(map(len, prompts)), max_new_tokens, k)
  tokens, lens = pad_prompts(prompts, cfg.pad_token_id or 0, t_bucket)
  graphdef, params = nnx.split(model)
  sample = bool(float(sp.temperature) > 0)
  max_new, seed, eos = jnp.int32(max_new_tokens), jnp.uint32(seed), jnp.int32(eos)
  t0 = time.perf_counter()
  state, prefill_s, decode_s = timed_prefill_decode(
      lambda: spec_prefill_program(graphdef, params, spec, dparams, jnp.asarray(tokens), jnp.asarray(lens), max_new,
                                   sp, seed, eos, max_len=max_len, num_draft=k),
      lambda st: spec_decode_program(graphdef, params, spec, dparams, st, max_new, sp, seed, eos, num_draft=k,
                                     sample=sample))
  buf, num_new = np.asarray(state.tokens), np.asarray(state.num_new)
  wall = time.perf_counter() - t0
  out = [buf[i, lens[i]:lens[i] + num_new[i]].tolist() for i in range(len(prompts))]
  stats = spec_stats(state.accept_hist, state.active_steps, num_new, state.step)
  return GenerationResult(tokens=out, prompt_lengths=lens.tolist(), target_forwards=int(state.step), wall_s=wall,
                          prefill_s=prefill_s, decode_s=decode_s, stats=stats)


def spec_stats(accept_hist, active_steps, num_new, steps) -> dict:
  """tau (tokens committed per verification pass of an active sequence), per-position acceptance and counts."""
  hist, active_steps, num_new = np.asarray(accept_hist), np.asarray(active_steps), np.asarray(num_new)
  k = len(hist) - 1
  # P(at least i+1 drafts accepted | verification pass), i = 0..K-1.
  at_least = [float(hist[i + 1:].sum() / max(hist.sum(), 1)) for i in range(k)]
  committed_after_prefill = int((num_new - 1).sum())
  return {"target_forwards": int(steps), "tau": committed_after_prefill / max(int(active_steps.sum()), 1),
          "accept_per_position": at_least, "accept_hist": hist.tolist(), "num_draft_tokens": k}
