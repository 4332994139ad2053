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
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.atomic import write_atomic, write_json_atomic
from dflash_train.data.chat import encode_renders, render_conversations, tokenize_text
from dflash_train.data.generation_mode import template_kwargs_for
from dflash_train.data.formats import (
    Conversation, DataError, RowStats, expand_paths, iter_rows, iter_unparsed_rows, normalise_messages, read_row,
)

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
        return np.fromiter(map(len, self.input_ids), dtype=np.int64, count=len(self.input_ids))

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
            # One concatenation and sum: a sum per row took 0.1 s for 40K rows.
            "loss_tokens": int(np.concatenate(self.loss_mask).sum(dtype=np.int64)),
            "mean": float(lengths.mean()),
            "p50": int(np.percentile(lengths, 50)),
            "p95": int(np.percentile(lengths, 95)),
            "max": int(lengths.max()),
        }


PARALLEL_MIN_ROWS = 10_000
"""Fewer rows than this are tokenised in process: a pool's start and transfers cost more than it saves."""
CHUNK_ROWS = 1024
"""Conversations rendered, then encoded, together: large enough to keep the tokenizer's threads busy."""
POOL_CHUNK_ROWS = 256
"""A pool worker's share at a time: small enough that the last chunks, on a few workers while the
others idle, are short (40 chunks of 1024 rows on 16 workers take 3 rounds where 2.5 would do)."""
MAX_WORKERS = 32
"""Cap of the default pool (one process per core) on hosts with many cores; measured up to 16."""


@dataclass
class _Unread:
    """A row that never reached the tokenizer: why (a DataError), or a failed generation's reason."""

    problem: DataError | str


def _checked(conv, tok, max_length: int) -> tuple[np.ndarray, np.ndarray] | DataError:
    if isinstance(tok, DataError):
        return tok
    # An anchor needs two consecutive response tokens; a row without them teaches nothing.
    mask = np.asarray(tok.loss_mask, dtype=np.int8)
    if not (mask[:-1] & mask[1:]).any():
        return DataError(f"{conv.source}: no response tokens within max_length ({max_length})")
    return np.asarray(tok.input_ids, dtype=np.int32), mask


def _read_rows(rows: list) -> list:
    """(where, row) pairs (iter_unparsed_rows) -> a Conversation or an _Unread each."""
    return [c if isinstance(c := read_row(where, row), Conversation) else _Unread(c) for where, row in rows]


def _render_rows(tokenizer, items: list, template_kwargs) -> list:
    convs = [c for c in items if isinstance(c, Conversation) and c.text is None]
    return render_conversations(tokenizer, [(c.messages, c.source) for c in convs], template_kwargs)


def _encode_rows(tokenizer, items: list, renders: list, max_length: int) -> list:
    """Corpus rows one by one; conversations in one batch (chat.encode_renders); unread rows as they are.
    A conversation whose template rewrites earlier turns gives a row per such turn after its own."""
    chats = iter(encode_renders(tokenizer, renders, max_length))
    rows = []
    for item in items:
        if isinstance(item, _Unread):
            rows.append(item)
            continue
        tok = tokenize_text(tokenizer, item.text, max_length) if item.text is not None else next(chats)
        rows.append(_checked(item, tok, max_length))
        rows += [_checked(item, turn, max_length) for turn in getattr(tok, "turns", ())]
    return rows


def _pipelined(tokenizer, chunks: list[list], max_length: int, template_kwargs) -> Iterator:
    """Chunk k+1 is parsed and rendered (Python) while chunk k is encoded on a thread (Rust, without the GIL)."""
    with ThreadPoolExecutor(1) as encoder:
        pending = None
        for chunk in chunks:
            items = _read_rows(chunk)
            renders = _render_rows(tokenizer, items, template_kwargs)
            if pending is not None:
                yield from pending.result()
            pending = encoder.submit(_encode_rows, tokenizer, items, renders, max_length)
        if pending is not None:
            yield from pending.result()


_worker_args: tuple = ()


