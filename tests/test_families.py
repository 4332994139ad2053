"""Does it work on my model? Every family of tests/families.py through the whole chain, in process
through the command line's own entry point: generate (every local engine), prepare, train, capture,
export, eval in fp32 (every answer the target's own greedy one, through the ragged acceptance cache
and the static decoder). The table of what works is docs/families.md; a family or stage that cannot
work must be refused in one line, and EXPECTED_REFUSALS says which and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from families import FAMILIES, tiny_model
from tiny import tiny_tokenizer

from dflash_train.train.capture import CapturedFeatures, fingerprint
from dflash_train.cli import main
from dflash_train.config_model import TargetConfig
from dflash_train.data.dataset import load_prepared
from dflash_train.targets.model import load_target
from dflash_train.targets.tokenizer import tokenizer_fingerprint

BASE_MODELS = {"gemma3"}
"""Saved without a chat template: a base model, whose prompts are continued as plain text."""
ENGINES = ("padded", "static", "continuous", "graphed")
EXPECTED_REFUSALS: dict[tuple[str, str], str] = {
    ("deepseek-v3", "generate continuous"): "multi-head latent attention",
}
"""(family, stage) -> a phrase of the one-line refusal; every other stage must work."""
PROMPTS = [f"q{i}: repeat after me, phrase number {i % 3}" for i in range(6)]
NEW_TOKENS = 20
"""Prompts of 40-60 tokens plus these: well past the families' sliding window (families.WINDOW)."""


