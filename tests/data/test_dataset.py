"""Prepared datasets: round trip, fingerprint refusal, row accounting."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_train.data.chat import tokenize_conversation
from dflash_train.data.dataset import load_prepared, load_training_data, save_prepared, tokenize_files
from dflash_train.data.formats import DataError
from dflash_train.targets.tokenizer import tokenizer_fingerprint
from tiny import tiny_tokenizer

TESTS = Path(__file__).resolve().parents[1]


def conversations(n: int) -> list[dict]:
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"question number {i}?"},
                {"role": "assistant", "content": f"answer {i}: " + "abc " * (i % 5 + 1)},
            ],
        }
        for i in range(n)
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prepare_load_round_trip(tmp_path):
    tok = tiny_tokenizer()
    rows = conversations(7)
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    ds = tokenize_files([src], tok, max_length=256, skip_invalid=False)
    assert len(ds) == 7 and ds.stats.ok == 7
    expected = tokenize_conversation(tok, rows[3]["messages"], 256)
    assert ds.input_ids[3].tolist() == expected.input_ids and ds.loss_mask[3].tolist() == expected.loss_mask
    fp = tokenizer_fingerprint(tok)
    out = save_prepared(ds, tmp_path / "prep", fp, 256)
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["max_length"] == 256 and meta["rows"]["ok"] == 7
    back = load_prepared(out, fp)
    assert len(back) == 7
    for a, b in zip(ds.input_ids + ds.loss_mask, back.input_ids + back.loss_mask):
        np.testing.assert_array_equal(a, b)
    cfg = SimpleNamespace(train_files=[str(out), src], max_length=256, skip_invalid=False, chat_template_kwargs={},
                          tokenize_workers=0)
    both = load_training_data(cfg, tok, fp)
    assert len(both) == 14


def test_shards_written_at_once_read_back_in_row_order(tmp_path, monkeypatch):
    import dflash_train.data.dataset as dataset

    tok = tiny_tokenizer()
    ds = tokenize_files([write_jsonl(tmp_path / "c.jsonl", conversations(11))], tok, 256, False)
    monkeypatch.setattr(dataset, "SHARD_ROWS", 3)
    out = save_prepared(ds, tmp_path / "prep", tokenizer_fingerprint(tok), 256)
    assert json.loads((out / "dataset.json").read_text())["shards"] == [f"shard_{i:05d}.parquet" for i in range(4)]
    back = load_prepared(out, tokenizer_fingerprint(tok))
    assert len(back) == 11
    for a, b in zip(ds.input_ids + ds.loss_mask, back.input_ids + back.loss_mask):
        np.testing.assert_array_equal(a, b)


def test_fingerprint_mismatch_is_refused(tmp_path):
    tok = tiny_tokenizer()
    ds = tokenize_files([write_jsonl(tmp_path / "c.jsonl", conversations(2))], tok, 256, False)
    out = save_prepared(ds, tmp_path / "prep", tokenizer_fingerprint(tok), 256)
    other = tiny_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    with pytest.raises(DataError, match="another target.*prepare"):
        load_prepared(out, tokenizer_fingerprint(other))


def test_prepared_dataset_keeps_its_skips_and_refuses_another_max_length(tmp_path):
    tok = tiny_tokenizer()
    rows = conversations(4)
    rows[1]["messages"][0]["content"] = "x" * 300  # no answer within max_length 128: skipped, counted
    ds = tokenize_files([write_jsonl(tmp_path / "c.jsonl", rows)], tok, 128, skip_invalid=True)
    fp = tokenizer_fingerprint(tok)
    out = save_prepared(ds, tmp_path / "prep", fp, 128)
    cfg = SimpleNamespace(train_files=[str(out)], max_length=128, skip_invalid=True, chat_template_kwargs={},
                          tokenize_workers=0)
    assert load_training_data(cfg, tok, fp).stats.to_dict() == ds.stats.to_dict() == {
        "rows": 4, "ok": 3, "skipped": {"no response tokens within max_length": 1}}
    cfg.max_length = 256  # rows cut at 128 would silently stand for rows of up to 256
    with pytest.raises(DataError, match=r"dataset.json: prepared with max_length 128, but data.max_length is 256"):
        load_training_data(cfg, tok, fp)


def test_interrupted_prepare_is_refused(tmp_path):
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "shard_00000.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="dataset.json"):
        load_prepared(tmp_path / "prep", "x")


def test_rows_without_answer_in_max_length_are_counted(tmp_path):
    tok = tiny_tokenizer()
    rows = conversations(4)
    rows[1]["messages"][0]["content"] = "x" * 300  # the answer falls beyond max_length
    src = write_jsonl(tmp_path / "c.jsonl", rows + [{"bad": 1}])
    with pytest.raises(DataError, match="c.jsonl:2.*max_length"):
        tokenize_files([src], tok, 128, skip_invalid=False)
    ds = tokenize_files([src], tok, 128, skip_invalid=True)
    assert len(ds) == ds.stats.ok == 3
    assert ds.stats.total == 5
    assert ds.stats.skipped["no response tokens within max_length"] == 1


def test_skip_invalid_skips_rows_the_template_cannot_render(tmp_path):
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = tiny_tokenizer(strict)
    rows = conversations(3)
    rows.insert(1, {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"},
                                 {"role": "assistant", "content": "fine then"}]})
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(DataError, match="c.jsonl:2.*no system role"):
        tokenize_files([src], tok, 256, skip_invalid=False)
    ds = tokenize_files([src], tok, 256, skip_invalid=True)
    assert len(ds) == ds.stats.ok == 3 and ds.stats.total == 4


POOLED = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
import dflash_train.data.dataset as dataset
from dflash_train.data.formats import DataError
from tiny import tiny_tokenizer
src, fork = sys.argv[1], sys.argv[2] == "fork"
assert dataset.can_fork(), "a fresh interpreter runs one thread and no CUDA: forking is safe"
dataset.PARALLEL_MIN_ROWS, dataset.POOL_CHUNK_ROWS = 0, 4
if not fork:
    dataset.can_fork = lambda: False  # as in a process with threads: the pool is spawned
tok = tiny_tokenizer()
ds = dataset.tokenize_files([src], tok, 128, skip_invalid=True, workers=2)
try:
    dataset.tokenize_files([src], tok, 128, skip_invalid=False, workers=2)
    error = None
except DataError as err:
    error = str(err)
print(json.dumps({"stats": ds.stats.to_dict(), "skipped": list(ds.stats.skipped), "error": error,
                  "ids": [a.tolist() for a in ds.input_ids], "mask": [a.tolist() for a in ds.loss_mask]}))
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_processes_tokenise_like_one_process(tmp_path, method):
    """Large inputs are parsed and tokenised by a pool of processes in chunks, forked when that is
    safe and spawned otherwise: same rows, same order, same skipped-row accounting as in process
    (rows skipped unread listed first, as when the parent read every row before tokenising); the
    first bad row in file order still fails the run when not skipped. The pool runs in a fresh
    interpreter: forking from this one (threads of pytest and its plugins) could inherit a held lock,
    which `can_fork` exists to avoid."""
    tok = tiny_tokenizer()
    rows = [json.dumps(r) for r in conversations(23)]
    rows[5] = json.dumps(conversations(6)[5] | {"messages": [{"role": "user", "content": "x" * 300},
                                                             {"role": "assistant", "content": "a"}]})
    rows[17] = json.dumps({"messages": [{"role": "user", "content": "a question, no answer"}]})
    rows[19] = '{"messages": [}'
    rows[21] = json.dumps({"status": "error", "prompt": "p"})
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(rows) + "\n")
    one = tokenize_files([src], tok, 128, skip_invalid=True, workers=1)

    def pooled(path):
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
        out = subprocess.run([sys.executable, "-c", POOLED, str(path), method], env=env, capture_output=True,
                             text=True, timeout=180)  # a deadlocked pool fails the test, not the whole run
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"tokeniser pool of 2 ({method})" in out.stderr  # the pool ran, started as asked
        return json.loads(out.stdout.splitlines()[-1])

    got = pooled(src)
    assert len(got["ids"]) == len(one) == 19 and got["stats"] == one.stats.to_dict()
    assert got["skipped"] == list(one.stats.skipped) == [
        "no assistant turn to learn from", "not valid JSON: Expecting value", "generation error",
        "no response tokens within max_length"]
    assert got["ids"] == [a.tolist() for a in one.input_ids] and got["mask"] == [a.tolist() for a in one.loss_mask]
    assert re.search("c.jsonl:6.*max_length", got["error"])
    del rows[5], rows[16]
    src.write_text("\n".join(rows) + "\n")
    assert re.search("c.jsonl:18: not valid JSON", pooled(src)["error"])


DYING = """
import os, sys
import dflash_train.data.dataset as dataset
from tiny import tiny_tokenizer
dataset.PARALLEL_MIN_ROWS, dataset.POOL_CHUNK_ROWS = 0, 4
def _tokenize_chunk(rows):  # forked workers inherit it: each dies on its first chunk
    os._exit(3)
