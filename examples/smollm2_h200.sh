#!/usr/bin/env bash
# SmolLM2-135M-Instruct end to end on one GPU, the way a user runs it (the recipe of the 2026-12-04
# chain: real held-out tau 3.534 ShareGPT, 3.35 HumanEval, 3.34 MT-Bench from 25.3 device-minutes in its
# stages on one H200; docs/benchmarks/chain.md):
#   prompts  -> 13,504 + 200 held-out distinct ShareGPT first turns (all the package has of <= 1,500
#               characters, case and spaces ignored); then the training prompts: the first EVERY_PROMPTS
#               distinct user turns of every conversation, each asked alone (a conversation that asks a
#               held-out prompt dropped whole; HumanEval and MT-Bench excluded); MULTI_PROMPTS
#               conversations asked turn after turn; CODE_PROMPTS HumanEval-shaped requests built from
#               the standard library's documented functions (HumanEval's own excluded)
#   generate -> SmolLM2 answers every training prompt file itself in one invocation, greedy, <= 512
#               new tokens (in-process, resumable), into $DATA/train
#   generate-heldout -> SmolLM2's answers to the held-out prompts: `train` then scores tau_hat and
#               tau_decode (decoding replayed) on them every PROBE_EVERY steps against device-seconds
#               (heldout.jsonl; `dflash-train curve`)
#   prepare  -> TRAIN_FILES tokenised once into $DATA/prepared (one forked process per core)
#   warmup   -> the drafter's step compiled for every shape bucket into the compile cache, so the
#               training budget goes to steps
#   train    -> configs/smollm2-h200.yaml on $DATA/prepared, then export the last checkpoint
#   eval     -> greedy speculative decoding on HumanEval (164), MT-Bench (80 x 2 turns) and the 200
#               held-out prompts: tau, histogram, lossless check (fp32, prompts decoded in batches),
#               then speedup (bf16, batch 1, KV caches: as served)
# Usage: bash examples/smollm2_h200.sh [prompts|generate|generate-heldout|prepare|warmup|train|eval|all]
#        (default: all; eval = eval-sets, eval-curve (tau at 1/3 and 2/3 of training), then speedup)
# Each stage reads what the one before wrote under $RUN; each can be rerun (generate resumes).
# The eval stages are independent: on two GPUs, run them side by side with CUDA_VISIBLE_DEVICES
# (EVAL_SETS picks the sets of eval-sets; EVAL_SETS=long adds tau by context length to 4K-8K tokens,
# 205 conversations of the `long` set: docs/design.md#data-formats).
# The variables below shrink it (CI runs it on CPU with a dozen prompts: tests/test_examples.py);
# TARGET, CONFIG and GEN_CONFIG run the same chain for another target (examples/gemma3_h200.sh).
set -euo pipefail
TARGET=${TARGET:-smollm2}
RUN=${RUN:-runs/smollm2-h200}
CONFIG=${CONFIG:-configs/smollm2-h200.yaml}
GEN_CONFIG=${GEN_CONFIG:-configs/generate/smollm2-local.yaml}
DEVICE=${DEVICE:-cuda}
DATA=${DATA:-$RUN/data}            # prompts and answers (another run can train on the same data)
NUM_PROMPTS=${NUM_PROMPTS:-13704}  # held-out ones included; all the package has (distinct ignoring case and spaces)
HELDOUT=${HELDOUT:-200}
ANSWER_TOKENS=${ANSWER_TOKENS:-512}
BATCH=${BATCH:-2048}               # rows the engine decodes at once: with 64-position KV blocks, 8.8% faster in the job than 1,024 rows
                                   # with 128 (generate_local.md)
