"""What every corpus recipe shares: the prepared ``Corpus``, the ``Recipe`` base, and the split
helpers (moeify.data.corpora holds the named recipes, moeify.data.local the local-path ones)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from moeify.data import cache
from moeify.errors import MoeifyError

SPLITS = ("train", "valid", "test")
# enwik8 / text8 convention (Transformer-XL's prep_enwik8.py, Mikolov's text8 split): valid and
# test are 5% each.
HELD_OUT_FRACTION = 0.05


@dataclass(frozen=True)
class Corpus:
    """A prepared corpus: three split files in the cache.

    ``byte_level`` says the corpus is scored in bits per byte with a byte tokenizer by convention
    (enwik8-style data); it does not restrict which tokenizer may be used."""

    name: str
    key: str
    root: Path
    byte_level: bool

    def path(self, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
        return self.root / f"{split}.txt"

    def read_bytes(self, split: str) -> bytes:
        return self.path(split).read_bytes()

    def read_text(self, split: str) -> str:
        return self.read_bytes(split).decode("utf-8", errors="replace")

    def num_bytes(self, split: str) -> int:
        return self.path(split).stat().st_size


# ----------------------------------------------------------------------------- split helpers

def split_by_fraction(data: bytes, *, align_lines: bool,
                      held_out: float = HELD_OUT_FRACTION) -> dict[str, bytes]:
    """train/valid/test = the first 1 - 2*held_out, the next held_out, the last held_out of
    ``data``; with ``align_lines`` each boundary moves forward to the next line start."""
    n = len(data)
    n_held = int(n * held_out)
    cuts = [n - 2 * n_held, n - n_held]
    if align_lines:
        for i, c in enumerate(cuts):
            nl = data.find(b"\n", c - 1) if c > 0 else -1
            if nl != -1 and nl + 1 < n:
                cuts[i] = nl + 1
        cuts[1] = max(cuts[1], cuts[0])
    parts = {"train": data[:cuts[0]], "valid": data[cuts[0]:cuts[1]], "test": data[cuts[1]:]}
    empty = [k for k, v in parts.items() if not v]
    if empty:
        raise MoeifyError(f"the corpus ({n} bytes) is too small to split into train/valid/test "
                          f"({', '.join(empty)} would be empty): give it more text")
    return parts


def halve_lines(data: bytes) -> tuple[bytes, bytes]:
    """Split held-out text into two halves at a line start (to carve a missing split)."""
    mid = len(data) // 2
    nl = data.find(b"\n", mid)
    cut = nl + 1 if nl != -1 and nl + 1 < len(data) else mid
    return data[:cut], data[cut:]


def write_splits(out: Path, parts: dict[str, bytes]) -> None:
    for split in SPLITS:
        cache.write_bytes_atomic(out / f"{split}.txt", parts[split])


# ----------------------------------------------------------------------------- recipes

@dataclass(frozen=True)
class Recipe:
    """How to obtain one corpus. ``prepare`` writes train.txt/valid.txt/test.txt into ``out``.

    ``source`` overrides where the raw data comes from (a local archive or file, or a URL)."""

    name: str
    description: str
    byte_level: bool = False

    def cache_key(self, source: str | None) -> str:
        if source is None:
            return self.name
        return f"{self.name}-{hashlib.sha1(source_identity(source).encode()).hexdigest()[:12]}"

    def prepare(self, out: Path, source: str | None) -> None:
        raise NotImplementedError


def source_identity(source: str) -> str:
    p = Path(source).expanduser()
    if p.exists():
        st = p.stat()
        return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return source
