#!/usr/bin/env bash
# Our AR vs transformers AR, one process per row (see README.md here). Usage: bash results/ar_vs_transformers/run.sh
set -u
cd "$(dirname "$0")/../.."
OUT=results/ar_vs_transformers
DOC=longspec_jax/assets/long_docs/inspect.py.txt
for spec in "shipped 1024" "shipped 4096" "shipped 16384" "smollm2 1024 --model smollm2-135m" "smollm2 4096 --model smollm2-135m" \
            "smollm2 8000 --model smollm2-135m --rope-scaling yarn:2" "smollm2 16000 --model smollm2-135m --rope-scaling yarn:2"; do
  set -- $spec; name=$1_$2; ctx=$2; shift 2
  /usr/bin/time -v -o $OUT/$name.time longspec bench "$@" --method ar --text-file $DOC --context $ctx --new-tokens 64 \
    --repeats 3 --peer transformers --json $OUT/$name.json --quiet > $OUT/$name.log 2>&1
  echo "$(date +%T) done $name rc=$?"
done
