#!/usr/bin/env bash
# Issue 18 / 12 measurements, one process per row, run on an otherwise idle machine. Usage: bash results/verify_pass/run.sh
set -u
cd "$(dirname "$0")/../.."
OUT=results/verify_pass
DOC=longspec_jax/assets/long_docs/inspect.py.txt
t() { /usr/bin/time -v -o "$1.time" "${@:2}" > "$1.log" 2>&1; echo "$(date +%T) done $1 rc=$?"; }
# 1. per-component profile of a T-row pass, both targets (and SmolLM2 in bf16)
t $OUT/profile_smollm2_fp32 python scripts/profile_verify.py --model smollm2-135m --contexts 1024,4096,8192 --rows 1,9,16 --out $OUT/profile_smollm2_fp32.json
t $OUT/profile_shipped_fp32 python scripts/profile_verify.py --contexts 1024,4096,8192 --rows 1,9,16 --out $OUT/profile_shipped_fp32.json
t $OUT/profile_smollm2_bf16 python scripts/profile_verify.py --model smollm2-135m --dtype bfloat16 --contexts 4096,8192 --rows 1,9,16 --out $OUT/profile_smollm2_bf16.json
# 2. prompt lookup end to end (verify_over_decode, speedup vs AR in the same process)
for spec in "smollm2 --model smollm2-135m --context 4096" "smollm2_yarn --model smollm2-135m --rope-scaling yarn:2 --context 8000" \
            "shipped --context 4096" "shipped8k --context 8192"; do
  set -- $spec; name=$1; shift
  t $OUT/pl_${name}_$(echo "$@" | grep -o '[0-9]*$') longspec bench "$@" --method prompt-lookup --text-file $DOC --new-tokens 128 --repeats 3 --json $OUT/pl_${name}_$(echo "$@" | grep -o '[0-9]*$').json --quiet
done
# 3. the same prompt-lookup rows on the code before this change (a worktree at a0bcb20; OLD=/path/to/it)
if [ -n "${OLD:-}" ]; then
  for spec in "smollm2 --model smollm2-135m --context 4096" "shipped --context 4096"; do
    set -- $spec; name=$1; shift; ctx=$(echo "$@" | grep -o '[0-9]*$')
    (cd "$OLD" && /usr/bin/time -v -o /dev/null python -m inference.cli bench "$@" --method prompt-lookup --text-file $DOC \
      --new-tokens 128 --repeats 3 --json "$OLDPWD/$OUT/pl_${name}_${ctx}_before.json" --quiet > "$OLDPWD/$OUT/pl_${name}_${ctx}_before.log" 2>&1)
    echo "$(date +%T) done before $name rc=$?"
  done
fi
