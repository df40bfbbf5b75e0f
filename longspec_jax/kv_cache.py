"""Static KV cache: preallocated [layers, batch, S_max, kv_heads, head_dim] buffers plus per-sequence lengths.

Writes land at each sequence's own offset; rejected speculative rows are never erased, the length pointer simply
does not cover them and later writes overwrite them.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S_max, Hkv, D]
  v: jax.Array  # [L, B, S_max, Hkv, D]
  lengths: jax.Array  # [B] int32: committed positions per sequence

  @classmethod
  def zeros(cls, num_layers, batch, max_len, kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
    shape = (num_layers, batch, max_len, kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes + self.lengths.nbytes
