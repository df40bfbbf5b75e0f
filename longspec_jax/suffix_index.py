"""A global n-gram index for the suffix drafter: a fixed-size hashed table, built on the host with numpy from a
corpus (and updated from past outputs), read on device inside the engine's jitted loop (drafters/suffix.py).

Each slot holds one context: an n-gram of one of `orders` lengths, hashed to a slot and to a 32-bit check value
(0 = empty slot), with its most frequent next token, that token's count and the context's total count. A lookup is
a hash and a gather per order, so it stays in-graph (no host round trip per step) at a cost independent of the
index size; a draft chains lookups, the drafted tokens extending the context. The table never grows: its memory
is fixed at build (16 bytes per slot), which also bounds the updates from past outputs (a context that finds its
slot taken by a more frequent one is dropped).

File: MAGIC, an 8-byte little-endian header length, a JSON header (format, vocab size, the tokenizer's vocabulary
hash, orders, slots, the byte cap it was built under, each array's dtype/shape/offset and a SHA-256 of the data),
then the arrays. Written under a temporary name and renamed (a crash leaves the old file whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from tokenizers import Tokenizer

MAGIC = b"LSJSUFX1"
FORMAT_VERSION = 1
ARRAYS = ("check", "next", "count", "total")  # per slot: uint32, int32, int32, int32
BYTES_PER_SLOT = 16
DEFAULT_ORDERS = (1, 2, 3, 4, 6, 8, 12, 16)
DEFAULT_MAX_BYTES = 256 * 2 ** 20  # the load-time cap when the caller gives none
# FNV-1a style mixing on 32-bit words; two seeds give independent slot and check hashes.
PRIME = np.uint32(16777619)
SLOT_SEED, CHECK_SEED, ORDER_STEP = 2166136261, 2654435761, 0x9E3779B9


class SuffixIndexError(ValueError):
  """An index file that cannot be used (truncated, corrupt, another tokenizer's, over its cap)."""


@dataclasses.dataclass(frozen=True)
class SuffixIndex:
  """The table (numpy, host) and what it was built for. `arrays()` gives the pytree the drafter reads on device."""
  orders: tuple[int, ...]
  vocab_size: int
  tokenizer_sha256: str
  check: np.ndarray  # [slots] uint32, 0 = empty
  next: np.ndarray  # [slots] int32 most frequent next token
  count: np.ndarray  # [slots] int32 its count
  total: np.ndarray  # [slots] int32 the context's count

  @property
  def slots(self) -> int:
    return int(self.check.shape[0])

  @property
  def nbytes(self) -> int:
    return self.slots * BYTES_PER_SLOT

  @property
  def used(self) -> int:
    return int(np.count_nonzero(self.check))

  def arrays(self) -> dict[str, np.ndarray]:
    return {name: getattr(self, name) for name in ARRAYS}


def tokenizer_sha256(tok: Tokenizer) -> str:
  """The tokenizer's identity: a hash of its vocabulary (token -> id), not of its file's formatting."""
  vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
  return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _mix(h: np.ndarray) -> np.ndarray:
  h = h ^ (h >> np.uint32(16))
  h = h * np.uint32(0x7FEB352D)
  h = h ^ (h >> np.uint32(15))
  h = h * np.uint32(0x846CA68B)
  return h ^ (h >> np.uint32(16))


def context_hashes(windows: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
  """(slot hash, check) uint32 of contexts `windows` [..., order] (oldest token first). The drafter computes the
  same function in jnp (drafters/suffix.py); check is never 0 (0 marks an empty slot)."""
  w = windows.astype(np.uint32)
  h1 = np.full(w.shape[:-1], (SLOT_SEED + order * ORDER_STEP) % 2 ** 32, np.uint32)
  h2 = np.full(w.shape[:-1], (CHECK_SEED + order * ORDER_STEP) % 2 ** 32, np.uint32)
  for i in range(order):
    h1 = (h1 ^ w[..., i]) * PRIME
    h2 = (h2 ^ w[..., i]) * PRIME
  return _mix(h1), _mix(h2) | np.uint32(1)


def _contexts(docs: Sequence[np.ndarray], order: int) -> tuple[np.ndarray, np.ndarray]:
  """(64-bit context keys, next tokens) of every position of every document that has `order` tokens before it."""
  keys, nexts = [], []
  for d in docs:
    if len(d) <= order:
      continue
    win = np.lib.stride_tricks.sliding_window_view(d[:-1], order)
    slot, check = context_hashes(win, order)
    keys.append((slot.astype(np.uint64) << np.uint64(32)) | check.astype(np.uint64))
    nexts.append(d[order:].astype(np.int32))
  if not keys:
    return np.zeros(0, np.uint64), np.zeros(0, np.int32)
  return np.concatenate(keys), np.concatenate(nexts)


def _top_continuations(keys: np.ndarray, nexts: np.ndarray) -> tuple[np.ndarray, ...]:
  """Per distinct context key: (key, most frequent next token, its count, total count)."""
  if keys.size == 0:
    return keys, nexts, np.zeros(0, np.int64), np.zeros(0, np.int64)
  o = np.lexsort((nexts, keys))
  k, n = keys[o], nexts[o]
  pair_start = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (n[1:] != n[:-1])])
  pk, pn = k[pair_start], n[pair_start]
  pc = np.diff(np.r_[pair_start, k.size])
  o = np.lexsort((-pc, pk))  # within a context, the most frequent pair first
  pk, pn, pc = pk[o], pn[o], pc[o]
  ctx_start = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
  return pk[ctx_start], pn[ctx_start], pc[ctx_start], np.add.reduceat(pc, ctx_start)