ENGINE=${ENGINE:-graphed}          # in-process generation engine: graphed (its step compiled: flex decoding), static, padded
EVERY_PROMPTS=${EVERY_PROMPTS:-50564}  # training prompts: distinct user turns of every conversation (all of them)
CODE_PROMPTS=${CODE_PROMPTS:-3561} # all the stubs of <= 1,500 characters
MULTI_PROMPTS=${MULTI_PROMPTS:-10524}  # also conversations of 2..MULTI_TURNS turns, answered turn after turn (0: none; all of them)
MULTI_TURNS=${MULTI_TURNS:-2}      # 2: a third answer would mostly fall past data.max_length (1,024 tokens)
MAX_CHARS=${MAX_CHARS:-1500}       # longest prompt drawn (characters; the counts above are at 1,500)
TRAIN_FILES=${TRAIN_FILES:-$DATA/train}  # comma-separated answer directories
TRAIN_ARGS=${TRAIN_ARGS:-}         # extra dotted overrides of $CONFIG
EVAL_BATCH=${EVAL_BATCH:-256}      # prompts decoded together for acceptance
NEW_TOKENS=${NEW_TOKENS:-256}      # eval answer length
EVAL_PROMPTS=${EVAL_PROMPTS:-}     # first N prompts of each eval set (default: all)
CURVE_PROMPTS=${CURVE_PROMPTS:-}   # first N HumanEval prompts for the earlier checkpoints (default: all)
SPEEDUP_PROMPTS=${SPEEDUP_PROMPTS:-20}
EVAL_SETS=${EVAL_SETS:-humaneval sharegpt mt-bench}
DT=(python3 -m dflash_train)

last_checkpoint() { ls -d "$RUN"/checkpoints/step_* | sort | tail -1; }

prompts() {  # held-out first turns, then the training prompts: every turn of the other conversations,
  # the multi-turn conversations when asked, the code requests
  "${DT[@]}" prompts --source sharegpt --num "$NUM_PROMPTS" --heldout "$HELDOUT" --max-chars "$MAX_CHARS" --out "$DATA"
  "${DT[@]}" prompts --source sharegpt-conversations --every-turn --num "$EVERY_PROMPTS" --heldout 0 --max-chars "$MAX_CHARS" \
    --exclude "$DATA/heldout_prompts.jsonl" humaneval mt-bench --out "$DATA/every"
  if [ "$MULTI_PROMPTS" -gt 0 ]; then
    "${DT[@]}" prompts --source sharegpt-conversations --multi-turn "$MULTI_TURNS" --num "$MULTI_PROMPTS" --heldout 0 --max-chars "$MAX_CHARS" \
      --exclude "$DATA/heldout_prompts.jsonl" humaneval mt-bench --out "$DATA/multi_prompts"
  fi
  if [ "$CODE_PROMPTS" -gt 0 ]; then
    "${DT[@]}" prompts --source python-stubs --num "$CODE_PROMPTS" --heldout 0 --max-chars "$MAX_CHARS" \
      --exclude humaneval --out "$DATA/code_prompts"
  fi
}

generate_train() {  # every training prompt file in one invocation: the model loads and its step compiles once
  local inputs=(--input "$DATA/every/train_prompts.jsonl")
  [ "$MULTI_PROMPTS" -gt 0 ] && inputs+=(--input "$DATA/multi_prompts/train_prompts.jsonl")
  [ "$CODE_PROMPTS" -gt 0 ] && inputs+=(--input "$DATA/code_prompts/train_prompts.jsonl")
  generate "$DATA/train" "${inputs[@]}"
}

generate() {  # $1: output directory; then generate's flags: --input FILE (one or more), others
  local out=$1; shift
  "${DT[@]}" generate -c "$GEN_CONFIG" --model "$TARGET" \
    --out "$out" --max-tokens "$ANSWER_TOKENS" --device "$DEVICE" --batch-size "$BATCH" \
    --concurrency $((2 * BATCH)) --engine "$ENGINE" $([ "$ENGINE" = graphed ] && echo --compile-step) "$@"
}

prepare() {  # every answer tokenised once (TRAIN_ARGS' data keys apply here too); train reads the shards
  # shellcheck disable=SC2086
  "${DT[@]}" prepare -c "$CONFIG" --out "$DATA/prepared" "data.train_files=[$TRAIN_FILES]" $TRAIN_ARGS
}

warmup() {  # the drafter's step compiled for every shape bucket, on the prepared data
  # shellcheck disable=SC2086
  "${DT[@]}" warmup -c "$CONFIG" run_dir="$RUN" device="$DEVICE" "data.train_files=[$DATA/prepared]" $TRAIN_ARGS
}

