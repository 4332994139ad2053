"""Training on sequences far past data.length_bucket and the tests' usual data.max_length (96): multi-turn
conversations of ~1,500 tokens, long documents in their user turns (the `long` prompt set's shape), with
a tiny target; the anchors, labels and block mask of a real micro-batch against brute-force loops."""

from __future__ import annotations

import json
import math

import torch

from dflash_train.draft import masks
from dflash_train.draft.objective import make_task
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics
from dflash_train.train.shapes import bucket_shapes

PHRASES = ["the answer is forty two.", "abcabcabc abcabcabc", "hello there, general kenobi"]


def long_conversation(i: int, num_turns: int = 3) -> dict:
    """~1,500 byte tokens: each user turn a 420-character document, each answer a learnable phrase."""
    messages = []
    for t in range(num_turns):
        document = " ".join(f"line {i}.{t}.{k} of the document." for k in range(16))
        messages += [{"role": "user", "content": f"{document}\nSummarise part {t + 1}."},
                     {"role": "assistant", "content": " ".join([PHRASES[(i + t) % 3]] * 3)}]
    return {"id": f"long{i}", "messages": messages}


def reference_task(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                   block_size: int, gamma: float):
    """Labels, weights and the block mask from docs/design.md#the-objective, one cell at a time."""
    b, n = anchors.shape
    t, q = ids.shape[1], n * block_size
    labels = torch.zeros(b, q, dtype=ids.dtype)
    weights = torch.zeros(b, q)
    mask = torch.zeros(b, 1, q, t + q, dtype=torch.bool)
    for row in range(b):
        for j in range(n):
            a = int(anchors[row, j])
            for k in range(block_size):
                slot = j * block_size + k
                if a + k < t:
                    labels[row, slot] = ids[row, a + k]
                if k >= 1 and valid[row, j] and a + k < t and loss_mask[row, a + k]:
                    weights[row, slot] = math.exp(-(k - 1) / gamma)
                mask[row, 0, slot, :a] = True  # context strictly below the anchor
                mask[row, 0, slot, t + j * block_size : t + (j + 1) * block_size] = True  # its own block
    return labels, weights, mask


def test_sequences_far_past_the_bucket_train_with_anchors_deep_in_their_context(
        tmp_path, make_run_config, shared_tiny_target):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(long_conversation(i)) + "\n" for i in range(8)))
    cfg = make_run_config(overrides=[f"data.train_files=[{data}]", "data.max_length=2048", "data.length_bucket=32",
                                     "data.token_budget=4096", "data.max_batch_size=2", "train.max_steps=8",
                                     "train.lr=1e-2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    batch, seed = trainer.stepper.local.next_micro_batch(trainer.progress)
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    assert tuple(ids.shape) in bucket_shapes(cfg.data) and ids.shape[1] >= 40 * cfg.data.length_bucket
    task = make_task(ids, loss_mask, cfg.objective, seed)
    assert int(task.anchors[task.valid].max()) > 1024  # blocks drawn deep into the context, not only near its start
    assert bool(loss_mask.gather(1, task.anchors)[task.valid].all())
    labels, weights, mask = reference_task(ids, loss_mask, task.anchors, task.valid, cfg.objective.block_size,
                                           cfg.objective.gamma)
    assert torch.equal(task.labels[task.weights > 0], labels[weights > 0])
    torch.testing.assert_close(task.weights, weights)
    assert torch.equal(masks.dense_mask(task.anchors, cfg.objective.block_size, ids.shape[1]), mask)

    trainer.fit(progress=False)
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


def test_listed_buckets_and_anchors_in_proportion_train_rows_of_mixed_length(
        tmp_path, make_run_config, shared_tiny_target):
    """data.length_buckets with objective.num_anchors_length: a short row's batch is padded to a short
    listed length and draws num_anchors a row; a long one's to a long length, with anchors in proportion."""
    data = tmp_path / "mixed.jsonl"
    rows = [long_conversation(i, num_turns=1 + 2 * (i % 2)) for i in range(8)]  # ~500 and ~1,500 tokens
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    buckets = [256, 512, 1024, 2048]
    cfg = make_run_config(overrides=[f"data.train_files=[{data}]", "data.max_length=2048",
                                     f"data.length_buckets={buckets}", "objective.num_anchors=8",
                                     "objective.num_anchors_length=512", "data.token_budget=4096",
                                     "data.max_batch_size=2", "train.max_steps=8", "train.lr=1e-2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    seen = set()
    for _ in range(8):
        batch, seed = trainer.stepper.local.next_micro_batch(trainer.progress)
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        length = ids.shape[1]
        assert tuple(ids.shape) in bucket_shapes(cfg.data) and length in buckets
        assert length == min(b for b in buckets if b >= int(batch["attention_mask"].sum(1).max()))
        task = make_task(ids, loss_mask, cfg.objective, seed)
        assert task.anchors.shape == (ids.shape[0], max(8, -(-8 * length // 512)))
        assert bool(loss_mask.gather(1, task.anchors)[task.valid].all())
        seen.add(length)
        trainer.progress.step += 1
    assert len(seen) >= 2  # short and long rows took different shapes
    trainer = Trainer(cfg, target=shared_tiny_target)
    trainer.fit(progress=False)
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in records)