def build_index(docs: Iterable[Sequence[int]], vocab_size: int, tokenizer_hash: str, slots: int,
                orders: Sequence[int] = DEFAULT_ORDERS, min_count: int = 2,
                progress: Callable[[str], None] | None = None) -> SuffixIndex:
  """The index of token documents `docs`: contexts seen at least `min_count` times, the most frequent ones kept
  where two share a slot (`slots`, a power of two)."""
  orders = tuple(sorted(set(int(o) for o in orders)))
  if slots < 1 or slots & (slots - 1):
    raise ValueError(f"slots must be a power of two >= 1, got {slots}")
  if not orders or orders[0] < 1:
    raise ValueError(f"orders must be context lengths >= 1, got {orders}")
  docs = [np.asarray(d, np.int64) for d in docs]
  for d in docs:
    if d.size and (d.min() < 0 or d.max() >= vocab_size):
      raise ValueError(f"a document has token ids outside the vocabulary [0, {vocab_size})")
  cand = []
  for o in orders:
    key, nxt, cnt, tot = _top_continuations(*_contexts(docs, o))
    keep = tot >= min_count
    cand.append((key[keep], nxt[keep], cnt[keep], tot[keep], np.full(int(keep.sum()), o)))
    if progress:
      progress(f"order {o}: {int(keep.sum()):,} contexts seen >= {min_count} times")
  key, nxt, cnt, tot, order = (np.concatenate(c) for c in zip(*cand))
  slot = (key >> np.uint64(32)).astype(np.uint32) & np.uint32(slots - 1)
  # Where contexts share a slot, the most frequent wins (ties: the longer context).
  o = np.lexsort((-order, -tot, slot))
  slot, key, nxt, cnt, tot = slot[o], key[o], nxt[o], cnt[o], tot[o]
  first = np.r_[True, slot[1:] != slot[:-1]] if slot.size else np.zeros(0, bool)  # no docs: an empty index
  table = _empty(slots)
  s = slot[first]
  table["check"][s] = (key[first] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
  table["next"][s] = nxt[first]
  table["count"][s] = np.minimum(cnt[first], 2 ** 31 - 1)
  table["total"][s] = np.minimum(tot[first], 2 ** 31 - 1)
  if progress:
    progress(f"{int(first.sum()):,} of {len(first):,} contexts placed in {slots:,} slots "
             f"({slots * BYTES_PER_SLOT / 2 ** 20:.0f} MiB)")
  return SuffixIndex(orders, vocab_size, tokenizer_hash, **table)


def _empty(slots: int) -> dict[str, np.ndarray]:
  return {"check": np.zeros(slots, np.uint32), "next": np.zeros(slots, np.int32),
          "count": np.zeros(slots, np.int32), "total": np.zeros(slots, np.int32)}


def update_index(index: SuffixIndex, sequences: Iterable[Sequence[int]]) -> SuffixIndex:
  """A new index with the contexts of `sequences` (e.g. prompt tail + generated tokens) counted in. The table's
  size does not change: a context whose slot holds another is dropped unless that one was seen only once. Each
  slot's next token follows a majority vote (a different token decrements the count and replaces the token when it
  reaches 0), which keeps the most frequent continuation exactly when one holds over half the context's uses."""
  table = {name: a.copy() for name, a in index.arrays().items()}
  mask = np.uint32(index.slots - 1)
  for seq in sequences:
    d = np.asarray(seq, np.int64)
    if d.size and (d.min() < 0 or d.max() >= index.vocab_size):
      raise ValueError(f"a sequence has token ids outside the index's vocabulary [0, {index.vocab_size})")
    for o in index.orders:
      if len(d) <= o:
        continue
      slots, checks = context_hashes(np.lib.stride_tricks.sliding_window_view(d[:-1], o), o)
      for s, c, t in zip((slots & mask).tolist(), checks.tolist(), d[o:].tolist()):
        if table["check"][s] != c:
          if table["total"][s] > 1:
            continue
          table["check"][s], table["next"][s], table["count"][s], table["total"][s] = c, t, 0, 0
        table["total"][s] += 1
        if table["next"][s] == t:
          table["count"][s] += 1
        elif table["count"][s] > 1:
          table["count"][s] -= 1
        else:
          table["next"][s], table["count"][s] = t, 1
  return dataclasses.replace(index, **table)


def _header(index: SuffixIndex, cap_bytes: int) -> dict[str, Any]:
  arrays, offset = [], 0
  digest = hashlib.sha256()
  for name, a in index.arrays().items():
    arrays.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                   "nbytes": int(a.nbytes)})
    offset += a.nbytes
    digest.update(np.ascontiguousarray(a).data)
  return {"format": "longspec-suffix-index", "version": FORMAT_VERSION, "vocab_size": index.vocab_size,
          "tokenizer_sha256": index.tokenizer_sha256, "orders": list(index.orders), "slots": index.slots,
          "cap_bytes": cap_bytes, "used_slots": index.used, "arrays": arrays, "data_bytes": offset,
          "data_sha256": digest.hexdigest()}


