"""HF checkpoint directories (config.json + safetensors, single file or sharded index) <-> our NNX models."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.config import INT8_QUANT_METHOD, ModelConfig

if TYPE_CHECKING:
  from longspec_jax.model import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _hf_name(path: tuple, prefix: str = "model.") -> tuple[str, bool]:
  """Our parameter path -> (HF tensor name, whether the array is transposed between the two). Decoder-only
  LMs name their body `model.*`; drafter checkpoints (DFlash, EAGLE-3) use bare names (prefix "")."""
  *parents, leaf = (str(p) for p in path)
  transpose = leaf == "kernel"
  name = ".".join(parents + ["weight" if leaf in ("kernel", "scale", "embedding") else leaf])
  return (name if parents[0] == "lm_head" else prefix + name), transpose


def _flat_params(model: nnx.Module) -> dict[tuple, jax.Array]:
  flat = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(prefix + (k,), v)
    else:
      flat[prefix] = node
  walk((), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return flat


def to_hf_tensors(model: nnx.Module, dtype: jax.typing.DTypeLike = np.float32,
                  prefix: str = "model.") -> dict[str, np.ndarray]:
  out = {}
  for path, arr in _flat_params(model).items():
    name, transpose = _hf_name(path, prefix)
    a = np.asarray(jnp.asarray(arr, jnp.float32))
    out[name] = np.ascontiguousarray(a.T if transpose else a).astype(dtype)
  return out


def weights_sha256(model_dir: str | os.PathLike) -> str:
  """Identity of a checkpoint's weights: sha256 over all its safetensors files, in name order."""
  import hashlib
  h = hashlib.sha256()
  for f in sorted(Path(model_dir).glob("*.safetensors")):
    with open(f, "rb") as fh:
      for chunk in iter(lambda: fh.read(1 << 20), b""):
        h.update(chunk)
  return h.hexdigest()


def _read_tensors(model_dir: Path) -> dict[str, jax.Array]:
  from safetensors import SafetensorError, safe_open

  index = model_dir / INDEX_FILE
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"corrupt sharded index {index}: {e}") from e
    files = sorted(set(weight_map.values()))
  elif (model_dir / SINGLE_FILE).exists():
    files = [SINGLE_FILE]
  else:
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
  tensors = {}
  for f in files:
    path = model_dir / f
    if not path.exists():
      raise FileNotFoundError(f"checkpoint shard {path} named in the index is missing")
    try:
      with safe_open(str(path), framework="flax") as fh:
        for k in fh.keys():
          tensors[k] = fh.get_tensor(k)
    except (SafetensorError, OSError, ValueError) as e:
      raise ValueError(f"corrupt safetensors file {path}: {e}") from e
  return dequantize_int8(tensors, where=str(model_dir))


# Int8 storage (`quantize_int8_tensors`): a matrix NAME [out, in] stored as int8 beside NAME_scale [out] (fp32, one
# symmetric scale per output channel, as `model.quantize_per_channel`), which halves a bf16 checkpoint on disk. It
# is a storage format only: reading returns fp32 matrices, so every loader is unchanged.
INT8_SCALE_SUFFIX = "_scale"
INT8_QUANTIZATION_CONFIG = {"quant_method": INT8_QUANT_METHOD, "bits": 8, "scale_suffix": INT8_SCALE_SUFFIX,
                            "scale_axis": "output row"}


def quantize_int8_tensors(tensors: dict[str, np.ndarray], min_size: int = 65536) -> dict[str, np.ndarray]:
  """Floating matrices of at least `min_size` entries -> int8 + NAME_scale; the rest (norms, index tensors) kept."""
  from longspec_jax.model import quantize_per_channel

  out = {}
  for name, a in tensors.items():
    if a.ndim == 2 and jnp.issubdtype(a.dtype, jnp.floating) and a.size >= min_size:
      values, scale = quantize_per_channel(jnp.asarray(a), axis=0)  # torch layout [out, in]: a scale per row
      out[name], out[name + INT8_SCALE_SUFFIX] = np.asarray(values), np.asarray(scale, np.float32)
    else:
      out[name] = a
  return out


