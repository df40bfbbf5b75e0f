"""The shipped default target loads, matches its tokenizer, generates, and beats the unigram baseline."""


import pytest

from longspec_jax.inference.cli import main
from longspec_jax.training.eval_target import evaluate_position_buckets, load_unigram
from longspec_jax import default_target_dir, long_doc_paths
from longspec_jax.hf_io import load_model_dir
from longspec_jax.tokenizer import load_tokenizer


def test_shipped_target_is_sane(capsys):
  d = default_target_dir()
  model = load_model_dir(d)
  tok = load_tokenizer(d)
  assert model.cfg.vocab_size == tok.get_vocab_size() == 8192
  assert sum(p.stat().st_size for p in d.iterdir()) < 40 * 2**20
  doc = long_doc_paths()[0].read_text()
  ids = [model.cfg.bos_token_id] + tok.encode(doc).ids
  unigram = load_unigram(d, model.cfg.vocab_size)
  res = evaluate_position_buckets(model, [ids], unigram, max_len=2048)
  assert res["0-1K"] < res["unigram"] - 0.5 and res["1-2K"] < res["unigram"] - 0.5


def test_readme_generate_command(capsys):
  assert main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "16"]) == 0
  out = capsys.readouterr().out
  assert out.strip()


def _lookup_equals_ar(model, doc: int) -> None:
  """Greedy prompt lookup (K = 6: a 7-row verify pass against the 1-row decode steps of AR, where a narrow dtype's
  rounding could part them) equals greedy AR of `model`, token for token, on two prompts of real text."""
  from longspec_jax.inference.generate import generate
  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.drafters.prompt_lookup import PromptLookupDrafter

  ids = load_tokenizer(default_target_dir()).encode(long_doc_paths()[doc].read_text()).ids
  prompts = [[model.cfg.bos_token_id] + ids[:300], [model.cfg.bos_token_id] + ids[1000:1120]]
  ar = generate(model, prompts, max_new_tokens=40, eos_id=-1)
  drafter = LoadedDrafter(PromptLookupDrafter(model.cfg.vocab_size))
  assert generate(model, prompts, max_new_tokens=40, eos_id=-1, drafter=drafter, num_draft=6).tokens == ar.tokens


def test_int8_target_spec_equals_ar():
  """dtype="int8-weights": the decoder projections in int8, and greedy speculative output equals greedy AR under
  that dtype, token for token, on real text."""
  import jax.numpy as jnp
  from longspec_jax.targets import load_target

  model = load_target(None, dtype="int8-weights")
  assert model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.int8
  _lookup_equals_ar(model, doc=2)


def test_bf16_target_spec_equals_ar():
  """dtype="bfloat16": weights, activations and KV cache in bf16, and greedy speculative output equals greedy AR
  under that dtype, token for token, on real text."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from longspec_jax.targets import load_target

  model = load_target(None, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  assert model.init_cache(1, 8).k[0].dtype == jnp.bfloat16
  _lookup_equals_ar(model, doc=1)
  with pytest.raises(ValueError, match="target dtype"):
    load_target(None, dtype="float16")
