"""Conversation -> (input_ids, loss_mask) through the target tokenizer's own chat template.

The loss mask covers assistant tokens only. Spans are found by rendering prefixes of the
conversation: the tokens between "everything before turn i + the generation prompt" and
"everything through turn i" are turn i's answer, as the target wrote it (its thinking included, for
a target that thinks). A template that renders an earlier turn otherwise once later turns follow
(Qwen3 drops the thinking of past turns) gets that turn as a row of its own.

A target without a chat template (a base model) is given `PLAIN_TEXT` when it loads: turns as plain
text after its BOS, a blank line between them, a prompt continued where it ends. `{"text": ...}`
rows are a corpus for any target: every token is learned, no template.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jinja2 import TemplateError

from dflash_train.data.formats import DataError


PLAIN_TEXT = (
    "{{ bos_token or '' }}{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
    "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '\\n\\n' }}{% endif %}"
)
"""The chat template given to a tokenizer that has none."""


def give_plain_template(tokenizer) -> None:
    """A tokenizer without a chat template (a base model's) renders conversations as PLAIN_TEXT."""
    if not tokenizer.chat_template:
        tokenizer.chat_template = PLAIN_TEXT


def text_format(tokenizer) -> str:
    """How conversations reach the target: its own chat template, or plain text (a base model)."""
    return "plain text (no chat template)" if tokenizer.chat_template == PLAIN_TEXT else "chat template"


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    turns: list[TokenizedConversation] = field(default_factory=list)
    """Assistant turns the template renders otherwise once later turns follow (Qwen3 drops an earlier
    turn's thinking): each is its own row, the conversation up to it as the target saw it then, the
    loss on that turn alone. Empty for most templates."""


def _render(tokenizer, messages, add_generation_prompt: bool, kwargs: dict, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except (TemplateError, ValueError) as err:  # e.g. "roles must alternate user/assistant"
        raise DataError(f"{where}: the chat template rejected this conversation: {err}") from None


def _trailing_whitespace(tokenizer, ids: list[int], start: int, end: int) -> int:
    """Drop trailing tokens that are whitespace only (the newline templates put after end-of-turn):
    the target never generates them, so the drafter should not be scored on them. Decoded without
    transformers' space clean-up, as everywhere here (its BPE tokenizers warn once per process that
    they ignore it: once per worker of a tokeniser pool)."""
    while end > start and tokenizer.decode([ids[end - 1]], clean_up_tokenization_spaces=False).strip() == "":
        end -= 1
    return end


@dataclass
class _Renders:
    """One conversation's rendered texts: the whole, and per answer (turn i) the text before it
    (with the generation prompt) and through it (None for the last turn: the whole)."""

    where: str
    full: str
    answers: list[tuple[int, str, str | None]]


def _render_all(tokenizer, messages: list[dict], kwargs: dict, where: str) -> _Renders:
    answers = [
        (i, _render(tokenizer, messages[:i], True, kwargs, where),
         None if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, kwargs, where))
        # An opening assistant turn (a greeting in ShareGPT) answers nothing: context, not a target.
        for i, message in enumerate(messages) if message["role"] == "assistant" and i > 0
    ]
    full = _render(tokenizer, messages, False, kwargs, where)
    for i, _, through in answers:
        thinking = messages[i].get("reasoning_content")
        if thinking and thinking.strip() not in (through or full):
            raise DataError(f"{where}: the chat template does not render the thinking (reasoning_content) of "
                            f"assistant turn {i}: the target wrote it, so training without it would teach another "
                            "text; use the target's own template, or rows without reasoning_content")
    return _Renders(where, full, answers)


def _answer_mask(tokenizer, renders: _Renders, encoded: dict[str, list[int]], max_length: int) -> TokenizedConversation:
    """Each answer's tokens are those between its prompt (`before`: the conversation up to it and the
    generation prompt) and the conversation through it (`through`), both as the target saw them when it
    wrote that answer. Where the whole conversation renders an answer that way, it is learned there;
    an answer the template renders otherwise once later turns follow becomes a row of its own."""
    full = encoded[renders.full]
    loss_mask = [0] * len(full)
    turns = []
    for i, before_text, through_text in renders.answers:
        before = encoded[before_text]
        through = full if through_text is None else encoded[through_text]
        if through[: len(before)] != before:
            raise DataError(
                f"{renders.where}: the chat template does not render assistant turn {i} after its own prompt "
                "(the generation prompt is not a prefix of the turn); cannot locate the answer tokens"
            )
        end = _trailing_whitespace(tokenizer, through, len(before), len(through))
        if full[: len(through)] == through:
            loss_mask[len(before):end] = [1] * (end - len(before))
        else:
            mask = [0] * len(before) + [1] * (end - len(before)) + [0] * (len(through) - end)
            turns.append(TokenizedConversation(input_ids=through[:max_length], loss_mask=mask[:max_length]))
    return TokenizedConversation(input_ids=full[:max_length], loss_mask=loss_mask[:max_length], turns=turns)


def render_conversations(tokenizer, conversations: list[tuple[list[dict], str]], template_kwargs: dict | None = None
                         ) -> list[_Renders | DataError | list[dict]]:
    """The first half of `tokenize_conversations`: each (messages, where) rendered through the chat
    template (Python, holding the GIL). A base model's conversations pass through as messages: they
    are encoded span by span in the second half."""
    if tokenizer.chat_template == PLAIN_TEXT:
        return [messages for messages, _ in conversations]
    kwargs = dict(template_kwargs or {})
    renders: list[_Renders | DataError | list[dict]] = []
    for messages, where in conversations:
        try:
            renders.append(_render_all(tokenizer, messages, kwargs, where))
        except DataError as err:
            renders.append(err)
    return renders


def encode_renders(tokenizer, renders: list, max_length: int) -> list[TokenizedConversation | DataError]:
    """The second half: every rendered text encoded in one batch, which the fast tokenizer spreads
    over its own threads (encoding is most of the cost, and releases the GIL); then the answer spans.
    The encoding is the one `apply_chat_template(tokenize=True)` gives: the text, no special tokens added."""
    texts = list(dict.fromkeys(t for r in renders if isinstance(r, _Renders)
                               for t in (r.full, *(x for _, before, through in r.answers for x in (before, through)))
                               if t is not None))
    encoded = dict(zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []))
    results: list[TokenizedConversation | DataError] = []
    for r in renders:
        if isinstance(r, DataError):
            results.append(r)
            continue
        try:
            plain = isinstance(r, list)  # a base model's messages
            results.append(_plain_conversation(tokenizer, r, max_length) if plain
                           else _answer_mask(tokenizer, r, encoded, max_length))
        except DataError as err:
            results.append(err)
    return results


