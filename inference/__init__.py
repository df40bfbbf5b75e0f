"""generate(), the jit-compiled draft-verify engine, the jit-able functional API, benchmarks and the CLI."""

from longspec_jax import check_namespaced

check_namespaced(__name__)
