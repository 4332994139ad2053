"""Time to first training step, cold vs warm persistent compile cache (GPU).

Each measurement runs in a FRESH process (in-memory caches cannot help): a 5-layer Qwen3-8B-width
drafter step (compiled layers + compiled flex_attention, 512 anchors x 16, 3072 context tokens) on
random features. The first process starts with an empty cache root, the second with the root the
first one filled.
    python bench/compile_start.py --out compile_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def first_step() -> dict:
    t0 = time.perf_counter()
    import torch

    from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
    from dflash_train.config_model import ObjectiveConfig
    from dflash_train.draft.objective import draft_loss, make_task
    from dflash_train.checks import compile_cache

    key = compile_cache.cache_key()
    state = compile_cache.cache_state(key)
    compile_cache.activate(key)
    cfg = DraftModelConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           intermediate_size=12288, num_hidden_layers=5, vocab_size=151936, block_size=16,
                           target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669)
    dev = torch.device("cuda")
    drafter = DFlashDraftModel(cfg).to(dev)
    for layer in drafter.layers:
        layer.compile()
    embed = torch.randn(cfg.vocab_size, 4096, device=dev, dtype=torch.bfloat16) * 0.02
    t = 3072
    ids = torch.randint(0, 150000, (1, t), device=dev)
    loss_mask = torch.ones(1, t, dtype=torch.long, device=dev)
    loss_mask[:, :400] = 0
    feats = torch.randn(1, t, 5 * 4096, device=dev, dtype=torch.bfloat16)
    task = make_task(ids, loss_mask, ObjectiveConfig(num_anchors=512, block_size=16, slot_weights="decay", gamma=7.0), 0)
    t_build = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = draft_loss(drafter, task, feats, embed, embed, True, 4096)
    (out.weighted_ce_sum / task.weights.sum()).backward()
    torch.cuda.synchronize()
    t_first = time.perf_counter()
    compile_cache.mark_warm(key, info={"first_step_s": t_first - t_build})
    return {"cache_state_at_start": state, "process_to_first_step_s": t_first - t0,
            "compile_and_first_step_s": t_first - t_build, "key": key}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(first_step()))
        return
    root = tempfile.mkdtemp(prefix="dflash-cache-", dir=os.path.expanduser("~"))
    env = dict(os.environ, DFLASH_TRAIN_CACHE=root)
    runs = []
    for label in ("cold", "warm"):
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        runs.append({"run": label, **json.loads(line[len("RESULT "):])})
    result = {"runs": runs, "speedup": runs[0]["compile_and_first_step_s"] / runs[1]["compile_and_first_step_s"]}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
