"""`longspec bench --peer transformers`: the peers' decode is timed inside each call (per-commit timestamps), and a
figure that cannot be right is an error instead of a number."""

import pytest

from longspec_jax.inference.benchmark.peers import decode_timing


def test_decode_timing_from_commit_times():
  # prompt of 100 tokens handed in at t=0, first token at 1 s (prefill), then 4 commits of 1, 3, 1, 2 tokens.
  t = decode_timing([0.0, 1.0, 1.1, 1.2, 1.3, 1.5], [100, 1, 1, 3, 1, 2], "peer")
  assert t["decode_tokens"] == 7 and t["tokens_per_s"] == pytest.approx(7 / 0.5)
  assert t["prefill_ms"] == pytest.approx(1000) and t["decode_ms"] == pytest.approx(500)


@pytest.mark.parametrize("times, counts, msg", [
    ([0.0, 1.0, 1.0], [100, 1, 1], "impossible timing: prefill"),  # zero decode time
    ([0.0, 0.0, 0.1], [100, 1, 1], "impossible timing: prefill"),  # zero prefill time
    ([0.0, 1.0, 1.001], [100, 1, 1], "faster than its own prefill"),  # 1000 tok/s decode vs 100 tok/s prefill
    ([0.0, 1.0], [100, 1], "at least 2"),  # one token: nothing was decoded
])
def test_impossible_figures_are_errors(times, counts, msg):
  with pytest.raises(ValueError, match=msg):
    decode_timing(times, counts, "transformers-ar")


def test_transformers_peers_on_a_tiny_model(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from longspec_jax.config import ModelConfig, RopeConfig
  from longspec_jax.hf_io import save_model_dir
  from longspec_jax.inference.benchmark.peers import transformers_peers
  from longspec_jax.model import create_model
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  text = "".join(f"def function_{i}(x, y):\n    return x * {i} + y\n\n" for i in range(200))
  tok = train_bpe([text], vocab_size=300)
  cfg = ModelConfig(family="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                    rope=RopeConfig(), bos_token_id=0, eos_token_id=None, pad_token_id=1, mask_token_id=2)
  model = create_model(cfg, seed=0)
  save_model_dir(model, tmp_path / "target")
  save_hf_tokenizer(tok, tmp_path / "target")
  prompt = [0] + tok.encode(text).ids[:255]
  peers = transformers_peers(model, tmp_path / "target", None, [prompt], new_tokens=12, num_draft=3, repeats=2)
  assert set(peers) == {"transformers-ar", "transformers-prompt-lookup"}
  assert peers["transformers-ar"]["decode_tokens"] == 11  # the first token came with the prefill
  for p in peers.values():
    assert 0 < p["decode_tokens"] <= 11 and p["decode_ms"] > 0 and p["prefill_ms"] > 0
    assert p["tokens_per_s"] > 0  # each call was checked against its own prefill rate
