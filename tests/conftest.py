"""Fixtures shared by several test files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The Triton kernels' fixed configuration on a GPU: tests check correctness at dozens of shapes,
# and autotuning would compile and time every configuration for each (moeify.ops.moe.kernels._triton_jit).
os.environ.setdefault("MOEIFY_TRITON_AUTOTUNE", "0")
# Without a GPU the Triton kernels run only in Triton's CPU interpreter, which must be chosen
# before anything imports triton (torch._dynamo does, and so does moeify.ops.moe through it):
# triton.language's own jitted helpers are built for one mode at import. tests/ops/
# test_triton_matmul.py runs the kernels in it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's on-disk caches in a directory of this session's own: the FX graph cache keys a
# compiled graph without the schemas of the custom ops it calls, so code cached before an op of
# moeify.ops.moe.compiled changed its arguments would be run against the new op.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moeify-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def shared_data_dir(monkeypatch) -> Path:
    """The data directory of the real-data tests, exported as MOEIFY_DATA_DIR: $MOEIFY_DATA_DIR
    when set, else the project's shared data beside the repository (../shared/data). A test
    skips only when the file it needs is not there (a checkout without the shared data)."""
    env = os.environ.get("MOEIFY_DATA_DIR")
    root = Path(env).expanduser() if env else REPO.parent / "shared" / "data"
    monkeypatch.setenv("MOEIFY_DATA_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the modules of tiny-tensor tests, which opt in with
    `pytestmark = pytest.mark.usefixtures("single_thread")`. On tiny tensors more threads only add
    OpenMP wake-up cost, which is large on a busy machine. The previous count is restored when
    the module ends."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def text_corpus(tmp_path, monkeypatch) -> Path:
    """A directory holding corpus.txt, 200 lines of random words (a corpus for tiny training
    runs), with MOEIFY_CACHE_DIR pointed inside it."""
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(2)
    words = "the cat sat on a warm mat by the door".split()
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 8))
                                                    for _ in range(200)))
    return tmp_path
