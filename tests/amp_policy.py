"""CUDA's autocast policy on the CPU, for tests.

Autocast runs some ops in float32 on CUDA but not on the CPU: under CUDA autocast ``sum``,
``softmax``, ``exp``, ``layer_norm``, ``cross_entropy`` and the others of PyTorch's list "CUDA
Ops that can autocast to float32" (docs: torch.amp, autocast op reference) cast their inputs to
float32 and return float32; under CPU autocast they keep bf16. Code that is correct under one
policy can fail under the other (a custom Function that returns float32 while it saved bf16
operands fails in its backward, on CUDA only), and a CPU-only CI never sees it.

``cuda_autocast_policy()`` is a TorchFunctionMode that applies that float32 list while CPU
autocast is on: inside it, CPU autocast behaves as CUDA autocast does for those ops, so the
CPU suite reproduces what a GPU run meets. Out-of-place ops only, as autocast itself (in-place
and ``out=`` variants are never autocast).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# PyTorch's "CUDA Ops that can autocast to float32" (torch.amp docs), by function name; the
# methods and functions of one name share it (Tensor.sum, torch.sum).
CUDA_FP32_OPS = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin",
    "binary_cross_entropy_with_logits", "cosh", "cosine_embedding_loss", "cdist",
    "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
    "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
    "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
})
_HALF = (torch.float16, torch.bfloat16)


def _up(a):
    if isinstance(a, torch.Tensor) and a.dtype in _HALF:
        return a.float()
    return a


class cuda_autocast_policy(TorchFunctionMode):
    """While CPU autocast is on, the ops of ``CUDA_FP32_OPS`` run in float32 (see the module
    docstring). ``seen`` counts the calls it promoted, so a test can show that it acted."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) in CUDA_FP32_OPS
                and torch.is_autocast_enabled("cpu")):
            up_args = tuple(_up(a) for a in args)
            up_kwargs = {k: _up(v) for k, v in kwargs.items()}
            if any(a is not b for a, b in zip(up_args, args)) or any(
                    up_kwargs[k] is not kwargs[k] for k in kwargs):
                self.seen += 1
            # The op itself under autocast's own rules (the float32 inputs stay float32).
            with torch.autocast("cpu", enabled=False):
                return func(*up_args, **up_kwargs)
        return func(*args, **kwargs)
