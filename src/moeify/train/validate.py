"""Validation during training: the stream perplexity of moeify.eval.adapters (re-exported here
for the trainer), and the autocast precision a run computes in."""

import torch

from moeify.eval.adapters import autocast_context, evaluate_stream  # noqa: F401


def resolve_amp(mode: str, device: torch.device) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use a grad scaler). ``auto``: bf16 on CUDA when supported, else
    fp16 with a scaler as in the paper; fp32 on CPU (CPU autocast is slower than fp32 here)."""
    if mode == "fp32" or (mode == "auto" and device.type != "cuda"):
        return None, False
    if mode == "auto":
        return (torch.bfloat16, False) if torch.cuda.is_bf16_supported() else (torch.float16, True)
    if mode == "bf16":
        return torch.bfloat16, False
    if device.type != "cuda":
        raise ValueError("amp=fp16 needs a CUDA device (it uses a grad scaler); on CPU use "
                         "amp=bf16 or amp=fp32")
    return torch.float16, True

