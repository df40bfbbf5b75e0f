#!/usr/bin/env bash
# Session 10: XLA:CPU's library-fusion flags against the default (YNNPACK runs each dot), on an idle machine.
#   bash results/verify_pass/session10/xla_flags.sh
cd "$(dirname "$0")/../../.."
OUT=results/verify_pass/session10
for v in default noind big; do
  case $v in
    default) fl="";;
    noind) fl="--xla_cpu_experimental_ynn_fusion_type=-individual_dot";;   # XLA's own dot emitters
    big) fl="--xla_cpu_experimental_ynn_fusion_type=+dot,+eltwise,+reduce";;  # larger YNNPACK fusions
  esac
  XLA_FLAGS="$fl" python scripts/profile_verify.py --contexts 4096 --rows 1,9 --repeats 15 --out $OUT/flags_shipped_$v.json > $OUT/flags_shipped_$v.log 2>&1
  XLA_FLAGS="$fl" python scripts/profile_verify.py --model smollm2-135m --contexts 8192 --rows 1,9 --repeats 9 --out $OUT/flags_smollm2_$v.json > $OUT/flags_smollm2_$v.log 2>&1
done