def tokenize_conversations(
    tokenizer, conversations: list[tuple[list[dict], str]], max_length: int, template_kwargs: dict | None = None
) -> list[TokenizedConversation | DataError]:
    """(messages, where) pairs -> their tokens and loss masks, or the DataError of each bad one."""
    return encode_renders(tokenizer, render_conversations(tokenizer, conversations, template_kwargs), max_length)


def tokenize_conversation(
    tokenizer, messages: list[dict], max_length: int, where: str = "", template_kwargs: dict | None = None
) -> TokenizedConversation:
    result = tokenize_conversations(tokenizer, [(messages, where)], max_length, template_kwargs)[0]
    if isinstance(result, DataError):
        raise result
    return result


def _plain_conversation(tokenizer, messages: list[dict], max_length: int) -> TokenizedConversation:
    """PLAIN_TEXT's rendering, encoded span by span: each answer alone, the text between answers
    (turns and the blank lines after them) together, as generation encoded the prompt and then
    appended the answer's tokens. One whole-text encoding would merge a prompt's last blank line
    with an answer's first characters (SentencePiece has tokens for runs of newlines)."""
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    mask = [0] * len(ids)
    context = ""
    for i, message in enumerate(messages):
        last = i == len(messages) - 1
        if message["role"] == "assistant" and i > 0:
            ids += (new := tokenizer(context, add_special_tokens=False)["input_ids"])
            mask += [0] * len(new)
            answer = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            end = _trailing_whitespace(tokenizer, answer, 0, len(answer))
            ids += answer
            mask += [1] * end + [0] * (len(answer) - end)
            context = "" if last else "\n\n"
        else:
            context += message["content"] + ("" if last else "\n\n")
    if context:
        ids += (new := tokenizer(context, add_special_tokens=False)["input_ids"])
        mask += [0] * len(new)
    return TokenizedConversation(input_ids=ids[:max_length], loss_mask=mask[:max_length])


def tokenize_text(tokenizer, text: str, max_length: int) -> TokenizedConversation:
    """A corpus row: the tokenizer's own encoding (its BOS included), every ordinary token learned."""
    ids = tokenizer(text)["input_ids"][:max_length]
    special = set(tokenizer.all_special_ids)
    return TokenizedConversation(input_ids=ids, loss_mask=[int(t not in special) for t in ids])
