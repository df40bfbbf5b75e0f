#!/usr/bin/env bash
# Creates the TPU VM slice (one VM per host) named $TPU_NAME. Usage: scripts/tpu/create.sh
set -euo pipefail
# shellcheck source=scripts/tpu/env.sh
. "$(dirname "$0")/env.sh"
gcloud compute tpus tpu-vm create "$TPU_NAME" \
  --zone="$ZONE" \
  --project="$PROJECT_ID" \
  --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION"
echo "created $TPU_NAME ($ACCELERATOR_TYPE in $ZONE); next: scripts/tpu/launch.sh"
