"""The parent side of compare and sweep: every run trains in its own child process
(moeify.sweep.child), so that its peak memory is its own (the child's max RSS from wait4 on
CPU, its CUDA max allocated on a GPU) and a crash in one run is reported without losing the
others.

Interrupted (Ctrl-C, or a run that failed), the parent sends each running child one SIGTERM
(the children run in their own session, so a Ctrl-C at the terminal reaches only the parent):
the child's trainer finishes its step, checkpoints it and exits without a result, and the next
invocation resumes it (``plan_run``). A child stopped while scoring a finished training is
scored again, not retrained.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from moeify.analysis.compare import valid_text
from moeify.errors import MoeifyError, env_flag
from moeify.rundir.layout import latest_checkpoint
from moeify.runtime import MALLOC_ENV
from moeify.sweep.protocol import (CHILD_LOG, CHILD_RESULT, PARENT_ENV, SPEC_FILE,
                                   failure_line, max_rss_bytes, spec_steps, write_json)
from moeify.rundir.lock import RunLock, describe_holder, live_holder

# The module a child runs (``python -m CHILD_MODULE --child SPEC``).
CHILD_MODULE = "moeify.sweep.child"


def child_env(threads: int) -> dict:
    """The environment of a child: ``threads`` OpenMP/MKL threads and the CLI's malloc tuning."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                PARENT_ENV: str(os.getpid())})  # the child stops when this process dies
    if not env_flag("MOEIFY_NO_MALLOC_TUNING"):
        for k, v in MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def last_step(run_dir: Path) -> int:
    """The last training step the run logged (0 before its first), read cheaply."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    step = 0
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b'{"kind": "train"'):
                try:
                    step = int(json.loads(line).get("step", step))
                except ValueError:
                    pass
    return step


def format_seconds(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Scheduler:
    """Runs child processes, ``jobs`` at a time, with progress and ETA on stderr. ``done`` holds
    every finished run's result (by spec name) even when a later run fails or the parent is
    interrupted; the running children are then stopped."""

    def __init__(self, specs: list[dict], jobs: int, tag: str = "compare",
                 on_done=None) -> None:
        self.queue = list(specs)
        self.jobs, self.tag, self.on_done = jobs, tag, on_done
        self.running: dict[int, tuple[subprocess.Popen, dict, float]] = {}
        self.done: dict[str, dict] = {}
        self.durations: list[float] = []
        self.total = len(specs)

    def _say(self, text: str) -> None:
        print(f"[{self.tag}] {text}", file=sys.stderr, flush=True)

    def _start(self, spec: dict) -> None:
        run_dir = Path(spec["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = run_dir / SPEC_FILE
        write_json(spec_path, spec)
        log = open(run_dir / CHILD_LOG, "a" if spec.get("resume") else "w")
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, "--child",
                                 str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                # Own session: a terminal's Ctrl-C reaches only the parent,
                                # whose stop() then sends one SIGTERM (a second signal would
                                # stop the trainer before it checkpoints).
                                env=child_env(spec["threads"]), start_new_session=True)
        log.close()
        self.running[proc.pid] = (proc, spec, time.time())
        n = self.total - len(self.queue)
        self._say(f"{n}/{self.total} {'resumed' if spec.get('resume') else 'started'} "
                  f"{spec['name']} ({spec_steps(spec)} steps, {spec['threads']} thread(s)); log "
                  f"{run_dir / CHILD_LOG}")

    def _eta(self) -> str:
        """The time left: a running child that has logged a step from its own rate; one still
        at step 0, and the queued runs, from the mean seconds per step of the finished runs (or
        of the running ones); "ETA unknown" while nothing has a rate yet, never 0m00s."""
        now = time.time()
        known, unknown, rates = [], [], []
        for _, (proc, spec, t0) in self.running.items():
            step = last_step(Path(spec["run_dir"]))
            if step:
                rates.append((now - t0) / step)
                known.append((spec_steps(spec) - step) * rates[-1])
            else:
                unknown.append(spec_steps(spec))
        per_step = [d / s for d, s in self.durations] or rates
        if not per_step:
            return "ETA unknown"
        mean = sum(per_step) / len(per_step)  # seconds per step, evaluations included
        queued = sum(spec_steps(sp) for sp in self.queue) * mean / self.jobs
        return f"ETA {format_seconds(max(known + [n * mean for n in unknown] or [0.0]) + queued)}"

    def progress(self) -> None:
        parts = [f"{spec['name']} step {last_step(Path(spec['run_dir']))}/{spec_steps(spec)}"
                 for _, (_, spec, _) in self.running.items()]
        self._say(f"{len(self.done)}/{self.total} done; running: {', '.join(parts)}; "
                  f"{self._eta()}")

    def stop(self) -> None:
        for p, _, _ in self.running.values():
            p.terminate()
        for p, _, _ in self.running.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.running.clear()

    def _reap(self, pid: int, status: int, ru) -> None:
        proc, spec, t0 = self.running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        run_dir = Path(spec["run_dir"])
        log = run_dir / CHILD_LOG
        if proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            raise MoeifyError(f"training {spec['name']} was stopped by a signal (exit "
                              f"{proc.returncode}) after checkpointing its last step; run the "
                              "same command again to resume it")
        if proc.returncode != 0:
            raise MoeifyError(f"training {spec['name']} failed (exit {proc.returncode}): "
                              f"{failure_line(log)}; the whole log is {log}")
        result = json.loads((run_dir / CHILD_RESULT).read_text())
        result["max_rss_bytes"] = max(max_rss_bytes(ru), result.get("max_rss_bytes") or 0)
        write_json(run_dir / CHILD_RESULT, result)
        self.durations.append((time.time() - t0, spec_steps(spec)))
        self.done[spec["name"]] = result
        self._say(f"finished {spec['name']} in {format_seconds(time.time() - t0)}: "
                  f"{valid_text(result['final_valid'])}")
        if self.on_done is not None:
            self.on_done(spec, result)

    def run(self, poll_s: float = 1.0, report_s: float = 30.0) -> dict[str, dict]:
        try:
            self._loop(poll_s, report_s)
        finally:
            self.stop()
        return self.done

    def _loop(self, poll_s: float, report_s: float) -> None:
        last_report = time.time()
        first = True
        while self.queue or self.running:
            # The first run prepares and tokenises the corpus alone (a shared cache).
            may_start = not first or not self.running
            if first and self.running:
                spec0 = next(iter(self.running.values()))[1]
                may_start = (Path(spec0["run_dir"]) / "metrics.jsonl").is_file()
            while self.queue and len(self.running) < self.jobs and may_start:
                self._start(self.queue.pop(0))
            if self.running and may_start:
                first = False
            for pid in list(self.running):
                got, status, ru = os.wait4(pid, os.WNOHANG)
                if got != 0:
                    self._reap(pid, status, ru)
            if self.running and time.time() - last_report >= report_s:
                self.progress()
                last_report = time.time()
            time.sleep(poll_s)


def train_all(specs: list[dict], jobs: int, tag: str,
              on_done=None) -> tuple[dict[str, dict], BaseException | None]:
    """Train ``specs``; return the finished runs' results and the failure or interruption that
    stopped the others (None when every run finished), so that callers tabulate what finished
    before passing the error on. ``on_done(spec, result)`` is called as each run finishes."""
    sched = Scheduler(specs, jobs, tag, on_done)
    try:
        with sigterm_as_interrupt():
            sched.run()
    except (Exception, KeyboardInterrupt) as e:
        return sched.done, e
    return sched.done, None


@contextlib.contextmanager
def sigterm_as_interrupt():
    """A SIGTERM to the parent is handled as Ctrl-C: KeyboardInterrupt, so the running
    children are stopped (each checkpoints its step), what finished is tabulated and the
    command ends with its "interrupted" line, instead of dying silently with orphans."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the default
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# What marks an OUT as a study of each kind (the other kind's results.json and results.md
# would be overwritten by a second kind).
_STUDY_MARKS = {"sweep": "sweep.json", "compare": f"runs/*/{SPEC_FILE}"}


