"""The in-process transformers backend on a tiny random target, alone and behind the HTTP server."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.job import generate
from dflash_train.generate.config import LocalConfig, build_generate_config
from dflash_train.decode.greedy import ReleaseFinished, generate_ids
from dflash_train.generate.local_backend import LocalBackend, encode_prompt, stop_ids
from tests.generate.conftest import read_rows, write_jsonl

PROMPTS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You verify tokens."}, {"role": "user", "content": "The quick brown fox jumps?"}],
    [{"role": "user", "content": "numbers 0123456789 and code: def f(x): return x, then tell me more"}],
    [{"role": "user", "content": "x"}],
]


def test_batched_greedy_equals_model_generate_prompt_by_prompt(tiny_target):
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", batch_size=8))
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=24)

    async def answer_all():
        try:
            return await asyncio.gather(*(backend.complete(m, params) for m in PROMPTS))
        finally:
            await backend.aclose()

    answers = asyncio.run(answer_all())  # concurrent calls: one left-padded batch of 4 lengths
    tokenizer, model = backend.tokenizer, backend.model
    for messages, answer in zip(PROMPTS, answers):
        ids = encode_prompt(tokenizer, messages, None)
        alone = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(ids):]
        new = alone.tolist()
        end = new.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in new else len(new)
        assert answer.text == tokenizer.decode(new[:end], skip_special_tokens=True)
        assert (answer.prompt_tokens, answer.completion_tokens) == (len(ids), end)
        assert answer.finish_reason == ("stop" if end < len(new) or new[-1] == tokenizer.eos_token_id else "length")
    assert len({a.text for a in answers}) == len(PROMPTS)  # a random model that says one thing proves nothing


def test_static_continuous_and_graphed_engines_answer_exactly_as_the_padded_generate(tiny_target):
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))
    model, tokenizer = backend.model, backend.tokenizer
    prompts = [encode_prompt(tokenizer, m, None) for m in PROMPTS]
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=20)
    stops = stop_ids(model, tokenizer)
    free = generate_ids(model, prompts, params, stops, pad_id=0)
    stops.add(free[0][0][5])  # a token the first answer reaches: that row must stop there
    padded = generate_ids(model, prompts, params, stops, pad_id=0, engine="padded")
    continuous = generate_ids(model, prompts, params, stops, pad_id=0, engine="continuous")
    static = generate_ids(model, prompts, params, stops, pad_id=0, engine="static")  # wider padding too
    graphed = generate_ids(model, prompts, params, stops, pad_id=0, engine="graphed")  # ours: per-row cache
    assert continuous == padded
    assert static == padded
    assert graphed == padded
    assert padded[0][1] and len(padded[0][0]) <= 6
    assert any(not stopped and len(ids) == 20 for ids, stopped in padded)  # both endings covered


@pytest.mark.parametrize("engine", ["padded", "static"])
def test_a_row_that_stops_is_released_at_once_while_its_batch_decodes_on(tiny_target, engine):
    """What lets generate's commit clock keep a long batch's finished rows: each stopped row is handed
    on the step it stops, with the answer the whole batch then returns for it."""
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))
    model, tokenizer = backend.model, backend.tokenizer
    prompts = [encode_prompt(tokenizer, m, None) for m in PROMPTS]
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=20)
    stops = stop_ids(model, tokenizer)
    free = generate_ids(model, prompts, params, stops, pad_id=0)
    stops.add(free[0][0][5])  # the first row stops at its sixth token, others run on
    steps, released = [0], {}

    def release(row, ids):
        released[row] = (list(ids), steps[0])

    original = ReleaseFinished.__call__

    def counting(self, input_ids, scores, **kwargs):
        steps[0] = input_ids.shape[1] - self.width
        return original(self, input_ids, scores, **kwargs)

    ReleaseFinished.__call__ = counting
    try:
        answers = generate_ids(model, prompts, params, stops, pad_id=0, engine=engine, release=release)
    finally:
        ReleaseFinished.__call__ = original
    assert released and set(released) == {row for row, (_, stopped) in enumerate(answers) if stopped}
    for row, (ids, at_step) in released.items():
        assert ids == answers[row][0] and at_step == len(ids)  # the answer, on the step it ended
    assert max(len(ids) for ids, _ in answers) > min(at for _, at in released.values())  # the batch went on


def test_every_engine_generate_offers_is_in_the_registry_and_graphed_releases_rows_too(tiny_target):
    from typing import get_args

    from dflash_train.decode.greedy import ENGINES

    assert set(ENGINES) == set(get_args(LocalConfig.model_fields["engine"].annotation))
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))
    model, tokenizer = backend.model, backend.tokenizer
    prompts = [encode_prompt(tokenizer, m, None) for m in PROMPTS]
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=20)
    stops = stop_ids(model, tokenizer)
    stops.add(generate_ids(model, prompts, params, stops, pad_id=0)[0][0][5])
    released = {}
    answers = generate_ids(model, prompts, params, stops, pad_id=0, engine="graphed",
                           release=lambda row, ids: released.setdefault(row, ids))
    assert answers == generate_ids(model, prompts, params, stops, pad_id=0)
    assert released == {row: ids for row, (ids, stopped) in enumerate(answers) if stopped} and released


def test_answers_come_from_the_plain_distribution_not_the_models_generation_settings(tiny_target):
    """A checkpoint's generation_config may carry a repetition penalty or n-gram ban; the answers
    (and eval's lossless reference) must be the plain argmax that speculative decoding verifies."""
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))
    model, tokenizer = backend.model, backend.tokenizer
    prompt = encode_prompt(tokenizer, PROMPTS[2], None)
    ids = torch.tensor([prompt])
    argmax = []
    with torch.no_grad():
        for _ in range(16):
            argmax.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[argmax[-1]]])], dim=1)
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=16)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    try:
        penalised = model.generate(torch.tensor([prompt]), max_new_tokens=16, pad_token_id=0)[0, len(prompt):].tolist()
        for engine in ("padded", "static", "continuous", "graphed"):
            assert generate_ids(model, [prompt], params, set(), pad_id=0, engine=engine) == [(argmax, False)]
    finally:
        model.generation_config.repetition_penalty = 1.0
        model.generation_config.no_repeat_ngram_size = 0
    assert penalised != argmax  # the settings do change what transformers' generate does by default


