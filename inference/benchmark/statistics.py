"""Confidence intervals over prompts: the bootstrap, paired differences, and the summary of one suite cell
(method x context x temperature)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from collections.abc import Callable

  from numpy.typing import ArrayLike


def bootstrap_ci(values: ArrayLike, n_boot: int = 10000, ci: float = 0.95, seed: int = 0,
                 stat: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[float, float]:
  """Percentile bootstrap CI over the first axis of `values` (prompts). `stat` maps a resampled array [n_boot, n,
  ...] to [n_boot] (default: the mean over prompts)."""
  values = np.asarray(values, np.float64)
  n = values.shape[0]
  idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
  boot = stat(values[idx]) if stat is not None else values[idx].mean(axis=1)
  lo, hi = np.quantile(boot, [(1 - ci) / 2, 1 - (1 - ci) / 2])
  return float(lo), float(hi)


def ratio_of_rates(x: np.ndarray) -> np.ndarray:
  """x [..., n, 4] = (tokens, seconds, AR tokens, AR seconds) per prompt -> (sum tok / sum s) / (AR same)."""
  s = x.sum(axis=-2)
  return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def acceptance_per_position(hist: ArrayLike) -> list[float]:
  """P(at least i+1 drafts accepted | verification pass), i = 0..K-1, from a histogram of 0..K accepted."""
  hist = np.asarray(hist)
  return [float(hist[i + 1:].sum() / max(hist.sum(), 1)) for i in range(len(hist) - 1)]


def cell_summary(recs: list[dict], n_boot: int, ci: float) -> dict:
  """One cell's per-prompt records -> mean tau and speedup with CIs, acceptance, step costs, state, exact match."""
  recs = sorted(recs, key=lambda r: r["prompt"])
  tau = np.asarray([r["tau"] for r in recs])
  rates = np.asarray([[r["new_tokens"] - 1, r["decode_s"], r["ar_new_tokens"] - 1, r["ar_decode_s"]]
                      for r in recs], np.float64)
  hist = np.sum([r["accept_hist"] for r in recs], axis=0) if recs[0]["accept_hist"] else np.zeros(0)
  exact = [r["exact_match_ar"] for r in recs]
  ok = (rates[:, 1] > 0).all() and (rates[:, 3] > 0).all() and rates[:, 0].sum() > 0 and rates[:, 2].sum() > 0
  r0 = recs[0]
  return {
      "method": r0["method"], "name": r0["name"], "options": r0["options"], "num_draft": r0["num_draft"],
      "context": r0["context"], "temperature": r0["temperature"], "prompts": [r["prompt"] for r in recs],
      "n_prompts": len(recs), "tau_per_prompt": tau.tolist(), "tau_mean": float(tau.mean()),
      "tau_ci": list(bootstrap_ci(tau, n_boot, ci)),
      "accept_per_position": acceptance_per_position(hist),
      "accept_hist": hist.tolist(),
      "tokens_per_s": float(rates[:, 0].sum() / rates[:, 1].sum()) if ok else None,
      "ar_tokens_per_s": float(rates[:, 2].sum() / rates[:, 3].sum()) if ok else None,
      "speedup": float(ratio_of_rates(rates)) if ok else None,
      "speedup_ci": list(bootstrap_ci(rates, n_boot, ci, stat=ratio_of_rates)) if ok else None,
      # Each prompt's own decode-rate ratio, for paired comparisons between methods on the same prompts.
      "speedup_per_prompt": ((rates[:, 0] / rates[:, 1]) / (rates[:, 2] / rates[:, 3])).tolist() if ok else None,
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


def paired_difference(a: dict, b: dict, n_boot: int, ci: float) -> dict | None:
  """Paired bootstrap, over the prompts two cells both measured (same cut points), of mean tau(a) - tau(b), of
  mean tau(a) / mean tau(b) and, where both cells have them, of the mean difference of per-prompt speedups (each
  against AR on that prompt in its own process). None with fewer than two common prompts."""
  ta = dict(zip(a["prompts"], a["tau_per_prompt"]))
  tb = dict(zip(b["prompts"], b["tau_per_prompt"]))
  common = sorted(set(ta) & set(tb))
  if len(common) < 2:
    return None
  pair = np.asarray([[ta[i], tb[i]] for i in common])
  diff = pair[:, 0] - pair[:, 1]
  lo, hi = bootstrap_ci(diff, n_boot, ci)
  ratio_ci = bootstrap_ci(pair, n_boot, ci, stat=lambda x: x[..., 0].mean(-1) / x[..., 1].mean(-1))
  out = {"diff": float(diff.mean()), "ci": [lo, hi], "ratio": float(pair[:, 0].mean() / pair[:, 1].mean()),
         "ratio_ci": list(ratio_ci), "prompts": len(common), "exceeds_ci": bool(lo > 0 or hi < 0)}
  if a.get("speedup_per_prompt") and b.get("speedup_per_prompt"):
    sa, sb = (dict(zip(c["prompts"], c["speedup_per_prompt"])) for c in (a, b))
    sdiff = np.asarray([sa[i] - sb[i] for i in common])
    slo, shi = bootstrap_ci(sdiff, n_boot, ci)
    out.update(speedup_diff=float(sdiff.mean()), speedup_diff_ci=[slo, shi],
               speedup_exceeds_ci=bool(slo > 0 or shi < 0))
  return out
