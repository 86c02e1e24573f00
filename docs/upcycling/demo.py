"""Upcycling demonstration: a dense model trained N steps, upcycled to SwitchHead and to
SwitchAll (SwitchHead + sigma-MoE), trained M more steps; beside it the dense model trained the
same M more steps (fresh optimizer and schedule, like the upcycled runs) and both MoE models
trained from scratch for N + M steps.

    MOEIFY_DATA_DIR=/path/to/data python docs/upcycling/demo.py all       # everything, in order
    python docs/upcycling/demo.py dense upcycled      # the dense chain only
    python docs/upcycling/demo.py dense+              # one of its runs (also switchhead-up,
                                                      # switchall-up), e.g. in parallel
    python docs/upcycling/demo.py scratch             # the from-scratch runs only
    python docs/upcycling/demo.py report              # table (results.md, results.json), plot
    python docs/upcycling/demo.py moh moh-report      # attention upcycling into MoH beside
                                                      # SwitchHead (results-moh.md / .json)

The stages print the moeify commands they run. Every run is one process with one thread under
nice -n 10. Runs go to $RUNS (default runs/upcycling); a finished run is not trained again.
DEMO_N and DEMO_M change N and M (300 each). The report is written beside this script
(docs/upcycling/results.md, results.json, curves.png: the committed results) only for the
committed settings; with others it goes to $RUNS/report, or to --report-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

N = int(os.environ.get("DEMO_N", 300))
M = int(os.environ.get("DEMO_M", 300))
RUNS = Path(os.environ.get("RUNS", "runs/upcycling"))
HERE = Path(__file__).resolve().parent
PRESET = "repro-dense"
ATTENTION = "switchhead:E=4,k=2"
FF = "sigma-moe:E=8,k=2"
# Validation during training for the curves (16k tokens every 100 steps); the table's numbers
# come from one evaluation of every final checkpoint on the same 65,536 validation tokens.
EVAL = ["--set", "eval_every=100", "--set", "eval_tokens=16384"]
TRAIN = [*EVAL, "--quiet"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

RUN_NAMES = {
    "dense": f"dense-{N}",
    "dense+": f"dense-{N}+{M}",
    "switchhead-up": f"switchhead-upcycled-{N}+{M}",
    "switchall-up": f"switchall-upcycled-{N}+{M}",
    "switchhead-scratch": f"switchhead-scratch-{N + M}",
    "switchall-scratch": f"switchall-scratch-{N + M}",
}


def run_dir(key: str) -> Path:
    return RUNS / RUN_NAMES[key]


def moeify(*args: str) -> None:
    cmd = ["nice", "-n", "10", sys.executable, "-m", "moeify.cli.main", *args]
    print("$ moeify " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run(cmd, check=True, env=ENV)


def finished(key: str, steps: int) -> bool:
    latest = run_dir(key) / "checkpoints" / "latest"
    return latest.is_file() and latest.read_text().strip() == f"step-{steps:08d}"


def evaluate(key: str) -> None:
    """The table's bpc of a finished run, computed now so that the report need not wait."""
    from report import eval_bpc

    print(f"# {RUN_NAMES[key]}: validation bpc {eval_bpc(run_dir(key)):.4f}", flush=True)


def stage_dense() -> None:
    if not finished("dense", N):
        moeify("train", "--preset", PRESET, "--steps", str(N), "--out", str(run_dir("dense")),
               *TRAIN)
    evaluate("dense")


def _upcycle(key: str, *conversion: str) -> None:
    if not (run_dir(key) / "checkpoints").is_dir():
        moeify("upcycle", "--run", str(run_dir("dense")), "--out", str(run_dir(key)),
               "--steps", str(M), *EVAL, *conversion)
    if not finished(key, M):
        moeify("train", "--resume", str(run_dir(key)), *TRAIN)
    evaluate(key)