def test_thinking_switch_reaches_the_chat_template(tiny_target):
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))
    off = backend.tokenizer.decode(encode_prompt(backend.tokenizer, PROMPTS[0], False))
    default = backend.tokenizer.decode(encode_prompt(backend.tokenizer, PROMPTS[0], None))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert default.endswith("<|im_start|>assistant\n")


def test_local_and_http_served_model_regenerate_identically(tmp_path, tiny_target, start_server):
    conversations = [
        {"id": f"m{i}", "messages": [*m, {"role": "assistant", "content": "old"}, {"role": "user", "content": "and?"}]}
        for i, m in enumerate(PROMPTS)
    ]
    inputs = write_jsonl(tmp_path / "in.jsonl", conversations)
    base = {"inputs": [str(inputs)], "progress": False, "model": str(tiny_target), "concurrency": 8,
            "sampling": {"max_tokens": 12, "thinking": False}}

    local = generate(build_generate_config({**base, "output_dir": str(tmp_path / "local"), "backend": "local"},
                                           {"local.device": "cpu"}))
    server = start_server("--model", str(tiny_target), "--device", "cpu", "--batch-size", "4")
    http = generate(build_generate_config({**base, "output_dir": str(tmp_path / "http")}, {"http.server_urls": [server.url]}))

    assert local["ok"] == http["ok"] == len(PROMPTS)
    assert local["completion_tokens"] == http["completion_tokens"] > 0
    by_id = {r["id"]: r for r in read_rows(tmp_path / "local")}
    for row in read_rows(tmp_path / "http"):
        assert row["messages"] == by_id[row["id"]]["messages"]
        assert row["num_turns"] == 2 and "old" not in [m["content"] for m in row["messages"]]
    meta = json.loads((tmp_path / "local" / "meta.json").read_text())
    assert meta["settings"]["sampling"]["thinking"] is False and len(meta["chat_template_hash"]) == 16
    assert meta["identity"]["target"]["num_layers"] == 2


def test_out_of_memory_halves_the_batch_and_loses_no_answer(tiny_target, monkeypatch, caplog):
    from dflash_train.generate import local_backend

    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=16)

    def answer(backend, prompts):
        async def run():
            try:
                return await asyncio.gather(*(backend.complete(m, params) for m in prompts))
            finally:
                await backend.aclose()
        return asyncio.run(run())

    expected = answer(LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", batch_size=8)), PROMPTS)
    real, sizes = local_backend.generate_batch, []

    def fits_two(model, tokenizer, prompts, *args):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, tokenizer, prompts, *args)

    monkeypatch.setattr(local_backend, "generate_batch", fits_two)
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", batch_size=8))
    with caplog.at_level("WARNING", logger="dflash_train"):
        assert answer(backend, PROMPTS) == expected
    assert sizes == [4, 2, 2] and backend.batch_size == 2
    assert "generation batch size now 2" in caplog.text
    sizes.clear()
    assert answer(backend, PROMPTS) == expected  # later batches start at the size that fitted
    assert sizes == [2, 2]

    def never_fits(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(local_backend, "generate_batch", never_fits)
    with pytest.raises(torch.OutOfMemoryError):  # a single prompt that does not fit fails, it does not vanish
        answer(LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", batch_size=8)), PROMPTS[:1])


def test_a_failing_batch_stops_the_run_keeps_finished_rows_and_reports_once(tmp_path, tiny_target, monkeypatch, caplog):
    import gc

    from dflash_train.generate import local_backend

    real, calls = local_backend.generate_batch, []

    def second_batch_breaks(model, tokenizer, prompts, *args):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("a bug in the second batch")
        return real(model, tokenizer, prompts, *args)

    monkeypatch.setattr(local_backend, "generate_batch", second_batch_breaks)
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "messages": m} for i, m in enumerate(PROMPTS * 3)])
    cfg = build_generate_config({"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "backend": "local",
                                 "progress": False, "model": str(tiny_target), "concurrency": 8,
                                 "sampling": {"max_tokens": 6}}, {"local.device": "cpu", "local.batch_size": 4})
    with caplog.at_level("ERROR", logger="asyncio"), pytest.raises(RuntimeError, match="second batch"):
        generate(cfg)
    gc.collect()  # asyncio reports an unretrieved task exception when the task is collected
    assert "never retrieved" not in caplog.text
    assert calls[:2] == [4, 4] and len(read_rows(tmp_path / "out")) == 4  # the first batch's rows are committed


