"""Regenerate conversations with the target itself: the drafter must learn what the TARGET says.

Every assistant turn is replaced, in order, by the target's own answer to the conversation so far
(turn 2 is asked with the target's turn-1 answer, not the dataset's); user and system turns are
kept; a conversation that ends with a user turn (a prompt file) gets one answer appended.

    inputs (streamed) -> skip rows already committed -> regenerate (N conversations in flight)
                      -> shards (atomic) -> summary.json

Each input row ends up in the output exactly once, as `ok`, `error` (generation failed after
retries; `reason` says why) or `skipped` (malformed input with `skip_invalid`). Rows are keyed by
a hash of file and line, so rerunning the same command after a crash skips what was committed and
does the rest. Non-ok rows carry no messages: nothing can train on an answer the target never gave.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.backends import Backend, GenerationError
from dflash_train.data.formats import DataError, row_id, iter_rows, normalise_messages
from dflash_train.generate.config import GenerateConfig
from dflash_train.atomic import write_json_atomic
from dflash_train.disk import require_writable, writes_to
from dflash_train.run_lock import RunLock
from dflash_train.generate.shards import (
    ShardWriter,
    committed_shards,
    read_done_keys,
    remove_temp_files,
    scan_outputs,
)

log = logging.getLogger("dflash_train")


def make_backend(cfg) -> Backend:
    """The backend `cfg` (a GenerateConfig) asks for.

    Imported here so that an HTTP run never loads transformers and a local run never needs
    aiohttp (the `generate` extra).
    """
    if cfg.backend == "http":
        from dflash_train.generate.http_backend import HttpBackend

        return HttpBackend(cfg.http, model=cfg.model, max_connections=cfg.concurrency)
    from dflash_train.generate.local_backend import LocalBackend

    return LocalBackend.load(cfg.model or "smollm2", cfg.local)


def row_key(where: str) -> str:
    """Stable identity of an input row: its resolved file and line (input ids may repeat)."""
    return hashlib.blake2b(where.encode(), digest_size=8).hexdigest()


def turn_seed(seed: int | None, key: str, turn: int) -> int | None:
    """Per-request seed: reproducible, yet no two requests share their sampling noise."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}:{turn}".encode(), digest_size=4).digest(), "little")


@dataclass
class Job:
    key: str
    id: str
    source: str
    messages: list[dict] | None = None
    invalid: str | None = None
    """Why the input row is malformed (only with skip_invalid)."""


