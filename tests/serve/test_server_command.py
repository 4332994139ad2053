"""The llama-server command lines serve-check forms: on CPU, on a CUDA build, at a chosen draft length;
and that the pinned llama-server knows every flag (where it is built)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dflash_train.serve.llama_cpp import LlamaCpp, LlamaCppError, find_llama_cpp
from dflash_train.serve.llama_server import Completion, LlamaServer


def command(cuda: bool, drafter: bool = True, **kw) -> list[str]:
    llama = LlamaCpp(server=Path("/llama.cpp/build/bin/llama-server"), source=Path("/llama.cpp"), cuda=cuda)
    return LlamaServer(llama, Path("t.gguf"), Path("d.gguf") if drafter else None, 16, Path("server.log"),
                       exact=True, **kw).cmd


def value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_on_cpu_the_drafter_drafts_the_full_block_and_nothing_is_offloaded():
    cmd = command(cuda=False)
    assert value(cmd, "--spec-draft-n-max") == "15" and value(cmd, "--spec-type") == "draft-dflash"
    assert "-ngl" not in cmd and "-ngld" not in cmd
    assert value(cmd, "-ctk") == value(cmd, "-ctkd") == "f32" and value(cmd, "-fa") == "off"


def test_a_cuda_build_puts_every_layer_of_both_models_on_the_gpu():
    cmd = command(cuda=True, draft_length=3)
    assert value(cmd, "-ngl") == "99" and value(cmd, "-ngld") == "99"
    assert value(cmd, "--spec-draft-n-max") == "3"
    target_only = command(cuda=True, drafter=False)
    assert value(target_only, "-ngl") == "99" and "-ngld" not in target_only and "-md" not in target_only


def test_backend_sampling_is_asked_for_only_when_chosen():
    assert "-bs" not in command(cuda=True)
    assert "-bs" in command(cuda=True, backend_sampling=True)


def test_the_built_llama_server_knows_every_flag():
    try:
        llama = find_llama_cpp()
    except LlamaCppError as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds llama.cpp before the tests: {err}")
        pytest.skip(str(err))
    usage = subprocess.run([str(llama.server), "--help"], capture_output=True, text=True, timeout=60).stdout
    flags = [arg for arg in command(cuda=True, draft_length=3, backend_sampling=True) + ["-t"] if arg.startswith("-")]
    assert [flag for flag in flags if f"{flag}," not in usage and f"{flag} " not in usage] == []


def test_the_drafters_time_is_read_from_llama_cpps_trace_lines_one_per_request(tmp_path):
    """llama.cpp prints its drafter's running totals at each finished request (format of
    common/speculative.cpp's common_speculative_print_stats); each completion gets its own share."""
    assert value(command(cuda=True), "-lv") == "4" and "-lv" not in command(cuda=True, drafter=False)
    line = ("0.0{i}.472.365 I spec common_specu: statistics     draft-dflash: #calls(b,g,a) =    {b} {g:6d} {g:6d}, "
            "#gen drafts = {g:6d}, #acc drafts = 3, #gen tokens = 45, #acc tokens = 9, #mean acc len = 1.50, "
            "#acc rate/pos = (0.5, 0.1), dur(b,g,a) = 0.050, {ms:.3f}, 0.200 ms\n")
    log = tmp_path / "server.log"
    log.write_text("0.00.1 I slot print_timing: id  0 | task 0 | eval time = 9.0 ms / 8 tokens\n"
                   + "".join(line.format(i=i, b=i + 1, g=g, ms=ms) for i, (g, ms) in enumerate([(3, 1.5), (13, 6.5)])))
    server = LlamaServer(LlamaCpp(server=Path("s"), source=Path("."), cuda=True), Path("t"), Path("d"), 16, log)
    warm_up, answer = Completion(tokens=[1], seconds=0.01), Completion(tokens=[2], seconds=0.02)
    server.time_drafting([warm_up, answer])
    assert (warm_up.draft_calls, warm_up.draft_seconds) == (3, pytest.approx(0.0015))
    assert (answer.draft_calls, answer.draft_seconds) == (10, pytest.approx(0.005))
    other = Completion(tokens=[3], seconds=0.01)
    server.time_drafting([other])  # two lines for one completion: not this log's requests, left unset
    assert other.draft_seconds is None and other.draft_calls == 0