def test_continuous_batching_on_cpu_reserves_pages_for_its_prompts_not_a_share_of_ram():
    """Left to itself transformers' continuous batching reserved ~13 GB of a 23 GB CPU machine for a
    tiny model's cache (a test worker was OOM-killed): on CPU the cache holds these answers only."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from dflash_train.decode.greedy import CPU_PAGE, _cpu_cache_config

    gen = GenerationConfig(max_new_tokens=20)
    prompts = [[1] * 10, [1] * (CPU_PAGE - 20), [1] * (CPU_PAGE - 19)]  # 1, 1 and 2 pages
    config = _cpu_cache_config(SimpleNamespace(device=torch.device("cpu")), prompts, gen)
    assert (config.page_size, config.num_blocks) == (CPU_PAGE, 1 + 1 + 2 + 1)
    assert _cpu_cache_config(SimpleNamespace(device=torch.device("meta")), prompts, gen) is None


def test_an_engine_that_cannot_start_fails_every_waiting_request(tiny_target, monkeypatch):
    """The graphed engine refusing a model (or failing to build) must answer every queued request
    with its error; it once failed only the rows in flight (none yet), and generate hung."""
    import asyncio

    import dflash_train.generate.local_backend as local_backend

    def refuse(*args, **kwargs):
        raise ValueError("engine 'graphed' cannot run this model")

    monkeypatch.setattr(local_backend, "GraphedEngine", refuse)
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", engine="graphed", batch_size=2))
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=4)

    async def ask_all():
        try:
            return await asyncio.wait_for(asyncio.gather(*(backend.complete(m, params) for m in PROMPTS),
                                                         return_exceptions=True), timeout=60)
        finally:
            await backend.aclose()

    results = asyncio.run(ask_all())
    assert len(results) == len(PROMPTS) and all("cannot run this model" in str(r) for r in results)


def test_a_multi_turn_prompt_file_is_answered_turn_after_turn(tmp_path, tiny_target):
    """`prompts --multi-turn` rows (user turns with empty assistant turns between them): every
    assistant turn becomes the target's own answer, the later turns asked after it."""
    from dflash_train.data.prompts import Prompt, write_prompts

    inputs = write_prompts(tmp_path / "in.jsonl", [Prompt(id="m", turns=["Hi there", "and then?", "why?"])])
    summary = generate(build_generate_config(
        {"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "progress": False, "model": str(tiny_target),
         "backend": "local", "sampling": {"max_tokens": 6}}, {"local.device": "cpu"}))
    (row,) = read_rows(tmp_path / "out")
    assert summary["ok"] == 1 and row["num_turns"] == 3
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in row["messages"][::2]] == ["Hi there", "and then?", "why?"]
    assert all(m["content"] for m in row["messages"][1::2])


def test_a_prompt_over_the_targets_context_is_an_error_row_naming_its_line(tmp_path, tiny_target, caplog):
    """The tiny target has 2,048 positions (byte-level tokenizer: a character a token): a longer
    prompt is that row's error, said with its file:line; an answer stops where the context ends."""
    inputs = write_jsonl(tmp_path / "in.jsonl", [
        {"messages": [{"role": "user", "content": "x" * 2100}]},
        {"messages": [{"role": "user", "content": "y" * 2020}]},
        {"messages": [{"role": "user", "content": "hello"}]},
    ])
    summary = generate(build_generate_config(
        {"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "progress": False, "model": str(tiny_target),
         "backend": "local", "sampling": {"max_tokens": 64}}, {"local.device": "cpu"}))
    assert (summary["ok"], summary["error"]) == (2, 1)
    rows = {r["source"].rsplit(":", 1)[1]: r for r in read_rows(tmp_path / "out")}
    assert rows["1"]["status"] == "error" and "over the target's context of 2,048 positions" in rows["1"]["reason"]
    assert f"{inputs}:1: turn 1: the prompt is 2," in caplog.text
    assert rows["2"]["prompt_tokens"] + rows["2"]["completion_tokens"] <= 2048
    assert rows["2"]["completion_tokens"] < 64 and rows["3"]["status"] == "ok"
