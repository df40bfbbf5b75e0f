"""SharpDraft: training-free, cardinality-aware query scaling for drafter attention.

A drafter trained with at most n0 visible keys spreads its softmax over more keys at n > n0, so the mass on the few
keys that matter shrinks ("attention-mass dilution"). SharpDraft multiplies each drafter query (after q-norm and
RoPE) by rho(n) >= 1, n = the keys that query sees, so every sequence and query gets its own rho.

Score model (per attention head): k relevant keys at mean logit mu + Delta, n - k background keys with logits
~ N(mu, sigma^2). Scaling logits by rho, the expected top-k mass is

    m(rho, n) = k e^{rho Delta} / (k e^{rho Delta} + (n - k) e^{rho^2 sigma^2 / 2}),

and m(rho, n) = m(1, n0) gives  rho Delta - rho^2 sigma^2 / 2 = Delta - sigma^2 / 2 + ln((n - k) / (n0 - k)).

Rules: *exact* solves that equation; *fixed-slope* uses rho = 1 + alpha ln(n / n0) for n > n0. Its tangent slope
at n0 (implicit differentiation of the equation) is alpha = n0 / ((n0 - k) (Delta - sigma^2)).

Calibration (`calibrate`) estimates (Delta, sigma, k) per layer and head from a drafter's own pre-softmax logits
at n0 keys (`Drafter.attention_logits`), see `query_outliers` and `pooled_stats`. Drafters apply it through
`SharpDraft.scale_queries`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.hf_io import weights_sha256
from longspec_jax.pallas_kernels.length_masked_attention.reference import sharpdraft_rho

from longspec_jax.sharpdraft_names import ALPHA_RULES, CHOICES, GRANULARITIES, RULES, SHARPDRAFT_FILE

if TYPE_CHECKING:
  from jax.typing import ArrayLike
  from numpy.typing import ArrayLike as NpArrayLike
FORMAT_VERSION = 1
OUTLIER_FALSE_RATE = 0.05  # expected background keys per query wrongly counted as relevant


# ---------------------------------------------------------------------------------------------------- rules


def exact_rho(n: ArrayLike, n0: float, delta: ArrayLike, sigma: ArrayLike, k: ArrayLike) -> jax.Array:
  """Exact rule, elementwise (jnp, traced n ok; parameters broadcast against n). rho = 1 for n <= n0.

  The left side f(rho) = rho Delta - rho^2 sigma^2 / 2 is a concave parabola with f(1) = right side at n0 and its
  peak at rho* = Delta / sigma^2. The wanted root is the one on the rising branch:
    rho = 2 C / (Delta + sqrt(Delta^2 - 2 sigma^2 C)),  C = Delta - sigma^2/2 + ln((n-k)/(n0-k))
  (the smaller root, rationalised so sigma -> 0 gives the linear solution 1 + ln(..) / Delta without 0/0).
  No real root >= 1 exists in two cases, handled as:
    * Delta <= sigma^2: f falls from rho = 1 on, so any rho > 1 lowers the top-k mass -> rho = 1 (no scaling;
      likewise k = 0, a head without relevant keys);
    * the target mass is above f's peak (huge n): no rho reaches it; rho* maximises the top-k mass, so
      C is capped at f(rho*) = Delta^2 / (2 sigma^2), which gives rho = rho*.
  """
  n = jnp.asarray(n, jnp.float32)
  delta = jnp.asarray(delta, jnp.float32)
  s2 = jnp.asarray(sigma, jnp.float32) ** 2
  k = jnp.asarray(k, jnp.float32)
  rises = (delta > s2) & (k >= 1)  # delta > s2 also implies delta > 0; k = 0: no relevant keys to sharpen
  grow = jnp.log(jnp.maximum(n - k, 1.0) / jnp.maximum(n0 - k, 1.0))
  c = delta - s2 / 2 + jnp.maximum(grow, 0.0)
  c_peak = jnp.where(s2 > 0, delta ** 2 / (2 * jnp.where(s2 > 0, s2, 1.0)), jnp.inf)
  c = jnp.minimum(c, c_peak)
  disc = jnp.maximum(delta ** 2 - 2 * s2 * c, 0.0)
  rho = 2 * c / jnp.where(rises, delta + jnp.sqrt(disc), 1.0)
  return jnp.where(rises & (n > n0), jnp.maximum(rho, 1.0), 1.0)


def tangent_alpha(n0: float, delta: NpArrayLike, sigma: NpArrayLike, k: NpArrayLike) -> np.ndarray:
  """d rho / d ln n of the exact rule at n0: the fixed-slope alpha to first order. 0 where the rule gives rho = 1."""
  delta, s2 = np.asarray(delta, np.float64), np.asarray(sigma, np.float64) ** 2
  k = np.asarray(k, np.float64)
  rises = (delta > s2) & (k >= 1)
  return np.where(rises, n0 / ((n0 - k) * np.where(rises, delta - s2, 1.0)), 0.0)


def fitted_alpha(n0: float, delta: NpArrayLike, sigma: NpArrayLike, k: NpArrayLike, n_max: int) -> np.ndarray:
  """Least-squares slope of (exact rho - 1) on ln(n / n0) over a log grid n0..n_max: a fixed slope that follows
  the exact rule across the whole range instead of only at n0 (the exact rule is convex in ln n)."""
  x = np.log(np.geomspace(n0, n_max, 33)[1:] / n0)
  rho = np.asarray(exact_rho(n0 * np.exp(x)[:, None], n0, np.ravel(delta)[None], np.ravel(sigma)[None],
                             np.ravel(k)[None]), np.float64)
  return ((rho - 1) * x[:, None]).sum(0).reshape(np.shape(delta)) / (x ** 2).sum()


# ---------------------------------------------------------------------------------------------- the hook


def _table(x):
  return tuple(tuple(float(v) for v in row) for row in np.asarray(x, np.float64))


@dataclasses.dataclass(frozen=True)
class SharpDraft:
  """Static (hashable) SharpDraft parameters of one drafter: per drafter attention layer and query head.

  Tables are tuples [layer][q head] so the object can be a static field of a drafter spec.
  """
  rule: str
  n0: int
  delta: tuple
  sigma: tuple
  k: tuple
  alpha: tuple

  def __post_init__(self):
    if self.rule not in RULES:
      raise ValueError(f"SharpDraft rule must be one of {RULES}, got {self.rule!r}")
    shape = np.shape(self.alpha)
    if len(shape) != 2 or any(np.shape(t) != shape for t in (self.delta, self.sigma, self.k)):
      raise ValueError("SharpDraft delta, sigma, k and alpha must be [layer][head] tables of one shape, got "
                       f"{[np.shape(t) for t in (self.delta, self.sigma, self.k, self.alpha)]}")
    if self.n0 < 2 or max(max(r) for r in self.k) >= self.n0:
      raise ValueError(f"SharpDraft needs n0 >= 2 and every k < n0, got n0={self.n0}, max k={np.max(self.k)}")

  @classmethod
  def from_stats(cls, rule: str, n0: int, delta: NpArrayLike, sigma: NpArrayLike, k: NpArrayLike,
                 alpha: NpArrayLike | None = None) -> "SharpDraft":
    """From [layer][head] arrays (alpha defaults to the tangent slope of the stats)."""
    alpha = tangent_alpha(n0, delta, sigma, k) if alpha is None else alpha
    return cls(rule, int(n0), _table(delta), _table(sigma), _table(k), _table(alpha))

  @property
  def num_layers(self) -> int:
    return len(self.alpha)

  def query_scale(self, layer: int, num_keys: jax.Array) -> jax.Array:
    """num_keys int [B, T]: keys visible to each query -> rho float32 [B, T, Hq] (exactly 1 where n <= n0)."""
    n = jnp.asarray(num_keys)[..., None]
    if self.rule == "fixed":
      return sharpdraft_rho(n, jnp.asarray(self.alpha[layer], jnp.float32), self.n0)
    return exact_rho(n, self.n0, self.delta[layer], self.sigma[layer], self.k[layer])

  def scale_queries(self, layer: int, q: jax.Array, num_keys: ArrayLike) -> jax.Array:
    """The SharpDraft hook, the one place queries are scaled (the target model's layers, DFlash, EAGLE-3): q [B, T,
    Hq, D] after q-norm and RoPE times rho of the keys each query sees, num_keys int broadcast to [B, T]. The
    product is taken in float32, then cast back to q's dtype."""
    rho = self.query_scale(layer, jnp.broadcast_to(num_keys, q.shape[:2]))
    return (q.astype(jnp.float32) * rho[..., None]).astype(q.dtype)


