#!/usr/bin/env bash
# Deletes the slice (billing stops). Copy results off first, e.g.:
#   gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:longspec-jax/runs" . --zone="$ZONE" --worker=0
# Usage: scripts/tpu/teardown.sh
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
. "$(dirname "$0")/env.sh"
gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --project="$PROJECT_ID" --quiet
echo "deleted $TPU_NAME"
