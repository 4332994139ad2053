"""The `dflash-train` commands' arguments: one function a command, `(parser, show_all)`, so that the
parser is one table (cli.py COMMANDS). Run-config commands take -c, dotted overrides and a flag per
config key (`--help` lists the common ones, `--help-all` every one).
"""

from __future__ import annotations

import argparse

from dflash_train.config import COMMON_KEYS, RunConfig
from dflash_train.config_flags import add_config_flags
from dflash_train.eval.config import EvalJobConfig
from dflash_train.generate.config import GenerateConfig


def draft_lengths(text: str) -> tuple[int, ...]:
    from dflash_train.serve.draft_lengths import parse_draft_lengths

    try:
        return parse_draft_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def settings(p: argparse.ArgumentParser, model, what: str, example: str, required: bool = False, short: bool = False,
              dest: str = "overrides", no_default: dict[str, str] | None = None,
              shown: frozenset[str] | None = None) -> argparse.ArgumentParser:
    """-c YAML file, `key=value` overrides and a flag for every field of `model`: one style for every command."""
    p.add_argument("-c", "--config", required=required, help=what)
    p.add_argument(dest, nargs="*", metavar="overrides", help=f"dotted overrides of the config, e.g. {example}")
    add_config_flags(p, model, short=short, no_default=no_default, shown=shown)
    return p


def run_config(show_all: bool, p: argparse.ArgumentParser, required: bool = True, example: str = "train.lr=3e-4"):
    return settings(p, RunConfig, "YAML run config (e.g. configs/qwen3-8b.yaml)", example, required,
                     shown=None if show_all else COMMON_KEYS)


def train_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    run_config(show_all, p).add_argument(
        "--resume", help="'auto' (newest checkpoint of the run dir) or a checkpoint dir; default: start fresh")


def warmup_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    run_config(show_all, p).add_argument("--steps", type=int, help="steps to run; default: train.compile_warmup_steps")


def launch_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    """None here: launch's options (torchrun-style) are parsed by launch itself."""


def prepare_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    run_config(show_all, p, example="data.train_files=[answers/]").add_argument("--out", required=True,
                                                                             help="output dataset directory")


def generate_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    settings(p, GenerateConfig, "generation YAML (GenerateConfig); overrides, then flags, change it",
             "sampling.top_p=0.95", short=True)


def capture_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    run_config(show_all, p)
    p.add_argument("--out", required=True, help="capture directory (resumable: run again to finish it)")
    p.add_argument("--rows-per-shard", type=int, default=1024, help="rows per safetensors shard (default: 1024)")


def eval_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    settings(p, EvalJobConfig, "YAML run config: its target, eval prompts and newest checkpoint become the defaults; "
             "flags override them", "eval.prompts=humaneval", short=True, dest="run_overrides",
             no_default={"target.path": "default: the run config's; required without -c"})


def curve_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("run_dirs", nargs="+", help="run directories holding heldout.jsonl")
    p.add_argument("--out", default="curve.png", help="PNG file to write")


def export_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("checkpoint", help="training checkpoint dir (runs/<name>/checkpoints/step_...), or a run dir: its "
                   "newest checkpoint")
    p.add_argument("--out", help="new export directory")
    p.add_argument("out_dir", nargs="?", help="the same, the older way (export CHECKPOINT DIR)")
    p.add_argument("--target", help="the target, for the mask token's text (default: the checkpoint's run's target)")
    p.add_argument("--mask-token", dest="mask_token", help="the mask token's text (default: looked up in the target's "
                   "tokenizer)")


def doctor_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    run_config(show_all, p, required=False).add_argument("--json", action="store_true", help="machine-readable report")


def diff_runs_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("run_a", help="run directory (holds manifest.json)")
    p.add_argument("run_b", help="run directory to compare with")


def quickstart_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible (bigger run), else cpu")
    # Smaller values make a smoke run (scripts/check_install.sh: 8 2 24 12 and train.epochs=1).
    for flag, what, cpu, cuda in (("--train-prompts", "prompts the target answers for training", 128, 2000),
                                  ("--eval-prompts", "held-out prompts for tau_hat and real speculative decoding", 8, 16),
                                  ("--answer-tokens", "longest regenerated answer, in tokens", 64, 256),
                                  ("--eval-new-tokens", "tokens decoded per held-out prompt when measuring tau", 48, 96)):
        p.add_argument(flag, type=positive_int, metavar="N", help=f"{what} (default: {cpu} on cpu, {cuda} on cuda)")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of configs/quickstart.yaml, e.g. train.max_steps=50 or train.epochs=1")


