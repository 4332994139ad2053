#!/usr/bin/env bash
# DFlash against DFlash2 (and DSpark) at equal device-minutes on one GPU, on one shared regeneration (SmolLM2 by
# default: examples/smollm2_h200.sh's stages and recipe). Arms:
#   dflash    BUDGET minutes of DFlash
#   dflash2   BUDGET minutes of DFlash2 from scratch
#   warm      BUDGET/2 minutes of DFlash, then BUDGET/2 of DFlash2 started from it (draft.init_from)
#   dspark    BUDGET minutes of DSpark (DFlash's layers and a Markov head) from scratch
#   ARM-VARIANT any arm above with one change (`variant_args`): decay (the decay's slot weights instead of
#             D-PACE, the default), join (a label outside the top k joins the selector's candidates instead
#             of giving no selector loss, the default), uniform (the selector's rows weighed alike, not by
#             their slot's weight); dpace and skip name the defaults
# Each arm's training is one `train` with train.time_budget_minutes (compilation before its clock),
# exported, then every arm is evaluated side by side (fp32, greedy, lossless-checked) on the held-out
# ShareGPT prompts, HumanEval and MT-Bench. The table at the end reads each arm's reports.
# Usage: bash examples/compare_families.sh [data|train|eval|table|all]   (default: all)
# A short protocol: EVERY_PROMPTS=24000 MULTI_PROMPTS=0 BUDGET=4 (docs/benchmarks/quality.md#dflash2).
set -euo pipefail
ROOT=${ROOT:-runs/families}
BUDGET=${BUDGET:-4}
ARMS=${ARMS:-dflash dflash2 warm}
FAMILY_ARGS=${FAMILY_ARGS:-"objective.loss.ce=1 objective.loss.selector=1"}  # DFlash2's loss (more overrides welcome)
DSPARK_ARGS=${DSPARK_ARGS:-}       # DSpark's overrides (e.g. objective.loss.l1=0.9 objective.loss.ce=0.1)
COMMON_ARGS=${COMMON_ARGS:-}       # overrides every arm takes (e.g. objective.slot_weights=decay objective.gamma=4.0)
export DATA=${DATA:-$ROOT/data}
CHAIN=(bash "$(dirname "$0")/smollm2_h200.sh")
half=$(python3 -c "print($BUDGET / 2)")

data() {  # prompts (unless already there), the target's answers, tokenised once
  [ -f "$DATA/heldout_prompts.jsonl" ] || RUN=$ROOT "${CHAIN[@]}" prompts
  RUN=$ROOT "${CHAIN[@]}" generate
  RUN=$ROOT TRAIN_ARGS="$COMMON_ARGS" "${CHAIN[@]}" prepare  # the data keys of COMMON_ARGS apply here too
}

train_arm() {  # $1: run dir, $2: minutes, then overrides
  local run=$1 minutes=$2; shift 2
  RUN=$run TRAIN_ARGS="train.time_budget_minutes=$minutes $COMMON_ARGS $*" "${CHAIN[@]}" train
}

variant_args() {  # $1: an arm's variant (its name past the first '-'): the overrides it adds
  case $1 in
    "") ;;
    decay) echo objective.slot_weights=decay ;;
    dpace) echo objective.slot_weights=dpace ;;
    join) echo objective.selector_outside_top_k=join ;;
    skip) echo objective.selector_outside_top_k=skip ;;
    uniform) echo objective.selector_weights=uniform ;;
    *) echo "unknown variant '$1' (decay, dpace, join, skip, uniform)" >&2; return 2 ;;
  esac
}

train() {
  local arm base variant overrides extra first
  for arm in $ARMS; do
    base=${arm%%-*} variant=${arm#*-}
    [ "$base" = "$arm" ] && variant=""
    overrides=$(variant_args "$variant") || return 2
    read -r -a extra <<< "$overrides"
    case $base in
      dflash) train_arm "$ROOT/$arm" "$BUDGET" "${extra[@]}" ;;
      # shellcheck disable=SC2086
      dflash2) train_arm "$ROOT/$arm" "$BUDGET" draft.family=dflash2 $FAMILY_ARGS "${extra[@]}" ;;
      warm)  # a selector variant changes the DFlash2 half only: DFlash has no selector
        [[ $overrides == *selector* ]] && first=() || first=("${extra[@]}")
        train_arm "$ROOT/$base-dflash${arm#"$base"}" "$half" "${first[@]}"
        # shellcheck disable=SC2086
        train_arm "$ROOT/$arm" "$half" draft.family=dflash2 draft.init_from="$ROOT/$base-dflash${arm#"$base"}/export" \
          $FAMILY_ARGS "${extra[@]}" ;;
      # shellcheck disable=SC2086
      dspark) train_arm "$ROOT/$arm" "$BUDGET" draft.family=dspark $DSPARK_ARGS "${extra[@]}" ;;
      *) echo "unknown arm '$arm' in ARMS (dflash, dflash2, warm, dspark, each optionally -decay, -join, -uniform, -dpace or -skip)" >&2
         return 2 ;;
    esac
  done
}

evaluate() {  # every arm's export on the three sets, side by side on the one GPU
  local pids=() arm
  for arm in $ARMS; do
    RUN=$ROOT/$arm "${CHAIN[@]}" eval-sets > "$ROOT/$arm/eval.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

table() {  # tau per set and arm, from the reports; training steps and tokens/s from each summary
  python3 - "$ROOT" $ARMS <<'EOF'
import json, sys
from pathlib import Path
root, arms = Path(sys.argv[1]), sys.argv[2:]
print(f"{'arm':10} {'steps':>6} {'tok/s':>9}  " + "  ".join(f"{s:>14}" for s in ("sharegpt", "humaneval", "mt-bench")))
for arm in arms:
    summary = json.loads((root / arm / "summary.json").read_text())
    last = summary["last"]
    cells = []
    for name in ("sharegpt", "humaneval", "mt-bench"):
        report = json.loads((root / arm / "eval" / name / "eval.json").read_text())
        lossless = report["lossless"]
        cells.append(f"{report['tau']:.3f} {lossless['matches']}/{lossless['total']}")
    print(f"{arm:10} {summary['steps']:>6} {last.get('tokens_per_s', 0):>9.0f}  " + "  ".join(f"{c:>14}" for c in cells))
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
