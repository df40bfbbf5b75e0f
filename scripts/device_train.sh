#!/usr/bin/env bash
# Drafter training on a lent accelerator, one command sized by a time budget (issue 56):
#   1. the corpus (data/corpus) if absent: `longspec corpus`, built from the Python standard library's source
#   2. the distillation store: SmolLM2-135M run teacher-forced over 8K windows of the corpus train split (10% its own
#      continuations), taps 2,15,27,28 and K/V of layers 1,14,27 in fp8, top-32 soft labels; streamed to disk shard
#      by shard (make-distill-store --max-minutes); it lives in --work, not under --out (tens of GB)
#   3. the shipped wide EAGLE-3 and 4. LongSpark SmolLM2 drafters trained on it with the shipped store configs
#      (train-drafter, time_budget_minutes: the first steps are timed and the step count set to fit; orbax
#      checkpoints every minute in --work, and a run whose steps slow down stops at its deadline and exports)
#   5. held-out tau_sim on the store's held-out windows (scripts/store_eval.py) of the new drafters in their shipped
#      storage form (int8, scripts/quantize_checkpoint.py) and, on SmolLM2, of the shipped ones on the same windows
# Under --out: eagle3/ and longspark/ (drafter directories as shipped), the trainers' logs, eval.json, a log of
# every stage and summary.json (stage timings, tokens, steps, tau), written also when the run is cut part-way.
# Plan and arithmetic for a 10-minute H100 call: results/device_train/README.md.
#
#   bash scripts/device_train.sh                  # on the accelerator machine, from the repository root
#   bash scripts/device_train.sh --minutes 8      # the whole run's budget (default 8, dry run 0.5; fixed shares)
#   bash scripts/device_train.sh --dry-run --out DIR   # any CPU: the same stages at toy size on the shipped 8.4M
#                                                      # target (tests/test_device_train.py runs it)
# --out defaults to $OUT when set (the device machine's return folder), else results/device_train/run;
# --work (store and checkpoints) defaults to /tmp/device_train_work (dry run: DIR/work).
set -euo pipefail

DRY_RUN=0
MINUTES=""
OUT_DIR=${OUT:-results/device_train/run}
WORK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --minutes) MINUTES="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    --work) WORK="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "device_train.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n $MINUTES ]] || MINUTES=$([[ $DRY_RUN == 1 ]] && echo 0.5 || echo 8)
if ! [[ $MINUTES =~ ^[0-9]+([.][0-9]+)?$ ]] || [[ $MINUTES =~ ^0*([.]0*)?$ ]]; then
  echo "device_train.sh: --minutes must be a positive number, got '$MINUTES'" >&2
  exit 2
fi
PY=${PYTHON:-python3}
[[ -n $WORK ]] || WORK=$([[ $DRY_RUN == 1 ]] && echo "$OUT_DIR/work" || echo /tmp/device_train_work)
mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(cd "$WORK" && pwd)
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/use_checkout.sh" device_train  # the checkout as the package when not installed
LONGSPEC=("$PY" -m longspec_jax.inference.cli)
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())")
echo "device_train: backend $BACKEND, dry run $DRY_RUN, budget $MINUTES min, results in $OUT_DIR, work in $WORK"
if [[ $DRY_RUN == 0 && $BACKEND == cpu ]]; then
  echo "device_train: no accelerator found (jax backend cpu); use --dry-run on a CPU" >&2
  exit 1
fi

