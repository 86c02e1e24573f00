"""Dataset and document helpers for lm-eval task configs (``!function utils.NAME``).

``local_json`` is a config's ``custom_dataset``: datasets' json builder on the files that
``dataset_kwargs.data_files`` names, relative paths resolved under $MOEIFY_DATA_DIR (the layout
of moeify.eval.paths), so task definitions can ship without their data and the data stays where
the user keeps it. Nothing is downloaded. The bundled tasks' harness_tasks/utils.py re-exports
these; a user's task directory can do the same with a one-line utils.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeify.errors import MoeifyError, read_utf8
from moeify.eval.lambada import split_passage
from moeify.eval.paths import DATA_DIR_ENV, data_dir


def resolve_data_files(data_files: str | dict[str, str]) -> dict[str, str]:
    """{split: absolute path}; a bare string is the test split."""
    files = data_files if isinstance(data_files, dict) else {"test": data_files}
    root = data_dir()
    out = {}
    for split, name in files.items():
        p = Path(name).expanduser()
        if not p.is_absolute():
            if root is None:
                raise MoeifyError(f"harness task data {name} is read from ${DATA_DIR_ENV}, which "
                                  f"is not set: set it (or pass --data-dir) to the directory "
                                  f"holding {Path(name).parts[0]}/")
            p = root / p
        if not p.is_file():
            raise MoeifyError(f"harness task data not found: {p} (set ${DATA_DIR_ENV} or "
                              "--data-dir to the directory laid out like moeify's data directory)")
        check_json_lines(p)
        out[split] = str(p)
    return out


def check_json_lines(path: Path) -> None:
    """Every non-empty line of a JSON-lines file is a JSON object: datasets' json builder
    would fail on a corrupt one with a traceback of its own, without naming the line."""
    for lineno, line in enumerate(read_utf8(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError as e:
            raise MoeifyError(f"{path}:{lineno}: not a JSON line ({e.msg}: column "
                              f"{e.colno}); fix or remove that line") from None
        if not ok:
            raise MoeifyError(f"{path}:{lineno}: not a JSON object; each line must be one "
                              "record such as {\"text\": ...}")


def local_json(data_files: str | dict[str, str] = "", **_metadata):
    import datasets

    return datasets.load_dataset("json", data_files=resolve_data_files(data_files))


# LAMBADA: the passage split exactly as `moeify eval --task lambada` splits it (the context, and
# the last word with the whitespace before it).
def lambada_context(doc: dict) -> str:
    return split_passage(doc["text"])[0]


def lambada_target(doc: dict) -> str:
    return split_passage(doc["text"])[1]


# BLiMP: a pair counts when the good sentence scores strictly higher (as
# `moeify eval --task blimp` counts it). lm-eval's multiple-choice argmax would count a tie as
# correct; the release has 7 pairs whose two sentences are identical.
def blimp_strict(doc: dict, results: list) -> dict:
    good, bad = (r[0] if isinstance(r, (tuple, list)) else r for r in results)
    return {"acc": float(good > bad)}
