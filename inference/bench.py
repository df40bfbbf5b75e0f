"""`longspec bench`: one method against this project's jitted AR, in the same process, on the first N tokens of a
text file. Timings are medians over repeats; the first call of each program (compilation) is not timed."""

from __future__ import annotations

import functools

import resource
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.inference.generate import cache_len_for, generate, pad_prompts
from longspec_jax.drafters import load_drafter
from longspec_jax.drafters.base import (DEFAULT_NUM_DRAFT, PrefillResult, ProposeContext, default_num_draft,
                                       state_nbytes)
from longspec_jax.kv_cache import COMPILER_OPTIONS
from longspec_jax.sampling import SamplingParams

BATCH_STRIDE = 64  # batch element b starts b * BATCH_STRIDE tokens into the file


def bench_prompts(ids: list[int], context: int, batch: int, bos: int | None) -> list[list[int]]:
  need = context - (bos is not None) + (batch - 1) * BATCH_STRIDE
  if len(ids) < need:
    raise ValueError(f"the text has {len(ids)} tokens; context {context} with batch {batch} needs {need}")
  head = [bos] if bos is not None else []
  return [head + ids[b * BATCH_STRIDE: b * BATCH_STRIDE + context - len(head)] for b in range(batch)]


def _timed(fn, repeats: int) -> tuple[object, float]:
  fn()  # compile / warm up
  times, out = [], None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return out, statistics.median(times)


def profile_step(model, drafter, prompts, num_draft: int, sp: SamplingParams, repeats: int = 3):
  """Draft and verify cost of one step at this context, timed outside the decode loop (profiling mode)."""
  spec, dparams = drafter.spec, drafter.params
  longest = max(map(len, prompts))
  t_bucket, max_len = cache_len_for(longest, 8, extra=num_draft + 1)
  tokens, lens = pad_prompts(prompts, model.cfg.pad_token_id or 0, t_bucket)
  tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
  graphdef, params = nnx.split(model)
  sample = bool(float(sp.temperature) > 0)

  @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
  def setup(params, dparams):
    m = nnx.merge(graphdef, params)
    out = m(tokens, cache=m.init_cache(tokens.shape[0], max_len), mode="prefill", taps=spec.taps,
            return_kv=spec.needs_target_kv, return_logits=False)
    buf = jnp.zeros((tokens.shape[0], max_len), jnp.int32).at[:, :tokens.shape[1]].set(tokens)
    cache = out.cache.replace(lengths=lens)
    pre = PrefillResult(prompt_tokens=tokens, tokens=buf, prompt_lens=lens, taps=out.taps, new_kv=out.new_kv,
                        target_cache=cache)
    return buf, cache, spec.init_state(dparams, pre, max_len)

  buf, cache, dstate = setup(params, dparams)
  ctx = ProposeContext(tokens=buf, num_tokens=lens, sampling=sp)

  @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
  def draft(dparams, dstate):
    return spec.propose(dparams, dstate, ctx, jax.random.key(0), num_draft, sample)[0]

  @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
  def verify(params, cache, block):
    m = nnx.merge(graphdef, params)
    out = m(block, cache=cache.replace(lengths=lens - 1), mode="extend", taps=spec.taps,
            return_kv=spec.needs_target_kv)
    return out.logits

  drafts, t_draft = _timed(lambda: jax.block_until_ready(draft(dparams, dstate)), repeats)
  block = jnp.concatenate([tokens[jnp.arange(tokens.shape[0]), lens - 1][:, None], drafts], axis=1)
  _, t_verify = _timed(lambda: jax.block_until_ready(verify(params, cache, block)), repeats)
  return 1000 * t_draft, 1000 * t_verify, state_nbytes(dstate)


def decode_rate(model, prompts, new_tokens: int, repeats: int, **kw):
  """(result, decode tokens/s, prefill s, decode s). generate() times its prefill and decode programs apart;
  medians over `repeats` calls after a compiling one. The first token of each sequence comes from the prefill, so
  the rate counts the tokens the decode loop made."""
  run = lambda: generate(model, prompts, max_new_tokens=new_tokens, **kw)
  run()
  results = [run() for _ in range(repeats)]
  res = results[-1]
  prefill_s = statistics.median(r.prefill_s for r in results)
  decode_s = statistics.median(r.decode_s for r in results)
  n_decoded = sum(len(t) - 1 for t in res.tokens)
  return res, (n_decoded / decode_s if n_decoded else None), prefill_s, decode_s


