"""compare and sweep children do not outlive their parent: a child stops when the parent is
killed (even with kill -9 of the parent's process group: children run in their own session),
and a SIGTERM to the parent is handled as Ctrl-C (the children are stopped, each checkpointing).
Real processes; a stand-in child module keeps them cheap."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _env(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, str(tmp_path), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("platform", ["linux", "other"])  # prctl, or the getppid poll
def test_a_child_stops_when_its_parent_is_killed(tmp_path, platform):
    child = textwrap.dedent(f"""
        import sys, time
        from moeify.sweep import protocol
        sys.platform = {"linux" if platform == "linux" else "darwin"!r}
        print(protocol.stop_with_parent(protocol.parent_from_env(), poll_s=0.2), flush=True)
        time.sleep(120)
    """)
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, MOEIFY_PARENT_PID=str(os.getpid()))
        p = subprocess.Popen([sys.executable, "-c", {child!r}], env=env, start_new_session=True)
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env=_env(tmp_path))
    pid = None
    try:
        pid = int(proc.stdout.readline())
        how = proc.stdout.readline().strip()  # the child is set up
        assert how == ("prctl" if platform == "linux" else "poll")
        assert not _gone(pid)
        proc.kill()  # kill -9 of the parent alone: the child is in its own session
        proc.wait()
        assert _wait_gone(pid, 20), "the child outlived its parent"
    finally:
        proc.kill()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


FAKE_CHILD = """
import pathlib, signal, sys, time, json
spec = json.loads(pathlib.Path(sys.argv[2]).read_text())
run = pathlib.Path(spec["run_dir"])

def stop(signum, frame):  # what the trainer does: checkpoint the step, exit 128 + signal
    (run / "stopped").write_text(str(signum))
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stop)
(run / "started").write_text("")
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_to_the_parent_is_handled_as_ctrl_c(tmp_path):
    (tmp_path / "fake_child.py").write_text(FAKE_CHILD)
    run = tmp_path / "run"
    parent = textwrap.dedent(f"""
        from moeify.sweep import scheduler
        scheduler.CHILD_MODULE = "fake_child"
        spec = {{"name": "a", "run_dir": {str(run)!r}, "threads": 1,
                 "train_config": {{"steps": 5}}}}
        done, error = scheduler.train_all([spec], 1, "compare")
        print("returned", type(error).__name__, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        end = time.time() + 60
        while not (run / "started").exists() and time.time() < end:
            time.sleep(0.1)
        assert (run / "started").exists(), proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # The parent went on as after Ctrl-C: it stopped the child with one SIGTERM and returned.
    assert "returned KeyboardInterrupt" in out, err
    assert (run / "stopped").read_text() == str(int(signal.SIGTERM))
