"""The shared core of the zero-shot tasks: log-probabilities of continuations given prefixes.

Shape legend: B sequences in a batch, T positions, V vocabulary.

Every task asks the same question of a causal LM: for a token sequence prefix + continuation,
what are log p(c_i | prefix, c_<i) for each continuation token, and what is the argmax at each of
those positions? ``score_continuations`` answers it in padded batches through
``logits_fn(ids_BT) -> logits_BTV``, a stateless function (no XL memory carried between calls:
the tasks score every item on its own, as the SwitchHead authors did). Sequences are padded on
the right, which a causal model never sees from earlier positions. A ``logits_fn`` that takes a
``valid_BT`` keyword (False = padding; ``moeify.eval.adapters.stateless_logits_fn`` does) gets
the padding mask too, so that layers which look at the whole sequence (Mixture-of-Depths'
expert-choice routing) treat a padded item as they would the item alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from moeify.errors import MoeifyError

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
# progress(done, total): called after each batch with the items scored so far (a display).
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class ContinuationScore:
    """Per continuation token: its log-probability (float64) and, when requested, the model's
    argmax there (empty otherwise)."""

    logprobs: torch.Tensor
    greedy: list[int]

    @property
    def total(self) -> float:
        return float(self.logprobs.sum())

    @property
    def mean(self) -> float:
        return float(self.logprobs.mean())


def zero_shot_context(model_config) -> int:
    """The longest input a zero-shot item may have: without memory, an XL model was trained to
    attend over its chunk plus one chunk of memory, so it gets twice its context length."""
    return model_config.context_length * (2 if model_config.xl_memory else 1)


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are scored in float32; float32/float64 ones as they are (a float64
    copy of [B, T, V] logits would cost gigabytes for a 50k vocabulary)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def call_logits(logits_fn: LogitsFn, ids_BT: torch.Tensor,
                valid_BT: torch.Tensor) -> torch.Tensor:
    """``logits_fn(ids_BT, valid_BT=valid_BT)`` when it takes that keyword, else
    ``logits_fn(ids_BT)`` (see the module docstring)."""
    try:
        takes_valid = "valid_BT" in inspect.signature(logits_fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        takes_valid = False
    return logits_fn(ids_BT, valid_BT=valid_BT) if takes_valid else logits_fn(ids_BT)


def check_logits(logits_BTV: torch.Tensor, B: int, T: int, max_id: int) -> None:
    if logits_BTV.dim() != 3 or tuple(logits_BTV.shape[:2]) != (B, T):
        raise ValueError(f"logits_fn must return logits of shape [B, T, V] = [{B}, {T}, V], got "
                         f"{tuple(logits_BTV.shape)}")
    if logits_BTV.shape[2] <= max_id:
        raise ValueError(f"logits_fn returned {logits_BTV.shape[2]} classes but the tokenizer "
                         f"produced id {max_id}: the model and tokenizer do not match")


@torch.no_grad()
def score_continuations(logits_fn: LogitsFn, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                        *, batch_size: int = 16, max_len: int | None = None, pad_id: int = 0,
                        greedy: bool = False,
                        progress: ProgressFn | None = None) -> list[ContinuationScore]:
    """Score each (prefix_ids, continuation_ids) pair; both must be non-empty.

    ``max_len`` bounds the model input length (the model's context): longer inputs lose tokens
    from the left of the prefix. ``greedy`` also records the argmax at each continuation
    position. Items are batched by length to limit padding. ``progress(done, total)`` is called
    after each batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    inputs, n_cont = [], []
    for prefix, cont in items:
        if len(prefix) < 1 or len(cont) < 1:
            raise ValueError("every item needs at least one prefix and one continuation token")
        seq = [*prefix, *cont][:-1]   # position i predicts token i + 1
        if max_len is not None and len(seq) > max_len:
            if len(cont) > max_len:
                raise MoeifyError(f"a continuation of {len(cont)} tokens does not fit the model "
                                  f"context of {max_len} tokens")
            seq = seq[len(seq) - max_len:]
        inputs.append(seq)
        n_cont.append(len(cont))
    order = sorted(range(len(items)), key=lambda i: -len(inputs[i]))
    results: list[ContinuationScore | None] = [None] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        B, T = len(idx), len(inputs[idx[0]])
        ids_BT = np.full((B, T), pad_id, dtype=np.int64)
        tgt_BT = np.zeros((B, T), dtype=np.int64)
        mask_BT = np.zeros((B, T), dtype=bool)
        valid_BT = np.zeros((B, T), dtype=bool)
        for row, i in enumerate(idx):
            L, C = len(inputs[i]), n_cont[i]
            ids_BT[row, :L] = inputs[i]
            tgt_BT[row, L - C:L] = items[i][1]
            mask_BT[row, L - C:L] = True
            valid_BT[row, :L] = True
        logits_BTV = upcast(call_logits(logits_fn, torch.from_numpy(ids_BT),
                                        torch.from_numpy(valid_BT)))
        check_logits(logits_BTV, B, T, int(max(ids_BT.max(), tgt_BT.max())))
        tgt = torch.from_numpy(tgt_BT).to(logits_BTV.device)
        logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
        tok_logp_BT = logp_BTV.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        mask = torch.from_numpy(mask_BT)
        counts = [n_cont[i] for i in idx]   # row-major masking keeps each row's tokens together
        logps = torch.split(tok_logp_BT.cpu().double()[mask], counts)  # (MPS has no float64)
        argmax = logits_BTV.argmax(-1).cpu()[mask].tolist() if greedy else None
        offset = 0
        for i, lp, c in zip(idx, logps, counts):
            results[i] = ContinuationScore(lp, argmax[offset:offset + c] if argmax else [])
            offset += c
        if progress is not None:
            progress(start + B, len(order))
    return results  # type: ignore[return-value]