def _continue(dense: Path, out: Path, steps: int) -> None:
    """The dense model trained ``steps`` more steps from a step-0 checkpoint of its weights,
    with the upcycled runs' recipe (fresh AdamW, warm-up and cosine over the new steps)."""
    import dataclasses

    from moeify.rundir import load_trained
    from moeify.train.config import read_train_config
    from moeify.train.start import start_run_from_model

    if not (out / "checkpoints").is_dir():
        print(f"# start {out} from the weights of {dense} (fresh optimizer)")
        src = load_trained(dense)
        cfg = dataclasses.replace(read_train_config(src.run_dir), steps=steps,
                                  model=src.model_config.to_dict(), model_overrides=(),
                                  eval_every=100, eval_tokens=16384)
        start_run_from_model(cfg, out, src.model, src.tokenizer)
    latest = out / "checkpoints" / "latest"
    if latest.read_text().strip() != f"step-{steps:08d}":
        moeify("train", "--resume", str(out), *TRAIN)


def _continue_dense() -> None:
    _continue(run_dir("dense"), run_dir("dense+"), M)
    evaluate("dense+")


def stage_upcycled() -> None:
    _upcycle("switchhead-up", "--attention", ATTENTION)
    _upcycle("switchall-up", "--attention", ATTENTION, "--ff", FF)
    _continue_dense()


def _architecture(**conversions: str) -> dict:
    """The upcycled models' ModelConfig (the same architecture, trained from scratch)."""
    from moeify.models.presets import get_preset
    from moeify.models.upcycle import upcycle

    return upcycle(get_preset(PRESET).build(), **conversions).config.to_dict()


def stage_scratch() -> None:
    from moeify.train.config import TrainConfig

    for key, conv in (("switchhead-scratch", {"attention": ATTENTION}),
                      ("switchall-scratch", {"attention": ATTENTION, "feedforward": FF})):
        if finished(key, N + M):
            evaluate(key)
            continue
        model = _architecture(**conv)
        cfg = TrainConfig(preset=key, model=model, steps=N + M, eval_every=100,
                          eval_tokens=16384)
        code = ("import json,sys; from moeify.train.config import TrainConfig; "
                "from moeify.train.trainer import train; "
                "train(TrainConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], "
                "resume=bool(int(sys.argv[3])), quiet=True)")
        resume = (run_dir(key) / "checkpoints").is_dir()
        print(f"# train {key} from scratch: TrainConfig(model=<upcycled architecture>, "
              f"steps={N + M})", flush=True)
        subprocess.run(["nice", "-n", "10", sys.executable, "-c", code, json.dumps(cfg.to_dict()),
                        str(run_dir(key)), str(int(resume))], check=True, env=ENV)
        evaluate(key)


# ---------------------------------------------------------------------------- MoH
# Attention upcycling into MoH beside SwitchHead, on a dense RoPE model (MoH's models use RoPE):
# repro-rope-dense trained MOH_N steps, each conversion trained MOH_M more, small enough for
# about 15 minutes on one core. `python docs/upcycling/demo.py moh` (then `moh-report`).
MOH_N = int(os.environ.get("DEMO_MOH_N", 300))
MOH_M = int(os.environ.get("DEMO_MOH_M", 60))
MOH_PRESET = "repro-rope-dense"
MOH_CONVERSIONS = {  # key -> attention conversion (8 dense heads of 16)
    "switchhead-up": "switchhead:E=4,k=2",
    "moh-up": "moh:shared=4,k=2",
    "moh-qnorm-up": "moh:shared=4,k=2,router=query_norm",
    "moh-all-up": "moh:shared=4,k=4,router_scale=0",
}
MOH_RUN_NAMES = {"dense": f"dense-{MOH_N}", "dense+": f"dense-{MOH_N}+{MOH_M}",
                 **{key: f"{key.removesuffix('-up')}-upcycled-{MOH_N}+{MOH_M}"
                    for key in MOH_CONVERSIONS}}


