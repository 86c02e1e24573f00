"""The shared core of the zero-shot tasks: log-probabilities of continuations given prefixes.

Shape legend: B sequences in a batch, T positions, V vocabulary.

Every task asks the same question of a causal LM: for a token sequence prefix + continuation,
what are log p(c_i | prefix, c_<i) for each continuation token, and what is the argmax at each of
those positions? ``score_continuations`` answers it in padded batches through
``logits_fn(ids_BT) -> logits_BTV``, a stateless function (no XL memory carried between calls:
the tasks score every item on its own, as the SwitchHead authors did). Sequences are padded on
the right, which a causal model never sees from earlier positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moeify.errors import MoeifyError

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ContinuationScore:
    """Per continuation token: its log-probability (float64) and the model's argmax there."""

    logprobs: torch.Tensor
    greedy: list[int]

    @property
    def total(self) -> float:
        return float(self.logprobs.sum())

    @property
    def mean(self) -> float:
        return float(self.logprobs.mean())


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are scored in float32; float32/float64 ones as they are (a float64
    copy of [B, T, V] logits would cost gigabytes for a 50k vocabulary)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def check_logits(logits_BTV: torch.Tensor, B: int, T: int, max_id: int) -> None:
    if logits_BTV.dim() != 3 or tuple(logits_BTV.shape[:2]) != (B, T):
        raise ValueError(f"logits_fn must return logits of shape [B, T, V] = [{B}, {T}, V], got "
                         f"{tuple(logits_BTV.shape)}")
    if logits_BTV.shape[2] <= max_id:
        raise ValueError(f"logits_fn returned {logits_BTV.shape[2]} classes but the tokenizer "
                         f"produced id {max_id}: the model and tokenizer do not match")


@torch.no_grad()
def score_continuations(logits_fn: LogitsFn, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                        *, batch_size: int = 16, max_len: int | None = None,
                        pad_id: int = 0) -> list[ContinuationScore]:
    """Score each (prefix_ids, continuation_ids) pair; both must be non-empty.

    ``max_len`` bounds the model input length (the model's context): longer inputs lose tokens
    from the left of the prefix. Items are batched by length to limit padding."""
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
    targets = [list(cont) for _, cont in items]
    order = sorted(range(len(items)), key=lambda i: -len(inputs[i]))
    results: list[ContinuationScore | None] = [None] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        T = len(inputs[idx[0]])
        ids_BT = torch.full((len(idx), T), pad_id, dtype=torch.long)
        tgt_BT = torch.zeros((len(idx), T), dtype=torch.long)
        mask_BT = torch.zeros((len(idx), T), dtype=torch.bool)
        for row, i in enumerate(idx):
            L, C = len(inputs[i]), n_cont[i]
            ids_BT[row, :L] = torch.tensor(inputs[i], dtype=torch.long)
            tgt_BT[row, L - C:L] = torch.tensor(targets[i], dtype=torch.long)
            mask_BT[row, L - C:L] = True
        logits_BTV = logits_fn(ids_BT)
        check_logits(logits_BTV, len(idx), T, int(max(ids_BT.max(), tgt_BT.max())))
        logp_BTV = torch.log_softmax(upcast(logits_BTV), dim=-1)
        tgt_dev = tgt_BT.to(logp_BTV.device)
        tok_logp_BT = logp_BTV.gather(-1, tgt_dev.unsqueeze(-1)).squeeze(-1).double().cpu()
        greedy_BT = logits_BTV.argmax(-1).cpu()
        for row, i in enumerate(idx):
            sel = mask_BT[row]
            results[i] = ContinuationScore(tok_logp_BT[row][sel].clone(),
                                           greedy_BT[row][sel].tolist())
    return results  # type: ignore[return-value]