def scaled_logits(sharpdraft: SharpDraft | None, layer: int, logits: jax.Array) -> jax.Array:
  """Apply SharpDraft to `attention_logits` output [B, Hq, Tq, N] (each query sees its N keys)."""
  if sharpdraft is None:
    return logits
  b, _, tq, n = logits.shape
  rho = sharpdraft.query_scale(layer, jnp.full((b, tq), n, jnp.int32))  # [B, Tq, Hq]
  return logits * rho.transpose(0, 2, 1)[..., None]


# ------------------------------------------------------------------------------------------- calibration


def query_outliers(scores: np.ndarray) -> np.ndarray:
  """Relevant-key count per query: scores [Q, N] -> [Q] int.

  Background location/spread are estimated robustly (median, 1.4826 * MAD) so the relevant keys do not inflate
  them; a key is relevant when it lies above the level a Gaussian background exceeds with probability
  OUTLIER_FALSE_RATE / N (so ~OUTLIER_FALSE_RATE background keys per query are miscounted).
  """
  from scipy.special import ndtri
  n = scores.shape[-1]
  med = np.median(scores, axis=-1, keepdims=True)
  mad = 1.4826 * np.median(np.abs(scores - med), axis=-1, keepdims=True)
  z = ndtri(1 - OUTLIER_FALSE_RATE / n)
  return np.sum(scores > med + z * np.maximum(mad, 1e-6), axis=-1)


