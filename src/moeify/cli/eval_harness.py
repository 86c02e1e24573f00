"""``moeify eval --harness TASK[,TASK]``: lm-evaluation-harness tasks on a run, offline.

The tasks come from moeify's bundled local definitions (moeify/interop/harness_tasks: LAMBADA
and BLiMP read from $MOEIFY_DATA_DIR) and from the user's ``--harness-include`` directories;
lm-eval's own task registry is not consulted, since its tasks fetch their data from the hub.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

HF_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
# Bootstrap resamples for the stderr of non-mean metrics (LAMBADA perplexity); lm-eval's CLI
# uses 100000, which costs more than scoring a small model.
BOOTSTRAP_ITERS = 1000


def add_arguments(p) -> None:
    p.add_argument("--harness", metavar="TASK[,TASK]",
                   help="run lm-evaluation-harness tasks instead of --task (needs "
                   "pip install -e '.[harness]'): moeify_lambada, moeify_blimp (the group), "
                   "moeify_blimp_<paradigm>, or tasks defined in --harness-include directories; "
                   "offline, data from --data-dir or $MOEIFY_DATA_DIR; --limit is per task (per "
                   "paradigm for BLiMP)")
    p.add_argument("--harness-include", metavar="DIR", action="append", default=[],
                   help="a directory of lm-eval task YAML files to add (repeatable)")
    p.add_argument("--harness-out", metavar="FILE", help="where to write the harness results "
                   "JSON (default RUN/harness/<checkpoint>-<tasks>.json)")


def go_offline() -> None:
    """Keep the Hugging Face libraries under lm-eval off the network: the variables they read at
    import, and the flags of those already imported."""
    os.environ.update(HF_OFFLINE)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap would fork workers
    for module, flags in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                          ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        mod = sys.modules.get(module)
        for flag in flags:
            if mod is not None and hasattr(mod, flag):
                setattr(mod, flag, True)


def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--harness needs at least one task name, e.g. --harness moeify_lambada")
    return tasks


def check_tasks(tasks: list[str], known: list[str]) -> None:
    unknown = [t for t in tasks if t not in known]
    if unknown:
        local = [t for t in known if not t.startswith("moeify_blimp_")]
        raise ValueError(f"unknown harness task {', '.join(unknown)}: known tasks are "
                         f"{', '.join(local)} and moeify_blimp_<paradigm>; add your own with "
                         "--harness-include DIR")


def default_out(run_dir, checkpoint: str, tasks: list[str], limit: int | None):
    from pathlib import Path

    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(tasks))[:120]
    suffix = f"-limit{limit}" if limit else ""
    return Path(run_dir) / "harness" / f"{checkpoint}-{name}{suffix}.json"


def run_harness(args) -> int:
    if args.task is not None or args.data is not None:
        raise ValueError("--harness replaces --task and --data: the task configs name their "
                         "files (point them at your data with --data-dir or $MOEIFY_DATA_DIR)")
    tasks = parse_tasks(args.harness)
    if args.data_dir is None:
        return _run_harness(args, tasks)
    # The task configs read the data directory from the environment: set for this command only
    # (a caller in the same process, e.g. a test or a notebook, keeps its own).
    old = os.environ.get("MOEIFY_DATA_DIR")
    os.environ["MOEIFY_DATA_DIR"] = str(Path(args.data_dir).expanduser())
    try:
        return _run_harness(args, tasks)
    finally:
        if old is None:
            os.environ.pop("MOEIFY_DATA_DIR", None)
        else:
            os.environ["MOEIFY_DATA_DIR"] = old


def _run_harness(args, tasks) -> int:
    import json
    import logging

    go_offline()
    from moeify.interop.harness import MoeifyLM, local_task_manager

    task_manager = local_task_manager(args.harness_include)
    check_tasks(tasks, task_manager.all_tasks)

    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table

    from moeify.train.distributed import DistEnv, configure_cpu_threads, pick_device
    from moeify.rundir import load_trained
    from moeify.train.trainer import resolve_amp

    device = pick_device(args.device, DistEnv())
    if device.type == "cpu":
        configure_cpu_threads()
    tm = load_trained(args.run, device)
    lm = MoeifyLM.from_model(tm.model, tm.tokenizer, device=device, batch_size=args.batch_size,
                             amp_dtype=resolve_amp("auto", device)[0])
    from moeify.train.progress import CountProgress

    shown: dict[str, CountProgress] = {}

    def progress(label: str, done: int, total: int) -> None:
        if label not in shown:
            shown[label] = CountProgress(f"harness {label}", "requests",
                                         enabled=not args.quiet)
        shown[label](done, total)

    lm.progress = progress
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # one warning per task otherwise
    with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress: stdout is ours
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager,
                                      limit=args.limit, log_samples=False,
                                      bootstrap_iters=BOOTSTRAP_ITERS)
    out = {"run": str(tm.run_dir), "checkpoint": tm.checkpoint.path.name,
           "step": tm.checkpoint.step, "harness": tasks, "limit": args.limit,
           "lm_eval": lm_eval.__version__,
           **{k: res.get(k, {}) for k in ("results", "groups", "group_subtasks", "n-samples",
                                           "versions", "higher_is_better")}}
    path = Path(args.harness_out) if args.harness_out else default_out(
        tm.run_dir, tm.checkpoint.path.name, tasks, args.limit)
    text = json.dumps(out, indent=2, default=handle_non_serializable)
    # The results first: a run directory that cannot be written must not lose the evaluation.
    if args.json:
        print(text, flush=True)
    else:
        print(make_table(res))
        if res.get("groups"):
            print(make_table(res, "groups"))
        sys.stdout.flush()
    written = write_results(path, (text + "\n").encode(), explicit=args.harness_out is not None,
                            run_name=tm.run_dir.name)
    if not args.json:
        print(f"wrote {written}")
    return 0


def write_results(path: Path, data: bytes, *, explicit: bool, run_name: str) -> Path:
    """Write the results JSON to ``path``; where the run directory cannot be written (a
    read-only run, a full disk) and ``path`` is the default, to a named writable place
    instead: the current directory, else the moeify cache; saying so, and naming
    --harness-out. The user's own --harness-out is not replaced: its error is raised."""
    from moeify.data.cache import cache_subdir, write_bytes_atomic
    from moeify.errors import MoeifyError, describe_os_error

    def write(p: Path) -> Path:
        p.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(p, data)
        return p

    try:
        return write(path)
    except OSError as e:
        if explicit:
            raise
        first = describe_os_error(e)
    name = f"harness-{run_name}-{path.name}"
    tried = []
    for place in (lambda: Path.cwd() / name, lambda: cache_subdir("harness") / name):
        try:
            candidate = place()
            written = write(candidate)
        except (OSError, MoeifyError) as e:
            tried.append(describe_os_error(e) if isinstance(e, OSError) else str(e))
            continue
        print(f"note: the results could not be written into the run ({first}); wrote them "
              f"to {written} instead (choose the file with --harness-out FILE)",
              file=sys.stderr)
        return written
    raise MoeifyError(f"the results (printed above) could not be written: {first}; nor "
                      f"beside it: {'; '.join(tried)}; pass --harness-out FILE")