# Shares of the budget (minutes): the store, each trainer's loop; the rest (~25%) goes to what the stages spend
# outside those clocks (imports, the target's load, compiling, reading the store's argmax counts, export, eval).
share() { "$PY" -c "import sys; print(round(float(sys.argv[1]) * float(sys.argv[2]), 3))" "$MINUTES" "$1"; }
STORE_MIN=$(share 0.30)
EAGLE3_MIN=$(share 0.25)
LONGSPARK_MIN=$(share 0.20)
STORE="$WORK/store"
CORPUS=data/corpus
if [[ $DRY_RUN == 1 ]]; then
  # The shipped 8-layer target: EAGLE-3 taps its default aux layers (2, 4, 5), a 3-layer LongSpark reads the K/V
  # of layers (1, 3, 5) and their outputs (taps 2, 4, 6).
  STORE_ARGS=(--max-documents 40 --window 512 --max-tokens 3072 --shard-tokens 1024 --topk 8 --taps 2,4,5,6 --kv-layers 1,3,5
              --dtype float8 --on-policy-fraction 0.3 --on-policy-new-tokens 16)
  COMMON=(--set val_fraction=0.3 --set val_windows=2 --set compute_dtype=float32 --set steps=16
          --set log_every=1 --set checkpoint_every_minutes=1.0)
  EAGLE3_SETS=(--set context_len=64 --set attn_block=64 --set batch_size=2 --set draft_vocab_size=1024
               --set model.num_attention_heads=4 --set model.num_key_value_heads=2 --set model.intermediate_size=256)
  LONGSPARK_SETS=(--set batch_size=2 --set draft_vocab_size=1024 --set mask_token_id=-1 --set raw_window=64
                  --set tail_rows=64 --set anchors_per_window=4 --set model.intermediate_size=128)
  EVAL_ARGS=(--draws 2 --val-fraction 0.3)
  BASELINES=()  # the shipped small-target drafters read other layers than this store holds
else
  # SmolLM2-135M: EAGLE-3's aux layers 2, 15, 27; LongSpark's K/V of layers 1, 14, 27 and their outputs (taps 2,
  # 15, 28), as the shipped drafters (their drafter.json). EAGLE-3 batches 16x the shipped run's (the GPU idles at
  # 4), LongSpark's 4x (each window brings its 8K prefix K/V: the host's copying bounds it; results/device_train).
  STORE_ARGS=(--model smollm2-135m --window 8192 --max-tokens 9000000 --taps 2,15,27,28 --kv-layers 1,14,27
              --dtype float8 --on-policy-fraction 0.1 --on-policy-new-tokens 256 --quiet)
  COMMON=(--set steps=1000000 --set eval_every=0 --set log_every=20 --set checkpoint_every_minutes=1.0)
  EAGLE3_SETS=(--set batch_size=64 --set draft_vocab_size=4096)
  LONGSPARK_SETS=(--set batch_size=16)
  EVAL_ARGS=(--draws 32)
  BASELINES=(--drafter shipped_eagle3=longspec_jax/assets/drafters/eagle3-smollm2-135m
             --drafter shipped_longspark=longspec_jax/assets/drafters/longspark-smollm2-135m)
fi

