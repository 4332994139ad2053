"""Reading conversations: JSONL or Parquet, OpenAI `messages` or ShareGPT `conversations`, or
plain `text` rows (a corpus: every token is learned, no template).

Rows stream one at a time (a million-row file never sits in memory as parsed objects). A bad row
is a `DataError` naming file, line and problem: `tokenize_files` raises it, or with `skip_invalid`
skips it and counts it in `RowStats`. Nothing is dropped silently.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class DataError(ValueError):
    pass


@dataclass
class Conversation:
    source: str
    """file:line of the row."""
    id: str
    messages: list[dict]
    """[{"role": system|user|assistant, "content": str}, ...], an assistant turn's thinking as
    "reasoning_content"; empty for a text row"""
    text: str | None = None
    """A `{"text": ...}` row: plain text, learned whole, never rendered through a chat template."""


@dataclass
class RowStats:
    ok: int = 0
    skipped: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return self.ok + sum(self.skipped.values())

    def skip(self, err: DataError) -> None:
        """Count a skipped row under its reason: the message without location and details."""
        self.skipped[str(err).split(": ", 1)[-1].split(" (")[0][:80]] += 1

    def to_dict(self) -> dict:
        return {"rows": self.total, "ok": self.ok, "skipped": dict(self.skipped)}

    def describe(self) -> str:
        """One line for the log: '24 rows: 21 used, 3 skipped (no assistant turn to learn from: 2, ...)'."""
        reasons = ", ".join(f"{reason}: {n}" for reason, n in self.skipped.most_common())
        skipped = sum(self.skipped.values())
        return f"{self.total} rows: {self.ok} used, {skipped} skipped" + (f" ({reasons})" if reasons else "")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise DataError(f"{where}: only text content parts are supported, got {part!r:.80}")
        return "".join(parts)
    raise DataError(f"{where}: content must be a string, got {type(content).__name__}")


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where an assistant turn's thinking is kept apart from its answer: SGLang's and vLLM's reasoning
parsers (`reasoning_content`; newer vLLM `reasoning`), gpt-oss templates (`thinking`). Chat templates
read it as `reasoning_content`."""