def refuse_other_study(out: Path, kind: str) -> None:
    """Refuse an OUT that holds a study of another kind (a compare into a sweep's OUT, or the
    reverse), naming it, before anything is written."""
    out = Path(out)
    for other, mark in _STUDY_MARKS.items():
        if other != kind and any(out.glob(mark)):
            raise MoeifyError(f"{out} holds a moeify {other} (its {mark.split('/')[-1]}); a "
                              f"{kind} there would overwrite its results.json and results.md: "
                              "choose another --out")


# ---------------------------------------------------------------------- run directories

# What a run directory's spec holds besides the settings that define the run: where it is
# (the directory, however --out was spelled), how it was scheduled (threads), and the resume
# flag of one attempt.
_NOT_DEFINING = ("run_dir", "threads", "resume")


def _defining(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in _NOT_DEFINING}


def spec_differences(old: dict, new: dict) -> list[str]:
    """The settings that define a run (preset, seed, steps, corpus, every --set and recipe
    value, the scoring options) on which two specs differ, as "KEY OLD -> NEW"."""
    def flat(spec: dict) -> dict:
        out = {}
        for k, v in _defining(spec).items():
            if isinstance(v, dict):
                out.update({(f"{kk}" if k == "train_config" else f"{k}.{kk}"): vv
                            for kk, vv in v.items()})
            else:
                out[k] = v
        return out

    a, b = flat(json.loads(json.dumps(old))), flat(json.loads(json.dumps(new)))  # as stored
    return [f"{k} {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}"
            for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)]


