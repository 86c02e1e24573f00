"""Token streams for Transformer-XL-style training: memory-mapped splits, contiguous batches.

Shape legend: B batch rows (streams) per process, T tokens per step, W data-parallel processes.

``tokenize_split(corpus, tokenizer, split)`` encodes a split once into
``<cache>/tokens/<corpus>/<tokenizer fingerprint>/<split>.bin`` (uint16 when the vocabulary fits,
else uint32) and returns it memory-mapped, so many processes share one copy in the page cache.

``StreamBatcher`` cuts the token array into B*W contiguous streams of equal length and yields
[B, T+1] windows that advance by T: row b of step s+1 starts exactly where row b of step s ended
(its last column is the next window's first), so XL memory carried from one step to the next sees
the text that really precedes the current window. Process r of W takes rows r*B .. r*B+B-1 of the
global batch, so W processes with B rows each see exactly what one process with W*B rows sees.
After the last full window of a pass the batcher starts over (a new epoch); ``starts_new_pass``
tells the trainer to reset XL memory there.
"""

from __future__ import annotations

import json
import mmap
import re
import time
from pathlib import Path

import numpy as np
import torch

from moeify.data import cache
from moeify.errors import MoeifyError, read_utf8

_CHUNK_BYTES = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# A newline between two printable ASCII characters: no token of the BPE tokenisers spans it, and
# the pre-tokens on either side do not depend on what lies beyond it.
_SAFE_BOUNDARY = re.compile(rb"[\x21-\x7e]\n[\x21-\x7e]")


def _chunks(data, target: int) -> list[tuple[int, int]]:
    """Chunk boundaries (about ``target`` bytes apart) placed so that tokenising chunk by chunk
    gives the same tokens as tokenising the whole text: just after a newline that sits between
    two printable ASCII characters (a chunk grows until it reaches one)."""
    n, spans, start = len(data), [], 0
    while start < n:
        m = _SAFE_BOUNDARY.search(data, min(start + target, n) - 1) if start + target < n else None
        end = m.start() + 2 if m else n
        spans.append((start, end))
        start = end
    return spans


def tokenize_split(corpus, tokenizer, split: str) -> np.ndarray:
    """The tokens of ``split`` as a read-only memory-mapped 1-D array (cached)."""
    out_dir = cache.cache_subdir("tokens", corpus.key, tokenizer.fingerprint())
    path, meta_path = out_dir / f"{split}.bin", out_dir / f"{split}.json"
    dtype = token_dtype(tokenizer.vocab_size)
    if path.is_file() and meta_path.is_file():
        meta = json.loads(read_utf8(meta_path))
        size_ok = path.stat().st_size == meta["tokens"] * dtype.itemsize
        if meta.get("dtype") == dtype.name and size_ok:
            return _memmap(path, dtype)
    what = f"{corpus.name}/{split}"
    if corpus.num_bytes(split) == 0:
        n_tokens = _encode_to(path, b"", tokenizer, dtype, what)
    else:
        # Memory-mapped so that a large split is never held in memory whole.
        with open(corpus.path(split), "rb") as src, \
                mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as data:
            n_tokens = _encode_to(path, data, tokenizer, dtype, what)
    cache.write_bytes_atomic(meta_path, json.dumps(
        {"tokens": n_tokens, "dtype": dtype.name, "tokenizer": tokenizer.fingerprint()}).encode())
    return _memmap(path, dtype)


def _encode_to(path: Path, data, tokenizer, dtype: np.dtype, what: str) -> int:
    spans = _chunks(data, _CHUNK_BYTES)
    cache.progress(f"tokenising {what} ({len(data) / 1e6:.1f} MB) with {tokenizer.name}")
    t0 = last = time.monotonic()
    n_tokens = 0
    with cache.atomic_write(path) as f:
        for a, b in spans:
            ids = tokenizer.encode_array(data[a:b])
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise MoeifyError(f"tokenizer {tokenizer.name} produced ids outside its vocabulary")
            f.write(ids.astype(dtype).tobytes())
            n_tokens += ids.size
            now = time.monotonic()
            if now - last > 5.0:
                last = now
                done = b / len(data)
                eta = (now - t0) * (1 - done) / max(done, 1e-9)
                cache.progress(f"  {100 * done:.0f}% ({n_tokens} tokens), ETA {eta:.0f}s")
    cache.progress(f"  {what}: {n_tokens} tokens ({len(data) / max(n_tokens, 1):.2f} bytes/token)")
    return n_tokens


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class StreamBatcher:
    """Contiguous [B, T+1] windows over B*W streams of a token array, resumable and shardable.

    ``batch_size`` is B (rows of this process), ``rank``/``world_size`` select this process's
    rows. ``next()`` returns an int64 tensor [B, T+1]: inputs are [:, :-1], targets [:, 1:]."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        rows = batch_size * world_size
        self.stream_len = len(tokens) // rows
        if self.stream_len < seq_len + 1:
            raise MoeifyError(
                f"{len(tokens)} tokens cannot fill {rows} streams of at least {seq_len + 1} tokens "
                f"(batch {batch_size} x {world_size} processes, sequence length {seq_len}): use "
                "a smaller batch or sequence length, or a larger corpus")
        self.steps_per_epoch = (self.stream_len - 1) // seq_len
        offsets_B = (rank * batch_size + np.arange(batch_size)) * self.stream_len
        self._idx_BT = offsets_B[:, None] + np.arange(seq_len + 1)[None, :]
        self.step = 0   # window index within the current pass
        self.epoch = 0

    @property
    def starts_new_pass(self) -> bool:
        """True when the next window is the first of a pass (XL memory should be reset)."""
        return self.step == 0

    def next(self) -> torch.Tensor:
        window_BT = np.asarray(self.tokens[self._idx_BT + self.step * self.seq_len], dtype=np.int64)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.step, self.epoch = 0, self.epoch + 1
        return torch.from_numpy(window_BT)

    __next__ = next

    def __iter__(self) -> "StreamBatcher":
        return self

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "rows": self.batch_size * self.world_size,
                "seq_len": self.seq_len, "n_tokens": int(len(self.tokens))}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position. The global layout (B*W rows, T, token count) must match;
        the split between processes may differ."""
        want = {"rows": self.batch_size * self.world_size, "seq_len": self.seq_len,
                "n_tokens": int(len(self.tokens))}
        got = {k: state.get(k) for k in want}
        if got != want:
            raise MoeifyError(
                f"the saved data position was written for {got['rows']} rows x {got['seq_len']} "
                f"tokens over {got['n_tokens']} tokens, but this run has {want['rows']} x "
                f"{want['seq_len']} over {want['n_tokens']}: resume with the same global batch, "
                "sequence length, corpus and tokenizer")
        if not 0 <= int(state["step"]) < self.steps_per_epoch:
            raise MoeifyError(f"saved data position {state['step']} is outside the "
                              f"{self.steps_per_epoch} windows of a pass: the state is corrupt")
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
