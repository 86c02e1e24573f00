"""Model adapters for moeify.eval's scoring functions, and stream perplexity (validation).

Shape legend: B streams / sequences, T tokens, V vocabulary.

The eval functions take ``logits_fn(ids_BT) -> logits_BTV``. ``stateless_logits_fn`` scores
every call on its own (the zero-shot tasks); ``xl_logits_fn`` carries the model's XL memory from
one call to the next (perplexity over a long stream, as in training), with a reset function.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np
import torch

from moeify.eval.perplexity import perplexity


def autocast_context(device: torch.device, amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def stateless_logits_fn(model: torch.nn.Module, device: torch.device,
                        amp_dtype: torch.dtype | None = None) -> Callable:
    @torch.no_grad()
    def fn(ids_BT: torch.Tensor, valid_BT: torch.Tensor | None = None) -> torch.Tensor:
        with autocast_context(device, amp_dtype):
            valid = None if valid_BT is None else valid_BT.to(device)
            return model(ids_BT.to(device), valid_BT=valid).logits.float()
    return fn


def xl_logits_fn(model: torch.nn.Module, device: torch.device,
                 amp_dtype: torch.dtype | None = None) -> tuple[Callable, Callable]:
    """``(logits_fn, reset_fn)``: consecutive calls continue the same B streams."""
    state: dict = {"memory": None}
    xl = bool(getattr(model.config, "xl_memory", False))

    def reset() -> None:
        state["memory"] = None

    @torch.no_grad()
    def fn(ids_BT: torch.Tensor) -> torch.Tensor:
        mem = state["memory"]
        if mem is not None and mem[0].shape[0] != ids_BT.shape[0]:
            mem = None
        with autocast_context(device, amp_dtype):
            out = model(ids_BT.to(device), memory=mem if xl else None)
        state["memory"] = out.memory if xl else None
        return out.logits.float()
    return fn, reset


def evaluate_stream(model: torch.nn.Module, tokens, tokenizer, *, seq_len: int, batch_size: int,
                    max_tokens: int = 0, device: torch.device | None = None,
                    amp_dtype: torch.dtype | None = None, progress=None) -> dict:
    """Loss, perplexity and (byte-level) bits per character of a token stream.

    ``max_tokens`` > 0 scores only the first ``max_tokens`` targets. The model is put in eval
    mode for the duration (routing statistics stay untouched) and restored afterwards."""
    device = device or next(model.parameters()).device
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    tokens = np.asarray(tokens)
    was_training = model.training
    model.eval()
    try:
        fn, reset = xl_logits_fn(model, device, amp_dtype)
        res = perplexity(fn, tokens, tokenizer=tokenizer, batch_size=batch_size,
                         seq_len=seq_len, reset_fn=reset, progress=progress)
    finally:
        model.train(was_training)
    out = {"loss": res["loss"], "tokens": res["tokens"]}
    if getattr(tokenizer, "byte_level", False):
        out["bpc"] = res["loss"] / math.log(2)
    else:
        out["ppl"] = res["ppl"]
    return out
