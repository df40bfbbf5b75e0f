"""The suite's tiny target config, importable outside pytest (a subprocess that must not load conftest's XLA flags)."""

from longspec_jax.config import ModelConfig, RopeConfig


def tiny_model_config() -> ModelConfig:
  return ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                     rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                     pad_token_id=1, mask_token_id=2)
