"""Runs the `longspec` CLI of a copy of the package installed apart (`pip install --no-deps --target SITE SRC`), not
of the editable checkout, e.g. an earlier commit's code for a before/after comparison:

  git worktree add /tmp/before_src 4496eef
  pip install --no-deps --no-build-isolation --target /tmp/before_site /tmp/before_src
  python scripts/run_installed_cli.py /tmp/before_site bench-suite --config configs/bench/house_check_shipped.yaml \
      --out results/house_check/shipped_before
"""

import sys

if __name__ == "__main__":
  if len(sys.argv) < 2:
    raise SystemExit(__doc__)
  site = sys.argv[1]
  # The editable install's finder would map longspec_jax to this checkout: drop it and put SITE first.
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
  sys.path.insert(0, site)
  import longspec_jax.inference.cli as cli
  if not cli.__file__.startswith(site):
    raise SystemExit(f"longspec_jax came from {cli.__file__}, not {site}")
  sys.exit(cli.main(sys.argv[2:]))
