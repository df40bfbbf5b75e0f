#!/usr/bin/env bash
# Starts the same `longspec` command on every host at once, as one multi-process JAX job (SPMD): each host runs
# `longspec --distributed ...`, which calls jax.distributed.initialize(); on a TPU slice the coordinator address,
# process count and process id come from the TPU environment. Output of every host streams back here.
# Usage: scripts/tpu/run.sh COMMAND [ARGS...]   e.g. scripts/tpu/run.sh train-drafter --drafter pard
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
. "$(dirname "$0")/env.sh"
if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]  (a longspec subcommand, run on every host)" >&2
  exit 2
fi
args="$(printf '%q ' "$@")"
tpu_ssh_all "cd $REMOTE_DIR && . .venv/bin/activate && longspec --distributed $args"