class BadInputRow(DataError):
    """A malformed input row stopped the run (no skip_invalid); `where` is its `file:line`."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where

    def how_to_go_on(self, command: list[str]) -> str:
        path, _, line = self.where.rpartition(":")
        row = f"line {line} of {path}" if line.isdigit() else f"{line} of {path}"  # JSONL line, Parquet row
        return (f"to go on, fix {row} and run the same command again, or record malformed rows as skipped:\n"
                f"  {shlex.join([*command, '--skip-invalid'])}")


def check_turns(messages: list[dict], where: str) -> None:
    roles = [m["role"] for m in messages if m["role"] != "system"]
    if "user" not in roles:
        raise DataError(f"{where}: no user turn to answer")
    if roles[0] != "user":
        raise DataError(f"{where}: the first non-system turn is '{roles[0]}', not 'user'")


def iter_jobs(paths: list[str], skip_invalid: bool) -> Iterator[Job]:
    """Every input row in order, one at a time; malformed ones raise unless skip_invalid."""
    for path in paths:
        for where, row in iter_rows(Path(path).resolve()):
            key = row_key(where)
            try:
                if isinstance(row, DataError):
                    raise row
                messages = normalise_messages(row, where)
                check_turns(messages, where)
            except DataError as err:
                if not skip_invalid:
                    raise BadInputRow(str(err), where) from None
                yield Job(key, key, where, invalid=str(err).removeprefix(f"{where}: "))
                continue
            yield Job(key, row_id(row, key), where, messages=messages)


def count_rows(paths: list[str]) -> int:
    """Rows for the progress bar: Parquet metadata, JSONL non-blank lines (read in blocks, not
    parsed; blank lines are no rows, and a last line without a newline is one)."""
    total = 0
    for path in map(Path, paths):
        if path.suffix == ".parquet":
            total += pq.ParquetFile(path).metadata.num_rows
        elif path.is_file():
            with path.open("rb") as f:
                text_in_line = False  # the current line, possibly split across blocks, has non-blank text
                for block in iter(lambda: f.read(1 << 20), b""):
                    *ended, tail = block.split(b"\n")
                    for part in ended:
                        total += text_in_line or bool(part.strip())
                        text_in_line = False
                    text_in_line = text_in_line or bool(tail.strip())
                total += text_in_line
    return total


def _result_row(job: Job, status: str, reason: str | None = None, messages: list | None = None, **counts) -> dict:
    return {
        "key": job.key,
        "id": job.id,
        "source": job.source,
        "status": status,
        "reason": reason,
        "messages": messages or [],
        "num_turns": counts.get("num_turns", 0),
        "prompt_tokens": counts.get("prompt_tokens", 0),
        "completion_tokens": counts.get("completion_tokens", 0),
        "num_truncated": counts.get("num_truncated", 0),
    }


async def regenerate(job: Job, backend: Backend, params: GenParams, system_prompt: str | None) -> dict:
    """The target answers every assistant turn of `job` in order; returns the output row."""
    if job.invalid is not None:
        return _result_row(job, "skipped", job.invalid)
    source = job.messages
    if system_prompt is not None and source[0]["role"] != "system":
        source = [{"role": "system", "content": system_prompt}, *source]
    if source[-1]["role"] != "assistant":
        source = [*source, {"role": "assistant", "content": None}]
    history: list[dict] = []  # what the target sees: role + content only
    out: list[dict] = []
    counts = {"num_turns": 0, "prompt_tokens": 0, "completion_tokens": 0, "num_truncated": 0}
    for turn, message in enumerate(source):
        if message["role"] != "assistant":
            history.append(message)
            out.append({**message, "reasoning_content": None})
            continue
        request = replace(params, seed=turn_seed(params.seed, job.key, turn))
        try:
            answer = await backend.complete(history, request)
        except GenerationError as err:
            log.warning("%s: turn %d: %s (recorded as an error row)", job.source, turn, err)
            return _result_row(job, "error", f"turn {turn}: {err}", **counts)
        history.append({"role": "assistant", "content": answer.text})
        out.append({"role": "assistant", "content": answer.text, "reasoning_content": answer.reasoning})
        counts["num_turns"] += 1
        counts["prompt_tokens"] += answer.prompt_tokens
        counts["completion_tokens"] += answer.completion_tokens
        counts["num_truncated"] += answer.finish_reason == "length"
    return _result_row(job, "ok", None, out, **counts)


@dataclass
class RunStats:
    rows_in: int = 0
    already_done: int = 0
    written: dict = field(default_factory=lambda: {"ok": 0, "error": 0, "skipped": 0})
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)


def _settings(cfg: GenerateConfig) -> dict:
    """What decides the rows; must be identical for every row of one output directory.

    The format is here too: resume reads only shards of the current format, so switching it
    would regenerate (and duplicate) every row.
    """
    return {"backend": cfg.backend, "format": cfg.output_format, "sampling": cfg.sampling.model_dump(mode="json")}


class OutputMismatch(ValueError):
    """The output directory belongs to another run (settings, model): rerunning cannot resume it."""


class NoValidRows(DataError):
    """Every input row was malformed (and skipped): the output holds no answer to train on."""


def _check_meta(out_dir: Path, meta: dict) -> None:
    path = out_dir / "meta.json"
    if path.is_file():
        old = json.loads(path.read_text())
        keys = ("settings", "model", "chat_template_hash")
        diff = {k: (old.get(k), meta.get(k)) for k in keys if old.get(k) != meta.get(k)}
        if diff:
            raise OutputMismatch(
                f"{out_dir} holds rows generated with other settings {diff} (old, new); "
                "use a new output directory"
            )
    write_json_atomic(path, meta)


async def _pump(cfg: GenerateConfig, backend: Backend, writer: ShardWriter, done: set[str], stats: RunStats) -> None:
    """Stream jobs through at most `concurrency` regenerations; commit rows as they finish."""
    params = GenParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
        thinking=cfg.sampling.thinking,
        seed=cfg.sampling.seed,
    )
    total = None
    if cfg.progress:
        total = count_rows(cfg.inputs)
        total = min(total, cfg.limit) if cfg.limit else total
    bar = tqdm(total=total, unit="row", disable=not cfg.progress, dynamic_ncols=True, smoothing=0.05)
    pending: set[asyncio.Task] = set()

    def finish(tasks) -> None:
        # Every failure is retrieved here (a batch that fails fails thousands of rows at once: asyncio
        # would print each one's traceback as "never retrieved"); the finished rows are kept.
        failures = []
        for task in tasks:
            if (err := task.exception()) is not None:
                failures.append(err)
                continue
            row = task.result()
            writer.add(row)
            stats.written[row["status"]] += 1
            stats.completion_tokens += row["completion_tokens"]
        bar.update(len(tasks) - len(failures))
        elapsed = time.monotonic() - stats.started
        bar.set_postfix(tok_s=f"{stats.completion_tokens / elapsed:.0f}", err=stats.written["error"], refresh=False)
        if failures:
            raise failures[0]

    bad_input: DataError | None = None
    ticker = asyncio.create_task(writer.commit_on_time())
    try:
        try:
            for job in iter_jobs(cfg.inputs, cfg.skip_invalid):
                if cfg.limit is not None and stats.rows_in >= cfg.limit:
                    break
                stats.rows_in += 1
                if job.key in done:
                    stats.already_done += 1
                    bar.update(1)
                    continue
                pending.add(asyncio.create_task(regenerate(job, backend, params, cfg.sampling.system_prompt)))
                if len(pending) >= cfg.concurrency:
                    finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    finish(finished)
        except DataError as err:
            bad_input = err  # raised once the rows in flight, valid work, are finished and committed
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finish(finished)
        if bad_input is not None:
            raise bad_input
    finally:
        # On a bug or an interrupt: keep what is finished, drop what is in flight (redone next run).
        for task in (*pending, ticker):
            task.cancel()
        await asyncio.gather(*pending, ticker, return_exceptions=True)
        writer.commit()
        bar.close()


async def _generate(cfg: GenerateConfig) -> dict:
    out_dir = Path(cfg.output_dir)
    require_writable(out_dir, "generate's output")
    out_dir.mkdir(parents=True, exist_ok=True)
    with RunLock(out_dir, "generate"), writes_to(out_dir):
        # Every input is looked for before the model loads: inputs are answered one file after another,
        # so a missing second file found in its turn would come after the whole first file's answers.
        if missing := [p for p in cfg.inputs if not Path(p).is_file()]:
            raise DataError(f"data file not found: {', '.join(missing)}")
        if removed := remove_temp_files(out_dir):
            log.info("removed %d uncommitted temporary file(s) of an earlier run", removed)
        done = read_done_keys(committed_shards(out_dir, cfg.output_format))
        # Its commit clock starts now: a model load that takes part of a short-lived job counts.
        writer = ShardWriter(out_dir, cfg.output_format, shard_size=cfg.shard_size, interval_s=cfg.shard_interval_s)
        backend = make_backend(cfg)
        stats = RunStats()
        try:
            identity = await backend.identity()
            meta = {
                "settings": _settings(cfg),
                "model": identity["model"],
                "chat_template_hash": identity.get("chat_template_hash"),
                "identity": identity,
                "inputs": [str(Path(p).resolve()) for p in cfg.inputs],
            }
            _check_meta(out_dir, meta)
            await _pump(cfg, backend, writer, done, stats)
        finally:
            await backend.aclose()
        summary = _summary(cfg, out_dir, stats, done)
        write_json_atomic(out_dir / "summary.json", summary)
        if summary["skipped"] and not (summary["ok"] or summary["error"]):  # as prepare and train refuse it
            raise NoValidRows(f"{', '.join(cfg.inputs)}: no usable input row: all {summary['skipped']} skipped as "
                              f"malformed (each row's reason is in {out_dir}); nothing was generated")
        return summary


def _summary(cfg: GenerateConfig, out_dir: Path, stats: RunStats, done: set[str]) -> dict:
    totals = scan_outputs(committed_shards(out_dir, cfg.output_format))
    elapsed = time.monotonic() - stats.started
    this_run = sum(stats.written.values())
    summary = {
        "rows_in": stats.rows_in,
        **totals,
        "this_run": {
            "rows": this_run,
            **stats.written,
            "already_done": stats.already_done,
            "seconds": round(elapsed, 3),
            "rows_per_s": round(this_run / elapsed, 2),
            "completion_tokens_per_s": round(stats.completion_tokens / elapsed, 1),
        },
    }
    # Rows from inputs no longer listed (or a different limit) would break rows_in = ok+error+skipped.
    summary["rows_not_in_inputs"] = len(done) - stats.already_done
    if summary["rows_out"] != stats.rows_in:
        log.warning("output holds %d rows for %d input rows", summary["rows_out"], stats.rows_in)
    return summary


def stop_advice(cfg: GenerateConfig, err: BaseException, command: list[str]) -> str | None:
    """What a stopped run kept and how to go on: a malformed row stops every rerun at the same row
    until it is fixed or skipped; any other stop is resumed by the same command."""
    held = describe_partial(cfg)
    if isinstance(err, BadInputRow):
        return f"generate stopped at a malformed input row{f'; {held}' if held else ''}; {err.how_to_go_on(command)}"
    if held is None:
        return None
    return f"generate stopped: {held}; the same command resumes after them:\n  {shlex.join(command)}"


def describe_partial(cfg: GenerateConfig) -> str | None:
    """What a stopped run left in its output directory (committed rows survive: a rerun resumes)."""
    shards = committed_shards(Path(cfg.output_dir), cfg.output_format)
    if not shards:
        return None
    held = scan_outputs(shards)
    return (f"{cfg.output_dir} keeps {held['rows_out']} committed rows ({held['ok']} ok, {held['error']} error, "
            f"{held['skipped']} skipped) in {held['shards']} shard(s)")


def generate(cfg: GenerateConfig) -> dict:
    """Regenerate `cfg.inputs` into `cfg.output_dir`; returns (and writes) the summary."""
    return asyncio.run(_generate(cfg))