train() {
  local probe=()  # held-out tau_hat and tau_decode against device-seconds, when the held-out answers exist (generate-heldout)
  [ -d "$DATA/heldout" ] && probe=("eval.heldout_files=[$DATA/heldout]" "eval.heldout_every=${PROBE_EVERY:-6000}")
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of overrides
  "${DT[@]}" train -c "$CONFIG" run_dir="$RUN" device="$DEVICE" "data.train_files=[$DATA/prepared]" "${probe[@]}" \
    $TRAIN_ARGS --resume auto
  "${DT[@]}" export "$(last_checkpoint)" "$RUN/export"
}

evaluate() {  # $1: drafter dir, $2: report dir; then eval's flags (--prompts SET, one or more; the last --num-prompts wins)
  local drafter=$1 out=$2; shift 2
  "${DT[@]}" eval --target "$TARGET" --drafter "$drafter" --max-new-tokens "$NEW_TOKENS" \
    --device "$DEVICE" --batch-size "$EVAL_BATCH" ${EVAL_PROMPTS:+--num-prompts "$EVAL_PROMPTS"} --out "$out" "$@"
}

eval_sets() {  # the trained drafter on the sets, in one process (target and drafter loaded once), each
  # report in $RUN/eval/<set>; fp32: the lossless check is exact
  local names=() sets=() set out="$RUN/eval"
  for set in $EVAL_SETS; do
    case $set in
      humaneval|mt-bench|long) sets+=(--prompts "$set") ;;
      sharegpt) sets+=(--prompts "sharegpt=$DATA/heldout_prompts.jsonl") ;;
      *) echo "unknown eval set '$set' in EVAL_SETS (humaneval, sharegpt, mt-bench, long)" >&2; return 2 ;;
    esac
    names+=("$set")
  done
  [ ${#names[@]} -eq 0 ] && return 0
  # one set writes its report where --out says, several one directory each inside it
  [ ${#names[@]} -eq 1 ] && out="$RUN/eval/${names[0]}"
  evaluate "$RUN/export" "$out" "${sets[@]}" --dtype float32 --speed-prompts 0
}

eval_curve() {  # tau against training length: the checkpoints at ~1/3 and ~2/3 of the run
  local ckpts=("$RUN"/checkpoints/step_*) m
  m=$((${#ckpts[@]} - 1))  # the earlier checkpoints (eval-sets has the last)
  for ckpt in $(printf '%s\n' "${ckpts[$((m / 3))]}" "${ckpts[$((2 * m / 3))]}" | sort -u); do
    evaluate "$ckpt" "$RUN/eval/humaneval_$(basename "$ckpt")" --prompts humaneval --dtype float32 --speed-prompts 0 \
      ${CURVE_PROMPTS:+--num-prompts "$CURVE_PROMPTS"}
  done
}

speedup() {  # speed as served: bf16 (the target's dtype), one prompt at a time, KV caches (its lossless
  # count is bf16's: near-ties may flip between a 16-token verification and a 1-token decode)
  evaluate "$RUN/export" "$RUN/eval/humaneval_speedup" --prompts humaneval --num-prompts "$SPEEDUP_PROMPTS" \
    --speed-prompts "$SPEEDUP_PROMPTS"
}

case "${1:-all}" in
  prompts) prompts ;;
  generate) generate_train ;;
  generate-heldout) generate "$DATA/heldout" --input "$DATA/heldout_prompts.jsonl" ;;
  prepare) prepare ;;
  warmup) warmup ;;
  train) train ;;
  eval) eval_sets; eval_curve; speedup ;;
  eval-sets) eval_sets ;;
  eval-curve) eval_curve ;;
  speedup) speedup ;;
  all) prompts; generate_train; generate "$DATA/heldout" --input "$DATA/heldout_prompts.jsonl"; prepare; warmup; train; eval_sets; eval_curve; speedup ;;
  *) echo "usage: $0 [prompts|generate|generate-heldout|prepare|warmup|train|eval|eval-sets|eval-curve|speedup|all]" >&2
     exit 2 ;;
esac
