"""The distillation store: the frozen target run once, teacher-forced, over long windows of the corpus train split
(and optionally over its own continuations), keeping per token what drafter training reads.

Per stored token t of a window:
  tokens         the token itself
  taps           the target's residual stream at the requested tap indices   [n_taps, H]
  kv             post-norm, post-RoPE K/V rows of the requested layers        [n_layers, 2, Hkv, D]
  topk_ids       the k most likely next tokens under the target               [k]
  topk_logprobs  their log-probabilities (the soft labels; log_softmax over the full vocabulary)  [k]
The labels at t are the target's distribution of token t+1 given tokens 0..t of the same window.

Windows are cut from the train split's documents, shuffled by the seed and concatenated with EOS between them, so a
window of 8K tokens holds several documents and its later tokens have long context behind them. A configurable
share of windows keeps only its first part and lets the target continue it (greedy or sampled): on-policy text.

Format: numpy `.npy` files in one directory per shard (`shard_00000/`), plus `index.json` (settings, shards and the
windows each holds). Chosen over `datasets`/Arrow because trainers read random token ranges of large float arrays:
`np.load(..., mmap_mode="r")` gives that with no copy and no decoding layer, and `.npy` is a stable, self-describing
numpy format. Features are stored as bf16 (as uint16 bit patterns) or fp8 e4m3 (uint8, with a per-row float32 scale,
since SmolLM2's residual stream has activations far beyond fp8's range). A shard is written to a temporary directory
and renamed into place, then the index is replaced atomically: a kill loses at most the shard being written, and
rerunning the same command resumes after the last complete shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from longspec_jax.fileio import write_json_atomic

if TYPE_CHECKING:
  from collections.abc import Callable, Iterable, Sequence

  import jax
  from flax import nnx
  from tokenizers import Tokenizer

  from longspec_jax.model import Transformer

STORE_VERSION = 1
INDEX = "index.json"
FEATURE_DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_WINDOW = 128  # a trailing piece of the stream shorter than this is dropped
MAX_OPEN_ARRAYS = 256  # memmaps a DistillStore keeps open (a file descriptor each)


@dataclasses.dataclass(frozen=True)
class DistillStoreConfig:
  target: str | None = None  # a target name (smollm2-135m), an HF directory, or None for the shipped target
  corpus_dir: str = "data/corpus"
  out_dir: str = "runs/distill"
  max_tokens: int = 9_000_000  # stop once this many tokens are stored (or the train split runs out)
  max_minutes: float = 0.0  # >0: also stop (the shard in hand written) once this run has taken this long
  max_documents: int = 0  # >0: only the train split's first N documents (a small store without tokenizing all)
  window_tokens: int = 8192
  taps: tuple[int, ...] = ()
  kv_layers: tuple[int, ...] = ()
  topk: int = 32
  feature_dtype: str = "bf16"
  shard_tokens: int = 65536  # a shard closes once it holds at least this many tokens
  on_policy_fraction: float = 0.0  # share of windows whose tail the target writes itself
  on_policy_new_tokens: int = 256  # tokens the target generates for such a window
  on_policy_temperature: float = 0.8  # every other on-policy window is greedy, the rest sampled at this
  seed: int = 0

  def validate(self, num_layers: int) -> None:
    problems = []
    if self.feature_dtype not in FEATURE_DTYPES:
      problems.append(f"feature_dtype must be one of {FEATURE_DTYPES}, got {self.feature_dtype!r}")
    if self.window_tokens < MIN_WINDOW:
      problems.append(f"window_tokens must be >= {MIN_WINDOW}, got {self.window_tokens}")
    if self.topk < 1 or self.max_tokens < 1 or self.shard_tokens < 1:
      problems.append("topk, max_tokens and shard_tokens must be >= 1")
    if self.max_minutes < 0 or self.max_documents < 0:
      problems.append(f"max_minutes and max_documents must be >= 0, got {self.max_minutes}, {self.max_documents}")
    if not 0 <= self.on_policy_fraction <= 1:
      problems.append(f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
    if self.on_policy_fraction and not 0 < self.on_policy_new_tokens < self.window_tokens:
      problems.append("on_policy_new_tokens must be in [1, window_tokens)")
    bad = [t for t in self.taps if not 0 <= t <= num_layers] + [l for l in self.kv_layers
                                                              if not 0 <= l < num_layers]
    if bad:
      problems.append(f"taps must be in [0, {num_layers}] and kv layers in [0, {num_layers - 1}]; got "
                      f"taps {list(self.taps)}, kv layers {list(self.kv_layers)}")
    if problems:
      raise ValueError("; ".join(problems))


# --- feature encoding ------------------------------------------------------------------------------------------

def encode_features(x: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
  """[N, G, ...] float32 -> stored arrays. fp8 scales each [N, G] group by its absolute maximum."""
  import ml_dtypes
  if dtype == "bf16":
    return {"bits": x.astype(ml_dtypes.bfloat16).view(np.uint16)}
  flat = x.reshape(x.shape[0], x.shape[1], -1)
  # times the reciprocal, not divided: XLA turns a division by a constant into that product, and the two encoders
  # must agree bit for bit
  scale = np.maximum(np.abs(flat).max(axis=-1), 1e-30).astype(np.float32) * np.float32(1 / FP8_MAX)
  q = (flat / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  return {"bits": q.reshape(x.shape), "scale": scale}


def encode_on_device(x: jax.Array, dtype: str) -> dict[str, jax.Array]:
  """encode_features in JAX, bit for bit (float32 max, product, division and one rounding cast), inside the
  store's jitted forward: the host then only copies the encoded bytes."""
  import jax
  import jax.numpy as jnp
  x = x.astype(jnp.float32)
  if dtype == "bf16":
    return {"bits": jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)}
  flat = x.reshape(x.shape[0], x.shape[1], -1)
  scale = jnp.maximum(jnp.abs(flat).max(axis=-1), jnp.float32(1e-30)) * jnp.float32(1 / FP8_MAX)
  q = (flat / scale[..., None]).astype(jnp.float8_e4m3fn)
  return {"bits": jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(x.shape), "scale": scale}


