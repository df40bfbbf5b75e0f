import gc
import os

# Tests run on the host CPU; keep XLA from grabbing every core thread-pool wise for many tiny programs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI turns JAX's persistent compilation cache on by default; in-process CLI tests must not fill the user's
# cache (tests/test_cli.py checks the cache itself in subprocesses with their own directory).
os.environ.setdefault("LONGSPEC_COMPILE_CACHE", "off")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drop JAX's compiled programs after each test module. XLA:CPU maps every executable's code into its own memory
  regions, and the caches keep them all alive: a long-lived xdist worker reached 64,297 mappings against the
  kernel's vm.max_map_count of 65,530, and past it a compile segfaults (CI crashed that way twice)."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session")
def tiny_cfg():
  from longspec_jax.config import ModelConfig, RopeConfig
  return ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                     rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                     pad_token_id=1, mask_token_id=2)


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
  from longspec_jax.model import create_model
  return create_model(tiny_cfg, seed=0)
