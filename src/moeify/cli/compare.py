"""``moeify compare``: train several presets on the same data for the same steps (same seed,
same token order), then write DIR/results.json, DIR/results.md and DIR/curves.png.

Every preset trains in its own child process (``python -m moeify.cli.compare --child SPEC``),
so that its peak memory is its own (the child's max RSS from wait4 on CPU, its CUDA max allocated
on a GPU) and a crash in one run is reported without losing the others. After training, the
child scores the validation split (``--final-eval-tokens``; 0 = all of it) with XL memory
carried, and BLiMP when its data is found. The comparison itself is moeify.analysis.compare.

Interrupted (Ctrl-C, or a run that failed), the parent sends each running child one SIGTERM
(the children run in their own session, so a Ctrl-C at the terminal reaches only the parent):
the child's trainer finishes its step, checkpoints it and exits without a result, and the next
invocation resumes it. A child stopped while scoring a finished training is scored again, not
retrained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD_RESULT = "compare_child.json"
# The training time and peak memory of a child whose training finished, written before it
# scores the model: a child stopped while scoring resumes at the scoring, with these.
CHILD_TRAINED = "compare_trained.json"
CHILD_LOG = "train.log"
# How a child states the error that stopped it (one line, the last of its log).
CHILD_ERROR = "error:"
SPEC_FILE = "compare_spec.json"


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="train several presets identically and tabulate their quality and cost",
        description="Train each preset on the same corpus for the same number of steps (same "
        "seed, same token order), then write OUT/results.json and OUT/results.md (parameters, "
        "attention MACs and memory, final validation bpc or perplexity, training tokens/s, peak "
        "memory, BLiMP accuracy) and OUT/curves.png. Runs live in OUT/runs/PRESET.")
    p.add_argument("--presets", required=True, help="comma-separated preset names "
                   "(`moeify presets`; the CPU-scale family is repro-dense, repro-dense-h2, "
                   "repro-switchhead, repro-moa, repro-switchall)")
    p.add_argument("--data", default="wiki-excerpt", help="corpus (default wiki-excerpt)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed shared by every run (default 0)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="training setting for every run (batch_size=16, eval_every=50, ...); "
                   "repeatable")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time "
                   "(default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: "
                   "CPU cores / jobs). Oversubscribed OpenMP threads on a busy machine slow "
                   "training many times over")
    p.add_argument("--final-eval-tokens", type=int, default=0, help="validation tokens scored "
                   "after training (default 0: the whole split)")
    p.add_argument("--blimp-per-paradigm", type=int, default=20, help="BLiMP pairs per paradigm "
                   "(default 20; 0 skips BLiMP; moeify sweep, with many more runs, defaults to 0)")
    p.add_argument("--blimp-data", help="BLiMP directory (default $MOEIFY_DATA_DIR/blimp)")
    p.add_argument("--last-k", type=int, default=3, help="validation points the ordering is "
                   "checked over (default 3)")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in "
                   "OUT/runs with the same settings instead of refusing to overwrite them")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- parent


def _check(args) -> list[str]:
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    if not presets:
        raise ValueError(f"--presets needs at least one preset name, got {args.presets!r}")
    if len(set(presets)) != len(presets):
        raise ValueError(f"--presets needs distinct preset names, got {args.presets!r}")
    for name, v in (("--steps", args.steps), ("--jobs", args.jobs)):
        if v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")
    if args.final_eval_tokens < 0 or args.blimp_per_paradigm < 0 or args.last_k < 1:
        raise ValueError("--final-eval-tokens and --blimp-per-paradigm must be >= 0, "
                         "--last-k >= 1")
    return presets


def _train_configs(presets: list[str], args) -> dict:
    from moeify.train.config import TrainConfig, resolve_model_config

    cfgs = {}
    for p in presets:
        cfg = TrainConfig(preset=p, data=args.data, steps=args.steps,
                          seed=args.seed).with_overrides(args.overrides)
        cfgs[p] = (cfg, resolve_model_config(cfg))
    lengths = {m.context_length for _, m in cfgs.values()}
    if len(lengths) != 1:
        raise ValueError("the presets have different context lengths "
                         f"({', '.join(f'{p}: {m.context_length}' for p, (_, m) in cfgs.items())})"
                         ", so their token order would differ; set model.context_length=N")
    return cfgs


def _spec(preset: str, cfg, run_dir: Path, threads: int, args, name: str | None = None) -> dict:
    return {"name": name or preset, "preset": preset, "train_config": cfg.to_dict(),
            "run_dir": str(run_dir), "threads": threads,
            "final_eval_tokens": args.final_eval_tokens,
            "blimp_per_paradigm": args.blimp_per_paradigm, "blimp_data": args.blimp_data}


def _child_env(threads: int) -> dict:
    from moeify.cli.main import MALLOC_ENV

    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    if not env.get("MOEIFY_NO_MALLOC_TUNING"):
        for k, v in MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def _max_rss_bytes(ru) -> int:
    # Linux reports kilobytes, macOS bytes.
    return int(ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def _last_step(run_dir: Path) -> int:
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


def _fmt_s(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _steps(spec: dict) -> int:
    return int(spec["train_config"]["steps"])


class _Scheduler:
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
        _write_json(spec_path, spec)
        log = open(run_dir / CHILD_LOG, "a" if spec.get("resume") else "w")
        proc = subprocess.Popen([sys.executable, "-m", "moeify.cli.compare", "--child",
                                 str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                # Own session: a terminal's Ctrl-C reaches only the parent,
                                # whose stop() then sends one SIGTERM (a second signal would
                                # stop the trainer before it checkpoints).
                                env=_child_env(spec["threads"]), start_new_session=True)
        log.close()
        self.running[proc.pid] = (proc, spec, time.time())
        n = self.total - len(self.queue)
        self._say(f"{n}/{self.total} {'resumed' if spec.get('resume') else 'started'} "
                  f"{spec['name']} ({_steps(spec)} steps, {spec['threads']} thread(s)); log "
                  f"{run_dir / CHILD_LOG}")

    def _eta(self) -> str:
        now = time.time()
        remaining = []
        for _, (proc, spec, t0) in self.running.items():
            step = _last_step(Path(spec["run_dir"]))
            rate = step / max(now - t0, 1e-9)
            est = (_steps(spec) - step) / rate if step else None
            remaining.append(est)
        known = [r for r in remaining if r is not None]
        per_step = [d / s for d, s in self.durations] or (
            [max(known) * 1.2 / max(_steps(sp) for _, sp, _ in self.running.values())]
            if known else [])
        if not per_step:
            return "ETA unknown"
        mean = sum(per_step) / len(per_step)  # seconds per step, evaluations included
        queued = sum(_steps(sp) for sp in self.queue) * mean / self.jobs
        return f"ETA {_fmt_s(max(known or [0.0]) + queued)}"

    def progress(self) -> None:
        parts = [f"{spec['name']} step {_last_step(Path(spec['run_dir']))}/{_steps(spec)}"
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
        from moeify.errors import MoeifyError

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
        result["max_rss_bytes"] = max(_max_rss_bytes(ru), result.get("max_rss_bytes") or 0)
        _write_json(run_dir / CHILD_RESULT, result)
        self.durations.append((time.time() - t0, _steps(spec)))
        self.done[spec["name"]] = result
        from moeify.analysis.compare import valid_text

        self._say(f"finished {spec['name']} in {_fmt_s(time.time() - t0)}: "
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


def _write_json(path: Path, data) -> None:
    from moeify.data.cache import atomic_write

    with atomic_write(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")


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
    from moeify.errors import MoeifyError
    from moeify.train.lock import describe_holder, live_holder

    holder = live_holder(run_dir)
    if holder is not None:
        raise MoeifyError(f"{run_dir} is in use by another process, {describe_holder(holder)}; "
                          "wait for it to finish or stop it, or choose another --out")


def lock_out(out: Path, command: str):
    """The lock a compare or sweep holds on OUT for its lifetime: a second one on the same OUT
    is refused (naming the first) before it looks at any run directory."""
    from moeify.train.lock import RunLock

    return RunLock(out, what=f"moeify {command}",
                   advice="choose another --out").acquire()


def plan_run(run_dir: Path, spec: dict, *, reuse: bool) -> dict | None:
    """What to do with ``run_dir`` for ``spec``: return the finished run's result to reuse it,
    or None to train (setting ``spec["resume"]`` when an interrupted attempt with the same
    settings left a checkpoint). An unfinished attempt (our spec file, no result) without a
    checkpoint is cleared: it holds nothing trained. A directory in use by a live process, a
    finished or checkpointed run with other settings (the message names them), or a directory
    that is not a compare/sweep run, is refused."""
    import shutil

    from moeify.errors import MoeifyError
    from moeify.train.checkpoint import latest_checkpoint

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


def train_all(specs: list[dict], jobs: int, tag: str,
              on_done=None) -> tuple[dict[str, dict], BaseException | None]:
    """Train ``specs``; return the finished runs' results and the failure or interruption that
    stopped the others (None when every run finished), so that callers tabulate what finished
    before passing the error on. ``on_done(spec, result)`` is called as each run finishes."""
    sched = _Scheduler(specs, jobs, tag, on_done)
    try:
        sched.run()
    except (Exception, KeyboardInterrupt) as e:
        return sched.done, e
    return sched.done, None


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


def run(args) -> int:
    presets = _check(args)
    cfgs = _train_configs(presets, args)
    out = Path(args.out)
    lock = lock_out(out, "compare")
    try:
        return _run(args, presets, cfgs, out)
    finally:
        lock.release()


def _run(args, presets: list[str], cfgs: dict, out: Path) -> int:
    from moeify.analysis.compare import run_record, write_results
    from moeify.data import load_corpus

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    specs, results = [], {}
    for p in presets:
        run_dir = out / "runs" / p
        spec = _spec(p, cfgs[p][0], run_dir, threads, args)
        reused = plan_run(run_dir, spec, reuse=args.reuse)
        if reused is not None:
            results[p] = reused
            print(f"[compare] reusing the finished run {run_dir}", file=sys.stderr)
            continue
        specs.append(spec)
    load_corpus(args.data)  # prepare the corpus once, before the runs share it
    t0 = time.time()
    done, error = train_all(specs, args.jobs, "compare")
    results.update(done)
    finished = [p for p in presets if p in results]
    rows = []
    for p in finished:
        r = results[p]
        cuda = r.get("cuda_peak_bytes")
        rows.append(run_record(
            p, out / "runs" / p, final_valid=r["final_valid"],
            peak_memory_bytes=cuda if cuda else r.get("max_rss_bytes"),
            peak_memory_kind="CUDA max allocated" if cuda else "max resident set size (RSS)",
            blimp=r.get("blimp"), listops=r.get("listops")))
    cfg0 = cfgs[presets[0]][0]
    settings = {"presets": ",".join(presets), "data": args.data, "steps": args.steps,
                "seed": args.seed, "batch_size": cfg0.batch_size,
                "context_length": cfgs[presets[0]][1].context_length, "lr": cfg0.lr,
                "warmup_steps": cfg0.warmup_steps, "grad_clip": cfg0.grad_clip,
                "overrides": " ".join(args.overrides) or "none", "jobs": args.jobs,
                "threads_per_run": threads, **run_settings([results[p] for p in finished]),
                "this_invocation_wall_s": round(time.time() - t0, 1)}
    if error is not None:
        settings["unfinished"] = ",".join(p for p in presets if p not in results)
    if rows:
        data = write_results(out, rows, settings, last_k=args.last_k)
        print((out / "results.md").read_text())
        report_written(out, data)
    if error is not None:
        raise error
    return 0 if rows else 1


# ---------------------------------------------------------------------------- child


def _train_child(spec: dict, cfg, run_dir: Path) -> tuple[dict | None, int]:
    """Train (or resume) the child's run: (its training time and memory {"train_wall_s",
    "trainer_tokens_per_s", "max_rss_bytes"}, 0), or (None, the trainer's exit code) when a
    signal stopped the training (the trainer has then checkpointed the step it finished; the
    next sweep or compare resumes from there, and no result is written for a half-trained
    model). A run whose checkpoints already hold every step (its child was stopped while
    scoring) is not trained again: its time and peak memory are the ones recorded when its training finished (None if
    that record is missing), not those of the child that only scores it."""
    import resource

    from moeify.train.checkpoint import latest_checkpoint, step_of
    from moeify.train.trainer import train

    trained = run_dir / CHILD_TRAINED
    if spec.get("resume"):
        last = latest_checkpoint(run_dir)
        if last is not None and step_of(last) >= cfg.steps:
            if trained.is_file():
                return json.loads(trained.read_text()), 0
            return {"train_wall_s": None, "trainer_tokens_per_s": None, "max_rss_bytes": None}, 0
    result = train(cfg, run_dir, quiet=True, resume=bool(spec.get("resume")))
    if result.interrupted:
        return None, result.exit_code
    timing = {"train_wall_s": result.wall_s, "trainer_tokens_per_s": result.tokens_per_s,
              "max_rss_bytes": _max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF))}
    _write_json(trained, timing)
    return timing, 0


def child_main(spec_path: str) -> int:
    """Train one preset, score it, write CHILD_RESULT into its run directory (``_train_child``:
    a child stopped by a signal while training returns 128 + the signal without a result, and
    a run whose checkpoints already hold every step is scored without training)."""
    import torch

    from moeify.data import load_corpus, tokenize_split
    from moeify.errors import MoeifyError
    from moeify.eval.blimp import blimp_accuracy, load_blimp
    from moeify.train.config import TrainConfig
    from moeify.train.rundir import load_trained
    from moeify.eval.adapters import evaluate_stream, stateless_logits_fn

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    cfg = TrainConfig.from_dict(spec["train_config"])
    run_dir = Path(spec["run_dir"])
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    timing, code = _train_child(spec, cfg, run_dir)
    if timing is None:
        return code
    tm = load_trained(run_dir)
    device = next(tm.model.parameters()).device
    tokens = tokenize_split(load_corpus(cfg.data), tm.tokenizer, "valid")
    final = evaluate_stream(tm.model, tokens, tm.tokenizer, seq_len=tm.model_config.context_length,
                            batch_size=cfg.eval_batch_size, max_tokens=spec["final_eval_tokens"])
    blimp = {"error": "skipped (--blimp-per-paradigm 0)"}
    if spec["blimp_per_paradigm"]:
        try:
            pairs = load_blimp(spec["blimp_data"], limit_per_paradigm=spec["blimp_per_paradigm"])
            res = blimp_accuracy(stateless_logits_fn(tm.model, device), tm.tokenizer, pairs)
            blimp = {"accuracy": res["accuracy"], "pairs": res["pairs"]}
        except MoeifyError as e:
            blimp = {"error": str(e)}
    listops = None
    from moeify.data.corpora import resolve_recipe
    from moeify.data.listops import ListOpsRecipe, listops_accuracy, load_examples

    if isinstance(resolve_recipe(cfg.data)[0], ListOpsRecipe):
        corpus = load_corpus(cfg.data)
        seen = {e.expression for e in load_examples(corpus, "train")}
        listops = listops_accuracy(stateless_logits_fn(tm.model, device), tm.tokenizer,
                                   load_examples(corpus, "valid"), train_expressions=seen)
    out = {"preset": spec["preset"], "final_valid": final, "blimp": blimp, "listops": listops,
           **timing,
           "device": str(device), "torch": torch.__version__, "threads": spec["threads"],
           "load_avg": None if load0 is None else [round(load0, 2), round(os.getloadavg()[0], 2)],
           "cuda_peak_bytes": (torch.cuda.max_memory_allocated(device)
                               if device.type == "cuda" else None)}
    _write_json(run_dir / CHILD_RESULT, out)
    return 0


def child_entry(spec_path: str) -> int:
    """child_main with the CLI's error handling: an error the user can act on (a full disk, a
    bad setting) is one ``error:`` line in the log for the parent to quote, exit 2."""
    from moeify.cli.main import error_line
    from moeify.errors import MoeifyError

    try:
        return child_main(spec_path)
    except (MoeifyError, ValueError, OSError) as e:
        if os.environ.get("MOEIFY_DEBUG"):
            raise
        print(f"{CHILD_ERROR} {error_line(e)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_entry(sys.argv[2]))
    print("usage: moeify compare ... (this module's own entry point is for its child runs)",
          file=sys.stderr)
    sys.exit(2)
