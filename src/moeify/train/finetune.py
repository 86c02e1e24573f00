"""Fine-tuning defaults: the settings a run starts with when its weights are pretrained (an
imported Hugging Face checkpoint, ``--init-from RUN``, or an upcycled model), in place of the
defaults sized for training the tiny presets from scratch (lr 5e-3, which would wreck a real
pretrained model in a few steps).

The values are those a user of Hugging Face ``transformers.Trainer`` expects:

    lr            5e-5   ``TrainingArguments.learning_rate``'s default; the middle of the
                         2e-5 .. 1e-4 range usual for full fine-tuning of pretrained LMs
    warmup_steps  3%     of the run's steps (at least 1): the ``warmup_ratio=0.03`` of the
                         common instruction-tuning recipes (Stanford Alpaca, Vicuna), so the
                         first updates of a fresh AdamW do not jolt the weights
    grad_clip     1.0    ``TrainingArguments.max_grad_norm``
    weight_decay  0.0    ``TrainingArguments.weight_decay``
    amp           the source's dtype: bf16 for a bfloat16 checkpoint, fp16 for a float16 one
                  (bf16 where no CUDA device will train: fp16 needs a grad scaler on CUDA),
                  fp32 for float32 (weights stay float32 as master weights; autocast computes
                  in the source's precision, as ``Trainer(bf16=True)`` does)

The context (each training sequence's length) is the model's ``context_length``, the source's.
The schedule keeps moeify's shape (linear warm-up, cosine decay to ``min_lr_ratio``). Every
value given with ``--set`` wins; the line ``describe`` returns says what was chosen.
"""

from __future__ import annotations

import dataclasses
import math

FINETUNE_LR = 5e-5
WARMUP_RATIO = 0.03
FINETUNE_GRAD_CLIP = 1.0
FINETUNE_WEIGHT_DECAY = 0.0

# A checkpoint's torch dtype name (config.json's torch_dtype / dtype) -> TrainConfig.amp.
_AMP_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16",
                 "fp16": "fp16", "fp32": "fp32", "float": "fp32", "half": "fp16"}


def amp_of_dtype(dtype: str | None, *, cuda: bool) -> str | None:
    """The autocast mode for a source stored in ``dtype`` (None when unknown)."""
    amp = _AMP_OF_DTYPE.get(str(dtype).removeprefix("torch.")) if dtype else None
    if amp == "fp16" and not cuda:
        return "bf16"  # fp16 autocast needs CUDA's grad scaler; the same 2-byte footprint
    return amp


def finetune_defaults(cfg, *, explicit: set[str], source_dtype: str | None = None,
                      cuda: bool = False, context: int | None = None):
    """``cfg`` (a TrainConfig) with the fine-tuning defaults applied to every setting not in
    ``explicit`` (the keys given with --set), and the line that says what was chosen
    (``context``: the model's context_length, to name it there)."""
    changes: dict = {}
    if "lr" not in explicit:
        changes["lr"] = FINETUNE_LR
    if "warmup_steps" not in explicit:
        changes["warmup_steps"] = max(1, math.ceil(WARMUP_RATIO * cfg.steps))
    if "grad_clip" not in explicit:
        changes["grad_clip"] = FINETUNE_GRAD_CLIP
    if "weight_decay" not in explicit:
        changes["weight_decay"] = FINETUNE_WEIGHT_DECAY
    amp = amp_of_dtype(source_dtype, cuda=cuda)
    if "amp" not in explicit and amp is not None:
        changes["amp"] = amp
    out = dataclasses.replace(cfg, **changes)
    return out, describe(out, changes, source_dtype, context)


def describe(cfg, chosen: dict, source_dtype: str | None, context: int | None = None) -> str:
    parts = []
    if "lr" in chosen:
        parts.append(f"lr {cfg.lr:g}")
    if "warmup_steps" in chosen:
        parts.append(f"warm-up {cfg.warmup_steps} steps ({WARMUP_RATIO:.0%} of {cfg.steps})")
    if "grad_clip" in chosen:
        parts.append(f"grad_clip {cfg.grad_clip:g}")
    if "weight_decay" in chosen:
        parts.append(f"weight_decay {cfg.weight_decay:g}")
    if "amp" in chosen:
        parts.append(f"amp {cfg.amp} (the source's {source_dtype})")
    ctx = f"sequences of {context} tokens (the model's context)" if context else \
        "sequences of the model's context"
    if not parts:
        return f"fine-tuning pretrained weights with the settings given by --set; {ctx}"
    return (f"fine-tuning defaults (the weights are pretrained): {', '.join(parts)}; {ctx}; "
            "change any with --set KEY=VALUE")
