"""What the scheduler (parent) and a child run share: the files in the run directory and the
spec the parent writes for the child."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from moeify.data.cache import atomic_write

CHILD_RESULT = "compare_child.json"
# The training time and peak memory of a child whose training finished, written before it
# scores the model: a child stopped while scoring resumes at the scoring, with these.
CHILD_TRAINED = "compare_trained.json"
CHILD_LOG = "train.log"
# How a child states the error that stopped it (one line, the last of its log).
CHILD_ERROR = "error:"
SPEC_FILE = "compare_spec.json"


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """How a child scores its model once trained: validation tokens (0 = the whole split) and
    BLiMP pairs per paradigm (0 = skipped) from ``blimp_data`` (None: $MOEIFY_DATA_DIR/blimp)."""
    final_eval_tokens: int = 0
    blimp_per_paradigm: int = 0
    blimp_data: str | None = None


def run_spec(preset: str, cfg, run_dir: Path, threads: int, scoring: Scoring,
             name: str | None = None) -> dict:
    """The spec of one run (the child's only input, written to SPEC_FILE): ``cfg`` is its
    TrainConfig, ``name`` how the parent reports it (default: the preset)."""
    return {"name": name or preset, "preset": preset, "train_config": cfg.to_dict(),
            "run_dir": str(run_dir), "threads": threads,
            "final_eval_tokens": scoring.final_eval_tokens,
            "blimp_per_paradigm": scoring.blimp_per_paradigm, "blimp_data": scoring.blimp_data}


def spec_steps(spec: dict) -> int:
    return int(spec["train_config"]["steps"])


def write_json(path: Path, data) -> None:
    with atomic_write(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")


def max_rss_bytes(ru) -> int:
    # Linux reports kilobytes, macOS bytes.
    return int(ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def failure_line(log: Path) -> str:
    """What a failed child said, in one line: its own error line (``error: ...``), else the
    last line of a traceback (the exception), else the last line of its log."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError as e:
        return f"its log cannot be read ({e.strerror})"
    for line in reversed(lines):
        if line.startswith(CHILD_ERROR):
            return line[len(CHILD_ERROR):].strip()
    return lines[-1] if lines else "it printed nothing"


# The parent's pid, in a child's environment: the child stops when that process is gone.
PARENT_ENV = "MOEIFY_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent(parent: int | None, poll_s: float = 1.0) -> str | None:
    """Make the death of process ``parent`` (the compare or sweep that started this child) send
    this process SIGTERM, which the trainer handles as a stop: it finishes its step, checkpoints
    it and exits, and the next compare or sweep resumes the run. A kill -9 of the parent (or of
    its process group: the child runs in a session of its own) then leaves no orphan training.
    On Linux the kernel does it (prctl PR_SET_PDEATHSIG); elsewhere a daemon thread compares
    getppid() with ``parent`` every ``poll_s`` seconds. Returns how ("prctl" or "poll"), None
    when ``parent`` is None."""
    import os
    import signal

    if parent is None:
        return None
    how = "poll"
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
        return how
    if how == "poll":
        import threading
        import time

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(poll_s)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="moeify-parent-watch", daemon=True).start()
    return how


def parent_from_env() -> int | None:
    import os

    value = os.environ.get(PARENT_ENV)
    return int(value) if value and value.isdigit() else None
