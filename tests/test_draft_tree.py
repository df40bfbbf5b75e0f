"""Tree drafting: the tree's structure and builder, the tree-masked attention against dense attention, greedy tree
verification against a hand walk, EAGLE-3's tree drafts against its chain, and greedy tree decoding == AR."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.attention import dense_masked_attention, extend_attention
from longspec_jax.draft_tree import DraftTree, gather_path, load_tree, verify_tree_greedy
from longspec_jax.drafters.base import LoadedDrafter, ProposeContext
from longspec_jax.drafters.eagle3 import Eagle3Drafter
from longspec_jax.inference import engine
from longspec_jax.inference.generate import generate
from longspec_jax.sampling import SamplingParams
from tests.compiled import compiled
from tests.test_eagle3 import _eagle
from tests.test_speculative import _prompts, target  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
TREE = DraftTree.parse("0;1;2;0.0;0.1;1.0;0.0.0;0.0.1;0.1.0;0.0.0.0")


def test_tree_structure():
  assert TREE.num_nodes == 10 and TREE.depth == 4
  assert TREE.parents.tolist() == [0, 0, 0, 1, 1, 2, 4, 4, 5, 7]
  assert TREE.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
  mask = TREE.ancestor_mask()
  assert mask[10].nonzero()[0].tolist() == [0, 1, 4, 7, 10]  # 0.0.0.0: root, 0, 0.0, 0.0.0, itself
  assert mask[6].nonzero()[0].tolist() == [0, 2, 6]  # 1.0
  assert str(DraftTree.parse(str(TREE))) == str(TREE)
  assert DraftTree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


def test_best_first_takes_the_most_probable_paths():
  probs = [0.6, 0.2, 0.1]
  tree = DraftTree.best_first(probs, 6)
  # P: (0) .6, (0,0) .36, (0,0,0) .216, (1) .2, (0,0,0,0) .1296, (0,1)/(1,0) .12: the first five, then a .12 tie.
  top5 = {(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)}
  assert top5 < set(tree.paths) and len(set(tree.paths) - top5 & {(0, 1), (1, 0)}) == 1
  assert abs(tree.expected_accepted(probs) - (1 + .6 + .2 + .36 + .216 + .1296 + .12)) < 1e-9
  assert DraftTree.best_first(probs, 5, max_depth=2).depth == 2
  # No tree of that size does better under the model (exhaustive over 4-node trees from these paths).
  candidates = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
  import itertools
  best = max(DraftTree(c).expected_accepted(probs) for c in itertools.combinations(candidates, 4)
             if all(len(p) == 1 or p[:-1] in c for p in c))
  assert abs(DraftTree.best_first(probs, 4).expected_accepted(probs) - best) < 1e-12


@pytest.mark.parametrize("text,error", [("", "at least one path"), ("0;0.0.1", "no parent path"),
                                         ("0;0", "appears twice"), ("0;a", "dot-joined integer ranks"),
                                         ("0;-1", "ranks >= 0")])
def test_bad_trees(text, error):
  with pytest.raises(ValueError, match=error):
    DraftTree.parse(text)


def test_load_tree_from_paths_and_tree_files(tmp_path):
  assert load_tree("0;1;0.0") == DraftTree(((0,), (1,), (0, 0)))
  shipped = load_tree(f"{ROOT}/configs/trees/smollm2_eagle3.json#16")
  assert shipped.num_nodes == 16
  f = tmp_path / "t.json"
  f.write_text('{"trees": {"3": {"tree": "0;0.0;1"}}}')
  assert load_tree(f"{f}#3").paths == ((0,), (1,), (0, 0))
  with pytest.raises(ValueError, match="has no '4'-node tree; it has 3"):
    load_tree(f"{f}#4")
  with pytest.raises(FileNotFoundError, match="not found"):
    load_tree(f"{tmp_path}/none.json#3")
  (tmp_path / "bad.json").write_text("[1]")
  with pytest.raises(ValueError, match="is not a tree file"):
    load_tree(f"{tmp_path}/bad.json#3")


def test_bench_suite_tree_option():
  from longspec_jax.inference.benchmark.config import parse_method
  m = parse_method("eagle3:tree=0;1;0.0")
  assert m.tree == "0;1;0.0" and m.options == ()
  assert parse_method(f"eagle3:tree={ROOT}/configs/trees/smollm2_eagle3.json#8").tree.endswith("#8")
  with pytest.raises(ValueError, match="no parent path"):
    parse_method("eagle3:tree=0;1.1")


def test_tree_masked_extend_attention_equals_dense():
  rng = np.random.default_rng(0)
  b, s, hq, hkv, d = 2, 16, 4, 2, 8
  n = TREE.num_nodes + 1
  q = jnp.asarray(rng.normal(size=(b, n, hq, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, n, hkv, d)), jnp.float32) for _ in range(2))
  kc, vc = (jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32) for _ in range(2))
  start = jnp.asarray([5, 11])
  positions = start[:, None] + jnp.asarray(TREE.depths)[None]
  out = compiled(extend_attention, q, k, v, kc, vc, positions, new_visible=TREE.ancestor_mask())
  keys = np.concatenate([np.asarray(kc).transpose(0, 2, 1, 3), k], axis=1)
  vals = np.concatenate([np.asarray(vc).transpose(0, 2, 1, 3), v], axis=1)
  cache_vis = np.arange(s)[None, None, :] < np.asarray(start)[:, None, None]
  visible = np.concatenate([np.broadcast_to(cache_vis, (b, n, s)),
                            np.broadcast_to(TREE.ancestor_mask(), (b, n, n))], axis=2)
  np.testing.assert_allclose(out, compiled(dense_masked_attention, q, keys, vals, visible), atol=1e-5)


def test_verify_tree_greedy_walks_the_tree():
  rng = np.random.default_rng(1)
  n, vocab = TREE.num_nodes, 12
  parents, depths = TREE.parents, TREE.depths
  for trial in range(50):
    logits = jnp.asarray(rng.normal(size=(3, n + 1, vocab)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    tokens = np.zeros((3, n), np.int32)
    for bi in range(3):  # siblings distinct; sometimes the target's token among them
      for p in range(n + 1):
        kids = [c for c in range(n) if parents[c] == p]
        vals = rng.permutation([t for t in range(vocab) if t != argmax[bi, p]])[:len(kids)]
        if kids and rng.random() < 0.6:
          vals[rng.integers(len(kids))] = argmax[bi, p]
        tokens[bi, kids] = vals
    n_acc, committed, path = (np.asarray(x) for x in compiled(verify_tree_greedy, logits, jnp.asarray(tokens), TREE))
    for bi in range(3):  # the hand walk
      node, walk = 0, [0]
      while True:
        nxt = [c + 1 for c in range(n) if parents[c] == node and tokens[bi, c] == argmax[bi, node]]
        if not nxt:
          break
        node = nxt[0]
        walk.append(node)
      assert int(n_acc[bi]) == len(walk) - 1
      assert np.asarray(path[bi, :len(walk)]).tolist() == walk
      assert np.asarray(committed[bi, :len(walk)]).tolist() == argmax[bi, walk].tolist()
      assert all(depths[int(path[bi, j])] == j for j in range(TREE.depth + 1))
  x = jnp.arange(2 * 3 * (n + 1) * 2).reshape(2, 3, n + 1, 2)
  g = gather_path(x, path, 2)
  assert g.shape == (2, 3, TREE.depth + 1, 2)
  np.testing.assert_array_equal(g[1, 2, :, 0], x[1, 2, np.asarray(path[2]), 0])


def test_eagle3_tree_drafts_extend_its_chain(target):
  """The rank-0 path of the tree is the drafter's greedy chain; a rank-1 node is the chain's second choice."""
  eagle = _eagle(target)
  prompts = _prompts(2, [9, 30])
  config, params, inputs = engine.prepare(target, prompts, 8, drafter=eagle, num_draft=4)
  state = compiled(engine.prefill_and_start, config, params, inputs)
  ctx = ProposeContext(tokens=state.tokens, num_tokens=state.num_tokens, sampling=SamplingParams.make(0.0))
  chain, _, _ = compiled(eagle.spec.propose, eagle.params, state.drafter_state, ctx, jax.random.key(0), 4, False)
  nodes, _ = compiled(eagle.spec.propose_tree, eagle.params, state.drafter_state, ctx, TREE)
  idx = {p: i for i, p in enumerate(TREE.paths)}
  for depth in range(1, 5):
    np.testing.assert_array_equal(nodes[:, idx[(0,) * depth]], chain[:, depth - 1])
  for sibs in ([(0,), (1,), (2,)], [(0, 0), (0, 1)], [(0, 0, 0), (0, 0, 1)]):
    toks = np.asarray(nodes[:, [idx[p] for p in sibs]])
    assert all(len(set(r)) == len(sibs) for r in toks.tolist())  # siblings are distinct top-k candidates


@pytest.mark.parametrize("tree", [TREE, DraftTree.chain(3), DraftTree.best_first([0.5, 0.3, 0.1], 12)])
@pytest.mark.parametrize("batch,lengths", [(1, [5]), (3, [3, 40, 90])])
def test_greedy_tree_equals_ar(target, tree, batch, lengths):
  prompts = _prompts(batch, lengths)
  ar = generate(target, prompts, max_new_tokens=24, eos_id=-1)
  out = generate(target, prompts, max_new_tokens=24, eos_id=-1, drafter=_eagle(target), tree=tree)
  assert out.tokens == ar.tokens
  assert out.stats["num_draft_tokens"] == tree.depth


@dataclasses.dataclass(frozen=True)
class OracleOnABranch(Eagle3Drafter):
  """EAGLE-3's tree with the greedy continuation (params["oracle"], the AR token buffer) written onto the nodes
  of `truth_path`'s prefixes, as deep as `num_tokens % 5` this step: acceptance goes down a side branch, to a
  depth that changes from step to step."""
  truth_path: tuple = (1, 0, 0, 0)

  def propose_tree(self, params, state, ctx, tree):
    nodes, state = super().propose_tree(params, state, ctx, tree)
    idx = {p: i for i, p in enumerate(tree.paths)}
    reach = ctx.num_tokens % 5
    oracle = params["oracle"]
    for d in range(1, len(self.truth_path) + 1):
      pos = jnp.minimum(ctx.num_tokens + d - 1, oracle.shape[1] - 1)[:, None]
      truth = jnp.take_along_axis(oracle, pos, axis=1)[:, 0]
      col = idx[self.truth_path[:d]]
      nodes = nodes.at[:, col].set(jnp.where(d <= reach, truth, nodes[:, col]))
    return nodes, state


def test_deep_acceptance_on_a_side_branch_equals_ar(target):
  """Accepted paths that leave the rank-0 chain, at depths 0-4: the gathered rows (cache, drafter update) must keep
  the output equal to AR and the committed tokens per step must follow the oracle's depth."""
  prompts = _prompts(3, [7, 33, 61])
  new = 40
  ar = generate(target, prompts, max_new_tokens=new, eos_id=-1)
  buf = np.zeros((3, 256), np.int32)
  for b, (p, t) in enumerate(zip(prompts, ar.tokens)):
    buf[b, :len(p) + len(t)] = p + t
  eagle = _eagle(target)
  fields = {f.name: getattr(eagle.spec, f.name) for f in dataclasses.fields(eagle.spec)}
  oracle = LoadedDrafter(OracleOnABranch(**fields), {**eagle.params, "oracle": jnp.asarray(buf)})
  tree = DraftTree.parse("0;1;0.0;1.0;1.0.0;0.0.0;1.0.0.0")
  out = generate(target, prompts, max_new_tokens=new, eos_id=-1, drafter=oracle, tree=tree)
  assert out.tokens == ar.tokens
  assert out.stats["tau"] > 2.5, out.stats  # ~3 on average from the oracle's 0-4 deep paths
  assert out.stats["accept_hist"][4] > 0
  # The target cache holds the accepted path's rows: equal to one prefill over the committed tokens (a tiny random
  # target's argmax barely reads its context, so equal tokens alone would not show a wrong row).
  config, params, inputs = engine.prepare(target, prompts, new, eos_id=-1, drafter=oracle, tree=tree)
  state, _, _ = engine.run(config, params, inputs)
  lens = np.asarray(state.target_cache.lengths)
  pre = compiled(engine.prefill, config.graphdef, params.target, state.tokens, state.target_cache.lengths,
                 max_len=config.max_len)
  for layer in (0, target.cfg.num_hidden_layers - 1):
    for b, n in enumerate(lens):
      np.testing.assert_allclose(state.target_cache.k[layer][b, :, :n], pre.cache.k[layer][b, :, :n], atol=1e-4)
      np.testing.assert_allclose(state.target_cache.v[layer][b, :, :n], pre.cache.v[layer][b, :, :n], atol=1e-4)


def test_tree_errors(target):
  eagle = _eagle(target)
  with pytest.raises(ValueError, match="tree verification is greedy"):
    engine.prepare(target, [[1, 2, 3]], 4, temperature=1.0, drafter=eagle, tree=TREE)
  with pytest.raises(ValueError, match="differs from the tree's depth"):
    engine.prepare(target, [[1, 2, 3]], 4, drafter=eagle, num_draft=2, tree=TREE)
  with pytest.raises(ValueError, match="fixed shape"):
    engine.prepare(target, [[1, 2, 3]], 4, drafter=eagle, draft_length="auto", tree=TREE)
  with pytest.raises(ValueError, match="give a drafter too"):
    engine.prepare(target, [[1, 2, 3]], 4, tree=TREE)