def decode_on_device(rows: dict, name: str, dtype: str, out_dtype: Any) -> dict:
  """`rows` (a batch read with decode=False) with feature `name` decoded in JAX to out_dtype: what
  decode_features computes, bit for bit (an exact widening to float32, one float32 product, one rounding), inside a
  jitted step, so the host only copies the stored bytes (numpy's fp8 cast is the slow part of reading a store)."""
  import jax
  import jax.numpy as jnp
  rows = dict(rows)
  bits, scale = rows.pop(name), rows.pop(f"{name}_scale", None)
  if dtype == "bf16":
    x = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)
  else:
    x = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
    x = x * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))
  rows[name] = x.astype(out_dtype)
  return rows


def decode_features(bits: np.ndarray, dtype: str, scale: np.ndarray | None = None) -> np.ndarray:
  import ml_dtypes
  if dtype == "bf16":
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)
  x = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return x * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))


# --- the window plan -------------------------------------------------------------------------------------------

def token_stream(texts: list[str], tok: Tokenizer, eos_id: int, seed: int) -> np.ndarray:
  """The train split's documents in a seeded order, tokenized and joined with EOS (int32)."""
  order = np.random.default_rng(seed).permutation(len(texts))
  ids = []
  for enc in tok.encode_batch([texts[i] for i in order]):
    ids.extend(enc.ids)
    ids.append(eos_id)
  return np.asarray(ids, np.int32)


def plan_windows(stream_len: int, window_tokens: int) -> list[tuple[int, int]]:
  """(start, length) of consecutive windows over the stream; a last piece shorter than MIN_WINDOW is dropped."""
  return [(s, min(window_tokens, stream_len - s)) for s in range(0, stream_len, window_tokens)
          if stream_len - s >= MIN_WINDOW]


def on_policy_windows(num_windows: int, fraction: float, seed: int) -> np.ndarray:
  """[num_windows] bool: which windows the target continues itself (a fixed draw per seed)."""
  return np.random.default_rng([seed, 1]).random(num_windows) < fraction


# --- the target pass -------------------------------------------------------------------------------------------

ROW_CHUNK = 512  # LM-head rows at a time for the top-k: [512, V] fp32 logits instead of [window, V]


