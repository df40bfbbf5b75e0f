"""Drafter training data: prompts cut from the corpus train split, continued by the TARGET itself.

A drafter is judged by how often the target accepts its drafts, so it learns from the target's own outputs
(greedy and sampled) rather than from the corpus alone. Each row is one prompt window plus the target's
continuation. Every batch is a pure function of (seed, batch index) and is written as its own Arrow shard as soon
as it is generated, so a killed run resumes by skipping the shards already on disk; at the end the shards are
merged into one `datasets.Dataset` (`<out>/dataset`) with a `manifest.json`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from longspec_jax.hf_io import weights_sha256  # also re-exported for the trainers

if TYPE_CHECKING:
  import datasets

DATASET_DIR = "dataset"
SHARDS_DIR = "shards"
MANIFEST = "manifest.json"
SETTINGS = "settings.json"


@dataclasses.dataclass(frozen=True)
class DrafterDataConfig:
  target_dir: str
  corpus_dir: str = "data/corpus"
  out_dir: str = "runs/drafter_data"
  num_prompts: int = 400
  new_tokens: int = 256
  batch: int = 16
  temperature: float = 0.8
  greedy_fraction: float = 0.5  # this share of the batches is decoded greedily (temperature 0)
  min_prompt_tokens: int = 128
  max_prompt_tokens: int = 256
  seed: int = 0

  def __post_init__(self):
    for name in ("num_prompts", "new_tokens", "batch", "min_prompt_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.max_prompt_tokens < self.min_prompt_tokens:
      raise ValueError(f"max_prompt_tokens ({self.max_prompt_tokens}) < min_prompt_tokens "
                       f"({self.min_prompt_tokens})")
    if self.temperature < 0 or not 0 <= self.greedy_fraction <= 1:
      raise ValueError(f"need temperature >= 0 and greedy_fraction in [0, 1], got {self.temperature}, "
                       f"{self.greedy_fraction}")

  @property
  def num_batches(self) -> int:
    return -(-self.num_prompts // self.batch)

  def batch_is_greedy(self, k: int) -> bool:
    # Spreads the greedy batches evenly: batch k is greedy when floor((k+1)f) steps past floor(kf).
    f = self.greedy_fraction
    return int((k + 1) * f) > int(k * f)

  def settings(self) -> dict:
    """What determines the rows (the output dir does not): a resumed run must match it exactly."""
    d = dataclasses.asdict(self)
    d.pop("out_dir")
    d["target_dir"] = str(Path(self.target_dir).resolve())
    d["corpus_dir"] = str(Path(self.corpus_dir).resolve())
    return d


class PromptSampler:
  """Prompt i = a random window of one train document (chosen with probability proportional to its length, so
  windows are uniform over the text), a pure function of (seed, i). Documents are tokenized lazily: a few hundred
  prompts touch a few hundred documents, not the whole 28M-character split."""

  def __init__(self, texts: list[str], paths: list[str], tokenizer, bos_id: int | None, cfg: DrafterDataConfig):
    if not texts:
      raise ValueError("the corpus train split has no documents")
    self.texts, self.paths, self.tok, self.bos, self.cfg = texts, paths, tokenizer, bos_id, cfg
    lens = np.asarray([len(t) for t in texts], np.float64)
    self.cum = np.cumsum(lens) / lens.sum()
    self._ids: dict[int, list[int]] = {}

  def doc_ids(self, d: int) -> list[int]:
    if d not in self._ids:
      self._ids[d] = self.tok.encode(self.texts[d]).ids
    return self._ids[d]

  def prompt(self, i: int) -> dict:
    cfg = self.cfg
    rng = np.random.default_rng([cfg.seed, i])
    d = int(np.searchsorted(self.cum, rng.random(), side="right"))
    d = min(d, len(self.texts) - 1)
    ids = self.doc_ids(d)
    want = int(rng.integers(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1))
    # A document shorter than the window gives its first half, so the target still continues real text.
    length = want if len(ids) >= want + 16 else max(len(ids) // 2, 1)
    start = int(rng.integers(0, len(ids) - length + 1))
    window = ids[start:start + length]
    bos = start == 0 and self.bos is not None
    return {"prompt": ([self.bos] if bos else []) + window, "doc_path": self.paths[d], "doc_start": start,
            "bos": bos, "prompt_index": i}


def _batch_seed(seed: int, k: int) -> int:
  return int(np.random.default_rng([seed, 1_000_003, k]).integers(0, 2**31 - 1))


def _check_settings(out: Path, settings: dict) -> None:
  path = out / SETTINGS
  if path.exists():
    old = json.loads(path.read_text())
    if old != settings:
      diff = {k: (old.get(k), settings.get(k)) for k in set(old) | set(settings) if old.get(k) != settings.get(k)}
      raise ValueError(f"{out} holds drafter data made with different settings {diff} (old, new); use another "
                       "--out or delete it")
  else:
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def make_drafter_data(cfg: DrafterDataConfig) -> Path:
  """Generates cfg.num_prompts target continuations into cfg.out_dir; returns the merged dataset's directory."""
  import datasets
  from tqdm.auto import tqdm

  from longspec_jax.inference.generate import generate
  from longspec_jax.hf_io import load_model_dir
  from longspec_jax.tokenizer import load_tokenizer
  from longspec_jax.training.data import load_corpus

  target_dir = Path(cfg.target_dir)
  if not (target_dir / "config.json").exists():
    raise FileNotFoundError(f"no target model at {target_dir} (expected config.json + safetensors)")
  out = Path(cfg.out_dir)
  if (out / MANIFEST).exists() and (out / DATASET_DIR).exists():
    _check_settings(out, cfg.settings())
    print(f"drafter data already complete in {out}")
    return out / DATASET_DIR
  _check_settings(out, cfg.settings())

  model = load_model_dir(target_dir)
  tok = load_tokenizer(target_dir)
  train = load_corpus(cfg.corpus_dir)["train"]
  sampler = PromptSampler(train["text"], train["path"], tok, model.cfg.bos_token_id, cfg)

  shards = out / SHARDS_DIR
  shards.mkdir(parents=True, exist_ok=True)
  todo = [k for k in range(cfg.num_batches) if not (shards / f"{k:05d}").exists()]
  if len(todo) < cfg.num_batches:
    print(f"resuming: {cfg.num_batches - len(todo)} of {cfg.num_batches} batches already on disk")
  bar = tqdm(todo, desc="make-drafter-data", unit="batch", dynamic_ncols=True)
  done_tokens, done_s = 0, 0.0
  for k in bar:
    idx = range(k * cfg.batch, min((k + 1) * cfg.batch, cfg.num_prompts))
    rows = [sampler.prompt(i) for i in idx]
    temp = 0.0 if cfg.batch_is_greedy(k) else cfg.temperature
    seed = _batch_seed(cfg.seed, k)
    res = generate(model, [r["prompt"] for r in rows], max_new_tokens=cfg.new_tokens, temperature=temp,
                   seed=seed)
    for r, cont in zip(rows, res.tokens):
      r.update(continuation=cont, temperature=temp, gen_seed=seed, batch=k)
    n_new = sum(len(c) for c in res.tokens)
    # Written under a temporary name and renamed: a shard directory on disk is always complete.
    tmp = shards / f".tmp-{k:05d}"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_list(rows, features=_features()).save_to_disk(str(tmp))
    (tmp / "batch_meta.json").write_text(json.dumps({"wall_s": res.wall_s, "new_tokens": n_new}))
    tmp.rename(shards / f"{k:05d}")
    done_tokens += n_new
    done_s += res.wall_s
    bar.set_postfix(tok_s=f"{done_tokens / max(done_s, 1e-9):.0f}", new=done_tokens)
  bar.close()
  return _merge(out, cfg, model.cfg)


