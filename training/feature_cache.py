"""The offline feature cache: what drafter training reads from the frozen target, computed once per data dir.

A drafter trainer otherwise runs the frozen target over every training window at every step; on a CPU that forward
costs more than the drafter's own step (SmolLM2-135M: ~0.2 GFLOP per token). `build_feature_cache` runs it once
over every data row (prompt + continuation, at its true positions from 0) and writes float16 memmaps next to the
data:

  <data_dir>/features/taps.f16  [total_rows, n_taps, H]       residual stream at the requested tap indices
  <data_dir>/features/kv.f16    [total_rows, n_kv, 2, Hkv, D] post-norm, post-RoPE K/V of chosen layers (optional)
  <data_dir>/features/index.json  what was cached (taps, layers, row lengths, target weights) and how far it got

Rows are appended in dataset order and `index.json` records how many are complete, so a killed build resumes.
Trainers open it with `FeatureCache.open` and read windows with `window_taps`; a cache for other taps, rows or
target weights is refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from collections.abc import Iterable, Sequence

  from datasets import Dataset
  from numpy.typing import ArrayLike, DTypeLike

  from longspec_jax.config import ModelConfig
  from longspec_jax.model import Transformer

FEATURES_DIR = "features"
INDEX = "index.json"
CACHE_VERSION = 1


def cache_tap_indices(spec: str, target_cfg: ModelConfig) -> tuple[int, ...]:
  """'dflash,eagle3,7' -> the union of DFlash's default taps (5 layers), EAGLE-3's default aux layers and 7."""
  from longspec_jax.drafters.eagle3 import default_aux_layers
  from longspec_jax.drafters.frozen_target import default_target_layer_ids

  n = target_cfg.num_hidden_layers
  named = {"dflash": [i + 1 for i in default_target_layer_ids(n, 5)], "eagle3": list(default_aux_layers(n))}
  out = set()
  for part in filter(None, (p.strip() for p in spec.split(","))):
    if part in named:
      out.update(named[part])
    elif part.isdigit():
      out.add(int(part))
    else:
      raise ValueError(f"--cache-taps: {part!r} is neither a tap index nor one of {sorted(named)}")
  return tuple(sorted(out))


def data_rows(ds: Dataset) -> list[list[int]]:
  """The token rows a cache covers: prompt + continuation of every dataset row, in dataset order."""
  return [list(p) + list(c) for p, c in zip(ds["prompt"], ds["continuation"])]


def _meta(rows, taps, kv_layers, weights_id: str, hidden: int) -> dict:
  return {"version": CACHE_VERSION, "taps": [int(t) for t in taps], "kv_layers": [int(l) for l in kv_layers],
          "lens": [len(r) for r in rows], "weights_sha256": weights_id, "hidden_size": hidden}


class FeatureCache:
  """Read-only view of a finished cache: taps [rows, n, H] (and kv) memmaps plus row offsets."""

  def __init__(self, directory: Path, meta: dict, kv_shape: tuple[int, int] | None):
    self.dir, self.meta = Path(directory), meta
    self.taps_index = {t: i for i, t in enumerate(meta["taps"])}
    self.lens = np.asarray(meta["lens"], np.int64)
    self.off = np.concatenate([[0], np.cumsum(self.lens)])
    total, h = int(self.off[-1]), meta["hidden_size"]
    self.taps = np.memmap(self.dir / "taps.f16", np.float16, "r", shape=(total, len(meta["taps"]), h))
    self.kv = None
    if meta["kv_layers"]:
      hkv, d = kv_shape
      self.kv = np.memmap(self.dir / "kv.f16", np.float16, "r", shape=(total, len(meta["kv_layers"]), 2, hkv, d))

  @classmethod
  def open(cls, data_dir: str | Path, *, taps: Sequence[int], weights_id: str, num_rows: int,
           use_rows: int | None = None, kv_layers: Sequence[int] = ()) -> "FeatureCache | None":
    """The cache of `data_dir` (whose data has `num_rows` rows) if it holds `taps` and `kv_layers` of this target
    for its first `use_rows` rows (default all); None when there is none; ValueError when there is one that does
    not fit (so stale features are never read)."""
    d = Path(data_dir) / FEATURES_DIR
    if not (d / INDEX).exists():
      return None
    index = json.loads((d / INDEX).read_text())
    meta = index["meta"]
    need = num_rows if use_rows is None else use_rows
    problems = []
    if meta.get("version") != CACHE_VERSION:
      problems.append(f"version {meta.get('version')} (expected {CACHE_VERSION})")
    if len(meta["lens"]) != num_rows:
      problems.append(f"{len(meta['lens'])} rows, the data has {num_rows}")
    elif index["done"] < need:
      problems.append(f"unfinished ({index['done']} of {need} rows); rerun make-drafter-data")
    if meta["weights_sha256"] != weights_id:
      problems.append("made by other target weights")
    for what, want, have in (("taps", taps, meta["taps"]), ("kv layers", kv_layers, meta["kv_layers"])):
      missing = sorted(set(want) - set(have))
      if missing:
        problems.append(f"no {what} {missing} (it has {have})")
    if problems:
      raise ValueError(f"feature cache {d} does not fit this training run: {'; '.join(problems)}. Delete it and "
                       "rebuild it with `longspec make-drafter-data --cache-taps ... --cache-kv-layers ...`, or "
                       "set features=recompute")
    return cls(d, meta, tuple(index["kv_shape"]) if index.get("kv_shape") else None)

  def _rows(self, store: np.ndarray, row: int, start: int, width: int) -> np.ndarray:
    """Rows [start, start + width) of data row `row` from `store` (zero outside the row, e.g. start < 0)."""
    out = np.zeros((width,) + store.shape[1:], store.dtype)
    a, b = max(start, 0), min(start + width, int(self.lens[row]))
    if b > a:
      out[a - start:b - start] = store[self.off[row] + a:self.off[row] + b]
    return out

  def window_taps(self, row: int, start: int, width: int, taps: Sequence[int]) -> np.ndarray:
    """Taps `taps` of rows [start, start + width) of data row `row`: [width, len(taps), H] float16, zero outside
    the row."""
    return self._rows(self.taps, row, start, width)[:, [self.taps_index[t] for t in taps]]

  def taps_at(self, row: int, positions: ArrayLike, taps: Sequence[int]) -> np.ndarray:
    """Taps `taps` at `positions` (within the row) of data row `row`: [len(positions), len(taps), H] float16."""
    sel = [self.taps_index[t] for t in taps]
    return np.asarray(self.taps[self.off[row] + np.asarray(positions)])[:, sel]

  def window_kv(self, row: int, start: int, width: int, layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """K and V of target layers `layers` for rows [start, start + width) of data row `row`: each
    [len(layers), width, Hkv, D] float16, zero outside the row."""
    sel = [self.meta["kv_layers"].index(l) for l in layers]
    kv = self._rows(self.kv, row, start, width)[:, sel]  # [width, n, 2, Hkv, D]
    return kv[:, :, 0].transpose(1, 0, 2, 3), kv[:, :, 1].transpose(1, 0, 2, 3)


def build_feature_cache(data_dir: str | Path, target: Transformer, taps: Iterable[int], kv_layers: Iterable[int] = (),
                        *, weights_id: str,
                        tokens_per_batch: int = 4096, num_rows: int | None = None, show_progress: bool = True) -> Path:
  """Runs the frozen `target` once over the rows of `data_dir` (the first `num_rows`, default all; a later call
  with more continues) and writes the cache, resuming a partial one. Rows go through the target in batches of
  about `tokens_per_batch` tokens."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from tqdm.auto import tqdm

  from longspec_jax.training.drafter_data import load_drafter_data

  taps, kv_layers = tuple(sorted(set(int(t) for t in taps))), tuple(sorted(set(int(l) for l in kv_layers)))
  a = target.cfg
  bad = [t for t in taps if not 0 <= t <= a.num_hidden_layers] + [l for l in kv_layers
                                                                  if not 0 <= l < a.num_hidden_layers]
  if bad or not taps:
    raise ValueError(f"cache taps must be a non-empty set in [0, {a.num_hidden_layers}] and kv layers in "
                     f"[0, {a.num_hidden_layers - 1}]; got taps {list(taps)}, kv layers {list(kv_layers)}")
  ds, _ = load_drafter_data(data_dir)
  rows = data_rows(ds)
  d = Path(data_dir) / FEATURES_DIR
  d.mkdir(parents=True, exist_ok=True)
  meta = _meta(rows, taps, kv_layers, weights_id, a.hidden_size)
  kv_shape = [a.num_key_value_heads, a.head_dim]
  done = 0
  if (d / INDEX).exists():
    old = json.loads((d / INDEX).read_text())
    if old["meta"] != meta:
      raise ValueError(f"{d} holds a feature cache made for other rows, taps, layers or target weights; delete it "
                       "or pass the same --cache-taps / --cache-kv-layers")
    done = old["done"]
  end = len(rows) if num_rows is None else min(num_rows, len(rows))
  if done >= end:
    return d
  total = sum(len(r) for r in rows)
  off = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
  mode = "r+" if done else "w+"
  tap_mm = np.memmap(d / "taps.f16", np.float16, mode, shape=(total, len(taps), a.hidden_size))
  kv_mm = (np.memmap(d / "kv.f16", np.float16, mode, shape=(total, len(kv_layers), 2, *kv_shape))
           if kv_layers else None)
  graphdef, params = nnx.split(target)
  kv_ids = jnp.asarray(kv_layers, jnp.int32)

  @jax.jit
  def forward(p, tokens):
    out = nnx.merge(graphdef, p)(tokens, mode="train", taps=taps, return_kv=bool(kv_layers), return_logits=False)
    if not kv_layers:
      return out.taps, None
    k, v = out.new_kv  # [L, B, T, Hkv, D]
    return out.taps, jnp.stack([k[kv_ids], v[kv_ids]], 1).transpose(2, 3, 0, 1, 4, 5)  # [B, T, n, 2, Hkv, D]

  bar = tqdm(total=end, initial=done, desc="feature cache", unit="row", disable=not show_progress)
  lo = done
  while lo < end:
    # Rows are padded to a multiple of 128 (causal: padding after a row changes none of its rows); the batch is a
    # function of that width only, so each width compiles once.
    width = -(-len(rows[lo]) // 128) * 128
    batch = max(1, tokens_per_batch // width)
    hi = lo + 1  # consecutive rows that fit the first one's width
    while hi < min(lo + batch, end) and len(rows[hi]) <= width:
      hi += 1
    part = rows[lo:hi]
    tokens = np.zeros((batch, width), np.int32)
    for i, r in enumerate(part):
      tokens[i, :len(r)] = r
    tap_b, kv_b = forward(params, jnp.asarray(tokens))
    tap_b = np.asarray(tap_b, np.float16)
    kv_b = None if kv_b is None else np.asarray(kv_b, np.float16)
    for i, r in enumerate(part):
      tap_mm[off[lo + i]:off[lo + i + 1]] = tap_b[i, :len(r)]
      if kv_mm is not None:
        kv_mm[off[lo + i]:off[lo + i + 1]] = kv_b[i, :len(r)]
    tap_mm.flush()
    if kv_mm is not None:
      kv_mm.flush()
    # Written after the data it counts is flushed: a crash leaves at most one batch to redo.
    (d / INDEX).write_text(json.dumps({"meta": meta, "kv_shape": kv_shape, "done": lo + len(part)}))
    bar.update(len(part))
    lo += len(part)
  bar.close()
  return d


class RowTaps:
  """Taps for windows of rows drawn from several data dirs: global row g is row g - first[k] of cache k (the
  trainers number rows by concatenating their data dirs in order)."""

  def __init__(self, caches: list[FeatureCache]):
    self.caches = caches
    self.first = np.concatenate([[0], np.cumsum([len(c.lens) for c in caches])])

  def __call__(self, rows, starts, width: int, taps) -> np.ndarray:
    k = np.searchsorted(self.first, rows, side="right") - 1
    return np.stack([self.caches[int(ki)].window_taps(int(r - self.first[ki]), int(s), width, taps)
                     for ki, r, s in zip(k, rows, starts)])


def open_row_taps(data_dirs: Sequence[str | Path], datasets: Sequence[Dataset], *, taps: Sequence[int],
                  weights_id: str, mode: str) -> RowTaps | None:
  """mode "auto": the data dirs' caches when every dir has one (else None: the trainer runs the target);
  "recompute": None; "require": the caches or an error."""
  if mode not in ("auto", "recompute", "require"):
    raise ValueError(f"features must be auto, recompute or require, got {mode!r}")
  if mode == "recompute":
    return None
  caches = [FeatureCache.open(d, taps=taps, weights_id=weights_id, num_rows=len(ds))
            for d, ds in zip(data_dirs, datasets)]
  if any(c is None for c in caches):
    if mode == "require":
      missing = [str(d) for d, c in zip(data_dirs, caches) if c is None]
      raise FileNotFoundError(f"no feature cache in {missing}; build it with `longspec make-drafter-data --out DIR "
                              f"--cache-taps {','.join(map(str, taps))}`")
    return None
  return RowTaps(caches)


def with_taps(rows: dict, cached: RowTaps | None, taps: Sequence[int], dtype: DTypeLike) -> dict:
  """A sampler batch (naming its windows by "row" and "start") with their taps read from the feature cache when
  there is one (else the caller runs the target); the row/start keys are consumed either way."""
  rows = dict(rows)
  ids, starts = rows.pop("row"), rows.pop("start")
  if cached is not None:
    rows["taps"] = cached(ids, starts, rows["tokens"].shape[1], taps).astype(dtype)
  return rows
