"""The interface every tokeniser implements (moeify.data.tokenizers builds and loads them by
name; moeify.data.gpt2_bpe is one of them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from moeify.data import cache

META = "tokenizer.json"


class Tokenizer:
    """Base class; subclasses set ``name`` and ``vocab_size`` and implement the methods."""

    name: str = "tokenizer"
    vocab_size: int = 0
    byte_level: bool = False

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_array(self, data: bytes) -> np.ndarray:
        """Tokens of a block of UTF-8 text as an int64 array (bulk path for token streams)."""
        return np.asarray(self.encode(data.decode("utf-8", errors="replace")), dtype=np.int64)

    def fingerprint(self) -> str:
        raise NotImplementedError

    def config(self) -> dict:
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json (and any model files) into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.name, **self.config()}
        cache.write_bytes_atomic(directory / META, json.dumps(meta, indent=1).encode())
        return directory / META

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
