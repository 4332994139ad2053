"""Tokenised training data: built from conversation files, or prepared once into Parquet shards.

A prepared dataset is a directory with `dataset.json` (tokenizer/chat-template fingerprint,
max_length, length statistics, row accounting) and `shard_*.parquet` (input_ids, loss_mask).
Training refuses a dataset prepared for another tokenizer: the token ids would be meaningless.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.atomic import write_atomic, write_json_atomic
from dflash_train.data.chat import encode_renders, render_conversations, tokenize_text
from dflash_train.data.formats import DataError, RowStats, expand_paths, iter_conversations, iter_rows, normalise_messages

log = logging.getLogger("dflash_train")

SHARD_ROWS = 50_000


@dataclass
class TokenizedDataset:
    input_ids: list[np.ndarray] = field(default_factory=list)
    loss_mask: list[np.ndarray] = field(default_factory=list)
    stats: RowStats = field(default_factory=RowStats)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.input_ids], dtype=np.int64)

    def append(self, ids, mask) -> None:
        self.input_ids.append(np.asarray(ids, dtype=np.int32))
        self.loss_mask.append(np.asarray(mask, dtype=np.int8))

    def extend(self, other: TokenizedDataset) -> None:
        self.input_ids += other.input_ids
        self.loss_mask += other.loss_mask
        self.stats.ok += other.stats.ok
        self.stats.skipped += other.stats.skipped

    def length_stats(self) -> dict:
        lengths = self.lengths
        if not len(lengths):
            return {"sequences": 0}
        return {
            "sequences": int(len(lengths)),
            "tokens": int(lengths.sum()),
            "loss_tokens": int(sum(int(m.sum()) for m in self.loss_mask)),
            "mean": float(lengths.mean()),
            "p50": int(np.percentile(lengths, 50)),
            "p95": int(np.percentile(lengths, 95)),
            "max": int(lengths.max()),
        }


PARALLEL_MIN_ROWS = 10_000
"""Fewer rows than this are tokenised in process whatever `data.tokenize_workers` asks: a process
pool takes seconds to start (each worker imports torch and transformers)."""
CHUNK_ROWS = 1024
"""Conversations rendered, then encoded, together: large enough to keep the tokenizer's threads busy."""


def _checked(conv, tok, max_length: int) -> tuple[np.ndarray, np.ndarray] | DataError:
    if isinstance(tok, DataError):
        return tok
    # An anchor needs two consecutive response tokens; a row without them teaches nothing.
    mask = np.asarray(tok.loss_mask, dtype=np.int8)
    if not (mask[:-1] & mask[1:]).any():
        return DataError(f"{conv.source}: no response tokens within max_length ({max_length})")
    return np.asarray(tok.input_ids, dtype=np.int32), mask


def _render_rows(tokenizer, convs: list, template_kwargs) -> list:
    return render_conversations(tokenizer, [(c.messages, c.source) for c in convs if c.text is None], template_kwargs)


def _encode_rows(tokenizer, convs: list, renders: list, max_length: int) -> list:
    """Corpus rows one by one; conversations in one batch (chat.encode_renders)."""
    chats = iter(encode_renders(tokenizer, renders, max_length))
    return [_checked(c, tokenize_text(tokenizer, c.text, max_length) if c.text is not None else next(chats),
                     max_length) for c in convs]


def _tokenize_rows(tokenizer, convs: list, max_length: int, template_kwargs) -> list:
    return _encode_rows(tokenizer, convs, _render_rows(tokenizer, convs, template_kwargs), max_length)


def _pipelined(tokenizer, chunks: list[list], max_length: int, template_kwargs) -> Iterator:
    """Chunk k+1 is rendered (Python) while chunk k is encoded on a thread (Rust, without the GIL)."""
    with ThreadPoolExecutor(1) as encoder:
        pending = None
        for chunk in chunks:
            renders = _render_rows(tokenizer, chunk, template_kwargs)
            if pending is not None:
                yield from pending.result()
            pending = encoder.submit(_encode_rows, tokenizer, chunk, renders, max_length)
        if pending is not None:
            yield from pending.result()


_worker_args: tuple = ()


def _init_worker(*args) -> None:
    global _worker_args
    _worker_args = args
    # Each worker encodes on one thread: N processes with a thread per core each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _tokenize_chunk(convs: list) -> list:
    tokenizer, max_length, template_kwargs = _worker_args
    return _tokenize_rows(tokenizer, convs, max_length, template_kwargs)


def tokenize_workers(requested: int, rows: int) -> int:
    """Processes for `rows` conversations: 1 (0 asks for the default), or `requested` for large inputs."""
    return 1 if rows < PARALLEL_MIN_ROWS else max(requested, 1)


