"""The target's tokenizer, without its model: what `prepare` needs. Model loading imports
transformers' quantisation and kernel integrations on top (5.1 s against 6.2 s on a 2-core machine);
AutoTokenizer's own imports (torch, transformers' generation utilities) still took ~14 s on an H200
host (docs/benchmarks/throughput.md). An embedded target's tokenizer loads by its class instead,
without torch (1.5 s against 5.6 s on a 2-core machine)."""

from __future__ import annotations

import hashlib
import json

import transformers

from dflash_train.data.chat import give_plain_template
from dflash_train.targets.embedded import EMBEDDED_TARGETS, converted_target, converted_tokenizer_class
from dflash_train.targets.path import check_target_path, load_pretrained


def resolve_target_path(path: str) -> str:
    """The embedded target's converted dir, or `path` once checked (see target_path.py)."""
    return str(converted_target(path)) if path in EMBEDDED_TARGETS else check_target_path(path)


def load_tokenizer(path: str):
    """The target's tokenizer; one without a chat template (a base model) renders conversations as
    plain text (data/chat.py PLAIN_TEXT)."""
    # transformers resolves AutoTokenizer (and its torch import) only when it is asked for by name.
    tokenizer = load_pretrained(getattr(transformers, converted_tokenizer_class(path) or "AutoTokenizer"), path)
    give_plain_template(tokenizer)
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of vocabulary, special tokens and chat template: data tokenised for another target differs."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, str) else b"")
    return h.hexdigest()[:16]
