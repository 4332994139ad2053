"""Run config: unknown keys, dotted overrides, type errors name the field, shipped configs load."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_train.config import ConfigError, build_config, dump_config, load_config, parse_override

REPO = Path(__file__).resolve().parent.parent


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key"):
        build_config({"train": {"lrr": 1e-3}})
    with pytest.raises(ConfigError, match=r"draft\.blok_size: unknown key"):
        build_config(overrides=["draft.blok_size=8"])
    with pytest.raises(ConfigError, match=r"trian: unknown key"):
        build_config({"trian": {}})


def test_dotted_overrides_parse_types():
    cfg = build_config(
        {"train": {"lr": 1e-3}},
        overrides=[
            "train.lr=3.0e-4", "objective.gamma=4", "train.compile=true", "draft.target_layer_ids=[1, 5, 9]",
            "data.train_files=[a.jsonl,b.parquet]", "train.betas=[0.8, 0.99]", "objective.mask_token_id=null",
            "data.chat_template_kwargs={enable_thinking: false}", "run_dir=runs/x", "train.max_steps=7",
        ],
    )
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.objective.gamma == 4.0
    assert cfg.train.compile is True
    assert cfg.draft.target_layer_ids == [1, 5, 9]
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]
    assert tuple(cfg.train.betas) == (0.8, 0.99)
    assert cfg.objective.mask_token_id is None
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.run_dir == "runs/x" and cfg.train.max_steps == 7
    assert parse_override("train.lr=1e-3")[0] == "train.lr"
    assert build_config(overrides=["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="section.key=value"):
        build_config(overrides=["train.lr"])


@pytest.mark.parametrize(
    "override,field",
    [("train.lr=abc", "train.lr"), ("objective.block_size=1", "objective.block_size"), ("train.compile=maybe", "train.compile"),
     ("device=tpu", "device"), ("draft.target_layer_ids=5", "draft.target_layer_ids")],
)
def test_wrong_type_or_value_names_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[override])
    assert f"  {field}:" in str(err.value)


def test_token_budget_below_max_length_is_refused():
    with pytest.raises(ConfigError, match="token_budget.*max_length"):
        build_config({"data": {"max_length": 4096, "token_budget": 2048}})


def test_a_host_cache_size_without_the_cache_is_refused():
    with pytest.raises(ConfigError, match="cache_host_gib.*cache_features"):
        build_config(overrides=["data.cache_host_gib=4"])
    assert build_config(overrides=["data.cache_host_gib=4", "data.cache_features=true"]).data.cache_host_gib == 4


def test_load_config_errors_and_dump_round_trip(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    cfg = build_config(overrides=["train.lr=2e-4", "draft.target_layer_ids=[1,2]"])
    f = tmp_path / "cfg.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


CONFIGS = sorted((REPO / "configs").glob("*.yaml")) if (REPO / "configs").is_dir() else []


@pytest.mark.skipif(not (REPO / "configs").is_dir(), reason="no configs/ directory on this branch")
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.data.token_budget >= cfg.data.max_length


GENERATE_CONFIGS = sorted((REPO / "configs" / "generate").glob("*.yaml"))


@pytest.mark.parametrize("path", GENERATE_CONFIGS, ids=lambda p: p.name)
def test_shipped_generate_configs_load(path):
    from dflash_train.generate.config import load_generate_config

    cfg = load_generate_config(path)
    assert cfg.inputs and cfg.output_dir


@pytest.mark.parametrize("old,new", [("train.num_anchors", "objective.num_anchors"), ("draft.block_size", "objective.block_size"),
                                     ("train.loss", "objective.loss")])
def test_a_moved_key_is_refused_naming_its_new_place(old, new):
    section, key = old.split(".")
    value = {"kl": 1.0} if key == "loss" else 8
    with pytest.raises(ConfigError, match=f"{old} has moved to {new}"):
        build_config({section: {key: value}})
    with pytest.raises(ConfigError, match=f"{old} has moved to {new}"):
        build_config(overrides=[f"{old}.kl=1.0" if key == "loss" else f"{old}=8"])
    with pytest.raises(ConfigError, match=rf"drafters\[0\].{old} has moved to drafters\[0\].{new}"):
        build_config({"drafters": [{"name": "a", section: {key: value}}]})


def test_the_loss_chunk_adapts_to_large_vocabularies():
    """Unset, objective.ce_chunk_size keeps 4096 rows up to Qwen3's 151,936-token vocabulary and
    shrinks above it so a chunk's logits never exceed 4096 x 151,936 (Gemma's 262,144: 2,368 rows);
    a value set by the user is kept as given."""
    from dflash_train.draft.loss import CHUNK_LOGITS, loss_chunk_rows

    assert [loss_chunk_rows(None, v) for v in (49_152, 151_936, 262_144)] == [4096, 4096, 2368]
    assert 2368 * 262_144 <= CHUNK_LOGITS < (2368 + 64) * 262_144
    assert loss_chunk_rows(24_576, 262_144) == 24_576


def test_a_window_shorter_than_a_block_is_refused():
    with pytest.raises(ConfigError, match="sliding_window=4 is shorter than objective.block_size=8"):
        build_config(overrides=["draft.sliding_window=4", "objective.block_size=8"])
    assert build_config(overrides=["draft.sliding_window=8", "objective.block_size=8"]).draft.sliding_window == 8
    assert build_config().draft.sliding_window is None


def test_listed_length_buckets_are_one_ascending_list_that_holds_max_length():
    cfg = build_config(overrides=["data.max_length=4096", "data.length_buckets=[256, 1024, 4096]"])
    assert cfg.data.buckets == (256, 1024, 4096) and cfg.data.bucket_lengths == (256, 1024, 4096)
    multiples = build_config(overrides=["data.max_length=1024", "data.length_bucket=256"]).data
    assert multiples.buckets == 256 and multiples.bucket_lengths == (256, 512, 768, 1024)
    assert build_config(overrides=["data.max_length=1024"]).data.bucket_lengths == ()
    # no row is longer than max_length: the lengths past the first that holds it are never padded to
    past = build_config(overrides=["data.max_length=1000", "data.length_buckets=[256, 1024, 4096]"]).data
    assert past.buckets == past.bucket_lengths == (256, 1024)
    for bad, message in ((["data.length_bucket=256", "data.length_buckets=[512, 4096]"], "set one"),
                         (["data.length_buckets=[1024, 512, 4096]"], "ascending"),
                         (["data.length_buckets=[512, 2048]"], r"at least data.max_length \(4096\)")):
        with pytest.raises(ConfigError, match=message):
            build_config(overrides=["data.max_length=4096", *bad])


def test_anchors_grow_with_the_padded_length_past_num_anchors_length():
    """objective.num_anchors_length: num_anchors a row up to it, in proportion (rounded up) beyond."""
    objective = build_config(overrides=["objective.num_anchors=64", "objective.num_anchors_length=1024"]).objective
    assert [objective.anchors_per_row(n) for n in (256, 1024, 1536, 2048, 8192, 8000)] == [64, 64, 96, 128, 512, 500]
    dense = build_config(overrides=["objective.num_anchors=64", "objective.num_anchors_length=16"]).objective
    assert dense.anchors_per_row(256) == 256  # never more blocks than positions
    fixed = build_config(overrides=["objective.num_anchors=64"]).objective
    assert {fixed.anchors_per_row(n) for n in (256, 8192)} == {64}
