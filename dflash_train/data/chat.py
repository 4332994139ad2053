"""Conversation -> (input_ids, loss_mask) through the target tokenizer's own chat template.

The loss mask covers assistant tokens only. Spans are found by rendering prefixes of the
conversation: the tokens between "everything before turn i + the generation prompt" and
"everything through turn i" are turn i's answer. This works for any template that renders
prefixes as prefixes (checked, with a clear error when a template does not).
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from dflash_train.data.formats import DataError


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]


def _render(tokenizer, messages, add_generation_prompt: bool, kwargs: dict, where: str) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except (TemplateError, ValueError) as err:  # e.g. "roles must alternate user/assistant"
        raise DataError(f"{where}: the chat template rejected this conversation: {err}") from None
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _trailing_whitespace(tokenizer, ids: list[int], start: int, end: int) -> int:
    """Drop trailing tokens that are whitespace only (the newline templates put after end-of-turn):
    the target never generates them, so the drafter should not be scored on them."""
    while end > start and tokenizer.decode([ids[end - 1]]).strip() == "":
        end -= 1
    return end


def tokenize_conversation(
    tokenizer, messages: list[dict], max_length: int, where: str = "", template_kwargs: dict | None = None
) -> TokenizedConversation:
    kwargs = dict(template_kwargs or {})
    full = _render(tokenizer, messages, False, kwargs, where)
    loss_mask = [0] * len(full)
    for i, message in enumerate(messages):
        # An opening assistant turn (a greeting in ShareGPT) answers nothing: context, not a target.
        if message["role"] != "assistant" or i == 0:
            continue
        before = _render(tokenizer, messages[:i], True, kwargs, where)
        # The last turn's prefix is the whole conversation: one encode less for most rows.
        through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, kwargs, where)
        if full[: len(before)] != before or full[: len(through)] != through:
            raise DataError(
                f"{where}: the chat template does not render conversation prefixes as prefixes "
                f"(assistant turn {i}); cannot locate the answer tokens"
            )
        end = _trailing_whitespace(tokenizer, full, len(before), len(through))
        for p in range(len(before), end):
            loss_mask[p] = 1
    return TokenizedConversation(input_ids=full[:max_length], loss_mask=loss_mask[:max_length])
