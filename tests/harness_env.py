"""lm-evaluation-harness offline for a test, with a private datasets cache (the harness tests'
shared setup: tests/interop/test_harness.py, tests/cli/test_fault_audit.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def harness_offline(mp: pytest.MonkeyPatch, root: Path) -> None:
    """lm-evaluation-harness offline, with its datasets cache under ``root``/hf, for as long as
    ``mp`` (a MonkeyPatch) holds: the harness tests' shared setup."""
    mp.setenv("HF_DATASETS_CACHE", str(root / "hf"))
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "DISABLE_MULTIPROC"):
        mp.setenv(k, "1")
    if "datasets.config" in sys.modules:  # read once at import: patch the imported value too
        mp.setattr(sys.modules["datasets.config"], "HF_DATASETS_CACHE", root / "hf")
