"""Run directories: their layout, writing and reading them both ways, the lock that keeps one
writer per run, and loading a trained model from them.

One package that training, evaluation, analysis and interop all write and read runs through; it
sits above models and data and below train / eval / analysis / interop, so analysis reads and
interop writes checkpoints without importing train.

    RUN/config.json                      the resolved TrainConfig (as a dict)
    RUN/model.json                       the resolved ModelConfig (vocabulary = the tokenizer's)
    RUN/tokenizer.json (+ model files)   moeify.data.tokenizers.load_tokenizer
    RUN/metrics.jsonl                    {"kind": "train" | "valid", "step", "tokens", ...}
    RUN/checkpoints/latest               name of the newest checkpoint
    RUN/checkpoints/step-00000100/       one complete checkpoint, either kind:
        model.safetensors, state.pt      single-file (moeify.rundir.write)   
        dcp/, state.pt                   sharded, one file per process (moeify.rundir.sharded)
        meta.json                        step, model config, sha256 of every file; written last

Its modules:
    layout       file names, checkpoint names, finding checkpoints (``latest_checkpoint``)
    atomic       durable writes (fsync, atomic replace) and checksums
    files        the run's JSON files: reading, validating, writing them
    checkpoints  reading and verifying a checkpoint of either kind
    write        writing single-file checkpoints atomically; publishing, pruning, setting aside
    sharded      writing and restoring sharded (DCP) checkpoints, collectively
    lock         RunLock: one writer per run directory
    model        ``load_trained``: a run's model with its tokenizer, in eval mode
"""

from moeify.rundir.files import (check_run_dir, read_metrics, read_model_config,  # noqa: F401
                                 read_train_config_dict)
from moeify.rundir.layout import latest_checkpoint, resolve_checkpoint  # noqa: F401
from moeify.rundir.model import TrainedModel, load_trained  # noqa: F401
