"""Corpora from local files: a text file, a directory of text files, or C4/peS2o-style shards.

Text: a single file is split 90/5/5 at line starts. A directory whose file names carry split
names (``train``, ``valid``/``validation``/``val``, ``test``, as in WikiText's wiki.train.tokens
or train.txt) keeps those splits; a missing held-out split is carved from the other one (its two
halves at a line start), and a missing train split is an error. Any other directory is the
concatenation of its files in path order, split 90/5/5. ``.gz``/``.bz2``/``.xz`` files are
decompressed.

JSON shards: JSON-lines files (``.json``, ``.jsonl``, optionally ``.gz``) with a ``"text"``
field per line, the layout of C4 (c4-train.00000-of-01024.json.gz, c4-validation...) and peS2o
(train-00000-of-00020.json.gz, valid-...). Shard names select the split the same way. Documents
are separated by a blank line. Missing splits are carved per document, deterministically: with
no held-out shards at all, document i of the train shards goes to valid when i % 20 == 18 and to
test when i % 20 == 19 (5% each); with only one held-out split present, the other takes its
odd-numbered documents.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from moeify.data import cache
from moeify.data.recipe import SPLITS, Recipe, halve_lines, split_by_fraction, write_splits
from moeify.errors import MoeifyError

_JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_DOC_SEP = b"\n\n"


def split_of(name: str) -> str | None:
    """The split a file name designates, from its dot/dash/underscore-separated words."""
    words = set(re.split(r"[^a-z]+", name.lower()))
    if "train" in words:
        return "train"
    if words & {"valid", "validation", "val", "dev"}:
        return "valid"
    if "test" in words:
        return "test"
    return None


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _is_json(path: Path) -> bool:
    return path.name.lower().endswith(_JSON_SUFFIXES)


def recipe_for_path(path: Path) -> Recipe:
    path = path.expanduser()
    if path.is_dir():
        files = _files(path)
        if not files:
            raise MoeifyError(f"corpus directory {path} holds no files")
        if any(_is_json(p) for p in files):
            return JsonShards(name=f"json:{path.name}", description=f"JSON shards in {path}")
        return LocalText(name=f"text:{path.name}", description=f"text files in {path}")
    if _is_json(path):
        return JsonShards(name=f"json:{path.name}", description=f"JSON shard {path}")
    return LocalText(name=f"text:{path.name}", description=f"text file {path}")


class _LocalRecipe(Recipe):
    def cache_key(self, source: str | None) -> str:
        assert source is not None
        root = Path(source)
        files = _files(root) if root.is_dir() else [root]
        h = hashlib.sha1(str(root).encode())
        for p in files:
            st = p.stat()
            h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", root.name)[:40]
        return f"local-{slug}-{h.hexdigest()[:12]}"


def _read(path: Path) -> bytes:
    data = cache.read_maybe_compressed(path.read_bytes(), path.name.lower())
    check_text(data, path)
    return data


def check_text(data: bytes, path: Path) -> None:
    """Refuse what is not text (NUL bytes or invalid UTF-8), naming the file and the offset:
    training on an image or an archive by mistake would otherwise go unnoticed."""
    nul = data.find(b"\0")
    if nul < 0:
        try:
            data.decode("utf-8")
            return
        except UnicodeDecodeError as e:
            nul = e.start
    raise MoeifyError(f"{path} is not a text file (binary data at byte {nul}: not UTF-8 text); "
                      "--data takes text files (UTF-8), a directory of them, or JSON-lines "
                      "shards; remove it or point --data at the text")


@dataclass(frozen=True)
class LocalText(_LocalRecipe):
    def prepare(self, out: Path, source: str | None) -> None:
        assert source is not None
        root = Path(source)
        if root.is_file():
            write_splits(out, split_by_fraction(_read(root), align_lines=True))
            return
        files = _files(root)
        labelled: dict[str, list[Path]] = {s: [] for s in SPLITS}
        for p in files:
            split = split_of(p.name)
            if split is not None:
                labelled[split].append(p)
        if not any(labelled.values()):
            write_splits(out, split_by_fraction(_concat(files), align_lines=True))
            return
        if not labelled["train"]:
            raise MoeifyError(f"{root} has split-named files but none for train (e.g. "
                              "train.txt or wiki.train.tokens): add one or pass a single file")
        parts = {s: _concat(v) for s, v in labelled.items() if v}
        if "valid" not in parts and "test" not in parts:
            raise MoeifyError(f"{root} has a train file but no valid or test file: add one, or "
                              "pass the train file alone to split it 90/5/5")
        if "valid" not in parts:
            parts["valid"], parts["test"] = halve_lines(parts["test"])
        elif "test" not in parts:
            parts["valid"], parts["test"] = halve_lines(parts["valid"])
        write_splits(out, parts)


def _concat(files: list[Path]) -> bytes:
    chunks = []
    for p in files:
        data = _read(p)
        chunks.append(data if data.endswith(b"\n") or not data else data + b"\n")
    return b"".join(chunks)


@dataclass(frozen=True)
class JsonShards(_LocalRecipe):
    text_field: str = "text"

    def prepare(self, out: Path, source: str | None) -> None:
        assert source is not None
        root = Path(source)
        shards = [p for p in (_files(root) if root.is_dir() else [root]) if _is_json(p)]
        by_split: dict[str, list[Path]] = {s: [] for s in SPLITS}
        for p in shards:
            by_split[split_of(p.name) or "train"].append(p)
        if not by_split["train"]:
            raise MoeifyError(f"{root} has no train shards (names containing 'train', or "
                              "unlabelled shards): add some")
        has_valid, has_test = bool(by_split["valid"]), bool(by_split["test"])
        with cache.atomic_write(out / "train.txt") as f_train, \
                cache.atomic_write(out / "valid.txt") as f_valid, \
                cache.atomic_write(out / "test.txt") as f_test:
            sinks = {"train": _Sink(f_train), "valid": _Sink(f_valid), "test": _Sink(f_test)}
            for i, doc in enumerate(self._docs(by_split["train"])):
                if not has_valid and not has_test and i % 20 >= 18:
                    sinks["valid" if i % 20 == 18 else "test"].add(doc)
                else:
                    sinks["train"].add(doc)
            for split, other, present in (("valid", "test", has_test),
                                          ("test", "valid", has_valid)):
                for i, doc in enumerate(self._docs(by_split[split])):
                    sinks[other if (not present and i % 2 == 1) else split].add(doc)
        for split in SPLITS:
            if (out / f"{split}.txt").stat().st_size == 0:
                raise MoeifyError(f"the {split} split of {root} is empty: give more documents")

    def _docs(self, shards: list[Path]) -> Iterator[bytes]:
        for p in shards:
            cache.progress(f"reading {p.name}")
            with _open_lines(p) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError
                        raise MoeifyError(f"{p}:{lineno}: not a JSON line ({e}); shards must hold "
                                          "one JSON object per line") from e
                    if not isinstance(record, dict) or self.text_field not in record:
                        keys = list(record) if isinstance(record, dict) else type(record).__name__
                        raise MoeifyError(f"{p}:{lineno}: no {self.text_field!r} field (found "
                                          f"{keys}); C4/peS2o shards have one per document")
                    text = record[self.text_field]
                    if text:
                        yield str(text).encode("utf-8")


class _Sink:
    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.first = f, True

    def add(self, doc: bytes) -> None:
        if not self.first:
            self.f.write(_DOC_SEP)
        self.f.write(doc)
        self.first = False


def _open_lines(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    return io.open(path, "rb")