def top_k_mass(scores: NpArrayLike, k: NpArrayLike) -> np.ndarray:
  """Softmax mass on the k largest of each row: scores [..., N], k int broadcast to scores[..., 0]."""
  scores = np.asarray(scores, np.float64)
  srt = -np.sort(-scores, axis=-1)
  p = np.exp(srt - srt[..., :1])
  p /= p.sum(-1, keepdims=True)
  k = np.broadcast_to(np.asarray(k), scores.shape[:-1])
  return np.where(k > 0, np.take_along_axis(np.cumsum(p, -1), np.maximum(k, 1)[..., None] - 1, -1)[..., 0], 0.0)


def pooled_stats(scores: np.ndarray) -> dict:
  """Score-model statistics of one pool of queries (one head, a layer's heads or all heads): scores [Q, N].

  k = median relevant-key count per query (`query_outliers`). With that k, per query Delta = mean(top k) -
  mean(rest) and sigma^2 = var(rest); the pool's Delta and sigma^2 are their means. k = 0 (no outliers in most
  queries: an averaging head, diffuse by training) gets Delta = 0, i.e. no scaling.
  """
  scores = np.asarray(scores, np.float64)
  q, n = scores.shape
  k = int(np.round(np.median(query_outliers(scores))))
  srt = -np.sort(-scores, axis=-1)
  kk = max(k, 1)
  rest = srt[:, kk:]
  delta = float(np.mean(srt[:, :kk].mean(-1) - rest.mean(-1))) if k else 0.0
  sigma2 = float(np.mean(rest.var(-1)))
  mass = float(np.mean(top_k_mass(scores, k)))
  model_mass = k * np.exp(delta) / (k * np.exp(delta) + (n - k) * np.exp(sigma2 / 2)) if k else 0.0
  return {"k": k, "delta": delta, "sigma": float(np.sqrt(sigma2)), "queries": q, "keys": n,
          "top_k_mass": mass, "model_top_k_mass": float(model_mass)}


