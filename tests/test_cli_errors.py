"""Bad paths and files through the real CLI entry: one line naming the input, exit 2, no traceback
(and no minute of hub retries for a model id that is not a local directory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_train.cli import main
from tests.generate.conftest import build_tiny_target

REPO = Path(__file__).resolve().parent.parent
CONVERSATION = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def _config(tmp_path: Path, target: str, train_files: list[str] | None = None) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    cfg = {
        "run_dir": str(tmp_path / "run"), "device": "cpu",
        "target": {"path": target},
        "draft": {"num_layers": 1, "target_layer_ids": [0, 1], "attention": "sdpa"},
        "objective": {"block_size": 4, "mask_token_id": 0},
        "data": {"train_files": train_files or [str(data)], "max_length": 64, "token_budget": 128},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _one_line(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_missing_local_target_dir_is_one_line(tmp_path, capsys):
    cfg = _config(tmp_path, str(tmp_path / "no" / "model"))
    _one_line(capsys, main(["train", "-c", str(cfg)]), f"target.path '{tmp_path}/no/model': no such directory")
    _one_line(capsys, main(["eval", "--target", "./no/model", "--drafter", str(tmp_path), "--prompts",
                            str(tmp_path / "train.jsonl")]), "'./no/model': no such directory")


def test_hub_id_without_a_reachable_hub_fails_fast_in_one_line(tmp_path):
    """A real subprocess: nothing is patched, the hub endpoint is a closed local port."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dflash_train", "generate", "--input",
                           str(_config(tmp_path, "x").parent / "train.jsonl"), "--out", str(tmp_path / "out"),
                           "--backend", "local", "--model", "org/name", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 30, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "'org/name': no such directory, and no model hub is reachable (http://127.0.0.1:9" in lines[0]


def test_explicit_offline_mode_missing_model_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    cfg = _config(tmp_path, "org/name")
    _one_line(capsys, main(["train", "-c", str(cfg)]), "target.path 'org/name': cannot load", "offline")


def test_corrupt_checkpoint_on_resume_names_the_file(tmp_path, tiny_target_dir, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")  # truncated
    cfg = _config(tmp_path, str(tiny_target_dir))
    _one_line(capsys, main(["train", "-c", str(cfg), "--resume", str(ckpt)]),
              f"{ckpt}/model.safetensors: unreadable checkpoint file")


def test_train_checks_data_files_before_loading_the_target(tmp_path, monkeypatch, capsys):
    import dflash_train.train.inputs as inputs

    monkeypatch.setattr(inputs, "load_target", lambda *a: pytest.fail("the target loaded before the data check"))
    cfg = _config(tmp_path, "smollm2", train_files=[str(tmp_path / "answers.jsonl")])
    _one_line(capsys, main(["train", "-c", str(cfg)]), f"{tmp_path}/answers.jsonl: no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    cfg = _config(tmp_path, "smollm2", train_files=[str(bad)])
    _one_line(capsys, main(["train", "-c", str(cfg)]), f"{bad}:1: not valid JSON")


def test_train_eval_every_without_prompts_fails_before_loading_the_target(tmp_path, monkeypatch, capsys):
    import dflash_train.train.inputs as inputs

    monkeypatch.setattr(inputs, "load_target", lambda *a: pytest.fail("the target loaded before the eval check"))
    cfg = _config(tmp_path, "smollm2")
    _one_line(capsys, main(["train", "-c", str(cfg), "eval.every=2"]), "eval.every is set but eval.prompts is not")


@pytest.mark.parametrize("command", [["train"], ["capture", "--out", "x"], ["warmup"], ["prepare", "--out", "x"],
                                     ["eval"]], ids=lambda c: c[0])
def test_a_bad_config_fails_before_torch_is_imported(tmp_path, command):
    """A typo in the config is reported in well under a second: no command imports torch,
    transformers or the model code before its config has loaded."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 1.0\n")
    code = ("import sys; from dflash_train.cli import main\n"
            f"rc = main({[command[0], '-c', str(bad), *command[1:]]!r})\n"
            "print('rc', rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "train.lrr: unknown key" in done.stderr, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["2", "False", "False"], (done.stdout, done.stderr[-2000:])


@pytest.mark.slow(seconds=20)
def test_ctrl_c_during_prepare_is_one_line(tmp_path, tiny_target_dir):
    """Ctrl-C reaches the whole process group (the tokeniser pool too): the command says what it kept
    and how to go on, in one line; no traceback from it or its workers."""
    cfg = _config(tmp_path, str(tiny_target_dir))
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} " * 20}]} for i in range(60_000)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "prepare", "-c", str(cfg), "--out",
                             str(tmp_path / "prepared"), "data.tokenize_workers=2"], stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(REPO)}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    seen = []
    for line in proc.stderr:  # the pool is up: the worst moment, mid-chunk in every worker
        seen.append(line)
        if "tokeniser pool of 2" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    err = "".join(seen) + proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "SIGINT: prepare stopped; nothing was written; the same command starts again"
    assert not (tmp_path / "prepared").exists()
