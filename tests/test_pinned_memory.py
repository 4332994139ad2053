"""Our processes pin host memory by registering it (dflash_train/pinned_memory.py): the allocator
key is added before torch is imported, and a user's own allocator settings are kept."""

import os
import subprocess
import sys

from dflash_train.pinned_memory import PINNED_BY_REGISTER, pin_by_registering


def test_the_key_is_added_and_what_the_user_set_is_kept():
    env = {}
    assert pin_by_registering(env, modules={}) and env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_BY_REGISTER}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert pin_by_registering(env, modules={})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == f"expandable_segments:True,{PINNED_BY_REGISTER}"
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    assert pin_by_registering(env, modules={})  # torch reads PYTORCH_ALLOC_CONF first: the key goes there
    assert env == {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{PINNED_BY_REGISTER}", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}


def test_nothing_changes_after_torch_or_beside_a_pinned_setting():
    for env in ({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"},
                {"PYTORCH_ALLOC_CONF": "pinned_num_register_threads:4"}):
        before = dict(env)
        assert not pin_by_registering(env, modules={}) and env == before
    env = {}
    assert not pin_by_registering(env, modules={"torch": object()}) and env == {}


def test_importing_the_package_sets_it_before_torch_and_torch_accepts_it():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    code = ("import sys, os, dflash_train; assert 'torch' not in sys.modules; import torch; "
            "torch.zeros(2); print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == PINNED_BY_REGISTER