def calibrate(layer_scores: list[np.ndarray], granularity: str = "head", alpha_rule: str = "tangent",
              fit_max_keys: int = 16384) -> dict:
  """layer_scores: per drafter attention layer, logits [Q, Hq, N] of Q queries that each see N keys (N = n0).

  Returns the `sharpdraft.json` body (without provenance): per-head statistics, and the parameters applied at the
  chosen granularity (pooled over a layer's heads or the whole drafter, then repeated per head).
  """
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
  if alpha_rule not in ALPHA_RULES:
    raise ValueError(f"alpha rule must be one of {ALPHA_RULES}, got {alpha_rule!r}")
  keys = {s.shape[-1] for s in layer_scores}
  if len(keys) != 1:
    raise ValueError(f"every layer's queries must see the same number of keys, got {sorted(keys)}")
  n0 = keys.pop()
  rows = lambda s: np.moveaxis(np.asarray(s), 1, 0)  # [Hq, Q, N]
  heads = [[pooled_stats(h) for h in rows(s)] for s in layer_scores]
  if granularity == "head":
    applied = heads
  elif granularity == "layer":
    applied = [[pooled_stats(rows(s).reshape(-1, n0))] * s.shape[1] for s in layer_scores]
  else:
    pool = pooled_stats(np.concatenate([rows(s).reshape(-1, n0) for s in layer_scores]))
    applied = [[pool] * s.shape[1] for s in layer_scores]
  table = {f: np.array([[h[f] for h in layer] for layer in applied], np.float64) for f in ("delta", "sigma", "k")}
  if alpha_rule == "tangent":
    alpha = tangent_alpha(n0, table["delta"], table["sigma"], table["k"])
  else:
    alpha = fitted_alpha(n0, table["delta"], table["sigma"], table["k"], fit_max_keys)
  return {"version": FORMAT_VERSION, "n0": n0, "granularity": granularity, "alpha_rule": alpha_rule,
          **({"fit_max_keys": fit_max_keys} if alpha_rule == "fit" else {}),
          "applied": {"delta": table["delta"].tolist(), "sigma": table["sigma"].tolist(),
                      "k": table["k"].astype(int).tolist(), "alpha": alpha.tolist()},
          "heads": heads}


def load_sharpdraft(drafter_dir: str | os.PathLike, rule: str, method: str = "NAME") -> SharpDraft:
  """The calibrated SharpDraft stored beside a drafter checkpoint, with the given rule ("exact" | "fixed")."""
  path = Path(drafter_dir) / SHARPDRAFT_FILE
  if rule not in RULES:
    raise ValueError(f"sharpdraft rule must be one of {CHOICES}, got {rule!r}")
  if not path.exists():
    raise FileNotFoundError(
        f"no SharpDraft calibration at {path}; run `longspec calibrate-sharpdraft --drafter {method} "
        f"--drafter-dir {drafter_dir}` first (or use --sharpdraft off)")
  meta = json.loads(path.read_text())
  if meta.get("version") != FORMAT_VERSION:
    raise ValueError(f"{path} has format version {meta.get('version')}, expected {FORMAT_VERSION}; recalibrate")
  if meta.get("drafter_weights_sha256") not in (None, weights_sha256(drafter_dir)):
    raise ValueError(f"{path} was calibrated on other weights than the checkpoint in {drafter_dir} now; rerun "
                     f"`longspec calibrate-sharpdraft --drafter {method} --drafter-dir {drafter_dir}`")
  a = meta["applied"]
  return SharpDraft.from_stats(rule, meta["n0"], a["delta"], a["sigma"], a["k"], a["alpha"])