def save_index(index: SuffixIndex, path: str | os.PathLike, cap_bytes: int = DEFAULT_MAX_BYTES) -> Path:
  """Writes the index whole or not at all (temporary file, fsync, rename); refuses a table over `cap_bytes`."""
  if index.nbytes > cap_bytes:
    raise SuffixIndexError(f"suffix index of {index.slots:,} slots holds {index.nbytes:,} bytes, over the cap of "
                           f"{cap_bytes:,} bytes")
  path = Path(path)
  header = json.dumps(_header(index, cap_bytes)).encode()
  tmp = path.with_name(path.name + ".tmp")
  try:
    with open(tmp, "wb") as f:
      f.write(MAGIC + len(header).to_bytes(8, "little") + header)
      for a in index.arrays().values():
        f.write(np.ascontiguousarray(a).tobytes())
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
  return path


def read_header(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON header of an index file (SuffixIndexError when it is not one)."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no suffix index at {path} (build one with `longspec build-suffix-index`)")
  with open(path, "rb") as f:
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
      raise SuffixIndexError(f"{path} is not a suffix index file (or is truncated before its header)")
    size = int.from_bytes(head[len(MAGIC):], "little")
    raw = f.read(size) if size < 2 ** 24 else b""
  try:
    header = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError):
    raise SuffixIndexError(f"suffix index {path} has a corrupt or truncated header") from None
  if header.get("format") != "longspec-suffix-index" or header.get("version") != FORMAT_VERSION:
    raise SuffixIndexError(f"{path}: unsupported suffix index format {header.get('format')} "
                           f"v{header.get('version')} (this library reads v{FORMAT_VERSION})")
  header["data_start"] = len(MAGIC) + 8 + size
  return header


def load_index(path: str | os.PathLike, vocab_size: int | None = None, tokenizer: Tokenizer | str | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES) -> SuffixIndex:
  """Reads an index, checking it whole (size, data hash), made for this vocabulary size and tokenizer (a
  `tokenizers.Tokenizer` or its tokenizer_sha256; None: not checked) and within `max_bytes` and its own cap."""
  path = Path(path)
  h = read_header(path)
  if vocab_size is not None and h["vocab_size"] != vocab_size:
    raise SuffixIndexError(f"suffix index {path} was built for a vocabulary of {h['vocab_size']} tokens, not this "
                           f"target's {vocab_size}: rebuild it with this target's tokenizer")
  if tokenizer is not None:
    want = tokenizer if isinstance(tokenizer, str) else tokenizer_sha256(tokenizer)
    if h["tokenizer_sha256"] != want:
      raise SuffixIndexError(f"suffix index {path} was built with another tokenizer (vocabulary hash "
                             f"{h['tokenizer_sha256'][:12]}, this target's {want[:12]}): rebuild it")
  cap = min(max_bytes, h["cap_bytes"])
  if h["data_bytes"] > cap:
    raise SuffixIndexError(f"suffix index {path} holds {h['data_bytes']:,} bytes, over the cap of {cap:,} bytes "
                           f"(its own {h['cap_bytes']:,}, the reader's {max_bytes:,})")
  expected = h["data_start"] + h["data_bytes"]
  actual = path.stat().st_size
  if actual != expected:
    raise SuffixIndexError(f"suffix index {path} is {'truncated' if actual < expected else 'overlong'}: "
                           f"{actual:,} bytes, its header says {expected:,}")
  with open(path, "rb") as f:
    f.seek(h["data_start"])
    data = f.read(h["data_bytes"])
  if hashlib.sha256(data).hexdigest() != h["data_sha256"]:
    raise SuffixIndexError(f"suffix index {path} is corrupt: its data does not match the hash in its header")
  arrays = {a["name"]: np.frombuffer(data, np.dtype(a["dtype"]), int(np.prod(a["shape"])), a["offset"]).copy()
            for a in h["arrays"]}
  if sorted(arrays) != sorted(ARRAYS) or any(a.shape != (h["slots"],) for a in arrays.values()):
    raise SuffixIndexError(f"suffix index {path} has unexpected arrays {sorted(arrays)}")
  return SuffixIndex(tuple(h["orders"]), h["vocab_size"], h["tokenizer_sha256"], **arrays)
