"""The benchmarks keep working: their CPU modes run in CI (figures come from the H200s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from throughput import is_sync_warning, main  # noqa: E402


@pytest.mark.slow(seconds=3)
@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_throughput_benchmark_runs_each_family(family, tmp_path):
    """Each drafting family's step with the loss terms only it trains (e.g. DFlash2's selector), the
    layers recomputed in the backward for one of them."""
    recompute = ["--activation-checkpointing"] if family == "dflash2" else []
    result = main(["--tiny", "--steps", "1", "--headline", "--family", family, *recompute, "--out", str(tmp_path / "b.json")])
    assert result["family"] == family and result["drafter_tokens_per_s"] > 0
    assert result["activation_checkpointing"] is bool(recompute)


@pytest.mark.slow(seconds=3)
def test_throughput_benchmark_cpu_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = main(["--tiny", "--steps", "1", "--profile", "--out", str(out)])
    assert out.is_file()
    assert result["profile_e2e"]["families_ms"]["matmul"] > 0 and result["profile_target"]["wall_ms"] > 0
    for key in ("target_tokens_per_s", "drafter_tokens_per_s", "e2e_tokens_per_s", "drafter_steps_per_s",
                "drafter_with_task_steps_per_s", "block_mask_ms", "block_mask_create_block_mask_ms"):
        assert result[key] > 0
    assert result["anchors"] == 16 and result["block_size"] == 16
    assert result["compile_settings"]["inductor"] == {}  # no kernel tuning behind these rates


def test_sync_count_skips_the_debug_mode_notice():
    # torch's own texts: the first is what every synchronising call warns (or raises) in the sync debug
    # mode; the second is warned once when the mode is switched on, and was once counted as a sync.
    assert is_sync_warning("called a synchronizing CUDA operation")
    assert not is_sync_warning("Synchronization debug mode is a prototype feature and does not yet detect all "
                               "synchronizing operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)")


@pytest.mark.slow(seconds=95)
def test_multi_gpu_fault_run_cpu(tmp_path):
    """bench/multi_gpu.py on CPU (gloo): killing the target rank, then a drafter rank, stops each
    launch within seconds; two resumes finish the run with the uninterrupted run's exact losses."""
    import dist_setup
    import multi_gpu

    setup, out = tmp_path / "setup", tmp_path / "out"
    dist_setup.main(["--out", str(setup), "--shape", "tiny", "--rows", "64", "--max-length", "128", "--anchors", "8"])
    # each launch's start (three processes importing torch and transformers) is most of its time, not
    # its steps: 20 of them still kill each rank after a checkpoint and resume across two more
    multi_gpu.main(["--setup", str(setup), "--out", str(out), "--variants", "1t1d", "fault", "--steps", "20",
                    "--warm", "5", "--log-every", "1", "--checkpoint-every", "5", "--kill-steps", "6", "12"])
    reference = json.loads((out / "1t1d.json").read_text())
    assert reference["returncode"] == 0 and reference["steady_tokens_per_s"] > 0
    fault = json.loads((out / "fault.json").read_text())
    assert [k["killed_rank"] for k in fault["kills"]] == [0, 1]
    for kill in fault["kills"]:
        assert kill["launcher_rc"] != 0 and kill["exit_s_after_kill"] < 60 and not kill["surviving_processes"], kill
    assert fault["resume_returncode"] == 0 and fault["final_step"] == 20
    assert fault["compared_steps"] == list(range(1, 21)) and fault["max_abs_loss_diff_vs_1t1d"] == 0.0


