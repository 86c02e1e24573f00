"""Where the evaluation data lives: an explicit path, or under $MOEIFY_DATA_DIR.

$MOEIFY_DATA_DIR is laid out like the project's shared data directory:

    blimp/*.jsonl                       BLiMP, one file per paradigm
    lambada/lambada_test.jsonl          LAMBADA test set, {"text": ...} per line
    cbt/cbtest_{CN,NE,P,V}_test_2500ex.txt   Children's Book Test (the official test files)

The data is never downloaded at evaluation time; a missing file is a MoeifyError that says where
to put it and where to get it.
"""

from __future__ import annotations

import os
from pathlib import Path

from moeify.errors import MoeifyError

DATA_DIR_ENV = "MOEIFY_DATA_DIR"

# task -> (path under the data directory, what it is, where to get it)
TASK_DATA = {
    "blimp": ("blimp", "a directory of BLiMP paradigm files (*.jsonl)",
              "https://github.com/alexwarstadt/blimp (data/*.jsonl)"),
    "lambada": ("lambada/lambada_test.jsonl", "the LAMBADA test set as JSON lines",
                "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"),
    "cbt": ("cbt", "a directory with cbtest_{CN,NE,P,V}_test_2500ex.txt",
            "the CBTest release of the bAbI project (CBTest/data/)"),
}


def data_dir() -> Path | None:
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else None


def locate(task: str, path: str | Path | None = None, *, flag: str = "--data") -> Path:
    """The data of ``task``: ``path`` when given (it must exist), else under $MOEIFY_DATA_DIR.
    ``flag``: the option that gives the path, named in the error (``--blimp-data`` in compare
    and sweep)."""
    if task not in TASK_DATA:
        raise ValueError(f"unknown task {task!r}: choose one of {', '.join(TASK_DATA)}")
    sub, what, origin = TASK_DATA[task]
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise MoeifyError(f"{task} data not found at {p}: give the path of {what} "
                              f"(get it from {origin})")
        return p
    root = data_dir()
    if root is None:
        raise MoeifyError(f"{task} data not found: pass its path ({flag} PATH) or set "
                          f"{DATA_DIR_ENV} to a directory holding {sub} ({what}; get it from "
                          f"{origin})")
    p = root / sub
    if not p.exists():
        raise MoeifyError(f"{task} data not found: {DATA_DIR_ENV}={root} has no {sub}. Put "
                          f"{what} there (get it from {origin}) or pass its path ({flag} PATH)")
    return p
