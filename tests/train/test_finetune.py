"""Fine-tuning defaults for a run that starts from pretrained weights: transformers.Trainer's
lr, clipping and weight decay, a 3% warm-up, the source's dtype; --set wins."""

import pytest

from moeify.train.config import TrainConfig
from moeify.train.finetune import finetune_defaults


def test_the_defaults_replace_the_from_scratch_settings():
    cfg, line = finetune_defaults(TrainConfig(steps=1000), explicit=set(),
                                  source_dtype="bfloat16", context=2048)
    assert (cfg.lr, cfg.warmup_steps, cfg.grad_clip, cfg.weight_decay, cfg.amp) == (
        5e-5, 30, 1.0, 0.0, "bf16")
    assert TrainConfig().lr == 5e-3  # what an imported model got before
    assert line == ("fine-tuning defaults (the weights are pretrained): lr 5e-05, warm-up 30 "
                    "steps (3% of 1000), grad_clip 1, weight_decay 0, amp bf16 (the source's "
                    "bfloat16); sequences of 2048 tokens (the model's context); change any "
                    "with --set KEY=VALUE")


@pytest.mark.parametrize("dtype, cuda, amp", [
    ("float16", True, "fp16"), ("float16", False, "bf16"),  # fp16 autocast needs CUDA
    ("float32", False, "fp32"), ("torch.bfloat16", False, "bf16"), (None, False, "auto"),
    ("int8", False, "auto")])
def test_amp_follows_the_sources_dtype(dtype, cuda, amp):
    cfg, _ = finetune_defaults(TrainConfig(steps=10), explicit=set(), source_dtype=dtype,
                               cuda=cuda)
    assert cfg.amp == amp and cfg.warmup_steps == 1  # ceil(0.3), at least one step


def test_settings_given_with_set_win():
    given = TrainConfig(steps=100, lr=1e-4, amp="fp32", warmup_steps=0)
    cfg, line = finetune_defaults(given, explicit={"lr", "amp", "warmup_steps"},
                                  source_dtype="bfloat16")
    assert (cfg.lr, cfg.amp, cfg.warmup_steps, cfg.grad_clip) == (1e-4, "fp32", 0, 1.0)
    assert line.startswith("fine-tuning defaults (the weights are pretrained): grad_clip 1, "
                           "weight_decay 0; sequences of the model's context")
    _, line = finetune_defaults(given, explicit={"lr", "amp", "warmup_steps", "grad_clip",
                                                 "weight_decay"})
    assert line.startswith("fine-tuning pretrained weights with the settings given by --set")