def make_forward(target: Transformer, cfg: DistillStoreConfig
                 ) -> Callable[[nnx.State, jax.Array], dict[str, jax.Array]]:
  """A jitted teacher-forced pass over one window [1, W] -> (taps, kv, topk_ids, topk_logprobs) for its rows, taps
  and kv encoded as stored (cfg.feature_dtype; fp8 scales under NAME_scale)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  graphdef, _ = nnx.split(target)
  taps, kv_layers, k = tuple(cfg.taps), tuple(cfg.kv_layers), cfg.topk
  kv_ids = jnp.asarray(kv_layers, jnp.int32)

  @jax.jit
  def forward(params, tokens):
    model = nnx.merge(graphdef, params)
    out = model(tokens, mode="train", taps=taps, return_kv=bool(kv_layers), return_logits=False)
    h = out.hidden[0]  # [W, H] final normed hidden state
    chunks = h.reshape(-1, ROW_CHUNK, h.shape[-1])

    def top(hc):
      lp = jax.nn.log_softmax(model.logits_from_hidden(hc[None])[0].astype(jnp.float32), axis=-1)
      vals, ids = jax.lax.top_k(lp, k)
      return ids.astype(jnp.int32), vals

    ids, vals = jax.lax.map(top, chunks)
    result = {"topk_ids": ids.reshape(-1, k), "topk_logprobs": vals.reshape(-1, k)}
    features = {}
    if taps:
      features["taps"] = out.taps[0]
    if kv_layers:
      kk, vv = out.new_kv  # [L, 1, W, Hkv, D]
      features["kv"] = jnp.stack([kk[kv_ids, 0], vv[kv_ids, 0]], 1).transpose(2, 0, 1, 3, 4)  # [W, n, 2, Hkv, D]
    for name, x in features.items():
      enc = encode_on_device(x, cfg.feature_dtype)
      result[name] = enc["bits"]
      if "scale" in enc:
        result[f"{name}_scale"] = enc["scale"]
    return result

  return forward


def window_rows(forward: Callable[[nnx.State, jax.Array], dict[str, jax.Array]], params: nnx.State,
                ids: np.ndarray, window_tokens: int, vocab_size: int) -> dict[str, np.ndarray]:
  """One window's stored arrays. The window is padded to window_tokens (rounded up to ROW_CHUNK) so every window
  runs one compiled program; padding after the last token changes none of its rows (causal attention)."""
  import jax.numpy as jnp
  width = -(-window_tokens // ROW_CHUNK) * ROW_CHUNK
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :len(ids)] = ids
  out = {name: np.asarray(v)[:len(ids)] for name, v in forward(params, jnp.asarray(tokens)).items()}
  id_dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32  # SmolLM2's 49152 ids fit in 2 bytes
  rows = {"tokens": ids.astype(np.int32), "topk_ids": out["topk_ids"].astype(id_dtype),
          "topk_logprobs": out["topk_logprobs"].astype(np.float16)}
  rows.update({k: v for k, v in out.items() if k.startswith(("taps", "kv"))})  # encoded by the forward
  return rows


# --- the store -------------------------------------------------------------------------------------------------

def _settings(cfg: DistillStoreConfig, weights_id: str, stream_tokens: int) -> dict:
  """What fixes the store's contents: a rerun with other settings must not extend it."""
  s = dataclasses.asdict(cfg)
  for key in ("out_dir", "max_tokens", "max_minutes", "shard_tokens"):  # a rerun may store more, or move
    s.pop(key)
  s.update(taps=list(cfg.taps), kv_layers=list(cfg.kv_layers), weights_sha256=weights_id,
           stream_tokens=stream_tokens, version=STORE_VERSION)
  return s


def _write_shard(out: Path, name: str, windows: list[dict]) -> dict:
  """Concatenates the windows' rows into `out/name/*.npy` (written under a temporary name, then renamed)."""
  tmp = out / f".{name}.partial"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  for key in windows[0]["rows"]:
    np.save(tmp / f"{key}.npy", np.concatenate([w["rows"][key] for w in windows]))
  offsets = np.cumsum([0] + [len(w["rows"]["tokens"]) for w in windows])
  os.replace(tmp, out / name)
  return {"name": name, "tokens": int(offsets[-1]),
          "windows": [{"window": w["window"], "offset": int(o), "length": len(w["rows"]["tokens"]),
                       "generated_from": w["generated_from"]} for w, o in zip(windows, offsets[:-1])]}


