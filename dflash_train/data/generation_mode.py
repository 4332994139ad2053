"""The thinking mode answers were generated in, so that training renders them as they were served.

A `generate` output folder records its settings in meta.json, `sampling.thinking` among them (the
chat template's `enable_thinking`: on, off, or the template's default). Training text rendered in
another mode than the one the target answered in would teach the drafter a prompt the target never
saw (Qwen3's non-thinking prompt ends in an empty think block; its thinking prompt does not), so the
rows of such folders are rendered with the mode they were generated in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash_train.data.formats import DataError

log = logging.getLogger("dflash_train")

KEY = "enable_thinking"


def generated_thinking(paths) -> tuple[bool | None, list[Path]]:
    """(the thinking mode of the `generate` folders among `paths`, those folders); None when they
    recorded none (the template's default) or there are none. Folders of different modes are refused:
    one rendering cannot serve both."""
    modes: dict[Path, bool | None] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        meta = Path(path) / "meta.json"
        if meta.is_file():
            try:
                modes[Path(path)] = json.loads(meta.read_text())["settings"]["sampling"].get("thinking")
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise DataError(f"{meta}: unreadable generation settings ({type(err).__name__}: {err})") from None
    if len(set(modes.values())) > 1:
        listed = ", ".join(f"{p} ({_name(m)})" for p, m in modes.items())
        raise DataError(f"answers generated in different thinking modes: {listed}; prepare each mode on its own")
    return (next(iter(modes.values())) if modes else None), list(modes)


def template_kwargs_for(paths, configured: dict | None) -> dict:
    """`configured` (data.chat_template_kwargs) with the generated mode's `enable_thinking`; a
    configured value that contradicts it is refused."""
    kwargs = dict(configured or {})
    thinking, folders = generated_thinking(paths)
    if thinking is None:
        return kwargs
    if KEY in kwargs and kwargs[KEY] != thinking:
        raise DataError(f"data.chat_template_kwargs.{KEY}={kwargs[KEY]}, but {folders[0]} was generated with thinking "
                        f"{_name(thinking)} (its meta.json): its answers are rendered as they were written; "
                        f"remove the key")
    if KEY not in kwargs:
        log.info("rendering the answers of %s with thinking %s, as they were generated", ", ".join(map(str, folders)),
                 _name(thinking))
    return {**kwargs, KEY: thinking}


def served_thinking(data_cfg) -> bool | None:
    """The thinking mode a run's target is served in, as its training data was rendered: the data's
    `enable_thinking` (data.chat_template_kwargs, else the `generate` folders'; training refuses the
    two when they differ); None: the template's default. What `eval` renders its prompts with unless
    told otherwise."""
    if KEY in data_cfg.chat_template_kwargs:
        return data_cfg.chat_template_kwargs[KEY]
    return generated_thinking(data_cfg.train_files)[0]


def _name(thinking: bool | None) -> str:
    return {True: "on", False: "off", None: "as the template's default"}[thinking]
