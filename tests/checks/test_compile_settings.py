"""compile_settings_kept: a block that leaves inductor's settings alone passes; one that changes a
setting for the whole process fails, naming it and both values."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from dflash_train.checks.compile_settings import compile_settings_kept
from dflash_train.errors import UserError


def test_a_block_that_changes_no_setting_passes():
    with compile_settings_kept("a quiet library"):
        inductor_config.get_config_copy()


def test_a_block_that_turns_a_tuning_flag_on_fails_naming_it():
    with inductor_config.patch(coordinate_descent_tuning=False):  # restored whatever the block did
        with pytest.raises(UserError, match=r"a tuning library changed .*coordinate_descent_tuning: False -> True"):
            with compile_settings_kept("a tuning library"):
                inductor_config.coordinate_descent_tuning = True


def test_a_nested_setting_is_seen_too():
    with inductor_config.patch({"triton.cudagraphs": False}):
        with pytest.raises(UserError, match=r"triton\.cudagraphs: False -> True"):
            with compile_settings_kept("a library"):
                inductor_config.triton.cudagraphs = True


def test_a_custom_pass_set_where_there_was_none_is_seen():
    with inductor_config.patch(pre_grad_custom_pass=None):
        with pytest.raises(UserError, match=r"pre_grad_custom_pass: None -> <function"):
            with compile_settings_kept("a library"):
                inductor_config.pre_grad_custom_pass = lambda graph: None