def _init_worker(*args) -> None:
    global _worker_args
    _worker_args = args
    # Each worker encodes on one thread: N processes with a thread per core each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C reaches the whole process group: the parent stops the pool, a worker prints nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _tokenize_chunk(rows: list) -> tuple[list, np.ndarray, np.ndarray, list[int]]:
    """A worker's chunk, sent back packed: each row's problem (None for a tokenised one), and the
    tokenised rows' ids and masks concatenated. 80K small arrays, one by one, took the parent 0.5 s
    to unpickle; these are four objects."""
    tokenizer, max_length, template_kwargs = _worker_args
    items = _read_rows(rows)
    results = _encode_rows(tokenizer, items, _render_rows(tokenizer, items, template_kwargs), max_length)
    tokenised = [r for r in results if isinstance(r, tuple)]
    return ([None if isinstance(r, tuple) else r for r in results],
            np.concatenate([ids for ids, _ in tokenised] or [np.zeros(0, np.int32)]),
            np.concatenate([mask for _, mask in tokenised] or [np.zeros(0, np.int8)]),
            [len(ids) for ids, _ in tokenised])


def _unpacked(packed) -> Iterator:
    """_tokenize_chunk's rows again: views into its two arrays, problems as they were."""
    problems, ids, masks, lengths = packed
    spans = iter(lengths)
    start = 0
    for problem in problems:
        if problem is not None:
            yield problem
            continue
        end = start + next(spans)
        yield ids[start:end], masks[start:end]
        start = end


def can_fork() -> bool:
    """A forked worker starts at once with the parent's imports and tokenizer, but inherits only the
    forking thread: safe while this process runs no other thread and holds no CUDA context (the
    `prepare` command; not `train` once its target is on a GPU)."""
    cuda = sys.modules.get("torch.cuda")
    return (sys.platform == "linux" and threading.active_count() == 1
            and not (cuda is not None and cuda.is_initialized()))


def tokenize_workers(requested: int, rows: int) -> tuple[int, str]:
    """(processes, start method) for `rows` conversations. 0 (the default): one forked process per
    core for large inputs when forking is safe, else in process; 1: in process; N: a pool of N,
    spawned when forking is not safe (each worker then imports torch and transformers: seconds)."""
    if rows < PARALLEL_MIN_ROWS or requested == 1:
        return 1, ""
    fork = can_fork()
    if requested == 0:
        return (min(_cores(), MAX_WORKERS), "fork") if fork else (1, "")
    return requested, "fork" if fork else "spawn"