STAGES="$OUT_DIR/stages.tsv"
: > "$STAGES"
FAILED=()
write_summary() {
  local rc=$?
  set +e
  "$PY" - "$OUT_DIR" "$WORK" "$STAGES" "$DRY_RUN" "$MINUTES" "$BACKEND" "$rc" <<'EOF'
import json, sys
from pathlib import Path
out, work, stages, dry, minutes, backend, rc = sys.argv[1:]
out, work = Path(out), Path(work)
def read(path):
  try:
    return json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return None
summary = {"dry_run": dry == "1", "budget_minutes": float(minutes), "backend": backend, "exit_code": int(rc),
           "stages": [{"stage": s, "seconds": float(t), "ok": ok == "ok"}
                      for s, t, ok in (l.split("\t") for l in Path(stages).read_text().splitlines() if l)]}
index = read(work / "store" / "index.json")
if index:
  summary["store"] = {"stored_tokens": index["stored_tokens"], "shards": len(index["shards"]),
                      "bytes": index["bytes"], "runs": index.get("runs", [])}
corpus = read("data/corpus/manifest.json")
if corpus:
  summary["corpus"] = {"train_chars": corpus["splits"]["train"]["chars"], "python": corpus.get("python_version")}
evals = (read(out / "eval.json") or {}).get("drafters", {})
for kind in ("eagle3", "longspark"):
  info, budget = read(out / kind / "drafter.json"), read(work / kind / "budget.json")
  rec = {"budget": budget}
  if info:
    rec.update({k: info.get(k) for k in ("steps", "batch_size", "tokens_seen", "anchors_seen", "epochs",
                                          "final_loss", "train_wall_s", "parameters", "data")})
    # the trainer's own held-out score of its bf16 export (same held-out windows, its own batch draws)
    rec["trainer_val_tau_sim_bf16"] = info.get("val_tau_sim")
  # scripts/store_eval.py: the int8 copy and (SmolLM2) the shipped drafter on the same held-out draws
  tau = {label: evals[name]["val_tau_sim"] for label, name in (("new_int8", kind), ("shipped", f"shipped_{kind}"))
         if name in evals}
  if tau:
    rec["held_out_tau_sim"] = tau
  summary[kind] = rec
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"device_train: wrote {out / 'summary.json'}")
EOF
  [[ $rc -eq 0 ]] || echo "device_train: stopped early (exit $rc); summary.json holds the stages that finished" >&2
}
trap write_summary EXIT
trap 'exit 143' TERM INT
# Each stage's wall time goes to stages.tsv; its output to OUT/NAME.log (and the terminal). A failed stage is
# listed and the script goes on where the next stage can (a lent machine's minutes are few), exiting 1 at the end.
stage() {
  local name=$1; shift
  echo "== $name"
  local t0 rc
  t0=$(date +%s.%N)
  set +e
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  local secs
  secs=$("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0")
  printf '%s\t%s\t%s\n' "$name" "$secs" "$([[ $rc == 0 ]] && echo ok || echo failed)" >> "$STAGES"
  echo "device_train: stage $name took $secs s (exit $rc)"
  if [[ $rc != 0 ]]; then FAILED+=("$name"); fi
  return 0
}

corpus() {
  if [[ -f $CORPUS/dataset_dict.json ]]; then
    echo "corpus: $CORPUS is there ($(du -sh "$CORPUS" | cut -f1))"
  else
    "${LONGSPEC[@]}" corpus --out "$CORPUS" && echo "corpus: built $CORPUS ($(du -sh "$CORPUS" | cut -f1))"
  fi
}
distill_store() {
  "${LONGSPEC[@]}" make-distill-store --corpus "$CORPUS" --out "$STORE" --max-minutes "$STORE_MIN" "${STORE_ARGS[@]}"
}
train() {
  local kind=$1 minutes=$2; shift 2
  local rc=0
  "${LONGSPEC[@]}" train-drafter --drafter "$kind" --config "configs/drafter_${kind}_smollm2_store.yaml" \
    --set "store_dir=$STORE" --set "out_dir=$WORK/$kind" --set "time_budget_minutes=$minutes" "${COMMON[@]}" "$@" \
    || rc=$?
  cp "$WORK/$kind/train_log.jsonl" "$OUT_DIR/${kind}_train_log.jsonl" || true
  return $rc
}
shipped_form() {  # the int8 copies as shipped, then every drafter scored on the same held-out windows
  rm -rf "$OUT_DIR/eagle3" "$OUT_DIR/longspark"
  "$PY" scripts/quantize_checkpoint.py --src "$WORK/eagle3/final" --out "$OUT_DIR/eagle3" \
    --src "$WORK/longspark/final" --out "$OUT_DIR/longspark"
  # (the bf16 exports' scores on these windows are their drafter.json's val_tau_sim, from the trainers)
  "$PY" scripts/store_eval.py --store "$STORE" --drafter "eagle3=$OUT_DIR/eagle3" \
    --drafter "longspark=$OUT_DIR/longspark" "${BASELINES[@]}" "${EVAL_ARGS[@]}" --out "$OUT_DIR/eval.json"
}

stage corpus corpus
stage distill_store distill_store
stage train_eagle3 train eagle3 "$EAGLE3_MIN" --set max_train_tokens=0 --set held_out_within_tokens=0 \
  "${EAGLE3_SETS[@]}"
stage train_longspark train longspark "$LONGSPARK_MIN" "${LONGSPARK_SETS[@]}"
stage eval shipped_form
[[ ${#FAILED[@]} -eq 0 ]] || { echo "device_train: ${#FAILED[@]} stage(s) failed: ${FAILED[*]}" >&2; exit 1; }
