# Sourced by scripts/device_*.sh: when longspec_jax is not installed (a bare accelerator image with JAX but no
# network), expose this checkout as the package through a folder of links, since pyproject maps inference/,
# training/ and pallas_kernels/ into the longspec_jax namespace and a plain PYTHONPATH would not. Checked from / so
# that the checkout itself is not on sys.path. Needs $PY; $1 names the calling script in its message.
if ! (cd / && "$PY" -c "import longspec_jax.inference") 2>/dev/null; then
  SRC_LINKS=$(mktemp -d)/src
  mkdir -p "$SRC_LINKS/longspec_jax"
  for f in "$PWD"/longspec_jax/*; do ln -s "$f" "$SRC_LINKS/longspec_jax/"; done
  for d in inference training pallas_kernels; do ln -s "$PWD/$d" "$SRC_LINKS/longspec_jax/$d"; done
  # PYTHONSAFEPATH (Python >= 3.11): `python -m` must not put the checkout's own longspec_jax/ first on sys.path.
  export PYTHONPATH="$SRC_LINKS${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
  echo "$1: longspec_jax is not installed; using this checkout through $SRC_LINKS"
fi