def test_spec_speed_cpu_mode(tmp_path):
    """bench/spec_speed.py --tiny: both batch sizes run (eagerly on CPU), fp32 answers all equal."""
    import spec_speed

    out = tmp_path / "spec.json"
    result = spec_speed.main(["--tiny", "--batch", "1", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    for run, rows in zip(result["runs"], (1, 2)):
        assert run["rows"] == rows and run["graphs"] is False and run["differences"]["differ"] == 0
        assert run["spec_tokens_per_s"] > 0 and run["tau"] >= 1


def test_speedup_vs_tau_reads_reports_and_fits_one_slope_per_batch(tmp_path):
    import speedup_vs_tau

    runs = {"a": [(1, 1.0, 0.7), (8, 1.0, 0.6)], "b": [(1, 3.0, 2.1), (8, 3.0, 1.5)]}
    files = []
    for name, rows in runs.items():
        report = {"runs": [{"rows": r, "tau": t, "speedup": s} for r, t, s in rows] + [{"rows": 4, "error": "x"}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
        files.append(f"{name}={tmp_path / name}.json")
    pts = speedup_vs_tau.main([*files, "--out", str(tmp_path / "s.png")])
    assert len(pts) == 4 and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"  # the failed run is left out
    assert speedup_vs_tau.slope(pts, 1) == pytest.approx((0.7 + 3 * 2.1) / 10)  # sum(t*s) / sum(t*t)


def test_sweep_chart_takes_each_runs_last_probe_and_orders_by_value(tmp_path, capsys):
    import sweep_chart

    def run(name, minutes, records):
        d = tmp_path / name
        d.mkdir()
        probes = [{"step": s, "device_seconds": m * 60, "tau_hat": t, "tau_decode": t - 0.2, "loss": 9 - t}
                  for s, m, t in records]
        (d / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probes))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 20, "loss": 5.0}) + "\n")
        return d

    hi = run("hi", 2.7, [(100, 1.0, 1.5), (400, 2.7, 2.0)])
    lo = run("lo", 2.7, [(500, 2.7, 2.5)])
    sweeps = sweep_chart.main(["--sweep", "lr", f"{hi}=4e-3", f"{lo}=1e-3", "--out", str(tmp_path / "s.png")])
    assert [(p["run"], p["value"], p["tau_hat"], p["steps"]) for p in sweeps["lr"]] == [
        ("lo", 1e-3, 2.5, 500), ("hi", 4e-3, 2.0, 400)]  # the last probe record, in order of value
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "unequal budgets" not in capsys.readouterr().out

    short = run("short", 1.0, [(50, 1.0, 1.2)])
    sweep_chart.main(["--sweep", "lr", f"{short}=2e-3", f"{lo}=1e-3", "--out", str(tmp_path / "t.png")])
    assert "unequal budgets" in capsys.readouterr().out


def test_loop_speed_runs_the_three_feature_sources_on_the_same_batches(tmp_path):
    """bench/loop_speed.py on a tiny target: the capture is timed once and reused by a second call,
    each arm trains the same batches (equal tokens a step), and the memory arm starts with every row
    cached."""
    import dist_setup
    import loop_speed

    setup = tmp_path / "setup"
    dist_setup.main(["--out", str(setup), "--shape", "tiny", "--rows", "24", "--max-length", "128", "--anchors", "8"])
    args = ["-c", str(setup / "run.yaml"), "train.log_every=1", "--work", str(tmp_path / "work"), "--steps", "4"]
    first = loop_speed.main(args)
    assert not first["capture"]["reused"] and first["capture"]["rows"] == 24 and first["capture"]["tokens_per_s"] > 0
    arms = first["arms"]
    assert set(arms) == {"target", "capture", "memory"} and all(a["steps_per_s"] > 0 for a in arms.values())
    assert len({a["tokens_per_step"] for a in arms.values()}) == 1
    assert arms["memory"]["cached_rows"] == arms["memory"]["rows"] == 24
    # the memory arm trains without touching the shards; the capture arm reads a row per row trained
    assert arms["memory"]["capture_rows_read"] == 0 and arms["capture"]["capture_rows_read"] == 4
    assert arms["target"]["capture_rows_read"] == 0
    again = loop_speed.main([*args, "--arms", "memory", "cached"])
    assert again["capture"]["reused"] and again["capture"]["tokens_per_s"] is None
    assert list(again["arms"]) == ["memory", "cached"]
    # the cached arm fills the same cache from the target: no capture read, the same batches
    cached = again["arms"]["cached"]
    assert cached["cached_rows"] == 24 and cached["capture_rows_read"] == 0
    assert cached["tokens_per_step"] == arms["memory"]["tokens_per_step"]
    alone = loop_speed.main([*args[:-4], "--work", str(tmp_path / "work2"), "--steps", "2", "--arms", "cached"])
    assert "capture" not in alone and not (tmp_path / "work2" / "capture").exists()


