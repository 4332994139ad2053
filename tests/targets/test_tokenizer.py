"""An embedded target's tokenizer loads by its class name, without AutoTokenizer's imports: it must
be the tokenizer AutoTokenizer gives (training and eval data prepared by one are read by the other)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from dflash_train.data.chat import give_plain_template
from dflash_train.targets.embedded import EMBEDDED_TARGETS
from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path, tokenizer_fingerprint

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Write  two\tlines:  café, 数字 123 ¿qué?"},
            {"role": "assistant", "content": "First line.\n\n  Second   line ends here.\n"}]


# Gemma 3's first use downloads 253 MB and converts a 262K vocabulary (~135 s on 2 cores): started
# first, beside the example, so it does not end the run alone on one worker.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow(seconds=135)) if n == "gemma3-270m" else n
                                  for n in sorted(EMBEDDED_TARGETS)])
def test_an_embedded_target_loads_the_tokenizer_autotokenizer_gives(name):
    path = resolve_target_path(name)
    direct, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    give_plain_template(auto)
    assert type(direct) is type(auto)
    assert tokenizer_fingerprint(direct) == tokenizer_fingerprint(auto)
    texts = [direct.apply_chat_template(MESSAGES, tokenize=False), MESSAGES[0]["content"], " leading space", ""]
    for special in (False, True):
        encoded = [t(texts, add_special_tokens=special)["input_ids"] for t in (direct, auto)]
        assert encoded[0] == encoded[1]


def test_another_target_path_loads_through_autotokenizer(tmp_path, monkeypatch):
    import transformers

    calls = []
    stub = SimpleNamespace(chat_template="{{ messages }}")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(path) or stub)
    assert load_tokenizer(str(tmp_path)) is stub and calls == [str(tmp_path)]


def test_an_embedded_targets_tokenizer_loads_without_torch():
    """`prepare` of an embedded target never imports torch (seconds of start-up)."""
    code = ("import sys; from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path\n"
            "load_tokenizer(resolve_target_path('smollm2')); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.split()[-1:] == ["False"], done.stderr[-2000:]
