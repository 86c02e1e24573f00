"""A Hugging Face ``tokenizers`` tokenizer (a checkpoint's tokenizer.json) behind moeify's
Tokenizer interface (moeify.data.tokenizer_base), for models imported from Hugging Face
checkpoints.

In a run directory the Hugging Face file is stored as ``hf_tokenizer.json`` (moeify's own
``tokenizer.json`` names the tokenizer kind). Text is encoded without special tokens (no BOS/EOS
inserted by the post-processor), as moeify scores and continues raw text; decoding keeps special
tokens. ``vocab_size`` is the model's vocabulary, which may exceed the tokenizer's (padded
embedding rows); a tokenizer with ids beyond it is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from moeify.data import cache
from moeify.data.tokenizer_base import Tokenizer
from moeify.errors import MoeifyError, install_hint

HF_TOKENIZER_FILE = "hf_tokenizer.json"


def import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise MoeifyError("Hugging Face tokenizers need the tokenizers package: "
                          + install_hint("hf")) from e
    return tokenizers


def _parse(data: bytes, where: str):
    tokenizers = import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the Rust library raises its own exception types
        raise MoeifyError(f"{where} is not a valid Hugging Face tokenizer file ({e}); save the "
                          "tokenizer with save_pretrained") from None


class HFTokenizer(Tokenizer):
    """A tokenizer.json's tokenizer for a model with ``vocab_size`` ids."""

    name = "hf"
    byte_level = False

    def __init__(self, data: bytes, vocab_size: int, *, where: str = HF_TOKENIZER_FILE) -> None:
        self._data = data
        self.tok = _parse(data, where)
        n = int(self.tok.get_vocab_size(with_added_tokens=True))
        # Ids need not be contiguous: the largest one, not the count, must fit the embedding.
        top = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if max(n, top + 1) > vocab_size:
            raise MoeifyError(f"{where}: the tokenizer has {n} tokens with ids up to {top}, but "
                              f"the model's embedding has {vocab_size} rows (ids 0 to "
                              f"{vocab_size - 1}); use the tokenizer saved with this model")
        self.vocab_size = int(vocab_size)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int) -> "HFTokenizer":
        path = Path(path)
        if not path.is_file():
            raise MoeifyError(f"{path} is missing: the run's Hugging Face tokenizer file")
        return cls(path.read_bytes(), vocab_size, where=str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        return "hf-" + hashlib.sha1(self._data).hexdigest()[:12]

    def config(self) -> dict:
        return {"hf_file": HF_TOKENIZER_FILE, "vocab_size": self.vocab_size}

    @property
    def json_bytes(self) -> bytes:
        return self._data

    def save(self, directory: str | Path) -> Path:
        Path(directory).mkdir(parents=True, exist_ok=True)
        cache.write_bytes_atomic(Path(directory) / HF_TOKENIZER_FILE, self._data)
        return super().save(directory)
