"""EAGLE-3 and DFlash drafter checkpoints in the layouts other engines load, read into and written from this
library's own (issue 53). Plain dicts and arrays: no drafter module is imported, so the loaders (eagle3.py,
dflash.py) and the `export-drafter` command share it.

Layouts (facts read from speculators 0.9.0, dflash 0.1.0 and the engines' public sources; see README "Bring your
drafter, serve it"):
- `eagle3` (ours) and `specforge` EAGLE-3: `architectures: ["LlamaForCausalLMEagle3"]`, one layer `midlayer.*`,
  `fc`, `norm`, `lm_head` [draft vocab, H], `d2t` / `t2d`. The tapped layers: a top-level
  `eagle_aux_hidden_state_layer_ids` names layer INPUTS (vLLM reads it as is); SpecForge's
  `eagle_config.eagle_aux_hidden_state_layer_ids` names layer OUTPUTS (its target hooks a layer's output, SGLang
  adds 1). A config with the top-level key is read by it; one with only `eagle_config` is SpecForge's.
- `speculators` EAGLE-3 (`speculators_model_type: eagle3`): the layer config under `transformer_layer_config`
  (llama, or qwen3 with q/k norms), `layers.0.*` for `midlayer.*`, ids = layer inputs (default (2, L//2, L-3)),
  `d2t` / `t2d` only with a reduced draft vocabulary, maybe the target's `embed_tokens.weight`.
- `zlab` DFlash (ours too): `architectures: ["DFlashDraftModel"]`, Qwen3 config + `num_target_layers` +
  `dflash_config: {block_size, mask_token_id, target_layer_ids}` (layer OUTPUTS), `fc`, `hidden_norm`, `norm`,
  `layers.N.*`.
- `speculators` DFlash (`speculators_model_type: dflash`): `transformer_layer_config`, `block_size`,
  `mask_token_id`, `aux_hidden_state_layer_ids` = z-lab ids + 1 (layer inputs), the same tensor names.
Our EAGLE-3 taps are layer inputs (HF `hidden_states[i]`); our DFlash keeps z-lab's output ids (taps = ids + 1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longspec_jax.config import read_config_json

if TYPE_CHECKING:
  import numpy as np  # imported where used: `longspec --help` builds this module's choices without numpy

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
FORMATS = ("speculators", "specforge", "zlab")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose classes tests/test_drafter_interop.py loads
# speculators config keys that are not the layer config (EAGLE-3 / DFlash), and the switches we do not implement.
_SPEC_EAGLE3_OFF = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_EAGLE3_MIDLAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_DFLASH_LAYER = re.compile(r"layers\.(\d+)\.(input_layernorm\.weight|post_attention_layernorm\.weight|"
                           r"self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight|"
                           r"mlp\.(gate|up|down)_proj\.weight)")
# Tensors a speculators checkpoint may hold that belong to the target (reloaded from it by speculators too).
_TARGET_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_CARRIED_FILES = ("drafter.json", "draft_vocab.json")  # our metadata, copied beside an export


def detect_layout(cfg: dict) -> str | None:
  """The layout of a drafter config.json: "eagle3" (ours), "specforge-eagle3", "speculators-eagle3", "zlab-dflash",
  "speculators-dflash"; None for anything else (left to the method's own loader)."""
  kind = cfg.get("speculators_model_type")
  if kind is not None:
    if kind not in ("eagle3", "dflash"):
      raise ValueError(f"speculators checkpoint of type {kind!r}: only eagle3 and dflash are supported")
    return f"speculators-{kind}"
  archs = cfg.get("architectures") or []
  if EAGLE3_ARCHITECTURE in archs:
    return "eagle3" if "eagle_aux_hidden_state_layer_ids" in cfg else "specforge-eagle3"
  if DFLASH_ARCHITECTURE in archs:
    return "zlab-dflash"
  return None


def read_drafter_checkpoint(drafter_dir: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json, tensors as numpy; int8 storage read back as fp32) of a drafter directory."""
  import numpy as np
  from longspec_jax.hf_io import _read_tensors
  drafter_dir = Path(drafter_dir)
  cfg = read_config_json(drafter_dir / "config.json", "drafter")
  return cfg, {k: np.asarray(v) for k, v in _read_tensors(drafter_dir).items()}


def to_native(cfg: dict, tensors: dict[str, np.ndarray], method: str, num_target_layers: int | None = None,
              where: str = "") -> tuple[dict, dict[str, np.ndarray]]:
  """A checkpoint (config, tensors) in any supported layout of `method` ("eagle3" | "dflash") -> ours (the
  config our loaders read, with tap ids in our convention; tensors under our names). `num_target_layers` (the
  target's) bounds the tap ids; DFlash from speculators needs it (the layout does not record it). Errors name
  the layout and the missing, unexpected or misshapen tensor, or the tap id out of range."""
  layout = detect_layout(cfg) or ("eagle3" if method == "eagle3" else "zlab-dflash")
  if not layout.endswith(method):
    raise ValueError(f"drafter checkpoint{where} is in the {layout} layout, not an {method} one")
  name = _LAYOUT_NAMES[layout]
  if layout in ("eagle3", "specforge-eagle3"):
    cfg, tensors = _from_specforge(cfg, tensors, num_target_layers, name)
  elif layout == "speculators-eagle3":
    cfg, tensors = _from_speculators_eagle3(cfg, tensors, num_target_layers, name)
  elif layout == "speculators-dflash":
    cfg, tensors = _from_speculators_dflash(cfg, tensors, num_target_layers, name)
  else:
    cfg, tensors = dict(cfg), dict(tensors)
    _check_tap_ids(name, "dflash_config.target_layer_ids", _dflash_ids(cfg), 0, num_target_layers, "outputs")
  if method == "eagle3":
    _check_eagle3_tensors(cfg, tensors, name + where)
  else:
    _check_dflash_tensors(cfg, tensors, name + where)
  return cfg, tensors


_LAYOUT_NAMES = {"eagle3": "EAGLE-3 (LlamaForCausalLMEagle3) layout", "specforge-eagle3": "SpecForge EAGLE-3 layout",
                 "speculators-eagle3": "speculators EAGLE-3 layout", "zlab-dflash": "z-lab DFlash layout",
                 "speculators-dflash": "speculators DFlash layout"}


def _check_tap_ids(layout: str, key: str, ids: list[int], low: int, num_target_layers: int | None,
                   kind: str) -> None:
  """ids name layer `kind` ("inputs": 0..L, L the last layer's output; "outputs": 0..L-1) of an L-layer target."""
  if num_target_layers is None:
    return
  high = num_target_layers if kind == "inputs" else num_target_layers - 1
  bad = [i for i in ids if not low <= i <= high]
  if bad:
    raise ValueError(f"{layout}: {key} {bad} out of range: they name layer {kind}, and these ids are outside "
                     f"{low}..{high} for this {num_target_layers}-layer target")


def _dflash_ids(cfg: dict) -> list[int]:
  ids = (cfg.get("dflash_config") or {}).get("target_layer_ids", cfg.get("target_layer_ids")) or []
  return [int(i) for i in ids]


def _from_specforge(cfg: dict, tensors: dict, num_target_layers: int | None, layout: str) -> tuple[dict, dict]:
  cfg = dict(cfg)
  if "eagle_aux_hidden_state_layer_ids" in cfg:  # ours / vLLM: layer inputs, authoritative over eagle_config
    _check_tap_ids(layout, "eagle_aux_hidden_state_layer_ids", cfg["eagle_aux_hidden_state_layer_ids"], 0,
                   num_target_layers, "inputs")
  else:
    outputs = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if outputs:
      _check_tap_ids(layout, "eagle_config.eagle_aux_hidden_state_layer_ids", outputs, 0, num_target_layers,
                     "outputs")
      cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in outputs]
  return cfg, dict(tensors)


def _layer_config(tl: dict, layout: str) -> dict:
  """speculators' `transformer_layer_config` (written as a diff against the transformers class defaults) -> a
  complete Llama / Qwen3 config dict."""
  from transformers import AutoConfig
  if tl.get("model_type") not in ("llama", "qwen3"):
    raise ValueError(f"{layout}: transformer_layer_config model_type {tl.get('model_type')!r} is not supported "
                     "(llama or qwen3)")
  full = json.loads(AutoConfig.for_model(**tl).to_json_string(use_diff=False))
  keep = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
          "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings",
          "bos_token_id", "eos_token_id", "pad_token_id", "use_sliding_window", "layer_types")
  out = {k: full[k] for k in keep if full.get(k) is not None}
  if "sliding_attention" not in (out.get("layer_types") or []):
    out.pop("layer_types", None)
  return out


def _from_speculators_eagle3(cfg: dict, tensors: dict, num_target_layers: int | None,
                             layout: str) -> tuple[dict, dict]:
  on = [k for k in _SPEC_EAGLE3_OFF if cfg.get(k)]
  if on:
    raise ValueError(f"{layout}: {on} set; only plain EAGLE-3 is implemented (these switches are false there)")
  if "transformer_layer_config" not in cfg:
    raise ValueError(f"{layout}: config.json lacks transformer_layer_config")
  native = _layer_config(cfg["transformer_layer_config"], layout)
  native.update(architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=cfg.get("draft_vocab_size"),
                target_hidden_size=cfg.get("target_hidden_size") or native["hidden_size"])
  ids = cfg.get("eagle_aux_hidden_state_layer_ids")
  if ids:
    _check_tap_ids(layout, "eagle_aux_hidden_state_layer_ids", ids, 0, num_target_layers, "inputs")
    native["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in ids]
  out = {}
  for k, v in tensors.items():
    if k in _TARGET_OWNED:
      continue  # the target's embedding / head, which this library always reads from the target itself
    out["midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k] = v
  if native["draft_vocab_size"] == native["vocab_size"]:  # speculators stores no maps for a full vocabulary
    out.pop("d2t", None), out.pop("t2d", None)
  return native, out


def _from_speculators_dflash(cfg: dict, tensors: dict, num_target_layers: int | None,
                             layout: str) -> tuple[dict, dict]:
  if cfg.get("sample_from_anchor"):
    raise ValueError(f"{layout}: sample_from_anchor=true (the anchor slot drafts too) is not supported")
  if "transformer_layer_config" not in cfg:
    raise ValueError(f"{layout}: config.json lacks transformer_layer_config")
  native = _layer_config(cfg["transformer_layer_config"], layout)
  if native["model_type"] != "qwen3":
    raise ValueError(f"{layout}: DFlash layers are Qwen3 layers; transformer_layer_config is "
                     f"{native['model_type']!r}")
  if cfg.get("draft_vocab_size") not in (None, native["vocab_size"]):
    raise ValueError(f"{layout}: a reduced draft vocabulary (draft_vocab_size {cfg['draft_vocab_size']} of "
                     f"{native['vocab_size']}) is not supported for DFlash (it drafts through the target's head)")
  if num_target_layers is None:
    raise ValueError(f"{layout}: the target's layer count is needed to read it (the layout does not record it)")
  ids = cfg.get("aux_hidden_state_layer_ids")
  if not ids:
    raise ValueError(f"{layout}: config.json lacks aux_hidden_state_layer_ids")
  _check_tap_ids(layout, "aux_hidden_state_layer_ids", ids, 1, num_target_layers, "inputs")
  if cfg.get("mask_token_id") is None:
    raise ValueError(f"{layout}: config.json lacks mask_token_id")
  native.update(architectures=[DFLASH_ARCHITECTURE], num_target_layers=num_target_layers, is_causal=False,
                dflash_config={"block_size": int(cfg.get("block_size", 8)), "mask_token_id": int(cfg["mask_token_id"]),
                               "target_layer_ids": [int(i) - 1 for i in ids]})
  out = {k: v for k, v in tensors.items() if k not in _TARGET_OWNED + ("lm_head.weight", "d2t", "t2d")}
  return native, out


def _eagle3_names(cfg: dict, qk_norm: bool) -> set[str]:
  names = {"fc.weight", "norm.weight", "lm_head.weight"} | {"midlayer." + n for n in _EAGLE3_MIDLAYER}
  if qk_norm:
    names |= {"midlayer." + n for n in _QK_NORMS}
  if cfg.get("attention_bias"):
    names |= {f"midlayer.self_attn.{p}_proj.bias" for p in "qkvo"}
  return names


def _check_eagle3_tensors(cfg: dict, tensors: dict, where: str) -> None:
  """Missing and unexpected EAGLE-3 tensors, named (a misshapen one is named by hf_io.load_params_into)."""
  expected = _eagle3_names(cfg, "midlayer.self_attn.q_norm.weight" in tensors)
  unexpected = sorted(set(tensors) - expected - {"d2t", "t2d"})
  missing = sorted(expected - set(tensors))
  if unexpected or missing:
    raise ValueError(f"{where}: " + "; ".join(
        s for s in (f"missing tensors {missing}" if missing else "",
                    f"unexpected tensors {unexpected}" if unexpected else "") if s))


def _check_dflash_tensors(cfg: dict, tensors: dict, where: str) -> None:
  n = int(cfg.get("num_hidden_layers", 0))
  unexpected = []
  for k in tensors:
    m = _DFLASH_LAYER.fullmatch(k)
    if k in ("fc.weight", "hidden_norm.weight", "norm.weight") or (m and int(m.group(1)) < n):
      continue
    unexpected.append(k)
  if unexpected:
    raise ValueError(f"{where}: unexpected tensors {sorted(unexpected)[:8]} (plain DFlash has fc, hidden_norm, norm "
                     f"and {n} Qwen3 layers; DFlash-2 / DSpark extras are not supported)")


# ---- export ----------------------------------------------------------------------------------------------------

def export_drafter(src_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                   verifier: str | None = None, num_target_layers: int | None = None,
                   speculative_tokens: int = 3) -> Path:
  """Writes the drafter at `src_dir` (EAGLE-3 or DFlash, any supported layout) to `out_dir` in format `fmt`
  (FORMATS), its tap ids in that format's convention, floating tensors as `dtype` ("bfloat16" | "float32").
  verifier: the target's name or path recorded in a speculators config (speculators reloads the embedding from
  it). speculative_tokens: the EAGLE-3 draft length a speculators config proposes."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown drafter format {fmt!r}; choose from {', '.join(FORMATS)}")
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"export dtype must be bfloat16 or float32, got {dtype!r}")
  src = Path(src_dir)
  cfg, tensors = read_drafter_checkpoint(src)
  layout = detect_layout(cfg)
  if layout is None:
    raise ValueError(f"{src} is not an EAGLE-3 or DFlash drafter checkpoint (architectures "
                     f"{cfg.get('architectures')}); only those have counterparts in the other engines' layouts")
  method = layout.rsplit("-", 1)[-1]
  cfg, tensors = to_native(cfg, tensors, method, num_target_layers, where=f" {src}")
  cfg = {k: v for k, v in cfg.items() if k not in ("quantization_config", "n0", "torch_dtype")}
  if method == "eagle3":
    if fmt == "zlab":
      raise ValueError("zlab is a DFlash layout; export an EAGLE-3 drafter as speculators or specforge")
    cfg, tensors = (_eagle3_speculators(cfg, tensors, verifier, speculative_tokens) if fmt == "speculators"
                    else _eagle3_specforge(cfg, tensors))
  else:
    if fmt == "specforge":
      raise ValueError("no SpecForge DFlash layout is implemented here; export a DFlash drafter as zlab (which "
                       "vLLM loads) or speculators")
    if fmt == "speculators":
      cfg, tensors = _dflash_speculators(cfg, tensors, verifier)
  out = _write(out_dir, cfg, tensors, dtype)
  # Our own metadata rides along: drafter.json (provenance, and the draft vocabulary a block drafter was trained to
  # draft over) with draft_vocab.json, so that the copy drafts here exactly as the source did. Other engines ignore
  # both files and draft over the whole vocabulary (the output is the same, the acceptance may differ).
  for name in _CARRIED_FILES:
    if (src / name).is_file():
      shutil.copyfile(src / name, out / name)
  return out


def _eagle3_specforge(cfg: dict, tensors: dict) -> tuple[dict, dict]:
  qk = [n for n in tensors if n.endswith(_QK_NORMS)]
  if qk:
    raise ValueError(f"this EAGLE-3 drafter has Qwen3-style q/k norms ({', '.join(sorted(qk))}), which the "
                     "SpecForge / SGLang LlamaForCausalLMEagle3 layer lacks: export it as speculators (a qwen3 "
                     "layer config) instead")
  taps = cfg.get("eagle_aux_hidden_state_layer_ids")
  if taps and min(taps) < 1:
    raise ValueError(f"tap ids {taps} include 0 (the embedding output), which SpecForge's layer-output ids cannot "
                     "name")
  out = dict(cfg, architectures=[EAGLE3_ARCHITECTURE], model_type="llama")
  if taps:  # vLLM reads the top-level ids (layer inputs), SGLang / SpecForge eagle_config's (layer outputs)
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in taps], "use_aux_hidden_state": True}
  return out, _with_vocab_maps(cfg, tensors)


def _with_vocab_maps(cfg: dict, tensors: dict) -> dict:
  """d2t / t2d present (identity when the draft vocabulary is the full one)."""
  import numpy as np
  tensors = dict(tensors)
  n, v = int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), int(cfg["vocab_size"])
  d2t = np.asarray(tensors.get("d2t", np.zeros(n)), np.int64)
  t2d = np.zeros(v, bool)
  t2d[np.arange(n) + d2t] = True
  tensors.update(d2t=d2t, t2d=t2d)
  return tensors


def _layer_dict(cfg: dict, model_type: str, drop: tuple[str, ...] = ()) -> dict:
  keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
          "rope_parameters", "attention_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
  out = {k: cfg[k] for k in keys if k in cfg and k not in drop}
  if model_type == "llama":
    out["mlp_bias"] = cfg.get("mlp_bias", False)
  out["model_type"] = model_type
  return out


def _speculators_config(algorithm: str, tokens: int, verifier: str | None) -> dict:
  return {"algorithm": algorithm, "default_proposal_method": "greedy",
          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                "accept_tolerance": 0.0}],
          "verifier": {"name_or_path": verifier, "architectures": _verifier_architectures(verifier)}}


def _verifier_architectures(verifier: str | None) -> list[str]:
  path = Path(verifier) / "config.json" if verifier else None
  if path is not None and path.exists():
    return json.loads(path.read_text()).get("architectures") or []
  return []


def _eagle3_speculators(cfg: dict, tensors: dict, verifier: str | None, tokens: int) -> tuple[dict, dict]:
  qk_norm = "midlayer.self_attn.q_norm.weight" in tensors
  layer = _layer_dict(cfg, "qwen3" if qk_norm else "llama")
  layer["tie_word_embeddings"] = False
  out = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
         "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
         "draft_vocab_size": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
         "target_hidden_size": cfg.get("target_hidden_size"),
         "eagle_aux_hidden_state_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
         **{k: False for k in _SPEC_EAGLE3_OFF}, "embed_requires_grad": False,
         "speculators_config": _speculators_config("eagle3", tokens, verifier)}
  renamed = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
             for k, v in tensors.items()}
  if out["draft_vocab_size"] == cfg["vocab_size"]:
    renamed.pop("d2t", None), renamed.pop("t2d", None)
  else:
    renamed = _with_vocab_maps(cfg, renamed)
  return out, renamed


def _dflash_speculators(cfg: dict, tensors: dict, verifier: str | None) -> tuple[dict, dict]:
  d = cfg.get("dflash_config") or {}
  block = int(d.get("block_size", cfg.get("block_size", 16)))
  layer = _layer_dict(cfg, "qwen3")
  if cfg.get("mask_token_id") is not None:
    layer["mask_token_id"] = cfg["mask_token_id"]
  out = {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
         "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
         "draft_vocab_size": int(cfg["vocab_size"]), "block_size": block, "target_hidden_size": None,
         "aux_hidden_state_layer_ids": [i + 1 for i in _dflash_ids(cfg)],  # z-lab reads hidden_states[id + 1]
         "mask_token_id": int(d["mask_token_id"]), "sliding_window_non_causal": False, "sample_from_anchor": False,
         "speculators_config": _speculators_config("dflash", block - 1, verifier)}
  return out, dict(tensors)


def _write(out_dir: str | os.PathLike, cfg: dict, tensors: dict, dtype: str) -> Path:
  """config.json (dtype recorded as transformers writes it) + model.safetensors, floating tensors cast."""
  import numpy as np
  import ml_dtypes
  from safetensors.numpy import save_file
  target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  cast = {k: (np.ascontiguousarray(np.asarray(v, np.float32).astype(target))
              if np.issubdtype(np.asarray(v).dtype, np.floating) or np.asarray(v).dtype == ml_dtypes.bfloat16
              else np.ascontiguousarray(v)) for k, v in tensors.items()}
  cfg = dict(cfg, torch_dtype=dtype)
  if "transformer_layer_config" in cfg:
    cfg["transformer_layer_config"] = dict(cfg["transformer_layer_config"], dtype=dtype)
  (out / "config.json").write_text(json.dumps(cfg, indent=2))
  save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
  return out


def read_native(drafter_dir: str | os.PathLike, method: str,
                num_target_layers: int | None = None) -> tuple[dict, dict[str, Any]]:
  """A drafter directory in any supported layout of `method`, as (our config, our tensors) for its loader."""
  cfg, tensors = read_drafter_checkpoint(drafter_dir)
  return to_native(cfg, tensors, method, num_target_layers, where=f" {drafter_dir}")