def refuse_if_in_use(run_dir: Path) -> None:
    """A run directory locked by a live process is never cleared, trained into or reused."""
    holder = live_holder(run_dir)
    if holder is not None:
        raise MoeifyError(f"{run_dir} is in use by another process, {describe_holder(holder)}; "
                          "wait for it to finish or stop it, or choose another --out")


def lock_out(out: Path, command: str):
    """The lock a compare or sweep holds on OUT for its lifetime: a second one on the same OUT
    is refused (naming the first) before it looks at any run directory."""
    return RunLock(out, what=f"moeify {command}",
                   advice="choose another --out").acquire()


def plan_run(run_dir: Path, spec: dict, *, reuse: bool) -> dict | None:
    """What to do with ``run_dir`` for ``spec``: return the finished run's result to reuse it,
    or None to train (setting ``spec["resume"]`` when an interrupted attempt with the same
    settings left a checkpoint). An unfinished attempt (our spec file, no result) without a
    checkpoint is cleared: it holds nothing trained. A directory in use by a live process, a
    finished or checkpointed run with other settings (the message names them), or a directory
    that is not a compare/sweep run, is refused."""
    spec["resume"] = False
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    refuse_if_in_use(run_dir)
    old_path, result = run_dir / SPEC_FILE, run_dir / CHILD_RESULT
    try:
        old = json.loads(old_path.read_text()) if old_path.is_file() else None
    except ValueError:
        old = None
    if old is None and not result.is_file():
        raise MoeifyError(f"{run_dir} already holds a run (no readable {SPEC_FILE}): choose "
                          "another --out or delete it")
    diff = spec_differences(old, spec) if old is not None else ["(unknown settings)"]
    differ = f" with other settings ({'; '.join(diff)})" if diff else ""
    if result.is_file():
        if not diff and reuse:
            return json.loads(result.read_text())
        raise MoeifyError(f"{run_dir} already holds a finished run{differ}; choose another "
                          "--out, delete it, or pass --reuse to keep finished runs with the "
                          "same settings")
    checkpointed = latest_checkpoint(run_dir) is not None
    if checkpointed and not diff:
        spec["resume"] = True
        return None
    if checkpointed:
        raise MoeifyError(f"{run_dir} holds an unfinished run{differ} with checkpoints; run it "
                          "again with its own settings to resume it, delete it, or choose "
                          "another --out")
    print(f"[compare] clearing the unfinished attempt in {run_dir} (nothing trained yet)",
          file=sys.stderr)
    shutil.rmtree(run_dir)
    return None


def run_settings(results: list[dict]) -> dict:
    """Where and how the runs trained, from their own records (not this invocation's), so that
    reused runs keep the settings they trained under."""
    walls = [r.get("train_wall_s") for r in results if r.get("train_wall_s") is not None]
    loads = [r.get("load_avg") for r in results if r.get("load_avg")]
    return {"torch": results[0].get("torch") if results else None,
            "device": results[0].get("device", "cpu") if results else None,
            "cpu_count": os.cpu_count(),
            "runs_wall_s": round(sum(walls), 1) if walls else None,
            "load_avg_during_runs": (f"{min(min(x) for x in loads):.2f}-"
                                     f"{max(max(x) for x in loads):.2f}") if loads else None}


def report_written(out: Path, data: dict) -> None:
    """Name the files actually written; say why the plot is missing when it is."""
    files = [out / "results.json", out / "results.md"] + [out / p for p in data.get("plots", [])]
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    for note in data.get("plot_errors", []):
        print(f"note: {note}", file=sys.stderr)
