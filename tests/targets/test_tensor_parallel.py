"""A target sharded over a tensor-parallel group of CPU/gloo processes: the same features as the
whole target, and through `launch`'s worker the same training losses as one process."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dflash_train.config_model import TargetConfig
from dflash_train.targets.model import load_target
from dflash_train.targets.tensor_parallel import tensor_parallel_plan
from dflash_train.distributed.launch import main as launch_main
from dflash_train.distributed.layout import Layout, plan_split
from dist_runs import free_port, fork_all, losses, reference_losses, spawn, write_assets, write_config
from tiny import tiny_llama, tiny_target


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_assets(tmp_path_factory.mktemp("assets"), tiny_llama())


def _features_worker(rank: int, port: int, path: str, out: Path) -> None:
    """Rank 2 stays out of the group, as drafter ranks do."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    shards = dist.new_group([0, 1])
    ids = torch.randint(0, 259, (2, 13), generator=torch.Generator().manual_seed(1))
    cfg = TargetConfig(path=path, dtype="float32", tensor_parallel=2)
    if rank < 2:
        target = load_target(cfg, torch.device("cpu"), mesh=DeviceMesh.from_group(shards, "cpu"))
        q = target.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.to_local().shape[0] == q.shape[0] // 2
        torch.save(target.features(ids, [0, 1, 2]), out / f"tp{rank}.pt")
    else:
        whole = load_target(cfg.model_copy(update={"tensor_parallel": 1}), torch.device("cpu"))
        torch.save(whole.features(ids, [0, 1, 2]), out / "whole.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_features_equal_the_whole_targets(assets, tmp_path):
    port = free_port()
    assert fork_all([(_features_worker, (r, port, str(assets / "target"), tmp_path)) for r in range(3)]) == [0] * 3
    whole = torch.load(tmp_path / "whole.pt")
    assert whole.shape == (2, 13, 3 * 32)
    for rank in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"tp{rank}.pt"), whole, rtol=0, atol=1e-5)


def test_a_sharded_target_group_trains_like_one_process(assets, tmp_path):
    """Ranks 0-1 run one target sharded in two, rank 2 the drafter; only rank 0 sends."""
    config = write_config(assets, tmp_path / "run")
    assert spawn(3, ["-c", str(config), "--target-ranks", "2", "target.tensor_parallel=2"]) == [0] * 3
    expected = reference_losses(config, tmp_path / "ref")
    assert len(expected) == 4
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)


def test_groups_in_layout_and_plan():
    layout = Layout(4, (2,), ("d",), tensor_parallel=2)
    assert layout.num_target_groups == 2 and [layout.target_of(m) for m in range(4)] == [0, 2, 0, 2]
    assert layout.target_lead(3) == 2 and layout.describe(3) == "target group 1 shard 1"
    with pytest.raises(ValueError, match="3 target GPUs do not form groups of target.tensor_parallel = 2"):
        Layout(3, (1,), ("d",), tensor_parallel=2)
    with pytest.raises(ValueError, match="not --colocated"):
        Layout(2, (2,), ("d",), colocated=True, tensor_parallel=2)
    # One group of 2 makes 10K tokens/s; a drafter GPU 4K: 4 groups feed 4 x 10K, 10 drafters 40K.
    plan = plan_split(18, 10_000, [4_000], 50_000, tensor_parallel=2)
    assert (plan.num_targets, plan.group_sizes, plan.colocated) == (8, (10,), False)
    assert "per target group of 2 GPUs" in plan.reason
    with pytest.raises(ValueError, match="target group of 4 GPUs"):
        plan_split(4, 1.0, [1.0], None, tensor_parallel=4)


def test_unshardable_targets_are_refused_by_name():
    config = tiny_target(num_layers=1, hidden=64).model.config  # 4 heads, 2 KV heads, MLP 128
    assert set(tensor_parallel_plan(config, 2).values()) == {"colwise", "rowwise"}  # q/k_norm left replicated
    with pytest.raises(ValueError, match=r"does not divide the target's \{'num_key_value_heads': 2\}"):
        tensor_parallel_plan(config, 4)
    with pytest.raises(ValueError, match="run it with `dflash-train launch`"):
        load_target(TargetConfig(path="unused", tensor_parallel=2), torch.device("cpu"))


def test_launch_refuses_a_split_that_does_not_form_groups(assets, tmp_path):
    config = write_config(assets, tmp_path / "run", target={"path": str(assets / "target"), "tensor_parallel": 2})
    with pytest.raises(ValueError, match="3 target GPUs do not form groups of target.tensor_parallel = 2"):
        launch_main(["-c", str(config), "--target-gpus", "3", "--nproc-per-node", "4", "--dry-run"])
