"""The shipped default target loads, matches its tokenizer, generates, and beats the unigram baseline."""


from longspec_jax.inference.cli import main
from longspec_jax.inference.eval_target import evaluate_position_buckets, load_unigram
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
