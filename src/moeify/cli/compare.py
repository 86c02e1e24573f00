"""``moeify compare``: train several presets on the same data for the same steps (same seed,
same token order), then write DIR/results.json, DIR/results.md and DIR/curves.png.

Every preset trains in its own child process (``python -m moeify.cli.compare --child SPEC``),
so that its peak memory is its own (the child's max RSS from wait4 on CPU, its CUDA max allocated
on a GPU) and a crash in one run is reported without losing the others. After training, the
child scores the validation split (``--final-eval-tokens``; 0 = all of it) with XL memory
carried, and BLiMP when its data is found. The comparison itself is moeify.analysis.compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD_RESULT = "compare_child.json"
CHILD_LOG = "train.log"


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
                   "(default 20; 0 skips BLiMP)")
    p.add_argument("--blimp-data", help="BLiMP directory (default $MOEIFY_DATA_DIR/blimp)")
    p.add_argument("--last-k", type=int, default=3, help="validation points the ordering is "
                   "checked over (default 3)")
    p.add_argument("--reuse", action="store_true", help="keep runs that already finished in "
                   "OUT/runs with the same settings instead of refusing to overwrite them")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- parent


def _check(args) -> list[str]:
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    if len(presets) < 1 or len(set(presets)) != len(presets):
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


def _spec(preset: str, cfg, run_dir: Path, threads: int, args) -> dict:
    return {"preset": preset, "train_config": cfg.to_dict(), "run_dir": str(run_dir),
            "threads": threads, "final_eval_tokens": args.final_eval_tokens,
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


class _Scheduler:
    """Runs child processes, ``jobs`` at a time, with progress and ETA on stderr."""

    def __init__(self, specs: list[dict], steps: int, jobs: int, threads: int) -> None:
        self.queue = list(specs)
        self.steps, self.jobs, self.threads = steps, jobs, threads
        self.running: dict[int, tuple[subprocess.Popen, dict, float]] = {}
        self.done: dict[str, dict] = {}
        self.durations: list[float] = []
        self.total = len(specs)

    def _start(self, spec: dict) -> None:
        run_dir = Path(spec["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = run_dir / "compare_spec.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        log = open(run_dir / CHILD_LOG, "w")
        proc = subprocess.Popen([sys.executable, "-m", "moeify.cli.compare", "--child",
                                 str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env(spec["threads"]))
        log.close()
        self.running[proc.pid] = (proc, spec, time.time())
        n = self.total - len(self.queue)
        print(f"[compare] {n}/{self.total} started {spec['preset']} ({self.steps} steps, "
              f"{spec['threads']} thread(s)); log {run_dir / CHILD_LOG}", file=sys.stderr)

    def _eta(self) -> str:
        now = time.time()
        remaining = []
        for _, (proc, spec, t0) in self.running.items():
            step = _last_step(Path(spec["run_dir"]))
            rate = step / max(now - t0, 1e-9)
            est = (self.steps - step) / rate if step else (
                sum(self.durations) / len(self.durations) if self.durations else None)
            remaining.append(est)
        mean = (sum(self.durations) / len(self.durations)) if self.durations else None
        if mean is None:
            known = [r for r in remaining if r is not None]
            if not known:
                return "ETA unknown"
            mean = max(known) * 1.2  # training plus the final evaluation
        queued = len(self.queue) * mean / self.jobs
        longest = max([r for r in remaining if r is not None] or [0.0])
        return f"ETA {_fmt_s(longest + queued)}"

    def progress(self) -> None:
        parts = [f"{spec['preset']} step {_last_step(Path(spec['run_dir']))}/{self.steps}"
                 for _, (_, spec, _) in self.running.items()]
        print(f"[compare] {len(self.done)}/{self.total} done; running: {', '.join(parts)}; "
              f"{self._eta()}", file=sys.stderr, flush=True)

    def run(self, poll_s: float = 1.0, report_s: float = 30.0) -> dict[str, dict]:
        from moeify.errors import MoeifyError

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
                if got == 0:
                    continue
                proc, spec, t0 = self.running.pop(pid)
                proc.returncode = os.waitstatus_to_exitcode(status)
                log = Path(spec["run_dir"]) / CHILD_LOG
                if proc.returncode != 0:
                    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                    for p, _, _ in self.running.values():
                        p.terminate()
                    raise MoeifyError(f"training {spec['preset']} failed (exit "
                                      f"{proc.returncode}); the end of {log}:\n  "
                                      + "\n  ".join(tail))
                result = json.loads((Path(spec["run_dir"]) / CHILD_RESULT).read_text())
                result["max_rss_bytes"] = _max_rss_bytes(ru)
                (Path(spec["run_dir"]) / CHILD_RESULT).write_text(json.dumps(result, indent=2))
                self.durations.append(time.time() - t0)
                self.done[spec["preset"]] = result
                print(f"[compare] finished {spec['preset']} in {_fmt_s(time.time() - t0)}: "
                      f"valid {result['final_valid']}", file=sys.stderr, flush=True)
            if self.running and time.time() - last_report >= report_s:
                self.progress()
                last_report = time.time()
            time.sleep(poll_s)
        return self.done


def run(args) -> int:
    from moeify.analysis.compare import run_record, write_results
    from moeify.data import load_corpus
    from moeify.errors import MoeifyError

    presets = _check(args)
    cfgs = _train_configs(presets, args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    out = Path(args.out)
    specs, results = [], {}
    for p in presets:
        run_dir = out / "runs" / p
        spec = _spec(p, cfgs[p][0], run_dir, threads, args)
        old = run_dir / "compare_spec.json"
        if run_dir.exists() and any(run_dir.iterdir()):
            same = old.is_file() and json.loads(old.read_text()) == spec
            if args.reuse and same and (run_dir / CHILD_RESULT).is_file():
                results[p] = json.loads((run_dir / CHILD_RESULT).read_text())
                print(f"[compare] reusing the finished run {run_dir}", file=sys.stderr)
                continue
            raise MoeifyError(f"{run_dir} already holds a run; choose another --out, delete it, "
                              "or pass --reuse to keep finished runs with the same settings")
        specs.append(spec)
    load_corpus(args.data)  # prepare the corpus once, before the runs share it
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.time()
    results.update(_Scheduler(specs, args.steps, args.jobs, threads).run())
    rows = []
    for p in presets:
        r = results[p]
        cuda = r.get("cuda_peak_bytes")
        rows.append(run_record(
            p, out / "runs" / p, final_valid=r["final_valid"],
            peak_memory_bytes=cuda if cuda else r.get("max_rss_bytes"),
            peak_memory_kind="CUDA max allocated" if cuda else "max resident set size (RSS)",
            blimp=r.get("blimp"), listops=r.get("listops")))
    import torch

    cfg0 = cfgs[presets[0]][0]
    settings = {"presets": ",".join(presets), "data": args.data, "steps": args.steps,
                "seed": args.seed, "batch_size": cfg0.batch_size,
                "context_length": cfgs[presets[0]][1].context_length, "lr": cfg0.lr,
                "overrides": " ".join(args.overrides) or "none", "jobs": args.jobs,
                "threads_per_run": threads, "torch": torch.__version__,
                "device": results[presets[0]].get("device", "cpu"),
                "cpu_count": os.cpu_count(), "wall_s": round(time.time() - t0, 1),
                "load_avg_at_start": None if load is None else round(load[0], 2),
                "load_avg_at_end": round(os.getloadavg()[0], 2) if load else None}
    data = write_results(out, rows, settings, last_k=args.last_k)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}",
          file=sys.stderr)
    return 0 if data["results"] else 1


# ---------------------------------------------------------------------------- child


def child_main(spec_path: str) -> int:
    """Train one preset, score it, write CHILD_RESULT into its run directory."""
    import torch

    from moeify.data import load_corpus, tokenize_split
    from moeify.errors import MoeifyError
    from moeify.eval.blimp import blimp_accuracy, load_blimp
    from moeify.train.config import TrainConfig
    from moeify.train.rundir import load_trained
    from moeify.train.trainer import train
    from moeify.eval.adapters import evaluate_stream, stateless_logits_fn

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    cfg = TrainConfig.from_dict(spec["train_config"])
    run_dir = Path(spec["run_dir"])
    result = train(cfg, run_dir, quiet=True)
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
           "train_wall_s": result.wall_s, "trainer_tokens_per_s": result.tokens_per_s,
           "device": str(device),
           "cuda_peak_bytes": (torch.cuda.max_memory_allocated(device)
                               if device.type == "cuda" else None)}
    (run_dir / CHILD_RESULT).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2]))
    print("usage: moeify compare ... (this module's own entry point is for its child runs)",
          file=sys.stderr)
    sys.exit(2)