def build_distill_store(cfg: DistillStoreConfig, show_progress: bool = True) -> Path:
  """Builds (or resumes) the store in cfg.out_dir; returns its directory."""
  from tqdm.auto import tqdm

  from longspec_jax.hf_io import weights_sha256
  from longspec_jax.inference.generate import generate
  from longspec_jax.targets import load_target, load_tokenizer, resolve_target_dir
  from longspec_jax.training.data import load_corpus

  target_dir = resolve_target_dir(cfg.target)
  target = load_target(target_dir)
  cfg.validate(target.cfg.num_hidden_layers)
  tok = load_tokenizer(target_dir)
  eos = target.cfg.eos_token_id if target.cfg.eos_token_id is not None else 0
  texts = list(load_corpus(cfg.corpus_dir)["train"]["text"])  # the train split only: evaluation text stays out
  texts = texts[:cfg.max_documents or len(texts)]
  stream = token_stream(texts, tok, eos, cfg.seed)
  windows = plan_windows(len(stream), cfg.window_tokens)
  on_policy = on_policy_windows(len(windows), cfg.on_policy_fraction, cfg.seed)
  out = Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  settings = _settings(cfg, weights_sha256(target_dir), len(stream))
  index = {"settings": settings, "shards": []}
  if (out / INDEX).exists():
    index = json.loads((out / INDEX).read_text())
    changed = sorted(k for k in set(settings) | set(index["settings"])
                     if settings.get(k) != index["settings"].get(k))
    if changed:
      raise ValueError(f"{out} holds a store made with other settings ({', '.join(changed)}); use another --out "
                       "or the same settings to resume it")
  for stale in out.glob(".shard_*.partial"):  # a shard a kill interrupted
    shutil.rmtree(stale)
  stored = sum(s["tokens"] for s in index["shards"])
  next_window = max((w["window"] for s in index["shards"] for w in s["windows"]), default=-1) + 1

  from flax import nnx
  _, params = nnx.split(target)
  forward = make_forward(target, cfg)
  pending, pending_tokens, t0, generated_tokens, stored_before = [], 0, time.perf_counter(), 0, stored
  bar = tqdm(total=min(cfg.max_tokens, sum(n for _, n in windows)), initial=stored, unit="tok",
             desc="distill store", disable=not show_progress, smoothing=0.1)
  for w in range(next_window, len(windows)):
    if stored + pending_tokens >= cfg.max_tokens:
      break
    if cfg.max_minutes and time.perf_counter() - t0 >= cfg.max_minutes * 60:
      print(f"distill store: --max-minutes {cfg.max_minutes} reached at {stored + pending_tokens} tokens")
      break
    start, length = windows[w]
    ids = stream[start:start + length]
    generated_from = -1
    if on_policy[w] and length > cfg.on_policy_new_tokens:
      prompt = ids[:length - cfg.on_policy_new_tokens].tolist()
      temperature = 0.0 if w % 2 == 0 else cfg.on_policy_temperature
      gen = generate(target, [prompt], max_new_tokens=cfg.on_policy_new_tokens, temperature=temperature,
                     seed=cfg.seed * 1_000_003 + w, eos_id=-1).tokens[0]
      ids, generated_from = np.asarray(prompt + gen, np.int32), len(prompt)
      generated_tokens += len(gen)
    pending.append({"window": w, "generated_from": generated_from,
                    "rows": window_rows(forward, params, ids, cfg.window_tokens,
                                        target.cfg.vocab_size)})
    pending_tokens += len(ids)
    bar.update(len(ids))
    if pending_tokens >= cfg.shard_tokens or w == len(windows) - 1:
      index["shards"].append(_write_shard(out, f"shard_{len(index['shards']):05d}", pending))
      stored += pending_tokens
      pending, pending_tokens = [], 0
      index.update(stored_tokens=stored, num_windows=len(windows),
                   bytes=sum(f.stat().st_size for f in out.glob("shard_*/*.npy")))
      # after the shard is in place: the index never names a missing one
      write_json_atomic(out / INDEX, index, indent=1)
  if pending:  # max_tokens or max_minutes reached inside a shard
    index["shards"].append(_write_shard(out, f"shard_{len(index['shards']):05d}", pending))
    stored += pending_tokens
    index.update(stored_tokens=stored, num_windows=len(windows),
                 bytes=sum(f.stat().st_size for f in out.glob("shard_*/*.npy")))
    write_json_atomic(out / INDEX, index, indent=1)
  bar.close()
  secs = time.perf_counter() - t0
  index.setdefault("runs", []).append({"seconds": round(secs, 1), "tokens": stored - stored_before,
                                        "tokens_per_s": round((stored - stored_before) / max(secs, 1e-9), 1),
                                        "tokens_after": stored,
                                        "generated_tokens": generated_tokens})
  write_json_atomic(out / INDEX, index, indent=1)
  return out