def test_loop_speed_window_rates(tmp_path):
    """Steps/s of a window = its steps x tokens/s / tokens; the first two windows are left out."""
    import loop_speed

    records = [{"step": 10, "tokens": 1000, "tokens_per_s": 10.0},  # compile: left out
               {"step": 20, "tokens": 1000, "tokens_per_s": 100.0},  # left out
               {"step": 30, "tokens": 2000, "tokens_per_s": 1000.0},  # 10 steps in 2 s
               {"step": 35, "tokens": 500, "tokens_per_s": 1000.0},  # 5 steps in 0.5 s
               {"step": 45, "tokens": 1000, "tokens_per_s": 2000.0}]  # 10 steps in 0.5 s
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rates = loop_speed.window_rates(tmp_path / "metrics.jsonl")
    assert rates["steps_per_s"] == pytest.approx(10.0)  # median of 5, 10, 20
    assert rates["tokens_per_s"] == 1000.0 and rates["windows"] == 3
    assert rates["tokens_per_step"] == pytest.approx((200 + 100 + 100) / 3)


def test_peer_report_eval_table_reads_each_runs_sets_and_marks_the_missing(tmp_path):
    from peer_modelopt import eval_table

    ours, peer = tmp_path / "ours", tmp_path / "peer"
    for run, s, tau, rounds in ((ours, "sharegpt", 2.83, 15036), (ours, "mt-bench", 2.5, 9), (peer, "sharegpt", 2.19, 19335)):
        (run / "eval").mkdir(parents=True, exist_ok=True)
        (run / "eval" / f"{s}.json").write_text(json.dumps(
            {"tau": tau, "num_rounds": rounds, "lossless": {"matches": 199, "total": 200}}))
    lines = eval_table([ours, peer], ["a", "b"]).splitlines()
    assert lines[0] == "| trainer | sharegpt tau | humaneval tau | mt-bench tau |"
    assert lines[2] == "| a | 2.830 (15,036 rounds, lossless 199/200) | - | 2.500 (9 rounds, lossless 199/200) |"
    assert lines[3] == "| b | 2.190 (19,335 rounds, lossless 199/200) | - | - |"
    assert eval_table([tmp_path / "none"], ["c"]) == ""


def test_padding_bench_counts_slots_as_training_pads_them_and_packs_by_best_fit(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from padding import main as padding_main
    from padding import packed_rows

    # best fit decreasing, by hand: 7 -> row A (3 free), 5 -> B (5 free), 4 -> B (1 free), 3 -> A (0), 2 -> C
    assert packed_rows(np.array([3, 7, 2, 5, 4]), 10) == 3
    assert packed_rows(np.array([6, 6, 6]), 10) == 3  # no two fit together
    assert packed_rows(np.array([10]), 10) == 1

    lengths = [5, 9, 12, 3, 16, 7, 8, 30]
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "dataset.json").write_text("{}")
    pq.write_table(pa.table({"input_ids": [list(range(n)) for n in lengths]}), tmp_path / "prep" / "shard_00000.parquet")
    out = padding_main([str(tmp_path / "prep"), "--token-budget", "64", "--max-batch-size", "4",
                        "--length-bucket", "8", "0", "--pack-length", "32"])
    assert out["rows"] == 8 and out["tokens"] == sum(lengths)
    bucketed, longest = out["epochs"]
    # bucket 8: lengths pad to 8, 16 or 32; rows a batch = min(4, 64 // padded): 4, 4 and 2
    # bucket 8 (3, 5, 7, 8) -> 1 batch of 4 x 8; 16 (9, 12, 16) -> 1 batch, 4 x 16; 32 (30) -> 2 x 32
    assert bucketed["batches"] == 3 and bucketed["slots"] == 4 * 8 + 4 * 16 + 2 * 32
    assert abs(bucketed["real_over_slots"] - sum(lengths) / 160) < 1e-12
    assert longest["slots"] == sum(len(b) * max(b) for b in _batches_of(lengths, longest["batches"]))
    assert out["packed"]["rows"] == 3 and out["packed"]["batches"] == 2  # 90 tokens in rows of 32, 2 rows a step


def _batches_of(lengths, expected_batches):
    """The unbucketed batches `make_batches` builds (the function under the bench), as lengths."""
    import numpy as np

    from dflash_train.data.batching import make_batches

    batches = make_batches(np.array(lengths), 64, 4, 0, 0, 0)
    assert len(batches) == expected_batches
    return [[lengths[i] for i in b] for b in batches]


