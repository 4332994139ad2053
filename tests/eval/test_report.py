"""The evaluation report: aggregates consistent with the per-round data, files, and the CLI entry."""

import json

import pytest

from dflash_train.eval.config import DecodeSettings, EvalJobConfig
from dflash_train.eval.export import export_drafter
from dflash_train.data.prompts import load_prompts
from dflash_train.eval.report import evaluate, format_table, run_eval, write_report

from .test_export import save_checkpoint
from .tiny_models import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def chat_target(smollm2_tokenizer):
    """A tiny random model with SmolLM2's tokenizer and vocabulary: real chat templates, fast forwards."""
    return tiny_target(vocab_size=49152, tokenizer=smollm2_tokenizer)


def test_evaluate_multi_turn_report(chat_target, tmp_path):
    drafter = tiny_drafter(chat_target, block_size=4)
    report = evaluate(chat_target, drafter, load_prompts("mt-bench", 2),
                      DecodeSettings(max_new_tokens=6, block_size=3))
    assert report["num_prompts"] == 2 and report["num_turns"] == 4
    turns = report["turns"]
    # Turn 2 is asked after turn 1's answer, so its prompt holds everything before.
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + turns[0]["new_tokens"]
    assert report["lossless"] == {"matches": 4, "total": 4}
    hist = {int(k): v for k, v in report["acceptance_histogram"].items()}
    assert list(hist) == [1, 2, 3] and sum(hist.values()) == report["num_rounds"]
    assert report["tau"] == pytest.approx(sum(k * v for k, v in hist.items()) / report["num_rounds"])
    # Proposal k is accepted in exactly the rounds of length > k.
    rates = report["position_acceptance"]
    assert rates == pytest.approx([sum(v for k, v in hist.items() if k > j) / report["num_rounds"] for j in (1, 2)])
    assert report["spec_tokens_per_s"] > 0 and report["target_tokens_per_s"] > 0 and report["speed_prompts"] == 2

    json_path, png_path = write_report(report, tmp_path / "out")
    assert json.loads(json_path.read_text())["tau"] == report["tau"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.json", "eval.png"]
    table = format_table(report)
    assert "tau" in table and "4/4" in table and "FP8" not in table
    assert report["target_dtype"] == str(chat_target.embed_weight.dtype) and report["target_fp8"] == "off"


@pytest.mark.parametrize("granularity, why", [("tensorwise", "depends on the rest of its batch"),
                                              ("rowwise", "in bfloat16 a 16-token verification")])
def test_an_fp8_target_is_named_and_its_lossless_check_explained(chat_target, caplog, granularity, why):
    """An FP8 target's report says so, and the eval warns that the lossless check cannot hold:
    per-tensor activation scales tie a token to its batch (tests/targets/test_fp8.py shows it, through
    torchao); per-row ones need a bfloat16 target, whose verification and greedy step round apart."""
    import dataclasses

    fp8_target = dataclasses.replace(chat_target, fp8=granularity)  # labels only: the forward stays as it was
    with caplog.at_level("WARNING", logger="dflash_train"):
        report = evaluate(fp8_target, tiny_drafter(chat_target, block_size=4), load_prompts("mt-bench", 1),
                          DecodeSettings(max_new_tokens=4, speed_prompts=0))
    assert report["target_fp8"] == granularity and f"FP8 {granularity}" in format_table(report)
    warned = [r.getMessage() for r in caplog.records if "lossless check will find differences" in r.getMessage()]
    assert len(warned) == 1 and f"target.fp8={granularity} " in warned[0] and why in warned[0]


def test_sampled_report_has_no_lossless_check(chat_target):
    drafter = tiny_drafter(chat_target, block_size=4)
    report = evaluate(chat_target, drafter, load_prompts("humaneval", 1),
                      DecodeSettings(max_new_tokens=5, temperature=0.7))
    assert report["lossless"] is None and report["turns"][0]["new_tokens"] == 5


@pytest.mark.slow(seconds=20)
def test_run_eval_on_smollm2_with_an_exported_drafter(smollm2, tmp_path):
    drafter = tiny_drafter(smollm2, block_size=4, layer_ids=(1, 14, 27), num_layers=1)
    export = export_drafter(save_checkpoint(drafter, tmp_path / "ckpt"), tmp_path / "export")
    (report,) = run_eval(EvalJobConfig(target={"path": "smollm2"}, drafter=str(export), prompts="humaneval",
                                       num_prompts=1, out=str(tmp_path / "eval"), device="cpu",
                                       decode={"max_new_tokens": 6}))
    assert report["lossless"] == {"matches": 1, "total": 1} and report["drafter"] == str(export)
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_batch_size_changes_nothing_but_the_grouping(chat_target):
    """Prompts decoded 1, 2 or 3 at a time give one report (the batched decode keeps rows apart)."""
    drafter = tiny_drafter(chat_target, block_size=4)
    prompts = load_prompts("mt-bench", 3)
    reports = [evaluate(chat_target, drafter, prompts, DecodeSettings(max_new_tokens=6, batch_size=b, speed_prompts=0))
               for b in (1, 2, 3)]
    assert all(r.pop("acceptance_seconds") >= 0 for r in reports)  # wall time: the one field that differs
    assert reports[0] == reports[1] == reports[2]
    assert [(t["id"], t["turn"]) for t in reports[0]["turns"]] == [(p.id, t) for p in prompts for t in (0, 1)]
    assert reports[0]["speedup"] is None and "speedup" not in format_table(reports[0])


def test_the_ragged_cache_and_cache_free_decoding_give_one_report(chat_target):
    """`--acceptance-cache ragged|none` (and auto, which picks ragged here) change how the target
    runs, not what is decided: the reports are equal but for the path named and its wall time."""
    from dflash_train.eval.config import build_eval_config

    drafter = tiny_drafter(chat_target, block_size=4)
    prompts = load_prompts("mt-bench", 3)
    reports = {c: evaluate(chat_target, drafter, prompts, DecodeSettings(max_new_tokens=8, batch_size=3, speed_prompts=0,
                                                                         acceptance_cache=c))
               for c in ("auto", "ragged", "none")}
    assert [reports[c].pop("acceptance_cache") for c in reports] == ["ragged", "ragged", "none"]
    assert all(r.pop("acceptance_seconds") >= 0 for r in reports.values())
    assert reports["auto"] == reports["ragged"] == reports["none"]
    assert build_eval_config(None, {"target.path": "smollm2", "drafter": "x", "decode.acceptance_cache": "none"}
                             ).decode.acceptance_cache == "none"


def test_a_reference_that_differs_is_reported_with_where(chat_target, monkeypatch):
    """The lossless check compares with transformers' greedy `generate`: a reference that differs
    from token 3 on must fail the check for that turn and name the position."""
    import dflash_train.eval.report as report_module

    real = report_module.generate_ids

    def off_by_one_at_3(*args, **kwargs):
        answers = real(*args, **kwargs)
        return [(ids[:3] + [(ids[3] + 1) % 49152] + ids[4:], stopped) if i == 0 else (ids, stopped)
                for i, (ids, stopped) in enumerate(answers)]

    monkeypatch.setattr(report_module, "generate_ids", off_by_one_at_3)
    drafter = tiny_drafter(chat_target, block_size=4)
    report = evaluate(chat_target, drafter, load_prompts("humaneval", 2),
                      DecodeSettings(max_new_tokens=6, speed_prompts=0))
    assert report["lossless"] == {"matches": 1, "total": 2}
    assert report["turns"][0]["lossless"] is False and report["turns"][0]["first_difference"] == 3
    assert report["turns"][1]["lossless"] is True and "first_difference" not in report["turns"][1]


def test_static_speed_engine_on_cpu(chat_target):
    """The static engine runs on CPU too (graphs off): fp32 answers equal the target's, and a sampled
    eval falls back to the eager engine, saying why."""
    drafter = tiny_drafter(chat_target, block_size=4)
    prompts = load_prompts("humaneval", 2)
    report = evaluate(chat_target, drafter, prompts, DecodeSettings(max_new_tokens=6, speed_engine="static"))
    assert report["speed_engine"] == "static" and report["graphs"] is False and report["speed_prompts"] == 2
    assert report["differences"]["differ"] == 0 and report["spec_tokens_per_s"] > 0 and report["speed_tau"] >= 1
    assert set(report["ms_per_round"]) == {"draft", "verify", "bookkeeping"}
    assert "draft / verify" in format_table(report)
    sampled = evaluate(chat_target, drafter, prompts,
                       DecodeSettings(max_new_tokens=4, temperature=0.7, speed_engine="static"))
    assert sampled["speed_engine"] == "eager" and "greedily" in sampled["static_unavailable"]
    settings = DecodeSettings(max_new_tokens=4, speed_prompts=1)
    assert evaluate(chat_target, drafter, prompts, settings)["speed_engine"] == "eager"


def eval_flags(*argv: str) -> list:
    """The overrides `dflash-train eval ARGV` passes to build_eval_config: the CLI's own parser."""
    from dflash_train.cli import build_parser
    from dflash_train.config_flags import with_flag_overrides

    return with_flag_overrides(build_parser().parse_args(["eval", *argv])).overrides


def test_eval_settings_come_from_the_run_config_then_the_flags(tmp_path, make_run_config):
    """`dflash-train eval -c run.yaml`: the run's target, eval prompts and newest checkpoint are the
    defaults; a flag given overrides its field; without a run, --target and --drafter are required."""
    from dflash_train.checkpoint.local import checkpoint_path
    from dflash_train.config import ConfigError
    from dflash_train.eval.config import build_eval_config

    run = make_run_config(overrides=["eval.prompts=humaneval", "eval.num_prompts=3", "eval.max_new_tokens=9"])
    for step in (2, 10):
        checkpoint_path(run.run_dir, step).mkdir(parents=True)
    cfg = build_eval_config(run, eval_flags("--batch-size", "5", "--dtype", "float32"))
    assert cfg.target.path == run.target.path and cfg.target.dtype == "float32"
    assert (cfg.prompts, cfg.num_prompts, cfg.decode.max_new_tokens) == (["humaneval"], 3, 9)
    assert cfg.drafter == str(checkpoint_path(run.run_dir, 10)) and cfg.decode.batch_size == 5
    flags = build_eval_config(None, eval_flags("--target", "smollm2", "--drafter", "x", "--temperature", "0.5"))
    assert flags.decode.temperature == 0.5 and flags.prompts == ["mt-bench"] and flags.decode.max_new_tokens == 256
    with pytest.raises(ConfigError, match="--drafter"):
        build_eval_config(None, eval_flags("--target", "smollm2"))
    with pytest.raises(ConfigError, match="decode.block_size"):
        build_eval_config(None, eval_flags("--target", "smollm2", "--drafter", "x", "--block-size", "1"))


def test_several_sets_in_one_run_equal_each_set_evaluated_alone(chat_target, tmp_path, monkeypatch):
    """`--prompts` twice: the target and drafter load once, and each set's report is the one it gets
    evaluated alone, written under its label."""
    import dflash_train.eval.report as report_module

    drafter = tiny_drafter(chat_target, block_size=4)
    loads = []
    monkeypatch.setattr(report_module, "load_target", lambda cfg, dev: loads.append(cfg) or chat_target)
    monkeypatch.setattr(report_module, "load_drafter", lambda path, target, dev: drafter)
    held = tmp_path / "held_prompts.jsonl"
    held.write_text(json.dumps({"messages": [{"role": "user", "content": "Name three rivers."}]}) + "\n")
    cfg = EvalJobConfig(target={"path": "tiny"}, drafter="d", prompts=["mt-bench", f"held={held}"], num_prompts=1,
                        out=str(tmp_path / "eval"), device="cpu",
                        decode={"max_new_tokens": 6, "block_size": 3, "speed_prompts": 0})
    reports = run_eval(cfg)
    assert len(loads) == 1 and [r["label"] for r in reports] == ["mt-bench", "held"]
    keys = ("tau", "num_rounds", "num_turns", "acceptance_histogram", "position_acceptance", "lossless")
    for report, source in zip(reports, ["mt-bench", str(held)]):
        alone = evaluate(chat_target, drafter, load_prompts(source, 1), cfg.decode)
        assert {k: report[k] for k in keys} == {k: alone[k] for k in keys}
        written = json.loads((tmp_path / "eval" / report["label"] / "eval.json").read_text())
        assert written["prompts"] == source and written["tau"] == report["tau"]
    assert reports[0]["num_turns"] == 2 and reports[1]["num_turns"] == 1


def test_prompt_set_labels(tmp_path):
    from dflash_train.eval.config import prompt_sets

    assert prompt_sets(["humaneval", "held=a/b.jsonl", "c/heldout_prompts.jsonl", "runs/lr=3e-4/held.jsonl",
                        "d/x.json"]) == [
        ("humaneval", "humaneval"), ("held", "a/b.jsonl"), ("heldout_prompts", "c/heldout_prompts.jsonl"),
        ("held", "runs/lr=3e-4/held.jsonl"), ("x", "d/x.json")]
    odd = tmp_path / "a=b.jsonl"  # a file whose name has "=" is that file, not a label
    odd.touch()
    assert prompt_sets([str(odd)]) == [("a=b", str(odd))]
    with pytest.raises(ValueError, match="share a label"):
        EvalJobConfig(target={"path": "t"}, drafter="d", prompts=["a/x.jsonl", "b/x.jsonl"])
    with pytest.raises(ValueError, match="no prompt set"):
        EvalJobConfig(target={"path": "t"}, drafter="d", prompts=[])


def test_a_lossless_mismatch_is_named_with_the_targets_top2_logits(chat_target, monkeypatch):
    """The reference is perturbed at token 3, so the speculative answer (the target's real greedy one)
    differs there; the report names the prompt, the token and the target's own top-2 logits."""
    import torch

    from dflash_train.data.prompts import Prompt
    from dflash_train.eval import report as report_module

    real_generate, true_answers = report_module.generate_ids, []

    def perturbed(model, ids, params, stop_ids, pad_id):
        out = real_generate(model, ids, params, stop_ids, pad_id)
        true_answers.extend(list(new) for new, _ in out)
        return [(new[:3] + [(new[3] + 1) % 49152] + new[4:], rest) for new, rest in out]

    monkeypatch.setattr(report_module, "generate_ids", perturbed)
    question = "Describe a quiet harbour at dawn in three sentences, with the boats and the gulls."
    report = evaluate(chat_target, tiny_drafter(chat_target, block_size=4), [Prompt(id="harbour", turns=[question])],
                      DecodeSettings(max_new_tokens=8, speed_prompts=0))
    assert report["lossless"] == {"matches": 0, "total": 1}
    (m,) = report["mismatches"]
    truth = true_answers[0]
    assert (m["id"], m["turn"], m["prompt"], m["prompt_start"]) == ("harbour", 0, 0, question[:60])
    assert (m["index"], m["token"], m["reference_token"]) == (3, truth[3], (truth[3] + 1) % 49152)
    assert m["token_text"] == chat_target.tokenizer.decode([truth[3]])

    # the target's logits after the shared prefix, computed here without the report's code
    prompt = chat_target.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                       add_generation_prompt=True)
    ids = chat_target.tokenizer(prompt, add_special_tokens=False).input_ids + truth[:3]
    with torch.no_grad():
        logits = chat_target.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2)
    assert m["top2"] == top.indices.tolist() and m["top2"][0] == truth[3]
    assert m["top2_logits"] == pytest.approx(top.values.tolist(), rel=1e-5)
    assert m["gap"] == pytest.approx(float(top.values[0] - top.values[1]), rel=1e-4, abs=1e-6)

    table = format_table(report).replace("\n", " ")
    assert "not lossless: prompt 0" in table.replace("│", "").replace("  ", " ")
    assert str(truth[3]) in table and f"{top.values[0].item():.6f}" in table
