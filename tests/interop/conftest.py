"""Fixtures of the Hugging Face interop tests: the checkpoints of a test module's HF_CONFIGS
(name -> a function returning a transformers config), written once per module, and their
imports."""

from __future__ import annotations

import pytest

from hf_checkpoints import save_checkpoint


@pytest.fixture(scope="module")
def hf_dirs(request, tmp_path_factory):
    """name -> (transformers model, save_pretrained directory), random weights seeded by the
    name's position in the module's HF_CONFIGS."""
    root = tmp_path_factory.mktemp("hf")
    configs = request.module.HF_CONFIGS
    return {name: save_checkpoint(configs[name](), root, name, seed=i)
            for i, name in enumerate(configs)}


@pytest.fixture(scope="module")
def imported(hf_dirs, tmp_path_factory):
    """name -> the moeify run directory ``import_hf`` made of that checkpoint."""
    from moeify.interop import import_hf

    root = tmp_path_factory.mktemp("runs")
    return {name: import_hf(path, root / name) for name, (_, path) in hf_dirs.items()}
