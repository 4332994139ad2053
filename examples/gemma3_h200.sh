#!/usr/bin/env bash
# Gemma 3 270M end to end on one GPU: the chain of examples/smollm2_h200.sh (prompts, regenerate,
# train, export, evaluate) with Gemma's recipe, configs/gemma3-270m-h200.yaml. Gemma 3 270M is a base
# model: it has no chat template, so each prompt is continued as plain text (its turns after <bos>,
# a blank line between them), and it seldom ends an answer: answers are capped at 256 tokens.
# Figures and the exact commands: docs/benchmarks/gemma3.md.
# Usage: bash examples/gemma3_h200.sh [stage]   (the stages of smollm2_h200.sh; default: all)
set -euo pipefail
export TARGET=gemma3-270m
export RUN=${RUN:-runs/gemma3-h200}
export CONFIG=${CONFIG:-configs/gemma3-270m-h200.yaml}
export ANSWER_TOKENS=${ANSWER_TOKENS:-256}
export NEW_TOKENS=${NEW_TOKENS:-128}
export BATCH=${BATCH:-1024}  # the engine rows its generation was measured at
export EVAL_SETS=${EVAL_SETS:-sharegpt humaneval}
# Gemma's data as measured (docs/benchmarks/gemma3.md): every-turn prompts and code, no two-turn
# conversations (SmolLM2's example asks all of them), the probe every 1,500 steps
export EVERY_PROMPTS=${EVERY_PROMPTS:-37000} MULTI_PROMPTS=${MULTI_PROMPTS:-0} PROBE_EVERY=${PROBE_EVERY:-1500}
exec bash "$(dirname "$0")/smollm2_h200.sh" "$@"