def write_int8_copy(src_dir: str | os.PathLike, out_dir: str | os.PathLike, min_size: int = 65536) -> dict:
  """A copy of checkpoint directory `src_dir` (single-file safetensors) whose large matrices are stored int8
  (`quantize_int8_tensors`); the other files are copied as they are. Written to a temporary directory renamed into
  place, so a crash leaves no half-written copy. Returns {"bytes_before", "bytes_after", "int8_tensors"}."""
  from safetensors.numpy import save_file

  src, out = Path(src_dir), Path(out_dir)
  if not (src / SINGLE_FILE).exists():
    raise FileNotFoundError(f"no {SINGLE_FILE} in {src} (sharded checkpoints are not supported here)")
  if out.exists():
    raise FileExistsError(f"{out} exists; choose a new directory")
  tensors = {k: np.asarray(v) for k, v in _read_tensors(src).items()}
  quantized = quantize_int8_tensors(tensors, min_size)
  tmp = out.with_name(out.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(SINGLE_FILE))
  save_file(quantized, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
  if (tmp / "config.json").exists():  # say so in config.json: a public loader then refuses the copy, not misreads it
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = INT8_QUANTIZATION_CONFIG
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
  os.replace(tmp, out)
  return {"bytes_before": (src / SINGLE_FILE).stat().st_size, "bytes_after": (out / SINGLE_FILE).stat().st_size,
          "int8_tensors": sum(v.dtype == np.int8 for v in quantized.values())}


def dequantize_int8(tensors: dict, where: str = "") -> dict:
  """Inverse of `quantize_int8_tensors` (fp32 matrices); tensors without int8 entries come back unchanged."""
  out = dict(tensors)
  for name, a in tensors.items():
    if a.dtype != jnp.int8:
      continue
    scale = out.pop(name + INT8_SCALE_SUFFIX, None)
    if scale is None or a.ndim != 2 or scale.shape != (a.shape[0],):
      raise ValueError(f"{where}: int8 tensor {name} {tuple(a.shape)} needs a scale {name}{INT8_SCALE_SUFFIX} of "
                       f"shape ({a.shape[0]},), got {None if scale is None else tuple(scale.shape)}")
    out[name] = np.asarray(a, np.float32) * np.asarray(scale, np.float32)[:, None]  # on the host: no compile
  return out


def load_params_into(model: nnx.Module, tensors: dict[str, jax.Array], where: str = "",
                     prefix: str = "model.") -> nnx.Module:
  """Fills every nnx.Param of `model` from HF-named tensors; errors name missing / mis-shaped tensors."""
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  flat = _flat_params(model)
  missing, bad_shape, used = [], [], set()
  new_flat = {}
  for path, arr in flat.items():
    name, transpose = _hf_name(path, prefix)
    if name not in tensors:
      missing.append(name)
      continue
    t = np.asarray(tensors[name])  # transposed and cast on the host: op by op on a device, each shape compiles
    t = t.T if transpose else t
    if t.shape != arr.shape:
      bad_shape.append(f"{name}: checkpoint {tuple(t.shape)} vs model {tuple(arr.shape)}")
      continue
    new_flat[path] = jnp.asarray(t.astype(arr.dtype))
    used.add(name)
  if missing or bad_shape:
    raise ValueError(f"checkpoint{where} does not match the model config: missing tensors {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''}; shape mismatches {bad_shape[:8]}")

  def rebuild(prefix, node):
    if isinstance(node, dict):
      return {k: rebuild(prefix + (k,), v) for k, v in node.items()}
    return new_flat[prefix]
  nnx.replace_by_pure_dict(state, rebuild((), pure))
  nnx.update(model, state)
  return model


def empty_model(build: Callable[[], nnx.Module], param_dtype: jax.typing.DTypeLike | None = None) -> nnx.Module:
  """The module `build()` makes, with zero-filled parameters of its abstract shapes (no random init): the shell a
  checkpoint is loaded into."""
  graphdef, abstract = nnx.split(nnx.eval_shape(build))
  return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.zeros(a.shape, param_dtype or a.dtype), abstract))