def moh_run(key: str) -> Path:
    return RUNS / "moh" / MOH_RUN_NAMES[key]


def stage_moh() -> None:
    """The dense RoPE model, its conversions and its own continuation; the bpc right after
    each conversion and at the end on the same validation tokens (report.eval_bpc)."""
    from report import eval_bpc

    dense = moh_run("dense")
    latest = dense / "checkpoints" / "latest"
    if not (latest.is_file() and latest.read_text().strip() == f"step-{MOH_N:08d}"):
        moeify("train", "--preset", MOH_PRESET, "--steps", str(MOH_N), "--out", str(dense),
               *TRAIN)
    print(f"# {dense.name}: validation bpc {eval_bpc(dense):.4f}", flush=True)
    for key, conversion in MOH_CONVERSIONS.items():
        run = moh_run(key)
        if not (run / "checkpoints").is_dir():
            moeify("upcycle", "--run", str(dense), "--out", str(run), "--steps", str(MOH_M),
                   *EVAL, "--attention", conversion)
            print(f"# {run.name} right after upcycling: validation bpc {eval_bpc(run):.4f}",
                  flush=True)
        latest = run / "checkpoints" / "latest"
        if latest.read_text().strip() != f"step-{MOH_M:08d}":
            moeify("train", "--resume", str(run), *TRAIN)
        print(f"# {run.name}: validation bpc {eval_bpc(run):.4f}", flush=True)
    _continue(dense, moh_run("dense+"), MOH_M)
    print(f"# {moh_run('dense+').name}: validation bpc {eval_bpc(moh_run('dense+')):.4f}")


STAGES = ("all", "dense", "upcycled", "dense+", "switchhead-up", "switchall-up", "scratch",
          "report", "moh", "moh-report")
# The settings of the committed results beside this script.
COMMITTED = {"N": 300, "M": 300}


def report_dir(given: str | None) -> Path:
    """Where the report goes: --report-dir, else beside this script for the committed settings
    (it rewrites the committed results), else $RUNS/report (never over the committed ones)."""
    if given is not None:
        return Path(given)
    return HERE if {"N": N, "M": M} == COMMITTED else RUNS / "report"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="docs/upcycling/demo.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="*", metavar="STAGE",
                        help=f"what to run, in order: {', '.join(STAGES)} (default: all)")
    parser.add_argument("--report-dir", help="where the report stage writes results.md, "
                        "results.json and curves.png (default: see above)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:  # (choices= with nargs="*" refuses an empty list on Python 3.11)
        parser.error(f"unknown stage {unknown[0]!r}: choose from {', '.join(STAGES)}")
    stages = args.stages or ["all"]
    RUNS.mkdir(parents=True, exist_ok=True)
    for s in stages:
        if s in ("dense", "all"):
            stage_dense()
        if s in ("upcycled", "all"):
            stage_upcycled()
        if s == "switchhead-up":
            _upcycle("switchhead-up", "--attention", ATTENTION)
        if s == "switchall-up":
            _upcycle("switchall-up", "--attention", ATTENTION, "--ff", FF)
        if s == "dense+":
            _continue_dense()
        if s in ("scratch", "all"):
            stage_scratch()
        if s == "moh":
            stage_moh()
        if s == "moh-report":
            from report import report_moh

            out = Path(args.report_dir) if args.report_dir else (
                HERE if (MOH_N, MOH_M) == (300, 60) else RUNS / "moh" / "report")
            out.mkdir(parents=True, exist_ok=True)
            report_moh(RUNS / "moh", MOH_RUN_NAMES, MOH_CONVERSIONS, MOH_N, MOH_M, out)
        if s in ("report", "all"):
            from report import report  # docs/upcycling/report.py

            out = report_dir(args.report_dir)
            out.mkdir(parents=True, exist_ok=True)
            print(f"# report -> {out}", flush=True)
            report(RUNS, RUN_NAMES, N, M, out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