def prompts_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("--source", default="sharegpt", help="sharegpt (first turns), "
                   "sharegpt-conversations (every user turn), mt-bench, humaneval, python-stubs (code requests "
                   "from the standard library's functions), long (conversations of long requests, 4K-7K tokens; "
                   "with --multi-turn 8 --max-chars 6000) or a JSONL file")
    p.add_argument("--num", type=int, required=True, help="distinct prompts in all (held-out ones included)")
    p.add_argument("--heldout", type=int, required=True, help="the last N go to heldout_prompts.jsonl "
                   "(0: a training-only set; --num: a held-out-only set)")
    p.add_argument("--exclude", nargs="*", default=[], help="prompt sets or files (e.g. humaneval, "
                   "heldout_prompts.jsonl) whose turns must not be chosen (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=2000, help="skip longer first turns")
    p.add_argument("--every-turn", dest="every_turn", action="store_true", help="each user turn is a prompt of "
                   "its own, not only the first (e.g. --source sharegpt-conversations); a conversation with an "
                   "excluded turn is dropped whole")
    p.add_argument("--multi-turn", dest="multi_turn", type=int, metavar="N", help="conversations of 2..N user "
                   "turns, each answered by the target after its own earlier answers (generate answers them in "
                   "order); cut before a turn over --max-chars, dropped whole when a turn is excluded")
    p.add_argument("--out", required=True, help="directory for train_prompts.jsonl and heldout_prompts.jsonl")


def corpus_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files (e.g. heldout_prompts.jsonl) whose "
                   "prompts must not occur in any kept conversation (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=4000,
                   help="most characters per segment; conversations are cut at user turns (default: 4000)")
    p.add_argument("--max-total-chars", dest="max_total_chars", type=int, default=None,
                   help="stop once this many characters are written (default: all)")
    p.add_argument("--out", required=True, help="JSONL file of {id, messages} rows")


def serve_check_args(p: argparse.ArgumentParser, show_all: bool) -> None:
    from dflash_train.serve.llama_cpp import BUILD_TIME

    p.add_argument("--engine", default="llama.cpp", choices=["llama.cpp"], help="the serving engine (default: llama.cpp)")
    p.add_argument("--target", required=True, help="the target: an HF model dir, or smollm2 / gemma3-270m")
    p.add_argument("--drafter", required=True, help="what eval decodes: a training checkpoint or an export folder")
    p.add_argument("--export", help="what llama.cpp serves: an export folder (default: --drafter, exported first "
                   "when it is a checkpoint); naming both checks an export against its checkpoint")
    p.add_argument("--out", default="serve-check", help="folder for the GGUFs, server logs and serve_check.json "
                   "(default: serve-check)")
    p.add_argument("--prompts", default="mt-bench", help="prompts: a set or JSONL file (default: mt-bench)")
    p.add_argument("--num-prompts", dest="num_prompts", type=positive_int, default=20, help="first turns decoded "
                   "(default: 20)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=positive_int, default=128,
                   help="tokens per answer (default: 128)")
    p.add_argument("--gguf-type", dest="gguf_type", default="f32", choices=["f32", "bf16", "f16"],
                   help="GGUF weights; f32 (default) computes as eval's float32, so answers compare exactly")
    p.add_argument("--max-tau-gap", dest="max_tau_gap", type=float, default=0.03, help="fail when llama.cpp's mean "
                   "accepted length differs from eval's tau by more than this share (default: 0.03)")
    p.add_argument("--min-identical", dest="min_identical", type=float, default=0.9, help="f32: fail when a smaller "
                   "share of prompts has llama.cpp's verification steps and accepted drafts exactly ours (default: 0.9)")
    p.add_argument("--threads", type=positive_int, help="llama-server threads (default: llama.cpp's)")
    p.add_argument("--draft-lengths", dest="draft_lengths", type=draft_lengths, metavar="N,N,..",
                   help="llama.cpp's --spec-draft-n-max values to measure tokens/s at, e.g. 1,3,7,15; the fastest "
                   "lossless one is reported (default: the block's full length, block size - 1, always measured)")
    p.add_argument("--draft-p-min", dest="draft_p_min", type=float, default=0.0, help="llama.cpp's "
                   "--spec-draft-p-min, and ours alike: a DSpark or DFlash2 draft stops at its first slot whose "
                   "confidence (DSpark's head, DFlash2's selector) reads below it (default: 0, off)")
    p.add_argument("--backend-sampling", dest="backend_sampling", action="store_true", help="llama.cpp's -bs: "
                   "the target picks its greedy token on the device, no logits copied to the host (default: off)")
    p.add_argument("--our-speed", dest="our_speed", action=argparse.BooleanOptionalAction, default=True,
                   help="beside llama.cpp's, our static decoder's speedup on the same prompts and device (default: True; "
                   "--no-our-speed skips it, on a CPU a few minutes for 20 prompts)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where llama.cpp serves: "
                   "cuda needs a CUDA build (--build-llama-cpp builds one for this GPU) and puts every layer "
                   "of target and drafter on the GPU (default: auto, cuda when an NVIDIA GPU is visible)")
    p.add_argument("--llama-cpp", dest="llama_cpp", metavar="DIR", help="a llama.cpp source tree with llama-server "
                   "built in DIR/build/bin (default: llama-server on PATH, else the cached pinned build)")
    p.add_argument("--build-llama-cpp", dest="build_llama_cpp", action="store_true", help="no llama.cpp found: "
                   "build the pinned release into the cache (cmake and a C++ compiler, and for cuda the CUDA "
                   f"toolkit; the CPU build: {BUILD_TIME})")