def _save_target(family: str, out: Path) -> Path:
    tokenizer = tiny_tokenizer(chat_template=None) if family in BASE_MODELS else tiny_tokenizer()
    model = tiny_model(family)
    ids = {"eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"), "pad_token_id": tokenizer.pad_token_id,
           "bos_token_id": None}
    for config in (model.config, model.generation_config):
        for key, value in ids.items():
            setattr(config, key, value)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _run_config(tmp: Path, model_dir: Path, data: Path) -> Path:
    tree = {
        "run_dir": str(tmp / "run"), "seed": 0, "device": "cpu",
        "target": {"path": str(model_dir)},
        "draft": {"num_layers": 1, "target_layer_ids": [0, 2], "attention": "sdpa"},
        "objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0, "ce_chunk_size": 64},
        "data": {"train_files": [str(data)], "max_length": 96, "token_budget": 384, "max_batch_size": 6},
        "train": {"lr": 3e-2, "warmup_ratio": 0.05, "log_every": 1, "max_steps": 60},
        "checkpoint": {"every": 60, "keep_last": 1},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _stage(outcomes: dict, family: str, stage: str, argv: list[str], capsys) -> bool:
    """Runs one command; a refusal is an exit 2 whose one line must be the expected one."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    expected = EXPECTED_REFUSALS.get((family, stage))
    if expected is None:
        assert code == 0, f"{family} {stage}: exit {code}: {err[-3:]}"
        outcomes[stage] = "works"
        return True
    assert code == 2 and expected in err[-1], f"{family} {stage}: expected a refusal naming {expected!r}: {err[-3:]}"
    outcomes[stage] = f"refused: {err[-1]}"
    return False


def _answers(out: Path) -> dict[str, str]:
    rows = [json.loads(line) for shard in sorted(out.glob("shard-*.jsonl")) for line in shard.read_text().splitlines()]
    assert all(r["status"] == "ok" for r in rows), rows[:1]
    return {r["id"]: r["messages"][-1]["content"] for r in rows}


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_whole_chain_works_on_every_family(family, tmp_path, capsys):
    model_dir = _save_target(family, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    outcomes: dict[str, str] = {}

    # generate: every local engine; in fp32 each one's greedy answers are the padded engine's
    answers = {}
    for engine in ENGINES:
        out = tmp_path / f"gen-{engine}"
        if _stage(outcomes, family, f"generate {engine}", [
                "generate", "--backend", "local", "--model", str(model_dir), "--input", str(prompts),
                "--out", str(out), "--output-format", "jsonl", "--max-tokens", str(NEW_TOKENS),
                "--engine", engine, "--device", "cpu", "--batch-size", "4"], capsys):
            answers[engine] = _answers(out)
    assert all(a == answers["padded"] for a in answers.values()), family

    config = _run_config(tmp_path, model_dir, tmp_path / "gen-padded")
    prepared = tmp_path / "prepared"
    _stage(outcomes, family, "prepare", ["prepare", "-c", str(config), "--out", str(prepared)], capsys)
    target = load_target(TargetConfig(path=str(model_dir)), torch.device("cpu"))
    dataset = load_prepared(prepared, tokenizer_fingerprint(target.tokenizer))
    assert len(dataset) == len(PROMPTS)

    # train: the drafter memorises six answers
    _stage(outcomes, family, "train", ["train", "-c", str(config), f"data.train_files=[{prepared}]"], capsys)
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], (family, losses[:5], losses[-5:])
    manifest = json.loads((run / "manifest.json").read_text())["target"]
    assert manifest["text_format"] == ("plain text (no chat template)" if family in BASE_MODELS else "chat template")

    # capture: the features on disk are the target's own
    captured = tmp_path / "captured"
    _stage(outcomes, family, "capture", ["capture", "-c", str(config), f"data.train_files=[{prepared}]",
                                         "--out", str(captured)], capsys)
    layer_ids = json.loads((captured / "capture.json").read_text())["fingerprint"]["layer_ids"]
    stored = CapturedFeatures(captured, fingerprint(target, layer_ids, dataset)).row(0)
    expected = target.features(torch.as_tensor(dataset.input_ids[0]).long()[None], layer_ids)[0]
    torch.testing.assert_close(stored, expected)

    export = tmp_path / "export"
    checkpoint = next((run / "checkpoints").glob("step_*"))
    _stage(outcomes, family, "export", ["export", str(checkpoint), "--out", str(export)], capsys)

    report_dir = tmp_path / "eval"
    _stage(outcomes, family, "eval", [
        "eval", "--target", str(model_dir), "--drafter", str(export), "--prompts", str(prompts), "--dtype", "float32",
        "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "3", "--speed-prompts", "1",
        "--speed-engine", "static", "--out", str(report_dir)], capsys)
    report = json.loads((report_dir / "eval.json").read_text())
    assert report["lossless"] == {"matches": len(PROMPTS), "total": len(PROMPTS)}, family
    # the fast paths, not their fallbacks: one ragged KV cache for acceptance, static caches for speed
    assert (report["acceptance_cache"], report["ragged_unavailable"]) == ("ragged", None), family
    assert (report["speed_engine"], report.get("static_unavailable")) == ("static", None), family
    print(json.dumps({"family": family, **outcomes}))  # -s: the rows of docs/families.md


DRAFTERS = {
    "dflash2": (["draft.family=dflash2", "draft.dflash2.conv_group_size=8", "draft.dflash2.selector_rank=8", "draft.dflash2.selector_top_k=3",
                 "objective.loss={ce: 1, selector: 1}"], "DFlash2DraftModel"),
    "dspark": (["draft.family=dspark", "draft.dspark.markov_rank=8", "objective.loss={ce: 0.1, l1: 0.9}"], "DSparkDraftModel"),
}
"""Drafting families beyond DFlash: (their train overrides, their export's architecture)."""


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_the_other_drafting_families_go_through_the_chain(family, drafter, tmp_path, capsys):
    """DFlash2 (in-block convolutions, the path selector trained by objective.loss.selector) and DSpark
    (the Markov head, trained with SpecForge's 0.1 CE + 0.9 L1 to the target): train, export in the engines' format, eval in fp32
    with the family's own greedy drafting (the selector's walk, the Markov chain), every answer lossless."""
    model_dir = _save_target(family, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    outcomes: dict[str, str] = {}
    _stage(outcomes, family, "generate padded", [
        "generate", "--backend", "local", "--model", str(model_dir), "--input", str(prompts), "--out",
        str(tmp_path / "gen-padded"), "--output-format", "jsonl", "--max-tokens", str(NEW_TOKENS), "--engine",
        "padded", "--device", "cpu", "--batch-size", "4"], capsys)
    config = _run_config(tmp_path, model_dir, tmp_path / "gen-padded")
    overrides, architecture = DRAFTERS[drafter]
    _stage(outcomes, family, "train", ["train", "-c", str(config), *overrides], capsys)
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], (family, losses[:5], losses[-5:])
    export = tmp_path / "export"
    _stage(outcomes, family, "export", ["export", str(next((run / "checkpoints").glob("step_*"))), "--out", str(export)], capsys)
    assert json.loads((export / "config.json").read_text())["architectures"] == [architecture]
    if drafter == "dspark":  # the Markov head trained away from its zero start, so the chain drafts with it
        assert load_file(export / "model.safetensors")["markov_head.markov_w2.weight"].abs().max() > 0
    report_dir = tmp_path / "eval"
    _stage(outcomes, family, "eval", [
        "eval", "--target", str(model_dir), "--drafter", str(export), "--prompts", str(prompts), "--dtype", "float32",
        "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "3", "--speed-prompts", "1",
        "--speed-engine", "static", "--out", str(report_dir)], capsys)
    report = json.loads((report_dir / "eval.json").read_text())
    assert report["lossless"] == {"matches": len(PROMPTS), "total": len(PROMPTS)}, family