class DistillStore:
  """Read side: the windows of a finished (or partial) store, decoded to float32 on request."""

  def __init__(self, directory: str | Path):
    self.dir = Path(directory)
    if not (self.dir / INDEX).exists():
      raise FileNotFoundError(f"no distillation store at {self.dir} (build one with `longspec make-distill-store`)")
    self.index = json.loads((self.dir / INDEX).read_text())
    self.settings = self.index["settings"]
    self.windows = [(s["name"], w) for s in self.index["shards"] for w in s["windows"]]
    self._maps = {}  # (shard, key) -> memmap or None: opening one parses its header, per read otherwise

  def _array(self, shard: str, key: str):
    if (shard, key) not in self._maps:
      if len(self._maps) >= MAX_OPEN_ARRAYS:  # each open memmap holds a file descriptor
        self._maps.clear()
      path = self.dir / shard / f"{key}.npy"
      self._maps[shard, key] = np.load(path, mmap_mode="r") if path.exists() else None
    return self._maps[shard, key]

  def window_lengths(self) -> np.ndarray:
    return np.asarray([w["length"] for _, w in self.windows])

  def read_window(self, i: int) -> dict[str, np.ndarray]:
    """Window i's rows: tokens, topk_ids, topk_logprobs (float32), and taps / kv (float32) when stored."""
    return {**self.read_rows(i, 0, self.windows[i][1]["length"]),
            "generated_from": self.windows[i][1]["generated_from"]}

  def tokens(self, i: int) -> np.ndarray:
    """Window i's tokens alone (int32)."""
    shard, w = self.windows[i]
    return np.asarray(self._array(shard, "tokens")[w["offset"]:w["offset"] + w["length"]], np.int32)

  def read_rows(self, i: int, start: int, length: int, taps: Sequence[int] | None = None,
                features: tuple[str, ...] = ("taps", "kv"), decode: bool = True) -> dict[str, np.ndarray]:
    """Rows [start, start + length) of window i (cut at its end), decoding only what is asked for: the stored
    taps at positions `taps` of the store's tap list (None = all) and the `features` named. decode=False: each
    feature as stored, its bits under its name and (fp8) its scales under NAME_scale, for decode_on_device."""
    shard, w = self.windows[i]
    lo = w["offset"] + start
    sl = slice(lo, w["offset"] + min(start + length, w["length"]))
    out = {"tokens": np.asarray(self._array(shard, "tokens")[sl]),
           "topk_ids": np.asarray(self._array(shard, "topk_ids")[sl], np.int32),
           "topk_logprobs": np.asarray(self._array(shard, "topk_logprobs")[sl], np.float32)}
    for name in features:
      bits = self._array(shard, name)
      if bits is None:
        continue
      scale = self._array(shard, f"{name}_scale")
      bits, scale = bits[sl], None if scale is None else scale[sl]
      if name == "taps" and taps is not None:
        bits, scale = bits[:, list(taps)], None if scale is None else scale[:, list(taps)]
      if not decode:
        out[name] = np.asarray(bits)
        if scale is not None:
          out[f"{name}_scale"] = np.asarray(scale)
        continue
      out[name] = decode_features(np.asarray(bits), self.settings["feature_dtype"],
                                  None if scale is None else np.asarray(scale))
    return out

  def tap_positions(self, layers: Sequence[int]) -> list[int]:
    """Positions in the store's tap list of the residual-stream taps `layers`; an error names any not stored."""
    stored = list(self.settings["taps"])
    missing = [l for l in layers if l not in stored]
    if missing:
      raise ValueError(f"the distillation store at {self.dir} has taps {stored}, not {missing}; rebuild it with "
                       f"--taps including them")
    return [stored.index(l) for l in layers]

  def argmax_counts(self, windows: Iterable[int], vocab_size: int) -> np.ndarray:
    """[vocab_size] how often each token is the target's most likely next token over the given windows."""
    counts = np.zeros(vocab_size, np.int64)
    for i in windows:
      shard, w = self.windows[i]
      ids = self._array(shard, "topk_ids")[w["offset"]:w["offset"] + w["length"], 0]
      counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)
    return counts


