"""Two machines for real, on one host: two `dflash-train launch` processes (--nnodes 2, one
process each, c10d rendezvous on localhost, gloo). They train exactly like one node with two
processes; when one node dies mid-run (its agent and worker killed together, as a lost machine),
the other exits non-zero within 60 s naming it, and the run resumes on two nodes to the end."""

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from dist_runs import children, free_port, launch_node, losses, reference_losses, spawn, write_assets, write_config
from tiny import tiny_target


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_assets(tmp_path_factory.mktemp("assets"), tiny_target(num_layers=3, hidden=32))


def start_two_nodes(argv: list[str]):
    """Node 0 first, once its rendezvous store listens: it hosts the store, as the machine named by
    --rdzv-endpoint does in a real job."""
    port = free_port()
    node0 = launch_node(0, f"localhost:{port}", argv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and node0.poll() is None:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return node0, launch_node(1, f"localhost:{port}", argv)


@pytest.mark.slow(seconds=35)
def test_two_nodes_train_like_one_node(assets, tmp_path):
    config = write_config(assets, tmp_path / "two")
    nodes = start_two_nodes(["-c", str(config), "--target-gpus", "1"])
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    config_one = write_config(assets, tmp_path / "one")
    assert spawn(2, ["-c", str(config_one), "--target-ranks", "1"]) == [0, 0]
    assert len(losses(tmp_path / "one")) == 4
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)


@pytest.mark.slow(seconds=80)
def test_a_lost_node_is_named_and_the_run_resumes(assets, tmp_path):
    config = write_config(assets, tmp_path / "run")
    # 24 steps: the kill lands right after the first checkpoint (step 2), 22 steps before the end
    argv = ["-c", str(config), "--target-gpus", "1", "--heartbeat-timeout", "10",
            "train.max_steps=24", "train.grad_accum=2"]
    node0, node1 = start_two_nodes(argv)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 90
    while not (checkpoints.is_dir() and list(checkpoints.glob("step_*"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node0.poll() is None and node1.poll() is None, "the run ended before its first checkpoint"
    for pid in [*children(node1.pid).values(), node1.pid]:  # the machine is gone: agent and worker
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = node0.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60 and node0.returncode != 0
    # The survivor's send fails and its watchdog names the silent peer; or the heartbeat times out.
    assert ("silent peers (likely dead): rank 1 (drafter 0 of group 'drafter', node 1" in out
            or "rank 1 (drafter 0 of group 'drafter', node 1" in out and "sent no heartbeat" in out), out[-3000:]
    node1.communicate()
    nodes = start_two_nodes([*argv, "--resume", "auto"])
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    expected = reference_losses(config, tmp_path / "ref", ["train.max_steps=24", "train.grad_accum=2"])
    assert re.search(r"starting at step [1-9]\d* of 24", outs[1]), outs[1][-2000:]
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)
