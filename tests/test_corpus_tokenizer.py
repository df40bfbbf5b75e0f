"""Corpus (split by document, via datasets) and the BPE tokenizer (HF tokenizer.json, AutoTokenizer-loadable)."""

import numpy as np

from longspec_jax.tokenizer import MASK_TOKEN, load_tokenizer, save_hf_tokenizer, special_token_ids, train_bpe
from longspec_jax.training.data import CorpusConfig, TokenStream, build_corpus, load_corpus


def _fake_stdlib(root):
  for i in range(40):
    sub = root / ("pkg" if i % 2 else "") / f"mod_{i}.py"
    sub.parent.mkdir(parents=True, exist_ok=True)
    sub.write_text(f'"""Module {i}."""\n' + "\n".join(f"def f_{i}_{j}(x):\n    return x * {j}\n"
                                                        for j in range(20 + 30 * (i % 5))))
  (root / "site-packages").mkdir()
  (root / "site-packages" / "skip.py").write_text("x = 1\n" * 100)
  (root / "bad.py").write_bytes(b"\xff\xfe not utf8" * 50)


def test_corpus_splits_by_document(tmp_path):
  _fake_stdlib(tmp_path / "lib")
  cfg = CorpusConfig(min_chars=50, long_min_chars=3000, num_long_docs=3, validation_fraction=0.2,
                     test_fraction=0.2)
  build_corpus(tmp_path / "corpus", cfg, root=tmp_path / "lib")
  dd = load_corpus(tmp_path / "corpus")
  paths = {s: set(dd[s]["path"]) for s in dd}
  all_paths = set().union(*paths.values())
  assert sum(len(p) for p in paths.values()) == len(all_paths) == 40  # each document in exactly one split
  assert not any("site-packages" in p or p == "bad.py" for p in all_paths)
  assert len(paths["long_test"]) == 3 and all(len(t) >= 3000 for t in dd["long_test"]["text"])
  assert paths["train"] and paths["validation"] and paths["test"]
  # Reproducible: the same inputs give the same splits.
  build_corpus(tmp_path / "corpus2", cfg, root=tmp_path / "lib")
  assert set(load_corpus(tmp_path / "corpus2")["train"]["path"]) == paths["train"]


def test_tokenizer_roundtrip_and_transformers(tmp_path):
  from transformers import AutoTokenizer
  texts = ["def add(a, b):\n    return a + b\n" * 20, "import os\nprint(os.getcwd())\n" * 20]
  tok = train_bpe(texts, vocab_size=300)
  save_hf_tokenizer(tok, tmp_path)
  ours = load_tokenizer(tmp_path)
  hf = AutoTokenizer.from_pretrained(tmp_path)
  s = "def add(x, y):\n    return x - y  # ünïcode\n"
  assert ours.encode(s).ids == hf(s)["input_ids"]
  assert hf.decode(hf(s)["input_ids"]) == s
  ids = special_token_ids(ours)
  assert ids["eos"] == hf.eos_token_id and ids["mask"] == hf.convert_tokens_to_ids(MASK_TOKEN)


def test_token_stream_batches_depend_only_on_step():
  s = TokenStream(np.arange(1000, dtype=np.uint16), seed=7)
  a = s.batch(5, 4, 32)
  assert a.shape == (4, 33) and np.array_equal(a, s.batch(5, 4, 32))
  assert not np.array_equal(a, s.batch(6, 4, 32))
  assert np.array_equal(a[:, 1:], a[:, :-1] + 1)  # contiguous windows
