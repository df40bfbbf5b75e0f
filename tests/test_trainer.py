"""The sharded trainer: runs on an 8-device CPU mesh and resumes exactly from an orbax checkpoint. The runs of a
test share one process (one JAX start and one compile): each reads only its config and what its out_dir holds."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_corpus_tokenizer import _fake_stdlib

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from longspec_jax.yaml_config import from_dict
    from longspec_jax.training.train_target import TargetTrainConfig, train_target, load_params_from_checkpoint
    assert len(jax.devices()) == 8, jax.devices()
    for raw in json.loads(sys.argv[1]):
      cfg = from_dict(TargetTrainConfig, raw)
      train_target(cfg)
      model, step = load_params_from_checkpoint(cfg)
      flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
      print("RESULT", json.dumps({"step": step, "sum": float(np.sum(flat.astype(np.float64))),
                                  "first": [float(x) for x in flat[:5]]}), flush=True)
""")


def _run(*cfgs: dict) -> list[dict]:
  """Trains each config in turn in one 8-device process; the final checkpoint's step and parameters of each."""
  env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"]
             + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  root = Path(__file__).resolve().parents[1]
  p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cfgs)], cwd=root, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  results = [json.loads(l[len("RESULT "):]) for l in p.stdout.splitlines() if l.startswith("RESULT")]
  assert len(results) == len(cfgs), p.stdout[-3000:]
  return results


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
  from longspec_jax.tokenizer import save_hf_tokenizer, train_bpe
  from longspec_jax.training.data import CorpusConfig, build_corpus, load_corpus
  tmp = tmp_path_factory.mktemp("data")
  _fake_stdlib(tmp / "lib")
  build_corpus(tmp / "corpus", CorpusConfig(min_chars=50, long_min_chars=3000, num_long_docs=1), root=tmp / "lib")
  save_hf_tokenizer(train_bpe(load_corpus(tmp / "corpus")["train"]["text"], 300), tmp / "tok")
  return tmp


def _cfg(tiny_data, out, **kw):
  cfg = dict(corpus_dir=str(tiny_data / "corpus"), tokenizer_dir=str(tiny_data / "tok"), out_dir=str(out),
             model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16),
             stages=[dict(seq_len=32, batch_size=8, steps=4), dict(seq_len=64, batch_size=8, steps=2)],
             optim=dict(lr=0.01, warmup_steps=2), attn_block=16, log_every=1, checkpoint_every_minutes=100.0)
  cfg.update(kw)
  return cfg


def test_sharded_training_resumes_exactly(tiny_data, tmp_path):
  straight, first, resumed = _run(_cfg(tiny_data, tmp_path / "a"),
                                  _cfg(tiny_data, tmp_path / "b", stop_after_steps=3), _cfg(tiny_data, tmp_path / "b"))
  assert straight["step"] == 6
  log = [json.loads(l) for l in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
  assert len(log) == 6 and all(r["loss"] > 0 for r in log)
  assert (tmp_path / "a" / "final" / "config.json").exists() and (tmp_path / "a" / "final" / "unigram.npy").exists()

  assert first["step"] == 3
  assert resumed["step"] == 6
  assert resumed["first"] == straight["first"] and resumed["sum"] == straight["sum"]


def test_run_files_are_replaced_whole_while_another_process_reads_them(tmp_path):
  """Process 0 rewrites train_config.json on a resume while the others read it: a reader must see the old file or
  the new one, never a truncated one (a plain write_text let a two-process resume read '' and die)."""
  import threading
  from longspec_jax.fileio import write_json_atomic
  path = tmp_path / "train_config.json"
  record = {"steps": 6, "lr": 0.02, "names": ["x" * 64] * 256}
  write_json_atomic(path, record)
  stop, bad = threading.Event(), []

  def read():
    while not stop.is_set():
      try:
        assert json.loads(path.read_text()) == record
      except (ValueError, AssertionError) as e:
        bad.append(e)

  reader = threading.Thread(target=read)
  reader.start()
  for _ in range(300):
    write_json_atomic(path, record)
  stop.set()
  reader.join()
  assert bad == [] and not list(tmp_path.glob("*.tmp"))