def normalise_messages(row: dict, where: str) -> list[dict]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        turns, role_key, text_key, field_name = row["messages"], "role", "content", "messages"
    elif "conversations" in row:
        turns, role_key, text_key, field_name = row["conversations"], "from", "value", "conversations"
    else:
        raise DataError(f"{where}: no 'messages', 'conversations' or 'text' field (keys: {sorted(row)[:8]})")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field '{field_name}' is empty or not a list")
    messages = []
    for i, turn in enumerate(turns):
        at = f"{where}: {field_name}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{at}: turn must be an object")
        raw_role = turn.get(role_key, turn.get("role"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise DataError(f"{at}: unknown role {raw_role!r} (known: {sorted(set(ROLE_ALIASES))})")
        content = turn.get(text_key, turn.get("content"))
        messages.append({"role": role, "content": _text(content, at)})
        reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
        if reasoning is not None:
            if role != "assistant" or not isinstance(reasoning, str):
                raise DataError(f"{at}: reasoning text belongs to an assistant turn, as a string")
            if reasoning.strip():
                messages[-1]["reasoning_content"] = reasoning
    return messages


def text_row(row) -> str | None:
    """The text of a `{"text": ...}` row (no messages), else None."""
    if isinstance(row, dict) and "text" in row and "messages" not in row and "conversations" not in row:
        return row["text"]
    return None


def normalise_text(text: str) -> str:
    """Case and whitespace ignored: how a held-out prompt is recognised in training text."""
    return " ".join(text.lower().split())


def row_id(row, fallback: str) -> str:
    if isinstance(row, dict):
        for key in ("id", "conversation_id", "uuid"):
            if row.get(key) is not None:
                return str(row[key])
    return fallback


MAX_ROW_BYTES = 4 << 20
"""Largest JSONL line / Parquet row read. Real conversations are well under 1 MB; one multi-megabyte
line sent to `generate` once grew the process to 24 GB (parsing, tokenising, a prompt of millions of
tokens). A longer row is a DataError naming file:line, found without reading the line whole."""


def _too_long(where: str, size: str) -> DataError:
    return DataError(f"{where}: row is {size}, over the {MAX_ROW_BYTES >> 20} MB limit "
                     "(dflash_train.data.formats.MAX_ROW_BYTES)")


def _lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) with each read bounded to MAX_ROW_BYTES + 1; an overlong line is
    (lineno, None) and its remainder is skipped in bounded reads, never held whole."""
    lineno = 0
    while raw := f.readline(MAX_ROW_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield lineno, None
            continue
        yield lineno, raw


BLANK = "blank line"
"""What a JSONL file's blank line is read as: no row, but counted where rows are (training data)."""


def _jsonl_lines(path: Path) -> Iterator[tuple[str, bytes | DataError | str]]:
    """The lines of a JSONL file, unparsed (parse_line parses one); a blank one as BLANK."""
    with path.open("rb") as f:
        for lineno, raw in _lines(f):
            where = f"{path}:{lineno}"
            if raw is None:
                yield where, _too_long(where, f"longer than {MAX_ROW_BYTES} bytes")
            else:
                yield where, raw if raw.strip() else BLANK


def parse_line(where: str, raw: bytes) -> object:
    """One JSONL line -> its JSON value, or the DataError saying why it has none."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return DataError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})")
    text = text.rstrip("\r\n")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        return DataError(f"{where}: not valid JSON: {_json_problem(err, text)}")


def _json_problem(err: json.JSONDecodeError, line: str) -> str:
    """A line cut short ends inside its value; json then reports the end of input, which on a line
    with its newline read as "line 2 column 1": say that the line ends early instead."""
    if err.pos >= len(line.rstrip()) or err.msg.startswith("Unterminated string"):
        return f"the line ends at column {len(line)} before its JSON value does (cut short?)"
    return f"{err.msg} (column {err.colno})"


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq  # Parquet inputs only: `prompts` and `corpus` read JSONL without pyarrow

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        sizes = _row_bytes(batch)
        for i in range(batch.num_rows):
            row += 1
            where = f"{path}:row {row}"
            # Only rows under the limit become Python objects (a huge one stays in Arrow memory).
            if sizes[i] > MAX_ROW_BYTES:
                yield where, _too_long(where, f"{sizes[i]} bytes")
            else:
                yield where, batch.slice(i, 1).to_pylist()[0]


def _row_bytes(batch) -> list[int]:
    """Approximate bytes per row of a record batch: the lengths of its string/binary values, at any
    nesting (messages are lists of structs), computed in Arrow without building Python objects."""
    import pyarrow as pa  # as in _parquet_rows: only for Parquet inputs
    import pyarrow.compute as pc

    sizes = [0] * batch.num_rows

    def visit(array, rows):
        t = array.type
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            for r, n in zip(rows, pc.fill_null(pc.binary_length(array), 0).to_pylist()):
                sizes[r] += n
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            lengths = pc.fill_null(pc.list_value_length(array), 0).to_pylist()
            child_rows = [r for r, n in zip(rows, lengths) for _ in range(n)]
            visit(pc.list_flatten(array), child_rows)
        elif pa.types.is_struct(t):
            for k in range(t.num_fields):
                visit(pc.struct_field(array, [k]), rows)

    for column in batch.columns:
        visit(column, list(range(batch.num_rows)))
    return sizes


def iter_rows(path: str | Path) -> Iterator[tuple[str, object]]:
    """(location, parsed row or DataError) for every row of a JSONL or Parquet file."""
    rows = iter_unparsed_rows(path)
    return ((where, parse_line(where, row) if isinstance(row, bytes) else row) for where, row in rows
            if row is not BLANK)


def iter_unparsed_rows(path: str | Path) -> Iterator[tuple[str, object]]:
    """iter_rows with JSONL lines left as bytes: JSON parsing is most of the cost of reading, and
    `tokenize_files` spreads it over its worker processes (read_row parses). Blank lines come as
    BLANK, so that the training data counts them."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return _jsonl_lines(path)
    raise DataError(f"{path}: unsupported data format (use .jsonl or .parquet)")


def expand_paths(paths) -> list[Path]:
    """Files as given; a directory (e.g. `dflash-train generate` output) -> its committed shards."""
    out = []
    for p in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(p)
        if p.is_dir():
            shards = sorted(f for f in p.glob("shard-*") if f.suffix in (".jsonl", ".parquet"))
            if not shards:
                raise DataError(f"{p}: directory holds no shard-*.jsonl / shard-*.parquet files")
            out += shards
        else:
            out.append(p)
    return out


def read_row(where: str, row) -> Conversation | DataError | str:
    """One row of iter_unparsed_rows -> its Conversation, the DataError that makes it unusable, or
    the reason a row that regeneration marked failed is skipped (it is accounted there: counted,
    never trained on)."""
    if row is BLANK:
        return BLANK
    if isinstance(row, bytes):
        row = parse_line(where, row)
    if isinstance(row, dict) and row.get("status", "ok") != "ok":
        return f"generation {row['status']}"
    try:
        if isinstance(row, DataError):
            raise row
        text = text_row(row)
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise DataError(f"{where}: field 'text' must be a non-empty string")
        messages = [] if text is not None else normalise_messages(row, where)
        if text is None and not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant turn to learn from")
    except DataError as err:
        return err
    return Conversation(source=where, id=row_id(row, where), messages=messages, text=text)