def tokenize_files(
    files, tokenizer, max_length: int, skip_invalid: bool, template_kwargs=None, workers: int = 0
) -> TokenizedDataset:
    """Conversation files -> token ids and loss masks, in file order. The chat template is rendered
    and encoded twice per single-turn answer (prompt, whole conversation; 2-4 ms a row): 35K rows
    take minutes in one process, so large inputs are
    cut into chunks for a pool of `workers` processes (0: one per core)."""
    ds, convs, unreadable = TokenizedDataset(), [], None
    try:
        convs.extend(iter_conversations(files, skip_invalid=skip_invalid, stats=ds.stats))
    except DataError as err:  # raised after the rows before it: one of those may fail first
        unreadable = err
    processes = tokenize_workers(workers, len(convs))
    start = time.perf_counter()
    chunks = [convs[i : i + CHUNK_ROWS] for i in range(0, len(convs), CHUNK_ROWS)]
    if processes == 1:
        _collect(ds, _pipelined(tokenizer, chunks, max_length, template_kwargs), skip_invalid)
    else:
        # spawn, not fork: the caller may hold CUDA state or threads that a forked child must not inherit.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(processes, initializer=_init_worker, initargs=(tokenizer, max_length, template_kwargs)) as pool:
            results = pool.imap(_tokenize_chunk, chunks)
            first = next(results, [])  # the pool's start (imports in every worker) is most of a small input's time
            log.info("tokeniser pool of %d: first chunk after %.1f s", processes, time.perf_counter() - start)
            _collect(ds, (r for chunk in itertools.chain([first], results) for r in chunk), skip_invalid)
    log.info("tokenised %d rows in %.1f s (%d process%s)", len(convs), time.perf_counter() - start, processes,
             "es" if processes > 1 else "")
    if unreadable is not None:
        raise unreadable
    return ds


def _collect(ds: TokenizedDataset, results, skip_invalid: bool) -> None:
    for result in results:
        if isinstance(result, DataError):
            if not skip_invalid:
                raise result
            ds.stats.ok -= 1
            ds.stats.skip(result)
            continue
        ds.append(*result)


def save_prepared(ds: TokenizedDataset, out_dir: str | Path, fingerprint: str, max_length: int) -> Path:
    out = Path(out_dir)
    if not len(ds):  # an empty dataset would only fail later, in train, as "no usable training rows"
        raise DataError(f"no usable rows ({ds.stats.describe()}): {out} not written")
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, start in enumerate(range(0, max(len(ds), 1), SHARD_ROWS)):
        sl = slice(start, start + SHARD_ROWS)
        table = pa.table(
            {
                "input_ids": pa.array([x.tolist() for x in ds.input_ids[sl]], type=pa.list_(pa.int32())),
                "loss_mask": pa.array([x.tolist() for x in ds.loss_mask[sl]], type=pa.list_(pa.int8())),
            }
        )
        name = f"shard_{i:05d}.parquet"
        write_atomic(out / name, lambda f, t=table: pq.write_table(t, f))
        shards.append(name)
    meta = {
        "tokenizer_fingerprint": fingerprint,
        "max_length": max_length,
        "shards": shards,
        "rows": ds.stats.to_dict(),
        "lengths": ds.length_stats(),
    }
    # dataset.json last: its presence marks a complete dataset.
    write_json_atomic(out / "dataset.json", meta)
    return out


def load_prepared(path: str | Path, fingerprint: str) -> TokenizedDataset:
    path = Path(path)
    meta_file = path / "dataset.json"
    if not meta_file.is_file():
        raise DataError(f"{path}: not a prepared dataset (no dataset.json; an interrupted prepare?)")
    meta = json.loads(meta_file.read_text())
    if meta["tokenizer_fingerprint"] != fingerprint:
        raise DataError(
            f"{meta_file}: tokenised for another target (tokenizer fingerprint "
            f"{meta['tokenizer_fingerprint']} != this target's {fingerprint}); run `dflash-train prepare` again"
        )
    ds = TokenizedDataset()
    for shard in meta["shards"]:
        table = pq.read_table(path / shard)
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            ds.append(ids, mask)
    ds.stats.ok = len(ds)
    return ds


def check_training_files(data_cfg) -> None:
    """Before the target loads (minutes for a big one): every data.train_files entry exists, and each
    conversation file's first row parses. Later bad rows are still found, by line, while tokenising."""
    if not data_cfg.train_files:
        raise DataError("data.train_files is empty: give conversation files or a prepared dataset")
    for entry in data_cfg.train_files:
        if (Path(entry) / "dataset.json").is_file():
            continue
        if not Path(entry).exists():
            raise DataError(f"data.train_files: {entry}: no such file or directory")
        for path in expand_paths(entry):
            rows = iter_rows(path)  # raises for a missing file or an unsupported format
            first = next(rows, None)
            if first is None or data_cfg.skip_invalid:
                continue
            where, row = first
            if isinstance(row, DataError):
                raise row
            if not (isinstance(row, dict) and row.get("status", "ok") != "ok"):  # failed generate rows are skipped
                normalise_messages(row, where)


def load_training_data(data_cfg, tokenizer, fingerprint: str) -> TokenizedDataset:
    """Every entry of data.train_files: a prepared dataset dir, or a conversation file."""
    if not data_cfg.train_files:
        raise DataError("data.train_files is empty: give conversation files or a prepared dataset")
    total = TokenizedDataset()
    prepared = [f for f in data_cfg.train_files if (Path(f) / "dataset.json").is_file()]
    raw = [f for f in data_cfg.train_files if f not in prepared]
    for entry in prepared:
        total.extend(load_prepared(entry, fingerprint))
    if raw:
        total.extend(tokenize_files(
            raw, tokenizer, data_cfg.max_length, data_cfg.skip_invalid, data_cfg.chat_template_kwargs,
            data_cfg.tokenize_workers,
        ))
    if not len(total):
        raise DataError(f"no usable training rows in {data_cfg.train_files} ({total.stats.describe()})")
    log.info("training data: %s", total.stats.describe())
    return total
