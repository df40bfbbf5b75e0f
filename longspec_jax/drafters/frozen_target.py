"""The target's frozen parts a drafter reads: which of its layers to tap, and its embedding, LM head and final norm
carried in a drafter's parameters (`io`), with the functions that apply them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
  """n target layers evenly spaced from layer 1 to layer L-3 (clamped into [0, L-1] for tiny targets)."""
  last = num_target_layers - 1
  start = min(1, last)
  end = min(max(start, num_target_layers - 3), last)
  return tuple(int(round(x)) for x in np.linspace(start, end, n))


def check_reads_target(what: str, arch, num_target_layers: int, target, fields: tuple[str, ...]) -> None:
  """A drafter (`arch`, made for a `num_target_layers`-layer target) reads `target`'s hidden states and uses its
  embedding / LM head: the layer count and `fields` of the two configs must agree."""
  problems = []
  if num_target_layers != target.num_hidden_layers:
    problems.append(f"trained for a {num_target_layers}-layer target, this one has {target.num_hidden_layers}")
  for name in fields:
    if getattr(arch, name) != getattr(target, name):
      problems.append(f"{name} {getattr(arch, name)} vs the target's {getattr(target, name)}")
  if problems:
    raise ValueError(f"{what} drafter does not match the target: " + "; ".join(problems))


def target_io(target, final_norm: bool = False) -> dict:
  """The target's frozen embedding (a drafter embeds its block with it), LM head when untied (logits are read
  through it) and, with `final_norm`, its final RMSNorm (for a drafter that has none of its own)."""
  io = {"embed": target.embed_tokens.embedding[...]}
  if target.lm_head is not None:
    io["lm_head"] = target.lm_head.kernel[...]
  if final_norm:
    io.update(norm=target.norm.scale[...], norm_eps=jnp.float32(target.norm.eps))
  return io


def embed_tokens(io, tokens, dtype):
  return io["embed"][tokens].astype(dtype)


def head_logits(io, h):
  if "lm_head" in io:
    return jnp.einsum("...h,hv->...v", h, io["lm_head"].astype(h.dtype), preferred_element_type=jnp.float32)
  return jnp.einsum("...h,vh->...v", h, io["embed"].astype(h.dtype), preferred_element_type=jnp.float32)


def apply_final_norm(io, h):
  """The target's final RMSNorm from `target_io(target, final_norm=True)`."""
  x32 = h.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + io["norm_eps"])
  return (io["norm"].astype(jnp.float32) * y).astype(h.dtype)
