"""The drafting families' interface: every family in the registry builds its drafter, exports under
its own architecture and reads back; shared code compares no family's name; the config reads the
registry without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.draft.build import drafter_for
from dflash_train.draft.model import DraftModelConfig
from dflash_train.eval.export import draft_config_from_export, export_config
from dflash_train.families import FAMILIES, by_architecture, family

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"
SIZES = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 2, "markov_rank": 3,
         "confidence_head": True}


def config_of(spec) -> DraftModelConfig:
    return DraftModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, num_hidden_layers=1, vocab_size=40, block_size=4,
                            target_layer_ids=[0, 1], num_target_layers=3, mask_token_id=3, family=spec.name,
                            **{k: SIZES[k] for k in spec.size_fields})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_builds_exports_and_reads_back(name, tmp_path):
    spec = family(name)
    cfg = config_of(spec)
    model = drafter_for(cfg)
    assert type(model).__name__ == spec.model.split(":")[1]
    written = export_config(cfg)
    assert written["architectures"] == [spec.architecture]
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert draft_config_from_export(tmp_path) == cfg
    assert by_architecture(spec.architecture, "x") is spec


def test_an_unknown_family_or_architecture_is_refused_in_one_line():
    with pytest.raises(ValueError, match="drafter family 'medusa'"):
        family("medusa")
    with pytest.raises(ValueError, match="x: architectures\\[0\\] is 'LlamaForCausalLM'"):
        by_architecture("LlamaForCausalLM", "x")


def test_no_module_outside_the_families_compares_a_family_name():
    pattern = re.compile(r"family ?(==|!=| in )")
    found = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py") if "families" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_the_config_reads_the_families_without_torch():
    code = ("import sys; from dflash_train.config import build_config; "
            "build_config({}, ['draft.family=dflash2', 'objective.loss.ce=1', 'objective.loss.selector=1']); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_a_family_whose_export_names_remote_code_has_its_class_in_the_modeling_file():
    """auto_map points AutoModel at the export's copied modeling file: its class must be there."""
    classes = set(re.findall(r"^class (\w+)\(", (PACKAGE / "eval" / "hf_modeling_dflash.py").read_text(), re.M))
    for spec in FAMILIES.values():
        assert (spec.architecture in classes) == spec.remote_code, spec.name
        assert ("auto_map" in export_config(config_of(spec))) == spec.remote_code, spec.name


def test_each_family_sizes_live_in_its_own_section_and_older_flat_keys_load(tmp_path):
    """`draft.<family>.<size>`: declared in the family's file (families/), not among the shared draft
    fields; a run config written before (every size flat under `draft`, as a checkpoint's config.yaml
    holds them) loads into the sections, and a size given both ways differently is refused."""
    from dflash_train.config import ConfigError, build_config, load_config
    from dflash_train.config_model import DraftConfig

    for spec in (s for s in FAMILIES.values() if s.options):
        assert DraftConfig.model_fields[spec.name].annotation is spec.options
        assert spec.options.__module__ == f"dflash_train.families.{spec.name}"
        assert not set(spec.size_fields) & set(DraftConfig.model_fields)
    old = tmp_path / "config.yaml"
    old.write_text("draft:\n  family: dspark\n  conv_kernel_size: 2\n  conv_group_size: 64\n  selector_rank: 64\n"
                   "  selector_top_k: 4\n  markov_rank: 8\n  confidence_head: false\n")
    cfg = load_config(old)
    assert cfg.draft.dspark.markov_rank == 8 and cfg.draft.dflash2.conv_group_size == 64
    assert load_config(old, ["draft.dspark.markov_rank=8"]) == cfg
    with pytest.raises(ConfigError, match=re.escape("draft.markov_rank=8 and draft.dspark.markov_rank=4: set one")):
        load_config(old, ["draft.dspark.markov_rank=4"])
    with pytest.raises(ConfigError, match=re.escape("draft.dspark.markov_rank belongs to draft.family=dspark")):
        build_config({}, ["draft.markov_rank=8"])


def test_a_drafters_entry_merges_into_its_family_section_size_by_size():
    """`drafters[]` entries (several drafters on one target stream) set sizes flat or in the section;
    the base's other sizes of that family carry over."""
    from dflash_train.config import build_config
    from dflash_train.distributed.layout import drafter_runs

    base = {"draft": {"family": "dflash2", "dflash2": {"selector_top_k": 8}},
            "objective": {"loss": {"ce": 1, "selector": 1}},
            "drafters": [{"name": "flat", "draft": {"conv_group_size": 32}},
                         {"name": "nested", "draft": {"dflash2": {"conv_group_size": 16}}},
                         {"name": "spark", "draft": {"family": "dspark", "markov_rank": 32, "dflash2": {"selector_top_k": 4}},
                          "objective": {"loss": {"ce": 1}}}]}
    runs = dict(drafter_runs(build_config(base)))
    assert (runs["flat"].draft.dflash2.conv_group_size, runs["flat"].draft.dflash2.selector_top_k) == (32, 8)
    assert (runs["nested"].draft.dflash2.conv_group_size, runs["nested"].draft.dflash2.selector_top_k) == (16, 8)
    assert runs["spark"].draft.dspark.markov_rank == 32
