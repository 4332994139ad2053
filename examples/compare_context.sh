#!/usr/bin/env bash
# A drafter trained on long rows against the recipe's 1,024 tokens a row, at equal device-minutes, on one
# shared regeneration with multi-turn conversations (SmolLM2 by default: examples/smollm2_h200.sh's stages
# and recipe). Arms, each FAMILY (compare_families.sh's arms) for BUDGET minutes:
#   short   data.max_length as the recipe has it (1,024)
#   long    LONG_LENGTH tokens a row; a batch is padded to the next of LONG_BUCKETS, and draws
#           num_anchors a row up to the recipe's 1,024 tokens and in proportion beyond
#           (objective.num_anchors_length): its short rows train as the short arm's do, only the long
#           rows cost more (results/smollm2-h100/long-8k-2.5min: why both matter)
# Both are evaluated (fp32, greedy, lossless-checked) on the held-out ShareGPT prompts, HumanEval and
# MT-Bench, and on LONG_PROMPTS conversations of the long set asked turn after turn, with tau by
# context bucket (0-1K ... 4K-8K). The table at the end reads the reports.
# Usage: bash examples/compare_context.sh [data|train|eval|table|all]   (default: all)
set -euo pipefail
ROOT=${ROOT:-runs/context}
BUDGET=${BUDGET:-4}
FAMILY=${FAMILY:-dflash2}
SHORT_LENGTH=${SHORT_LENGTH:-1024}  # the recipe's data.max_length: the length its num_anchors is sized for
LONG_LENGTH=${LONG_LENGTH:-8192}
LONG_BUCKETS=${LONG_BUCKETS:-[256,512,768,1024,1536,2048,3072,4096,6144,8192]}  # no spaces: one override
LONG_PROMPTS=${LONG_PROMPTS:-64}    # conversations of the long set evaluated
LONG_BATCH=${LONG_BATCH:-32}        # of them decoded together: 32 contexts of up to 8K tokens hold ~12 GiB of SmolLM2 KV cache in fp32
COMMON_ARGS=${COMMON_ARGS:-}       # overrides both arms take
ARMS=${ARMS:-short long}           # the arms train, eval and table run (one of them: e.g. a rerun of that arm)
for arm in $ARMS; do
  case $arm in short|long) ;; *) echo "unknown arm '$arm' in ARMS (short, long)" >&2; exit 2 ;; esac
done
export EVERY_PROMPTS=${EVERY_PROMPTS:-24000} MULTI_PROMPTS=${MULTI_PROMPTS:-4000} MULTI_TURNS=${MULTI_TURNS:-8}
export DATA=${DATA:-$ROOT/data}
LONG_DATA=$ROOT/long-data          # the same answers, tokenised at LONG_LENGTH
LONG_FILE=${LONG_FILE:-$DATA/long/heldout_prompts.jsonl}
LONG_ARGS="data.max_length=$LONG_LENGTH data.length_bucket=0 data.length_buckets=$LONG_BUCKETS objective.num_anchors_length=$SHORT_LENGTH"
HERE=$(dirname "$0")
CHAIN=(bash "$HERE/smollm2_h200.sh")
DT=(python3 -m dflash_train)

data() {  # prompts (unless already there), the long set, the target's answers, tokenised once per arm
  [ -f "$DATA/heldout_prompts.jsonl" ] || RUN=$ROOT "${CHAIN[@]}" prompts
  if [ ! -f "$LONG_FILE" ]; then  # prompts writes DIR/heldout_prompts.jsonl
    [ "$(basename "$LONG_FILE")" = heldout_prompts.jsonl ] || { echo "LONG_FILE=$LONG_FILE does not exist" >&2; return 2; }
    "${DT[@]}" prompts --source long --multi-turn 8 --max-chars 6000 --num "$LONG_PROMPTS" --heldout "$LONG_PROMPTS" \
      --out "$(dirname "$LONG_FILE")"
  fi
  RUN=$ROOT "${CHAIN[@]}" generate
  RUN=$ROOT TRAIN_ARGS="$COMMON_ARGS" "${CHAIN[@]}" prepare
  mkdir -p "$LONG_DATA" && cp "$DATA/heldout_prompts.jsonl" "$LONG_DATA/"
  # held-out answers (generate-heldout), where present, probe both arms alike: a probe's pauses count in the budget
  if [ -d "$DATA/heldout" ]; then ln -sfn "$(cd "$DATA/heldout" && pwd)" "$LONG_DATA/heldout"; fi
  local answers=$DATA/train  # named first: an assignment before a command sees the ones left of it
  DATA=$LONG_DATA RUN=$ROOT TRAIN_FILES=$answers TRAIN_ARGS="$COMMON_ARGS $LONG_ARGS" "${CHAIN[@]}" prepare
}

train() {  # the arms one after the other, each compare_families.sh's FAMILY arm
  local arm data extra
  for arm in $ARMS; do
    data=$DATA extra=""; [ $arm = long ] && data=$LONG_DATA extra=$LONG_ARGS
    ROOT=$ROOT/$arm DATA=$data ARMS=$FAMILY BUDGET=$BUDGET COMMON_ARGS="$COMMON_ARGS $extra" \
      bash "$HERE/compare_families.sh" train
  done
}

evaluate() {  # every arm's short sets and long set side by side on the one GPU
  local pids=() arm data run
  for arm in $ARMS; do
    data=$DATA; [ $arm = long ] && data=$LONG_DATA
    run=$ROOT/$arm/$FAMILY
    DATA=$data RUN=$run "${CHAIN[@]}" eval-sets > "$ROOT/$arm/eval.log" 2>&1 &
    pids+=($!)
    "${DT[@]}" eval --target "${TARGET:-smollm2}" --drafter "$run/export" --prompts "long=$LONG_FILE" \
      --num-prompts "$LONG_PROMPTS" --max-new-tokens "${NEW_TOKENS:-256}" --device "${DEVICE:-cuda}" \
      --batch-size "$LONG_BATCH" --dtype float32 --speed-prompts 0 --out "$run/eval/long" > "$ROOT/$arm/eval_long.log" 2>&1 &
    pids+=($!)
  done
  local failed=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return $failed
}

table() {  # tau per set and arm, the long set's by context bucket; steps and tokens/s from each summary
  python3 - "$ROOT" "$FAMILY" $ARMS <<'EOF'
import json, sys
from pathlib import Path
root, family = Path(sys.argv[1]), sys.argv[2]
for arm in sys.argv[3:]:
    run = root / arm / family
    summary = json.loads((run / "summary.json").read_text())
    cells = []
    for name in ("sharegpt", "humaneval", "mt-bench", "long"):
        report = json.loads((run / "eval" / name / "eval.json").read_text())
        cells.append(f"{name} {report['tau']:.3f} ({report['lossless']['matches']}/{report['lossless']['total']})")
    print(f"{arm:6} steps {summary['steps']:>6}  tokens/s {summary['last'].get('tokens_per_s', 0):>9.0f}  " + "  ".join(cells))
    buckets = json.loads((run / "eval" / "long" / "eval.json").read_text())["tau_by_context"]
    print(" " * 7 + "long set by context: " + "  ".join(f"{b['context']} {b['tau']:.3f} ({b['rounds']} rounds)" for b in buckets))
EOF
}

case "${1:-all}" in
  data) data ;;
  train) train ;;
  eval) evaluate ;;
  table) table ;;
  all) data; train; evaluate; table ;;
  *) echo "usage: $0 [data|train|eval|table|all]" >&2; exit 2 ;;
esac