def _features():
  import datasets
  return datasets.Features({
      "prompt": datasets.Sequence(datasets.Value("int32")),
      "continuation": datasets.Sequence(datasets.Value("int32")),
      "prompt_index": datasets.Value("int64"),
      "doc_path": datasets.Value("string"),
      "doc_start": datasets.Value("int64"),
      "bos": datasets.Value("bool"),
      "temperature": datasets.Value("float32"),
      "gen_seed": datasets.Value("int64"),
      "batch": datasets.Value("int32"),
  })


def _merge(out: Path, cfg: DrafterDataConfig, target_cfg) -> Path:
  import datasets

  shard_dirs = [out / SHARDS_DIR / f"{k:05d}" for k in range(cfg.num_batches)]
  ds = datasets.concatenate_datasets([datasets.load_from_disk(str(d)) for d in shard_dirs])
  metas = [json.loads((d / "batch_meta.json").read_text()) for d in shard_dirs]
  ds.save_to_disk(str(out / DATASET_DIR))
  new = [len(c) for c in ds["continuation"]]
  eos = target_cfg.eos_token_id
  wall = sum(m["wall_s"] for m in metas)
  manifest = {
      "target_dir": str(Path(cfg.target_dir).resolve()),
      "target": {"name": target_name(cfg.target_dir), "weights_sha256": weights_sha256(cfg.target_dir),
                 "vocab_size": target_cfg.vocab_size, "bos_token_id": target_cfg.bos_token_id,
                 "eos_token_id": eos, "pad_token_id": target_cfg.pad_token_id,
                 "mask_token_id": target_cfg.mask_token_id},
      "corpus_dir": str(Path(cfg.corpus_dir).resolve()),
      "settings": cfg.settings(),
      "batch_seeds": [_batch_seed(cfg.seed, k) for k in range(cfg.num_batches)],
      "counts": {
          "sequences": len(ds),
          "greedy_sequences": int(sum(t == 0 for t in ds["temperature"])),
          "prompt_tokens": int(sum(len(p) for p in ds["prompt"])),
          "generated_tokens": int(sum(new)),
          "eos_terminated": int(sum(1 for c in ds["continuation"] if c and c[-1] == eos)),
      },
      # generate()'s wall time per batch; the first batch of each prompt/cache bucket includes compilation.
      "generation_s": round(wall, 2),
      "first_batch_s": round(metas[0]["wall_s"], 2),
      "generated_tokens_per_s": round(sum(new) / max(wall, 1e-9), 1),
  }
  (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
  shutil.rmtree(out / SHARDS_DIR)
  return out / DATASET_DIR


def target_name(target_dir: str | Path) -> str:
  """A target's name: its directory's, or the run's for the trainer's `runs/<name>/final` export layout."""
  d = Path(target_dir).resolve()
  return d.parent.name if d.name == "final" else d.name


def load_drafter_data(data_dir: str | Path) -> tuple[datasets.Dataset, dict]:
  """(dataset, manifest) of a finished `make-drafter-data` run, with clear errors for missing or empty data."""
  import datasets

  data_dir = Path(data_dir)
  if not (data_dir / MANIFEST).exists() or not (data_dir / DATASET_DIR).exists():
    raise FileNotFoundError(f"no finished drafter data in {data_dir} (expected {MANIFEST} and {DATASET_DIR}/); "
                            "run `longspec make-drafter-data --out` to make it")
  try:
    ds = datasets.load_from_disk(str(data_dir / DATASET_DIR))
  except (IndexError, ValueError, OSError) as e:  # datasets cannot even open a saved dataset with no rows
    raise ValueError(f"the drafter data in {data_dir} is empty or unreadable: {e!r}") from e
  if len(ds) == 0:
    raise ValueError(f"the drafter data in {data_dir} is empty")
  return ds, json.loads((data_dir / MANIFEST).read_text())
