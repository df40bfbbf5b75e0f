"""Static draft trees: the drafter proposes several candidates per position and the target verifies them all in one
pass, each row attending to the cache and to its own ancestors (a tree mask), as in EAGLE / Medusa / SpecInfer.

A tree is a set of paths of ranks: path (0, 2) is the drafter's third-best token after its best first token. Node 0
is the root (the pending token, already committed); nodes 1..N are the paths, ordered by depth so that a parent
always precedes its children. Greedy verification walks from the root: a node is accepted when its token equals the
target's argmax at its parent and its parent was accepted. Siblings are distinct tokens (the drafter's top-k), so
the accepted nodes form one path, and the committed tokens are the target's argmax along it: exactly greedy
autoregression. The engine then treats that path as a verified chain of depth D (see `inference/engine.py`).

`best_first` builds the tree of N nodes with the highest expected accepted length under per-rank acceptance
probabilities (each node's chance of being accepted is the product of its ranks' probabilities): a node's expected
contribution can only fall along a path, so taking the N best paths greedily is optimal for that model.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

MAX_TREE_NODES = 256


@dataclasses.dataclass(frozen=True)
class DraftTree:
  """A static tree of draft paths (hashable: part of the engine's static config)."""
  paths: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    paths = tuple(tuple(int(r) for r in p) for p in self.paths)
    if not paths:
      raise ValueError("a draft tree needs at least one path")
    if len(paths) > MAX_TREE_NODES:
      raise ValueError(f"a draft tree has at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    seen = set()
    for p in paths:
      if not p or min(p) < 0:
        raise ValueError(f"tree path {p} must be a non-empty sequence of ranks >= 0")
      if p in seen:
        raise ValueError(f"tree path {p} appears twice")
      seen.add(p)
    for p in paths:
      if len(p) > 1 and p[:-1] not in seen:
        raise ValueError(f"tree path {p} has no parent path {p[:-1]}: every prefix of a path must be in the tree")
    object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))

  @classmethod
  def chain(cls, depth: int) -> "DraftTree":
    """The drafter's top-1 chain of `depth` drafts (a tree with one path)."""
    return cls(tuple((0,) * d for d in range(1, depth + 1)))

  @classmethod
  def parse(cls, text: str) -> "DraftTree":
    """Paths written as dot-joined ranks separated by ';' or ',': "0;1;0.0;0.1;0.0.0"."""
    items = [s.strip() for s in text.replace(",", ";").split(";") if s.strip()]
    try:
      return cls(tuple(tuple(int(r) for r in s.split(".")) for s in items))
    except ValueError as e:
      if "invalid literal" in str(e):
        raise ValueError(f"tree {text!r}: paths are dot-joined integer ranks separated by ';' (e.g. "
                         f"'0;1;0.0;0.1')") from None
      raise

  def __str__(self) -> str:
    return ";".join(".".join(map(str, p)) for p in self.paths)

  @classmethod
  def best_first(cls, rank_probs: Sequence[float], num_nodes: int, max_depth: int | None = None) -> "DraftTree":
    """The `num_nodes` paths of highest probability when rank r is accepted with probability rank_probs[r]
    (independently at each depth), at most `max_depth` deep."""
    probs = [float(p) for p in rank_probs]
    if not probs or any(not 0.0 < p <= 1.0 for p in probs):
      raise ValueError(f"rank_probs must be probabilities in (0, 1], got {rank_probs!r}")
    if not 1 <= num_nodes <= MAX_TREE_NODES:
      raise ValueError(f"num_nodes must be in [1, {MAX_TREE_NODES}], got {num_nodes}")
    frontier = [(-p, (r,)) for r, p in enumerate(probs)]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < num_nodes:
      neg_p, path = heapq.heappop(frontier)
      chosen.append(path)
      if max_depth is None or len(path) < max_depth:
        for r, p in enumerate(probs):
          heapq.heappush(frontier, (neg_p * p, path + (r,)))
    return cls(tuple(chosen))

  # --- derived structure (node 0 = root) ---------------------------------------------------------------------------

  @property
  def num_nodes(self) -> int:
    return len(self.paths)

  @property
  def depth(self) -> int:
    return max(len(p) for p in self.paths)

  @functools.cached_property
  def _index(self) -> dict:
    return {p: i + 1 for i, p in enumerate(self.paths)}

  @property
  def parents(self) -> np.ndarray:
    """[N] the parent node of nodes 1..N."""
    return np.asarray([self._index.get(p[:-1], 0) for p in self.paths], np.int32)

  @property
  def depths(self) -> np.ndarray:
    """[N + 1] depth of every node, the root's 0."""
    return np.asarray([0] + [len(p) for p in self.paths], np.int32)

  @property
  def ranks(self) -> np.ndarray:
    """[N] each node's rank among its parent's candidates."""
    return np.asarray([p[-1] for p in self.paths], np.int32)

  def ancestor_mask(self) -> np.ndarray:
    """[N + 1, N + 1] bool: row i sees column j iff j is i or an ancestor of i (the verification pass's mask)."""
    n = self.num_nodes + 1
    mask = np.eye(n, dtype=bool)
    parents = np.concatenate([[0], self.parents])
    for i in range(1, n):  # parents precede children, so the parent's row is final
      mask[i] |= mask[parents[i]]
    return mask

  def expected_accepted(self, rank_probs: Sequence[float]) -> float:
    """1 + the sum over nodes of P(node accepted) under `rank_probs` (tau of a greedy step under that model)."""
    probs = list(rank_probs)
    return 1.0 + sum(float(np.prod([probs[r] if r < len(probs) else 0.0 for r in p])) for p in self.paths)