def run_bench(model, tok, method: str, text: str, context: int, new_tokens: int, temperature: float = 0.0,
              seed: int = 0, batch: int = 1, num_draft: int | None = None, drafter_dir=None, repeats: int = 3,
              top_k: int = 0, top_p: float = 1.0, sharpdraft: str = "off", ar_baseline=None, log=None,
              budget: int | None = None) -> dict:
  """One method vs AR. `ar_baseline` = decode_rate(model, same prompts, same sampling) lets a sweep over methods
  in one process time AR once per context. `log(message)` reports each phase (the CLI prints it to stderr)."""
  log = log or (lambda msg: None)
  cfg = model.cfg
  drafter = load_drafter(method, model, drafter_dir, sharpdraft=sharpdraft, budget=budget)
  if num_draft is None:
    num_draft = default_num_draft(drafter.spec) if drafter is not None else DEFAULT_NUM_DRAFT
  prompts = bench_prompts(tok.encode(text).ids, context, batch, cfg.bos_token_id)
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

  if ar_baseline is None:
    log(f"ar: compiling, then {repeats} timed calls")
  ar, ar_tps, ar_prefill, ar_decode = ar_baseline or decode_rate(model, prompts, new_tokens, repeats, **kw)
  out = {"method": method, "sharpdraft": sharpdraft, "context": context, "new_tokens": new_tokens,
         "batch": batch, "temperature": temperature, "seed": seed, "num_draft_tokens": num_draft if drafter else 0,
         "ar_tokens_per_s": ar_tps, "ar_prefill_ms": 1000 * ar_prefill,
         "ar_decode_ms": 1000 * ar_decode}
  if budget is not None:
    out["budget"] = budget
  if drafter is None:
    out.update(tau=1.0, accept_per_position=[], target_forwards=ar.target_forwards, tokens_per_s=ar_tps,
               speedup=1.0, draft_ms_per_step=0.0, verify_ms_per_step=None, drafter_state_bytes=0,
               exact_match_ar=True if temperature == 0 else None)
  else:
    log(f"{method}: compiling, then {repeats} timed calls")
    res, tps, prefill, decode = decode_rate(model, prompts, new_tokens, repeats, drafter=drafter,
                                            num_draft_tokens=num_draft, **kw)
    log(f"{method}: tau {res.stats['tau']:.2f}; timing one draft and one verify step")
    sp = SamplingParams.make(temperature, top_k, top_p)
    draft_ms, verify_ms, state_bytes = profile_step(model, drafter, prompts, num_draft, sp)
    out.update(tau=res.stats["tau"], accept_per_position=res.stats["accept_per_position"],
               target_forwards=res.target_forwards, tokens_per_s=tps,
               speedup=tps / ar_tps if tps and ar_tps else None,
               prefill_ms=1000 * prefill, decode_ms=1000 * decode, draft_ms_per_step=draft_ms,
               verify_ms_per_step=verify_ms, drafter_state_bytes=state_bytes,
               # What a verify pass costs in AR steps (same process): speedup ~ tau / (this + draft/AR step).
               verify_over_decode=verify_ms * ar_tps / 1000 if ar_tps else None,
               exact_match_ar=(res.tokens == ar.tokens) if temperature == 0 else None)
  out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return out


def transformers_peers(model, model_dir: Path, drafter_dir: Path | None, prompts: list[list[int]], new_tokens: int,
                       num_draft: int, temperature: float = 0.0, seed: int = 0, repeats: int = 3) -> dict:
  """Decode tokens/s of transformers AR, assisted generation (exported standalone drafter) and prompt lookup on
  the same weights as `model` (fp32, CPU; its config, RoPE-scaling override included, is exported with them);
  greedy, or sampling at `temperature` with no top-k / top-p. Decode time is a full call minus a 1-token call,
  medians over `repeats` after a warm-up. Assisted generation runs only when the drafter shares the target's
  vocabulary (the shipped PARD drafter belongs to the shipped target)."""
  import tempfile

  import torch
  from transformers import AutoModelForCausalLM

  from longspec_jax.hf_io import load_model_dir, save_model_dir
  tmp = Path(tempfile.mkdtemp())
  save_model_dir(model, tmp / "target", tokenizer_dir=model_dir)
  target = AutoModelForCausalLM.from_pretrained(tmp / "target", dtype=torch.float32).eval()
  assistant = None
  if drafter_dir is not None:
    drafter = load_model_dir(drafter_dir, check_tokenizer=False)
    if drafter.cfg.vocab_size == model.cfg.vocab_size:
      save_model_dir(drafter, tmp / "drafter")
      assistant = AutoModelForCausalLM.from_pretrained(tmp / "drafter", dtype=torch.float32).eval()
  ids = torch.tensor(prompts[:1])
  runs = {"transformers-ar": {}, "transformers-prompt-lookup": {"prompt_lookup_num_tokens": num_draft}}
  if assistant is not None:
    runs["transformers-assisted"] = {"assistant_model": assistant}
  # transformers samples with top_k=50 unless told otherwise: match our plain temperature sampling.
  sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
              else dict(do_sample=False))
  out = {}
  for name, extra in runs.items():
    def go(n):
      with torch.no_grad():
        return target.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=model.cfg.pad_token_id or 0,
                               **sampling, **extra)
    torch.manual_seed(seed)
    go(2)
    _, t_prefill = _timed(lambda: go(1), repeats)
    _, t_full = _timed(lambda: go(new_tokens), repeats)
    out[name] = (new_tokens - 1) / max(t_full - t_prefill, 1e-9)
  return out
