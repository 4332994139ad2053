"""The launch memory plan: parameter counts against real models, and a plan that cannot fit refused."""

import pytest
from transformers import Qwen3Config

from dflash_train.config import build_config
from dflash_train.distributed.launch import main as launch_main
from dflash_train.distributed.memory import GiB, check_fits, plan_memory
from dist_runs import write_assets, write_config
from tiny import tiny_llama


def _run_config(**train):
    return build_config({"data": {"token_budget": 4096, "max_length": 2048}, "train": train}, source="test")


def test_target_bytes_count_the_real_models_parameters():
    model = tiny_llama(num_layers=3, hidden=32).model
    roles = plan_memory(_run_config(), model.config, num_features=3, tensor_parallel=1, max_in_flight=4,
                        colocated=False, dtype_bytes=4)
    target = roles[0].parts
    counted = (target["target shard"] + target["embedding+head"]) // 4 + model.config.hidden_size  # + final norm
    assert counted == sum(p.numel() for p in model.parameters())
    halves = plan_memory(_run_config(), model.config, num_features=3, tensor_parallel=2, max_in_flight=4,
                         colocated=False, dtype_bytes=4)[0].parts
    assert halves["target shard"] == target["target shard"] // 2
    assert halves["embedding+head"] == target["embedding+head"]  # replicated


def test_the_h200_workload_of_the_multi_gpu_benchmark():
    """docs/benchmarks/multi_gpu.md, 1 target + 1 drafter: 18.9 and 37.7 GiB measured peaks (NVML)."""
    qwen3_8b = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    cfg = build_config({"draft": {"num_layers": 5}, "data": {"token_budget": 3072, "max_length": 3072,
                                                              "max_batch_size": 1}, "objective": {"num_anchors": 512}},
                       source="test")
    target, drafter = plan_memory(cfg, qwen3_8b, num_features=5, tensor_parallel=1, max_in_flight=4, colocated=False)
    assert target.parts["target shard"] + target.parts["embedding+head"] == pytest.approx(2 * 8.19e9, rel=0.01)
    assert drafter.parts["drafter+grads+AdamW"] == pytest.approx(16 * 1.05e9, rel=0.01)
    assert 0.8 * 18.9 < target.total / GiB < 18.9 and 0.8 * 37.7 < drafter.total / GiB < 37.7
    with pytest.raises(ValueError, match=r"the plan does not fit: target GPU: 18\.\d\d GiB .* > 16\.0 GiB per GPU"):
        check_fits([target], 16 * GiB)
    sharded, _ = plan_memory(cfg, qwen3_8b, num_features=5, tensor_parallel=2, max_in_flight=4, colocated=False)
    check_fits([sharded], 16 * GiB)  # half the decoder per GPU


def test_launch_dry_run_prints_the_plan_and_refuses_what_cannot_fit(tmp_path, capsys):
    assets = write_assets(tmp_path / "assets", tiny_llama())
    config = write_config(assets, tmp_path / "run")
    argv = ["-c", str(config), "--target-gpus", "1", "--nproc-per-node", "2", "--dry-run"]
    assert launch_main([*argv, "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU (estimate):\n  target GPU: " in out and "\n  drafter GPU: " in out
    with pytest.raises(ValueError, match="the plan does not fit: target GPU: .*drafter GPU: "):
        launch_main([*argv, "--gpu-memory-gib", "0.0001"])


def test_the_plan_counts_the_most_blocks_any_batch_shape_draws():
    """max_blocks against every batch a brute force can form: rows of one padded length, as many as the
    budget and max_batch_size allow, times the anchors a row of that length draws."""
    from dflash_train.data.batching import bucket_shape
    from dflash_train.distributed.memory import max_blocks

    recipe = ["data.max_length=8192", "data.token_budget=32768", "data.max_batch_size=64", "objective.num_anchors=64"]
    for overrides in ([*recipe, "data.length_bucket=256"], [*recipe, "data.length_buckets=[256, 1024, 4096, 8192]"],
                      [*recipe, "data.length_buckets=[256, 1024, 4096, 8192]", "objective.num_anchors_length=1024"],
                      [*recipe], [*recipe, "objective.num_anchors_length=1024"],
                      # a bucket past max_length is never padded to; unbucketed, the rounding of proportional
                      # anchors makes a length between the ends the worst
                      [*recipe, "data.max_length=4096", "data.length_buckets=[256, 1024, 4096, 8192]"],
                      ["data.max_length=2238", "data.token_budget=7170", "data.max_batch_size=10",
                       "objective.num_anchors=4", "objective.num_anchors_length=510"]):
        cfg = build_config(overrides=overrides)
        dc = cfg.data
        brute = max(rows * cfg.objective.anchors_per_row(padded)
                    for rows, padded in (bucket_shape(n, dc.buckets or 1, dc.token_budget, dc.max_batch_size)
                                         for n in range(1, dc.max_length + 1)))
        assert max_blocks(cfg) == brute, overrides
