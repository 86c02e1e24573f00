"""The child side of compare and sweep: ``python -m moeify.sweep.child --child SPEC`` trains
(or resumes) the run the spec describes, scores the validation split (``final_eval_tokens``;
0 = all of it) with XL memory carried, BLiMP when asked and its data is found, and ListOps
accuracy on a ListOps corpus, then writes CHILD_RESULT into the run directory. The parent
(moeify.sweep.scheduler) reads nothing else."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

from moeify.data import load_corpus, tokenize_split
from moeify.data.corpora import resolve_recipe
from moeify.data.listops import ListOpsRecipe, listops_accuracy, load_examples
from moeify.errors import MoeifyError, env_flag, error_line
from moeify.eval import adapters
from moeify.eval.blimp import blimp_accuracy, load_blimp
from moeify.rundir import load_trained
from moeify.rundir.layout import latest_checkpoint, step_of
from moeify.sweep.protocol import (CHILD_ERROR, CHILD_RESULT, CHILD_TRAINED, max_rss_bytes,
                                   parent_from_env, stop_with_parent, write_json)
from moeify.train.config import TrainConfig
from moeify.train.trainer import train


def train_child(spec: dict, cfg: TrainConfig, run_dir: Path) -> tuple[dict | None, int]:
    """Train (or resume) the child's run: (its training time and memory {"train_wall_s",
    "trainer_tokens_per_s", "max_rss_bytes"}, 0), or (None, the trainer's exit code) when a
    signal stopped the training (the trainer has then checkpointed the step it finished; the
    next sweep or compare resumes from there, and no result is written for a half-trained
    model). A run whose checkpoints already hold every step (its child was stopped while
    scoring) is not trained again: its time and peak memory are the ones recorded when its
    training finished (None if that record is missing), not those of the child that only
    scores it."""
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
              "max_rss_bytes": max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF))}
    write_json(trained, timing)
    return timing, 0


def child_main(spec_path: str) -> int:
    """Train one preset, score it, write CHILD_RESULT into its run directory (``train_child``:
    a child stopped by a signal while training returns 128 + the signal without a result, and
    a run whose checkpoints already hold every step is scored without training)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    cfg = TrainConfig.from_dict(spec["train_config"])
    run_dir = Path(spec["run_dir"])
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    timing, code = train_child(spec, cfg, run_dir)
    if timing is None:
        return code
    tm = load_trained(run_dir)
    device = next(tm.model.parameters()).device
    logits_fn = adapters.stateless_logits_fn(tm.model, device)
    tokens = tokenize_split(load_corpus(cfg.data), tm.tokenizer, "valid")
    final = adapters.evaluate_stream(tm.model, tokens, tm.tokenizer,
                                     seq_len=tm.model_config.context_length,
                                     batch_size=cfg.eval_batch_size,
                                     max_tokens=spec["final_eval_tokens"])
    blimp = {"error": "skipped (--blimp-per-paradigm 0)"}
    if spec["blimp_per_paradigm"]:
        try:
            pairs = load_blimp(spec["blimp_data"], limit_per_paradigm=spec["blimp_per_paradigm"],
                               flag="--blimp-data")
            res = blimp_accuracy(logits_fn, tm.tokenizer, pairs)
            blimp = {"accuracy": res["accuracy"], "pairs": res["pairs"]}
        except MoeifyError as e:
            blimp = {"error": str(e)}
    listops = None
    if isinstance(resolve_recipe(cfg.data)[0], ListOpsRecipe):
        corpus = load_corpus(cfg.data)
        seen = {e.expression for e in load_examples(corpus, "train")}
        listops = listops_accuracy(logits_fn, tm.tokenizer,
                                   load_examples(corpus, "valid"), train_expressions=seen)
    out = {"preset": spec["preset"], "final_valid": final, "blimp": blimp, "listops": listops,
           **timing,
           "device": str(device), "torch": torch.__version__, "threads": spec["threads"],
           "load_avg": None if load0 is None else [round(load0, 2), round(os.getloadavg()[0], 2)],
           "cuda_peak_bytes": (torch.cuda.max_memory_allocated(device)
                               if device.type == "cuda" else None)}
    write_json(run_dir / CHILD_RESULT, out)
    return 0


def child_entry(spec_path: str) -> int:
    """child_main with the CLI's error handling: an error the user can act on (a full disk, a
    bad setting) is one ``error:`` line in the log for the parent to quote, exit 2."""
    try:
        return child_main(spec_path)
    except (MoeifyError, ValueError, OSError) as e:
        if env_flag("MOEIFY_DEBUG"):
            raise
        print(f"{CHILD_ERROR} {error_line(e)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        stop_with_parent(parent_from_env())  # no training left behind by a killed parent
        sys.exit(child_entry(sys.argv[2]))
    print("usage: python -m moeify.sweep.child --child SPEC (moeify compare and moeify sweep "
          "start it)", file=sys.stderr)
    sys.exit(2)