def test_budget_replay_fills_the_budget_around_a_pause_and_follows_the_known_length(tmp_path):
    from budget_replay import main as replay_main

    def metrics(pause_after: int | None) -> Path:
        rows = [{"step": s, "tokens": 2000, "tokens_per_s": 1000.0, "paused_s": 20.0 if s == pause_after else 0.0,
                 "lr": 1e-3} for s in range(20, 2001, 20)]  # 20 steps of 0.1 s a window
        path = tmp_path / f"metrics_{pause_after}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    args = ["-c", str(Path(__file__).resolve().parents[1] / "configs/smollm2-h200.yaml"), "train.time_budget_minutes=1", "train.log_every=20",
            "train.compile_warmup_steps=10", "--planned", "600"]
    steady = replay_main([*args, "--metrics", str(metrics(None))])
    assert abs(steady["steps"] - 582) <= 1 and steady["seconds"] <= 58.2 + 0.1  # 60 s x 0.97 of 0.1 s steps
    assert steady["lr_factor_at"][500]["run"] == 1.0  # the lr the run logged, over its peak
    assert steady["mean_gap"] < 0.01  # the length is known from the first estimate on, after the warmup
    paused = replay_main([*args, "--metrics", str(metrics(100))])
    # The 20 s pause budgeted: 382 steps fit. The estimate expects more pauses at the run's average
    # (none come), so the last estimates leave up to a window's share of it unused.
    assert 370 <= paused["steps"] <= 382 and 58.2 - 1.5 <= paused["seconds"] <= 58.2 + 0.1


def test_regen_speed_cpu_mode():
    """bench/regen_speed.py --model tiny: both variants serve every prompt, the plain step, the
    profile and one prefill's profile run (eagerly on CPU)."""
    import regen_speed

    report = regen_speed.main(["--model", "tiny", "--num", "6", "--rows", "2", "--max-tokens", "8", "--variants", "sdpa",
                               "--plain", "16", "--profile", "--profile-prefill"])
    run = report["runs"][0]
    assert run["answers"] == 6 and run["answer_tokens"] == 48 and run["plain"][0]["tokens_per_s"] > 0
    assert run["timings"]["chunks"] > 0 and run["profile"] == []  # no CUDA kernels on CPU
    assert not run["prefill_compiled"] and run["prefill_compile_error"] is None
    prefill = run["prefill_profile"]  # packed: one prefill fills both rows
    assert prefill["packed"] and prefill["prompts"] == 2 and prefill["prompt_tokens"] >= 10
    # tiny: 2 layers of 64 wide (q 64x64, k and v 64x32, o 64x64, MLP 3 x 64x128, 2 norms) + the final norm
    layers = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert prefill["gflop"] == pytest.approx(2 * layers * prefill["prompt_tokens"] / 1e9, abs=1e-6)
    assert prefill["prompt_tokens_per_s"] > 0 and prefill["tflops"] == pytest.approx(prefill["gflop"] / prefill["ms"], abs=1e-3)


def test_regen_speed_refuses_a_prompt_file_for_a_random_weight_model(tmp_path, capsys):
    import regen_speed

    with pytest.raises(SystemExit):
        regen_speed.main(["--model", "tiny", "--prompts", str(tmp_path / "p.jsonl")])
    assert "--prompts needs a model with a tokenizer; tiny has random weights and none" in capsys.readouterr().err


@pytest.mark.slow(seconds=30)  # the packed prefill compiled (C++ on CPU)
def test_regen_speed_reports_the_engines_gpu_clock():
    """Every chunk and prefill the engine made is in the job's GPU timeline, whole and middle half
    (the prefills compiled: --compile-prefill)."""
    import regen_speed

    report = regen_speed.main(["--model", "tiny", "--num", "12", "--rows", "2", "--max-tokens", "8",
                               "--variants", "sdpa", "--compile-prefill"])
    run = report["runs"][0]
    assert run["prefill_compiled"], run["prefill_compile_error"]
    assert run["answers"] == 12 and run["answer_tokens"] == 96
    whole, middle = run["gpu_timeline"]["whole_job"], run["gpu_timeline"]["middle_half"]
    assert whole["steps"]["launches"] == run["timings"]["chunks"]
    assert whole["prefills"]["launches"] == run["timings"]["prefills"]
    assert 0 <= whole["idle_fraction"] <= 1
    launches = lambda part: sum(v["launches"] for v in part.values() if isinstance(v, dict))  # noqa: E731
    assert 0 < launches(middle) < launches(whole)