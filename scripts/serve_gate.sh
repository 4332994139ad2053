#!/usr/bin/env bash
# The serving gate: the quickstart's drafter (SmolLM2, trained on CPU) served by llama.cpp must be
# lossless with llama.cpp's acceptance within 3% of our eval's on the same prompts; the same check
# must fail on an export with one field broken (the captured target layers changed). Run by .ci/run
# after the tests; needs llama.cpp (python -m dflash_train.serve.llama_cpp finds or builds it).
# The checks after the first compare exports and rounds, not speed: --no-our-speed.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BIN="$REPO/.venv/bin"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dflash-serve-gate.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t_start=$SECONDS
step() { echo "== [$((SECONDS - t_start)) s] $*"; }

step "dflash-train quickstart (CPU) in $WORK"
(cd "$WORK" && "$BIN/dflash-train" quickstart --device cpu > quickstart.log 2>&1) || { tail -20 "$WORK/quickstart.log"; exit 1; }
ckpt=$(ls -d "$WORK"/runs/quickstart/checkpoints/step_* | sort | tail -1)

step "serve-check of $ckpt"
"$BIN/dflash-train" serve-check --target smollm2 --drafter "$ckpt" --out "$WORK/served" --num-prompts 20 \
    --max-new-tokens 128

step "a broken export must fail the check"
"$BIN/dflash-train" export "$ckpt" --out "$WORK/broken" >/dev/null
"$BIN/python" - "$WORK/broken/config.json" <<'PY'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
layers = config["dflash_config"]["target_layer_ids"]
config["dflash_config"]["target_layer_ids"] = [i + 1 for i in layers]  # off by one, as a hand edit might be
json.dump(config, open(path, "w"), indent=2)
print(f"target_layer_ids {layers} -> {config['dflash_config']['target_layer_ids']}")
PY
set +e
"$BIN/dflash-train" serve-check --target smollm2 --drafter "$ckpt" --export "$WORK/broken" --out "$WORK/served" \
    --no-our-speed --num-prompts 8 --max-new-tokens 64
rc=$?
set -e
if [ "$rc" -ne 1 ]; then
    echo "serve-check of the broken export exited $rc, expected 1 (FAILED)" >&2
    exit 1
fi
step "DFlash2: the quickstart's drafter with perturbed convolutions and a random selector, round for round"
"$BIN/python" - "$ckpt" "$WORK/dflash2" <<'PY'
import dataclasses, json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from dflash_train.draft.dflash2 import DFlash2DraftModel
from dflash_train.eval.export import export_config, mask_token_text, read_drafter_folder
v1, state = read_drafter_folder(sys.argv[1])
cfg = dataclasses.replace(v1, family="dflash2", conv_kernel_size=2, conv_group_size=64, selector_rank=32,
                          selector_top_k=4)
model = DFlash2DraftModel(cfg)
model.load_state_dict(state, strict=False)
model.reset_dflash2()  # drafts as the quickstart's drafter; then every new part moved off identity
torch.manual_seed(0)
with torch.no_grad():
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel[:, 1] += 0.3 * torch.randn_like(conv.base_kernel[:, 1])
            conv.kernel_projection.weight.normal_(std=0.015)
    for p in model.candidate_selector.parameters():
        p.normal_(std=0.3)
out = Path(sys.argv[2])
out.mkdir()
(out / "config.json").write_text(json.dumps(export_config(cfg, mask_token_text("smollm2", cfg.mask_token_id))))
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
PY
"$BIN/dflash-train" serve-check --target smollm2 --drafter "$WORK/dflash2" --out "$WORK/served" --num-prompts 8 \
    --no-our-speed --max-new-tokens 128
"$BIN/python" - "$WORK/served/serve_check.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
same = s["same_steps_and_accepted"]
assert same["matches"] == same["total"], f"DFlash2: llama.cpp's rounds differ from ours on {same}"
print(f"DFlash2: {s['engine_accepted']} accepted in {s['engine_verification_steps']} steps on both sides")
PY
step "DSpark: warm-started from the quickstart's drafter, trained on its data, round for round"
(cd "$WORK" && "$BIN/dflash-train" train -c "$REPO/dflash_train/configs/quickstart.yaml" device=cpu \
    run_dir=runs/dspark draft.family=dspark draft.dspark.markov_rank=32 "draft.init_from=$ckpt" train.epochs=2 \
    > dspark_train.log 2>&1) || { tail -20 "$WORK/dspark_train.log"; exit 1; }
dspark=$(ls -d "$WORK"/runs/dspark/checkpoints/step_* | sort | tail -1)
"$BIN/dflash-train" serve-check --target smollm2 --drafter "$dspark" --out "$WORK/served" --num-prompts 8 \
    --no-our-speed --max-new-tokens 128
"$BIN/python" - "$WORK/served/serve_check.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
same = s["same_steps_and_accepted"]
assert same["matches"] == same["total"], f"DSpark: llama.cpp's rounds differ from ours on {same}"
print(f"DSpark: {s['engine_accepted']} accepted in {s['engine_verification_steps']} steps on both sides")
PY
step "serve gate passed"
