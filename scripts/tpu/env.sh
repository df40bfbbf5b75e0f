#!/usr/bin/env bash
# Settings shared by the TPU scripts: export them (or edit the defaults) before running create/launch/run/teardown.
# ACCELERATOR_TYPE and RUNTIME_VERSION must be a pair Cloud TPU offers (e.g. v5litepod-16 with
# v2-alpha-tpuv5-lite, v5p-32 with v2-alpha-tpuv5, v4-32 with tpu-ubuntu2204-base).
# shellcheck disable=SC2034  # sourced by the other scripts
TPU_NAME="${TPU_NAME:-longspec}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
PROJECT_ID="${PROJECT_ID:-$(gcloud config get-value project 2>/dev/null)}"
# Where the repository lives on every host (a copy per host; runs/ and data/ there are per host unless shared).
REMOTE_DIR="${REMOTE_DIR:-longspec-jax}"

tpu_ssh_all() {
  # Runs one shell command on every host of the slice at once.
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT_ID" --worker=all --command="$1"
}
