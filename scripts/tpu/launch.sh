#!/usr/bin/env bash
# Copies this checkout to every host of the slice and installs it there with JAX for TPU.
# Usage: scripts/tpu/launch.sh   (rerun after changing the code: it replaces the remote copy)
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
. "$(dirname "$0")/env.sh"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
archive="$(mktemp -d)/longspec.tar.gz"
# The tracked files only (no virtualenv, runs or data).
git -C "$repo" archive --format=tar.gz --prefix="$REMOTE_DIR/" -o "$archive" HEAD
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:longspec.tar.gz" \
  --zone="$ZONE" --project="$PROJECT_ID" --worker=all
tpu_ssh_all "rm -rf $REMOTE_DIR && tar -xzf longspec.tar.gz && cd $REMOTE_DIR && \
  python3 -m venv .venv && . .venv/bin/activate && pip install --quiet --upgrade pip && \
  pip install --quiet -e . 'jax[tpu]==0.10.2' && \
  python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
echo "installed on every host of $TPU_NAME; next: scripts/tpu/run.sh train-drafter --drafter pard ..."
