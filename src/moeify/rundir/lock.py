"""One trainer per run directory: a lock file held for the run's lifetime.

``RUN/.lock`` holds the owner's pid, host, start time and command line (JSON). The lock itself is
an ``flock`` on that file, which the kernel releases when the owner exits in any way (including
kill -9), so a lock file left behind by a killed trainer is stale by construction; its recorded
pid is only used for the message, and as the liveness test on file systems without flock.
``release()`` removes the file; it runs on every normal and error exit of the trainer.

Process ids are also what marks temporary checkpoint files (``.tmp-step-...-PID``): a file whose
process is gone is debris of a crash and may be swept; one of a live process is never touched.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from moeify.data.cache import pid_alive
from moeify.errors import MoeifyError

LOCK_FILE = ".lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def read_holder(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    cmd = " ".join(holder.get("argv") or [])
    return (f"pid {holder.get('pid')} on {holder.get('host')} (started {when}"
            + (f": {cmd}" if cmd else "") + ")")


def live_holder(run_dir: str | Path) -> dict[str, Any] | None:
    """The owner recorded in ``run_dir/.lock`` when a live process holds that lock (an flock
    that cannot be taken, or on file systems without flock a live recorded pid), else None.
    Reads only: a stale lock file is left for its next owner to take over."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path) or {}
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            holder = read_holder(path)
            if holder and holder.get("host") == socket.gethostname() and \
                    pid_alive(int(holder.get("pid", 0))):
                return holder
        return None
    finally:
        os.close(fd)  # drops the shared lock taken to test it


class RunLock:
    """``with RunLock(run_dir):`` or ``acquire()`` / ``release()``; refuses a second owner."""

    def __init__(self, run_dir: str | Path, *, what: str = "trainer",
                 advice: str = "train into another directory with --out") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.what, self.advice = what, advice
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(10):  # retried only when the file was replaced between open and flock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if not self._lock(fd):
                    raise self._refusal()
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    raise FileNotFoundError  # released and removed meanwhile: take the new file
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            self._write_owner(fd)
            return self
        raise MoeifyError(f"could not lock {self.path}: it keeps being replaced by another process")

    def _lock(self, fd: int) -> bool:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
        # No flock here (some network file systems): the recorded pid decides.
        holder = read_holder(self.path)
        if holder is None or holder.get("host") != socket.gethostname():
            return holder is None
        return holder.get("pid") == os.getpid() or not pid_alive(int(holder.get("pid", 0)))

    def _refusal(self) -> MoeifyError:
        holder = read_holder(self.path)
        return MoeifyError(
            f"{self.run_dir} is in use by another {self.what}, {describe_holder(holder)}; wait "
            f"for it to finish or stop it, or {self.advice}")

    def _write_owner(self, fd: int) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                 "argv": sys.argv}
        data = (json.dumps(owner) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def release(self) -> None:
        """Remove the lock file and let go; safe to call twice."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(lock: RunLock) -> str | None:
    """Take ``lock`` for its run directory and sweep what crashed checkpoint writers left
    there; the one-line reason when the directory cannot be used (None when it can)."""
    from moeify.errors import describe_os_error
    from moeify.rundir.layout import CHECKPOINTS
    from moeify.rundir.write import sweep_stale

    run_dir = lock.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        return f"--out {run_dir} is a file, not a directory: give a new or existing run directory"
    try:
        lock.acquire()
        if (run_dir / CHECKPOINTS).is_dir():
            sweep_stale(run_dir / CHECKPOINTS)
    except MoeifyError as e:
        return str(e)
    except OSError as e:  # e.g. a read-only file system
        return f"cannot use the run directory: {describe_os_error(e)}"
    return None