def _cores() -> int:
    """The cores this process may run on (Linux); every core elsewhere."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenize_files(
    files, tokenizer, max_length: int, skip_invalid: bool, template_kwargs=None, workers: int = 0
) -> TokenizedDataset:
    """Conversation files -> token ids and loss masks, in file order. The files' rows are read here
    unparsed; each chunk of them is parsed (JSON, then the conversation's checks), rendered through
    the chat template (Python) and encoded (the fast tokenizer, Rust) twice per single-turn answer
    (the prompt, the whole conversation): in process, chunk k encodes on the tokenizer's threads
    while chunk k+1 parses and renders; in a pool (`tokenize_workers`), each worker parses, renders
    and encodes whole chunks, so all of that runs on every core."""
    template_kwargs = template_kwargs_for(files, template_kwargs)  # `generate` folders: their thinking mode
    ds, rows, unreadable = TokenizedDataset(), [], None
    try:
        for path in expand_paths(files):
            rows.extend(iter_unparsed_rows(path))
    except DataError as err:  # raised after the rows before it: one of those may fail first
        unreadable = err
    processes, method = tokenize_workers(workers, len(rows))
    start = time.perf_counter()
    size = CHUNK_ROWS if processes == 1 else POOL_CHUNK_ROWS
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    if processes == 1:
        _collect(ds, _pipelined(tokenizer, chunks, max_length, template_kwargs), skip_invalid)
    else:
        # concurrent.futures, not multiprocessing.Pool: on the first bad row the pending chunks are
        # cancelled and the running ones finish, where Pool.terminate kills workers that may hold its
        # queue's locks and can hang; a worker that dies is an error here, a hang there.
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context(method),
                                 initializer=_init_worker, initargs=(tokenizer, max_length, template_kwargs)) as pool:
            try:
                results = pool.map(_tokenize_chunk, chunks)
                first = next(results)  # a spawned pool's start (imports in every worker) is seconds
                log.info("tokeniser pool of %d (%s): first chunk after %.1f s", processes, method,
                         time.perf_counter() - start)
                _collect(ds, (r for packed in itertools.chain([first], results) for r in _unpacked(packed)),
                         skip_invalid)
            except BrokenProcessPool as err:
                raise RuntimeError(f"a tokeniser process died ({err}); out of memory? `data.tokenize_workers: 1` "
                                   "tokenises in process") from None
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
    log.info("tokenised %d rows in %.1f s (%s)", len(rows), time.perf_counter() - start,
             "in process" if processes == 1 else f"{processes} {method}ed processes")
    if unreadable is not None:
        raise unreadable
    return ds


def _collect(ds: TokenizedDataset, results, skip_invalid: bool) -> None:
    """Rows in file order; the first problem raises unless `skip_invalid`. Rows skipped unread are
    counted before those skipped in tokenising (dataset.json lists the reasons in that order)."""
    unread, untokenised = RowStats(), RowStats()
    for result in results:
        if isinstance(result, _Unread):
            if isinstance(result.problem, str):
                unread.skipped[result.problem] += 1
                continue
            result = result.problem
            stats = unread
        else:
            stats = untokenised
        if isinstance(result, DataError):
            if not skip_invalid:
                raise result
            stats.skip(result)
            continue
        ds.append(*result)
        ds.stats.ok += 1
    ds.stats.skipped.update(unread.skipped)
    ds.stats.skipped.update(untokenised.skipped)


def save_prepared(ds: TokenizedDataset, out_dir: str | Path, fingerprint: str, max_length: int) -> Path:
    out = Path(out_dir)
    if not len(ds):  # an empty dataset would only fail later, in train, as "no usable training rows"
        raise DataError(f"no usable rows ({ds.stats.describe()}): {out} not written")
    out.mkdir(parents=True, exist_ok=True)

    def write_shard(i: int) -> str:
        sl = slice(i * SHARD_ROWS, (i + 1) * SHARD_ROWS)
        table = pa.table({"input_ids": _list_array(ds.input_ids[sl]), "loss_mask": _list_array(ds.loss_mask[sl])})
        name = f"shard_{i:05d}.parquet"
        write_atomic(out / name, lambda f: pq.write_table(table, f))
        return name

    # Shards at once, one thread each: pyarrow encodes without the GIL (a 50K-row shard takes ~1 s).
    count = -(-len(ds) // SHARD_ROWS)
    with ThreadPoolExecutor(min(count, _cores())) as writers:
        shards = list(writers.map(write_shard, range(count)))
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


def _list_array(rows: list[np.ndarray]) -> pa.ListArray:
    """Rows as one Arrow list column, built from the concatenated values and their offsets (no
    Python lists: 16M tokens take a second that way instead of ten)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))


def _rows(column: pa.ChunkedArray, dtype) -> list[np.ndarray]:
    lists = column.combine_chunks()
    values = np.array(lists.values.to_numpy(zero_copy_only=False), dtype=dtype)  # writable, one buffer
    offsets = lists.offsets.to_numpy()
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def load_prepared(path: str | Path, fingerprint: str, max_length: int | None = None) -> TokenizedDataset:
    """A prepared dataset, refused when tokenised for another tokenizer or, given `max_length`, cut at
    another length (its rows' cuts and skips are prepare's); its skipped rows stay counted."""
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
    if max_length is not None and meta["max_length"] != max_length:
        raise DataError(f"{meta_file}: prepared with max_length {meta['max_length']}, but data.max_length is "
                        f"{max_length}: prepare it again with data.max_length={max_length}, or train with "
                        f"data.max_length={meta['max_length']}")
    ds = TokenizedDataset()
    for shard in meta["shards"]:
        table = pq.read_table(path / shard)
        ds.input_ids += _rows(table.column("input_ids"), np.int32)
        ds.loss_mask += _rows(table.column("loss_mask"), np.int8)
    ds.stats.ok = len(ds)
    ds.stats.skipped.update(meta["rows"]["skipped"])
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
        total.extend(load_prepared(entry, fingerprint, data_cfg.max_length))
    if raw:
        total.extend(tokenize_files(
            raw, tokenizer, data_cfg.max_length, data_cfg.skip_invalid, data_cfg.chat_template_kwargs,
            data_cfg.tokenize_workers,
        ))
    if not len(total):
        raise DataError(f"no usable training rows in {data_cfg.train_files} ({total.stats.describe()})")
    log.info("training data: %s", total.stats.describe())
    return total