def split_windows(store: DistillStore, seed: int, val_fraction: float, max_train_tokens: int = 0,
                  held_out_within_tokens: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(train, val) positions in store.windows. A window's side is a seeded draw on its window number alone, so it
  stays put as the store grows (a store extended between runs never moves a held-out window into training).
  max_train_tokens > 0 keeps the first train windows (in window order) that fit in that many tokens: a run on a
  store that has grown since trains on the same distinct tokens (a data-scaling arm). held_out_within_tokens > 0
  keeps the held-out windows that end within the store's first that many tokens: arms started as the store grows
  are scored on the same windows (the others stay unused, on neither side)."""
  held = np.asarray([np.random.default_rng([seed, 11, w["window"]]).random() < val_fraction
                     for _, w in store.windows], bool)
  if held.all() or (val_fraction > 0 and not held.any()):
    raise ValueError(f"val_fraction {val_fraction} leaves no {'training' if held.all() else 'held-out'} windows "
                     f"among the store's {len(held)}")
  lengths = store.window_lengths()
  train = np.flatnonzero(~held)
  if max_train_tokens > 0:
    fits = np.cumsum(lengths[train]) <= max_train_tokens
    if not fits[0]:
      raise ValueError(f"max_train_tokens {max_train_tokens} is smaller than the store's first train window "
                       f"({lengths[train[0]]} tokens)")
    train = train[fits]
  val = np.flatnonzero(held)
  if held_out_within_tokens > 0:
    val = val[np.cumsum(lengths)[val] <= held_out_within_tokens]
    if len(val) == 0:
      raise ValueError(f"no held-out window ends within the store's first {held_out_within_tokens} tokens "
                       f"(held_out_within_tokens)")
  return train, val


class StoreWindows:
  """Training windows of `width` tokens cut from the store's windows `windows` (a window longer than `width`
  starts at a seeded random offset): batch s is a pure function of (seed, s), so a resumed run replays it.
  A batch holds tokens [B, W], valid [B], taps [B, W, n, H] (the tap layers asked for), topk_ids /
  topk_logprobs [B, W, k] (the target's distribution of the next token at each position); short windows are
  padded with pad_id and zero features, and rows past `valid` carry no loss. decode=False: the taps as stored
  (and taps_scale), for decode_on_device in the jitted step."""

  def __init__(self, store: DistillStore, windows, width: int, tap_layers, pad_id: int, seed: int,
               decode: bool = True):
    if len(windows) == 0:
      raise ValueError(f"no windows to train on in the distillation store at {store.dir}")
    self.store, self.windows, self.width = store, np.asarray(windows), width
    self.lens = store.window_lengths()[self.windows]
    self.taps, self.pad_id, self.seed = store.tap_positions(tap_layers), pad_id, seed
    self.decode = decode

  def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> dict:
    from longspec_jax.training.drafter_common import draw_windows
    _, picks, offs, _ = draw_windows(self.lens, self.seed, step, batch_size, self.width, rows)
    parts = [self.store.read_rows(int(self.windows[p]), int(o), self.width, self.taps, ("taps",), self.decode)
             for p, o in zip(picks, offs)]
    return pad_rows(parts, self.width, self.pad_id)


def pad_rows(parts: list[dict], width: int, pad_id: int) -> dict:
  """read_rows results stacked into a batch of `width` rows each, with "valid" the real row counts."""
  out = {"valid": np.asarray([len(p["tokens"]) for p in parts], np.int32)}
  for key in parts[0]:
    fill = pad_id if key == "tokens" else 0
    arr = np.full((len(parts), width) + parts[0][key].shape[1:], fill, parts[0][key].dtype)
    for i, p in enumerate(parts):
      arr[i, :len(p[key])] = p[key]
    out[key] = arr
  return out
