"""Data, losses, the sharded trainer (Optax, jax.sharding, orbax) and the target and drafter trainers."""

from longspec_jax import check_namespaced

check_namespaced(__name__)