def load_tree(text: str) -> DraftTree:
  """A tree from its paths ("0;1;0.0") or from a tree file written by scripts/tree_rank_probs.py, "FILE.json#N" (its
  N-node tree; configs/trees/)."""
  if not isinstance(text, str):
    raise ValueError(f"a tree is its paths ('0;1;0.0') or FILE.json#N, got {text!r}")
  path, sep, size = text.partition("#")
  if not sep:
    return DraftTree.parse(text)
  try:
    trees = json.loads(Path(path).read_text())["trees"]
  except FileNotFoundError:
    raise FileNotFoundError(f"tree file {path} not found") from None
  except (json.JSONDecodeError, KeyError, TypeError):
    raise ValueError(f"tree file {path} is not a tree file (JSON with 'trees': {{N: {{'tree': PATHS}}}})") from None
  if size not in trees:
    raise ValueError(f"tree file {path} has no {size!r}-node tree; it has {', '.join(trees)}")
  return DraftTree.parse(trees[size]["tree"])


def verify_tree_greedy(target_logits: jax.Array, node_tokens: jax.Array,
                       tree: DraftTree) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy verification of a tree. target_logits [B, N+1, V] at [root, nodes]; node_tokens [B, N]. Returns
  (num_accepted [B], committed [B, D+1], path [B, D+1]): path[:, d] is the accepted node at depth d (the root at 0;
  past num_accepted, a node of that depth, junk) and committed the target's argmax along it."""
  target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N+1]
  parents = jnp.asarray(tree.parents)
  match = node_tokens == target_tokens[:, parents]  # [B, N]
  accepted = match
  for _ in range(tree.depth - 1):  # a node needs its whole ancestry accepted; D-1 rounds reach the deepest
    parent_ok = jnp.concatenate([jnp.ones_like(match[:, :1]), accepted], axis=1)[:, parents]
    accepted = match & parent_ok
  depths = jnp.asarray(tree.depths[1:])
  num_accepted = jnp.max(jnp.where(accepted, depths, 0), axis=1)
  per_depth = depths[None, :] == jnp.arange(1, tree.depth + 1)[:, None]  # [D, N]
  # Siblings are distinct tokens, so at most one node per depth is accepted (were two equal, their ancestries would
  # be equal token for token and so would their rows); a depth with none accepted points anywhere in it.
  score = per_depth[None].astype(jnp.int32) * (1 + accepted[:, None, :].astype(jnp.int32))  # [B, D, N]
  path = jnp.concatenate([jnp.zeros_like(num_accepted)[:, None], 1 + jnp.argmax(score, axis=2).astype(jnp.int32)],
                         axis=1)
  return num_accepted, jnp.take_along_axis(target_tokens, path, axis=1), path


def gather_path(x: jax.Array | None, path: jax.Array, axis: int) -> jax.Array | None:
  """x's rows along `path` [B, D+1] on `axis` (batch on the axis before it): a tree pass's rows as a chain's."""
  if x is None:
    return None
  idx = path.reshape(path.shape + (1,) * (x.ndim - axis - 1))
  idx = idx.reshape((1,) * (axis - 1) + idx.shape)
  return jnp.take_along_axis(x, idx, axis=axis)