def load_drafter_weights(drafter_dir: str | os.PathLike, build: Callable[[], nnx.Module],
                         rename: Callable[[str], str] = lambda name: name) -> nnx.Module:
  """The module `build()` makes, loaded from a drafter directory's safetensors: bare tensor names (the public
  drafter layout), mapped to ours by `rename`."""
  tensors = {rename(k): v for k, v in _read_tensors(Path(drafter_dir)).items()}
  return load_params_into(empty_model(build), tensors, where=f" {drafter_dir}", prefix="")


def save_drafter_dir(out_dir: str | os.PathLike, hf_config: dict, tensors: dict[str, np.ndarray],
                     dtype: jax.typing.DTypeLike = np.float32) -> Path:
  """config.json (torch_dtype set) + model.safetensors of fp32 HF-named `tensors` cast to `dtype`: the layout of
  the public drafter checkpoints (DFlash, LongSpark)."""
  from safetensors.numpy import save_file
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  hf_config = dict(hf_config, torch_dtype="bfloat16" if dtype == jnp.bfloat16 else np.dtype(dtype).name)
  (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
  if dtype != np.float32:
    tensors = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in tensors.items()}
  save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
  return out_dir


def load_model_dir(model_dir: str | os.PathLike, *, dtype: jax.typing.DTypeLike = jnp.float32,
                   check_tokenizer: bool = True, config_fn: Callable[[ModelConfig], ModelConfig] | None = None,
                   param_dtype: jax.typing.DTypeLike | None = None, **model_kw: Any) -> Transformer:
  """Loads an HF Qwen3/Llama checkpoint directory into a `Transformer`.

  dtype: compute dtype; param_dtype: parameter dtype (default fp32); config_fn: ModelConfig -> ModelConfig applied
  before the model is built (e.g. a RoPE-scaling override)."""
  from longspec_jax.model import Transformer

  model_dir = Path(model_dir)
  if not model_dir.is_dir():
    raise FileNotFoundError(f"model directory {model_dir} does not exist")
  cfg = ModelConfig.from_json_file(model_dir / "config.json")
  if config_fn is not None:
    cfg = config_fn(cfg)
  tensors = _read_tensors(model_dir)
  if cfg.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
  model = empty_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, **model_kw), param_dtype)
  load_params_into(model, tensors, where=f" {model_dir}")
  if check_tokenizer and (model_dir / "tokenizer.json").exists():
    from longspec_jax.tokenizer import check_tokenizer_matches, eos_token_of, load_tokenizer
    check_tokenizer_matches(load_tokenizer(model_dir), cfg.vocab_size, cfg.eos_token_id, f" in {model_dir}",
                            eos_token_of(model_dir))
  return model


def save_model_dir(model: Transformer, out_dir: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
                   dtype: jax.typing.DTypeLike = np.float32, max_shard_bytes: int | None = None) -> Path:
  """Writes config.json + safetensors (sharded with an index when `max_shard_bytes` is set) + tokenizer files."""
  from safetensors.numpy import save_file

  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  cfg: ModelConfig = model.cfg
  hf_cfg = cfg.to_hf_dict()
  hf_cfg["torch_dtype"] = np.dtype(dtype).name if dtype != jnp.bfloat16 else "bfloat16"
  tensors = to_hf_tensors(model, dtype)
  if cfg.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)
  (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
  meta = {"format": "pt"}
  if max_shard_bytes is None:
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata=meta)
  else:
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
      if cur and size + tensors[name].nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = {}, 0
      cur[name] = tensors[name]
      size += tensors[name].nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, str(out_dir / fname), metadata=meta)
      weight_map.update({k: fname for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
  gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
  (out_dir / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}))
  if tokenizer_dir is not None:
    for f in TOKENIZER_FILES:
      src = Path(tokenizer_dir) / f
      if src.exists() and src.resolve() != (out_dir / f).resolve():
        shutil.copy(src, out_dir / f)
  return out_dir
