"""`longspec calibrate-sharpdraft`: measures a drafter's attention-score statistics at its training length n0 and
writes `sharpdraft.json` beside the checkpoint (see longspec_jax/sharpdraft.py for the score model and rules).

Text: windows of the corpus train split when the corpus exists (held-out long documents are kept for evaluation),
else the drafter's own training rows. Every window is [BOS] + n0 - 1 tokens from a random offset.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.drafters import SHARPDRAFT_METHODS
from longspec_jax.sharpdraft_names import SHARPDRAFT_FILE

if TYPE_CHECKING:
  import numpy as np
  from tokenizers import Tokenizer

  from longspec_jax.drafters.base import LoadedDrafter
  from longspec_jax.model import Transformer

# The methods SharpDraft applies to (registry entries with sharpdraft=True; their specs have attention_logits).
DRAFTERS = SHARPDRAFT_METHODS


def _windows_from_streams(streams: list[list[int]], n0: int, num: int, bos: int | None, seed: int) -> np.ndarray:
  import numpy as np  # here, not at the top: the CLI parser imports this module and must stay fast
  body = n0 - (bos is not None)
  streams = [s for s in streams if len(s) >= body]
  if not streams:
    raise ValueError(f"no text with at least {body} tokens to cut calibration windows of n0 = {n0}")
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(num):
    s = streams[i % len(streams)]
    start = int(rng.integers(0, len(s) - body + 1))
    rows.append(([bos] if bos is not None else []) + list(s[start:start + body]))
  return np.asarray(rows, np.int32)


def calibration_windows(tok: Tokenizer, n0: int, num: int, bos: int | None, corpus_dir: str | Path,
                        drafter_meta: dict, seed: int = 0) -> tuple[np.ndarray, str]:
  import numpy as np
  """[num, n0] token windows and a description of their source."""
  corpus_dir = Path(corpus_dir)
  if (corpus_dir / "dataset_dict.json").exists():
    from longspec_jax.training.data import load_corpus
    texts = load_corpus(corpus_dir)["train"]["text"]
    order = np.random.default_rng(seed).permutation(len(texts))
    streams = []
    for start in range(0, len(order), 64):  # tokenize only as many documents as needed
      for enc in tok.encode_batch([texts[int(i)] for i in order[start:start + 64]]):
        if len(enc.ids) >= n0:
          streams.append(enc.ids)
      if len(streams) >= num:
        break
    return (_windows_from_streams(streams, n0, num, bos, seed),
            f"corpus train split ({corpus_dir}), {min(len(streams), num)} documents")
  data = drafter_meta.get("data") or {}
  data_dir = (data[0] if isinstance(data, list) else data).get("dir")  # a list when trained on several sets
  if not data_dir or not (Path(data_dir) / "dataset").exists():
    raise FileNotFoundError(f"no corpus at {corpus_dir} and no drafter training data (drafter.json data.dir = "
                            f"{data_dir!r}); build the corpus with `longspec corpus` or pass --corpus DIR")
  import datasets
  ds = datasets.load_from_disk(str(Path(data_dir) / "dataset"))
  # Rows are ~n0 tokens each (prompt + target continuation): concatenated they form one stream to cut from.
  stream = [t for p, c in zip(ds["prompt"], ds["continuation"]) for t in p + c]
  return (_windows_from_streams([stream], n0, num, bos, seed),
          f"drafter training rows ({data_dir}/dataset, prompt + continuation, concatenated)")


def _queries(logits: np.ndarray) -> np.ndarray:
  """[B, Hq, Tq, N] -> [B * Tq, Hq, N]: every query row of the batch."""
  b, h, tq, n = logits.shape
  return logits.transpose(0, 2, 1, 3).reshape(b * tq, h, n)


def drafter_scores(loaded: LoadedDrafter, target: Transformer, windows: np.ndarray, batch: int) -> list[np.ndarray]:
  """Per drafter attention layer: logits [Q, Hq, N] of every query that sees all N keys of its window."""
  import jax
  import numpy as np
  from flax import nnx
  from tqdm import tqdm

  spec = loaded.spec
  graphdef, tparams = nnx.split(target)
  fn = jax.jit(lambda dp, tp, toks: spec.attention_logits(dp, nnx.merge(graphdef, tp), toks))
  per_layer = None
  for i in tqdm(range(0, len(windows), batch), desc="calibrate-sharpdraft", file=sys.stderr):
    logits = fn(loaded.params, tparams, windows[i:i + batch])
    rows = [_queries(np.asarray(x, np.float32)) for x in logits]
    per_layer = rows if per_layer is None else [np.concatenate([a, r]) for a, r in zip(per_layer, rows)]
  return per_layer


def run_calibration(drafter: str, drafter_dir: str | Path | None = None, model_dir: str | Path | None = None,
                    corpus_dir: str | Path = "data/corpus", granularity: str = "head", alpha_rule: str = "tangent",
                    fit_max_keys: int = 16384, num_windows: int = 256, batch: int = 8, seed: int = 0,
                    n0: int | None = None, out: str | Path | None = None) -> Path:
  from longspec_jax.drafters import load_drafter, drafter_path
  from longspec_jax.hf_io import load_model_dir, weights_sha256
  from longspec_jax.sharpdraft import calibrate
  from longspec_jax.targets import resolve_target_dir
  from longspec_jax.tokenizer import load_tokenizer

  if drafter not in DRAFTERS:
    raise ValueError(f"--drafter must be one of {DRAFTERS}, got {drafter!r}")
  target_dir = resolve_target_dir(model_dir)
  target = load_model_dir(target_dir)
  path = drafter_path(drafter, drafter_dir, target)  # default: the drafter shipped for this target
  meta_path = path / "drafter.json"
  meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
  n0 = n0 or meta.get("n0")
  if not n0:
    raise ValueError(f"{meta_path} gives no n0 (the drafter's training length); pass --n0")
  tok = load_tokenizer(target_dir)
  loaded = load_drafter(drafter, target, drafter_dir)
  windows, source = calibration_windows(tok, n0, num_windows, target.cfg.bos_token_id, corpus_dir, meta, seed)
  scores = drafter_scores(loaded, target, windows, batch)
  body = calibrate(scores, granularity, alpha_rule, fit_max_keys)
  if body["n0"] != n0:
    # The rule's n0 counts keys: a drafter whose queries also see a few block keys has n0_keys > n0 tokens.
    print(f"note: drafter queries see {body['n0']} keys on {n0}-token windows; rules use n0 = {body['n0']}",
          file=sys.stderr)
  result = {**body, "drafter": drafter, "drafter_weights_sha256": weights_sha256(path),
            "drafter_dir": str(drafter_dir) if drafter_dir else "shipped",
            "n0_tokens": n0, "text_source": source, "num_windows": int(len(windows)), "seed": seed,
            "target_dir": str(model_dir) if model_dir else "shipped",
            "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
  out = Path(out) if out else path / SHARPDRAFT_FILE
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(_rounded(result), indent=1))
  return out


def _rounded(x, digits: int = 6):
  if isinstance(x, float):
    return round(x, digits)
  if isinstance(x, dict):
    return {k: _rounded(v, digits) for k, v in x.items()}
  if isinstance(x, list):
    return [_rounded(v, digits) for v in x]
  return x


def summary(result: dict) -> str:
  lines = [f"n0 = {result['n0']} keys, granularity {result['granularity']}, alpha rule {result['alpha_rule']}",
           "layer head   k   delta  sigma  alpha  top-k mass (measured / model)"]
  for li, layer in enumerate(result["heads"]):
    for hi, h in enumerate(layer):
      lines.append(f"{li:5d} {hi:4d} {h['k']:3d} {h['delta']:7.3f} {h['sigma']:6.3f} "
                   f"{result['applied']['alpha'][li][hi]:6.3f}  {h['top_k_mass']:.3f} / {h['model_top_k_mass']:.3f}")
  return "\n".join(lines)
