"""Assistant-only loss masks for several chat templates, checked by decoding the masked tokens."""

from __future__ import annotations

import pytest

from dflash_train.data.chat import tokenize_conversation
from dflash_train.data.formats import DataError
from tiny import CHATML, tiny_tokenizer

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_for(name: str):
    if name == "chatml":
        return tiny_tokenizer(CHATML), "<|im_end|>"
    if name == "smollm2":
        return tiny_tokenizer(SMOLLM2), "<|im_end|>"
    tok = tiny_tokenizer(LLAMA3)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    return tok, "<|eot_id|>"


MULTI_TURN = [
    {"role": "system", "content": "You answer tersely."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six, of course.\nDone."},
]


def masked_spans(ids, mask) -> list[list[int]]:
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


@pytest.mark.parametrize("template", ["chatml", "llama3", "smollm2"])
@pytest.mark.parametrize("with_system", [True, False])
def test_loss_mask_covers_exactly_the_assistant_answers(template, with_system):
    tok, end = tokenizer_for(template)
    messages = MULTI_TURN if with_system else MULTI_TURN[1:]
    out = tokenize_conversation(tok, messages, max_length=4096)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(out.input_ids) == rendered
    assert len(out.input_ids) == len(out.loss_mask)
    spans = [tok.decode(s) for s in masked_spans(out.input_ids, out.loss_mask)]
    answers = [m["content"] + end for m in messages if m["role"] == "assistant"]
    assert spans == answers
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    if template == "smollm2" and not with_system:
        assert "SmolLM" in unmasked, "the injected default system prompt is never a loss target"


def test_truncation_to_max_length():
    tok, _ = tokenizer_for("chatml")
    full = tokenize_conversation(tok, MULTI_TURN, max_length=4096)
    cut = tokenize_conversation(tok, MULTI_TURN, max_length=70)
    assert len(full.input_ids) > 70
    assert cut.input_ids == full.input_ids[:70]
    assert cut.loss_mask == full.loss_mask[:70]


def test_template_that_does_not_render_prefixes_is_a_clear_error():
    # Renders the LAST message differently from earlier ones: prefixes are not prefixes.
    odd = (
        "{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    tok = tiny_tokenizer(odd)
    with pytest.raises(DataError, match="row 7: .* turn 2 after its own prompt"):
        tokenize_conversation(tok, MULTI_TURN, max_length=4096, where="row 7")


def test_opening_assistant_turn_is_context_not_target():
    """ShareGPT rows often open with an assistant greeting: it answers nothing, so it is not trained
    on, while later assistant turns are."""
    tok, _ = tokenizer_for("chatml")
    messages = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "x"},
                {"role": "assistant", "content": "yes sure"}]
    out = tokenize_conversation(tok, messages, max_length=100, where="f.jsonl:3")
    masked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m])
    assert "yes sure" in masked and "Hi, how" not in masked


def test_template_exception_becomes_a_data_error_naming_the_row():
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = tiny_tokenizer(strict)
    with pytest.raises(DataError, match="f.jsonl:9.*no system role"):
        tokenize_conversation(tok, MULTI_TURN, max_length=100, where="f.jsonl:9")


def test_a_base_model_continues_its_prompts_as_plain_text():
    """A tokenizer without a chat template gets PLAIN_TEXT: the turns after its BOS, a blank line
    between them; the answer's tokens (and only they) are learned, and they are the tokenizer's own
    encoding of the plain text."""
    from dflash_train.data.chat import PLAIN_TEXT, give_plain_template, text_format

    tok = tiny_tokenizer(chat_template=None)
    tok.add_special_tokens({"bos_token": "<s>"})
    give_plain_template(tok)
    assert tok.chat_template == PLAIN_TEXT and text_format(tok) == "plain text (no chat template)"
    messages = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "there was a fox."}]
    out = tokenize_conversation(tok, messages, max_length=256)
    assert out.input_ids == [tok.bos_token_id] + tok("Once upon a time\n\nthere was a fox.", add_special_tokens=False)["input_ids"]
    assert tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if m]) == "there was a fox."
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>Once upon a time\n\n"
    chat = tiny_tokenizer()
    give_plain_template(chat)  # a template of its own is kept
    assert chat.chat_template == CHATML and text_format(chat) == "chat template"


def test_text_rows_learn_every_ordinary_token():
    from dflash_train.data.chat import tokenize_text

    tok = tiny_tokenizer()
    out = tokenize_text(tok, "<|im_start|>plain corpus text", max_length=10)
    assert out.input_ids == tok("<|im_start|>plain corpus text")["input_ids"][:10]
    assert out.loss_mask == [0] + [1] * 9  # the special token is context only


def test_tokenising_leaves_transformers_space_clean_up_alone(caplog):
    """A BPE tokenizer saved with clean_up_tokenization_spaces=True (SmolLM2's) warns at its first
    decode that transformers ignores it; tokenising decodes without the clean-up, so no worker of a
    tokeniser pool prints that warning."""
    import logging

    tok = tiny_tokenizer(CHATML)
    tok.clean_up_tokenization_spaces = True
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process and message
    with caplog.at_level(logging.WARNING):
        tokenize_conversation(tok, MULTI_TURN, max_length=512)
    assert not [r for r in caplog.records if "clean_up_tokenization_spaces" in r.getMessage()]
    tok.decode(tok("a .")["input_ids"])  # the check itself can see the warning
    assert [r for r in caplog.records if "clean_up_tokenization_spaces" in r.getMessage()]
