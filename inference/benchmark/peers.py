"""`transformers` on the same weights as our target: AR, assisted generation (a standalone drafter) and prompt
lookup, for `longspec bench --peer transformers`.

Decode is timed inside each `generate` call: a streamer records when the prompt is handed in and when each step's
tokens are committed. Prefill = prompt to first commit (the pass over the prompt, with the first drafts for
assisted generation and prompt lookup); decode = first commit to last, over the tokens committed after the first.
An earlier version took decode time as (median of calls making N tokens) - (median of calls making 1): a small
difference of two large times measured apart. Where the prefill is most of a call (4K tokens on SmolLM2-135M on a
CPU) its run-to-run noise is as large as the whole decode, so the difference came out tiny or negative: 1,639 tok/s
for transformers AR and 3.1e10 for prompt lookup (31 tokens / the 1e-9 s floor it clamped a negative time to)
where a direct probe measured about 10.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import torch

  from longspec_jax.model import Transformer


class CommitClock:
  """A `transformers` streamer: the time of each `put` and how many tokens it carried (the prompt first, then
  each committed step; batch of one)."""

  def __init__(self):
    self.times: list[float] = []
    self.counts: list[int] = []

  def put(self, value: torch.Tensor) -> None:
    self.times.append(time.perf_counter())
    self.counts.append(int(value.numel()))

  def end(self) -> None:
    pass


def decode_timing(times: list[float], counts: list[int], what: str) -> dict:
  """Prefill and decode figures of one call from its commit times; a ValueError for a figure that cannot be right
  (no decode step, a non-positive time, decode faster than the call's own prefill: a decode step reads the whole
  model for at most K+1 tokens, a prefill for every prompt token)."""
  if len(times) < 3:
    raise ValueError(f"{what}: {len(times) - 1} commit(s); timing decode needs at least 2 (ask for more new tokens)")
  prompt_tokens, decode_tokens = counts[0], sum(counts[2:])
  prefill_s, decode_s = times[1] - times[0], times[-1] - times[1]
  if prefill_s <= 0 or decode_s <= 0 or decode_tokens <= 0:
    raise ValueError(f"{what}: impossible timing: prefill {prefill_s:.3g} s, decode {decode_s:.3g} s for "
                     f"{decode_tokens} tokens")
  rate, prefill_rate = decode_tokens / decode_s, prompt_tokens / prefill_s
  if rate > prefill_rate:
    raise ValueError(f"{what}: impossible timing: decode {rate:.4g} tok/s is faster than its own prefill "
                     f"({prompt_tokens} tokens at {prefill_rate:.4g} tok/s)")
  return {"tokens_per_s": rate, "prefill_ms": 1000 * prefill_s, "decode_ms": 1000 * decode_s,
          "decode_tokens": decode_tokens}


def transformers_peers(model: Transformer, model_dir: Path, drafter_dir: Path | None, prompts: list[list[int]],
                       new_tokens: int, num_draft: int, temperature: float = 0.0, seed: int = 0,
                       repeats: int = 3) -> dict:
  """name -> {"tokens_per_s", "prefill_ms", "decode_ms", "decode_tokens"} (medians over `repeats` calls after a
  short warm-up) for transformers AR, assisted generation (exported standalone drafter) and prompt lookup on the
  same weights as `model` (fp32, CPU; its config, RoPE-scaling override included, is exported with them), on the
  first prompt; greedy, or sampling at `temperature` with no top-k / top-p. Assisted generation runs only when the
  drafter shares the target's vocabulary (the shipped PARD drafter belongs to the shipped target)."""
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
    def timed_call(n: int) -> CommitClock:
      clock = CommitClock()
      with torch.no_grad():
        target.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=model.cfg.pad_token_id or 0,
                        streamer=clock, **sampling, **extra)
      return clock
    torch.manual_seed(seed)
    timed_call(2)  # warm-up: first-call allocations and dispatch
    calls = [decode_timing(c.times, c.counts, name) for c in (timed_call(new_tokens) for _ in range(repeats))]
    out[name] = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
  return out