_tokenize_chunk.__module__ = dataset.__name__  # pickled by name, as the real one
dataset._tokenize_chunk = _tokenize_chunk
dataset.tokenize_files([sys.argv[1]], tiny_tokenizer(), 128, skip_invalid=True, workers=2)
"""


def test_a_tokeniser_process_that_dies_fails_the_run_in_one_line(tmp_path):
    """A worker killed mid-chunk (the out-of-memory killer) ends the run with one line naming the way
    out, instead of waiting forever for its chunk."""
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in conversations(12)) + "\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", DYING, str(src)], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert re.search(r"RuntimeError: a tokeniser process died .*data.tokenize_workers: 1", out.stderr.splitlines()[-1])


def test_default_workers_fork_one_per_core_only_when_safe(monkeypatch):
    import threading

    import dflash_train.data.dataset as dataset

    monkeypatch.setattr(dataset.os, "sched_getaffinity", lambda pid: set(range(6)))
    assert dataset.tokenize_workers(0, dataset.PARALLEL_MIN_ROWS - 1) == (1, "")
    assert dataset.tokenize_workers(1, 10**6) == (1, "")
    assert dataset.tokenize_workers(0, 10**6) == ((6, "fork") if dataset.can_fork() else (1, ""))
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:  # another thread alive: a forked child could inherit a lock it holds, so no fork
        assert not dataset.can_fork()
        assert dataset.tokenize_workers(0, 10**6) == (1, "")
        assert dataset.tokenize_workers(3, 10**6) == (3, "spawn")
    finally:
        stop.set()
        busy.join()


def test_prepare_with_no_usable_row_writes_nothing(tmp_path):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "no answer"}]}, {"bad": 1}])
    ds = tokenize_files([src], tok, 128, skip_invalid=True)
    with pytest.raises(DataError, match=r"no usable rows \(2 rows: 0 used, 2 skipped \(.*: 1, .*: 1\)\): .*prep not "
                                        "written"):
        save_prepared(ds, tmp_path / "prep", tokenizer_fingerprint(tok), 128)
    assert not (tmp_path / "prep").exists()


def test_training_data_logs_its_skip_counts(tmp_path, caplog):
    tok = tiny_tokenizer()
    src = write_jsonl(tmp_path / "c.jsonl", conversations(3) + [{"bad": 1}, {"bad": 2}])
    cfg = SimpleNamespace(train_files=[src], max_length=256, skip_invalid=True, chat_template_kwargs={},
                          tokenize_workers=0)
    with caplog.at_level("INFO", logger="dflash_train"):
        load_training_data(cfg, tok, tokenizer_fingerprint(tok))
    assert "training data: 5 rows: 3 used, 2 skipped (no 'messages', 'conversations' or 'text' field: 2)" in caplog.text


def test_batched_tokenising_gives_the_chat_templates_own_tokens(tmp_path, monkeypatch):
    """Chunks rendered then encoded in batches, the next chunk rendered while one encodes: each row's
    ids are `apply_chat_template(tokenize=True)`'s own, in file order, multi-turn rows included."""
    import dflash_train.data.dataset as dataset

    tok = tiny_tokenizer()
    rows = conversations(11)
    rows[3]["messages"] += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "then more."}]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    monkeypatch.setattr(dataset, "CHUNK_ROWS", 4)
    ds = tokenize_files([src], tok, 256, skip_invalid=False)
    assert len(ds) == 11
    for row, ids, mask in zip(rows, ds.input_ids, ds.loss_mask):
        reference = tok.apply_chat_template(row["messages"], tokenize=True)
        reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
        assert ids.tolist() == reference
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert tok.decode(ids[mask.astype(bool)].tolist()) == "".join(a + "<|im_end|>" for a in answers)
