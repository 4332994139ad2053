# driver: python run.py NAME json_sizes override...
import json, sys, time
import os
import dflash_train.quickstart as q
from dflash_train.quickstart import Sizes, run_quickstart
if os.environ.get('QS_REUSE_DATA'):
    q.regenerate = lambda *a, **k: None  # training-only rerun on copied data
name, sizes_json, *ov = sys.argv[1:]
rd = f"runs/qs_{name}"
base = dict(train_prompts=128, eval_prompts=8, answer_tokens=64, eval_new_tokens=48)
base.update(json.loads(sizes_json))
t=time.time()
r = run_quickstart(device="cpu", overrides=[f"run_dir={rd}", f"data.train_files=[{rd}/data/train]", *ov], sizes=Sizes(**base))
print("RESULT", name, json.dumps({k: r[k] for k in ("before","after","seconds")}))
