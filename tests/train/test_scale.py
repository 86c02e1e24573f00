"""The trainer where models are trained at scale, on CPU: bf16 autocast trains every family, the
CUDA autocast defaults (bf16, fp16 with a scaler on request), and compile=true trains exactly
like eager."""

import math

import pytest
import torch

from moeify.train.config import TrainConfig
from moeify.train.trainer import Trainer, resolve_amp, train
from moeify.train.validate import autocast_context

SMALL = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
FAMILIES = ("tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-sigmamoe", "tiny-switch",
            "tiny-mod")


def _cfg(corpus, preset, **kw):
    extra = ("model.feedforward.d_ff=64",) if preset in ("tiny-dense", "tiny-switchhead",
                                                         "tiny-moa", "tiny-mod") else ()
    base = dict(preset=preset, data=str(corpus), tokenizer="byte256", steps=10, batch_size=4,
                warmup_steps=0, lr=3e-3, log_every=1, eval_every=0, eval_tokens=256,
                eval_batch_size=4, checkpoint_every=0, model_overrides=SMALL + extra)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("preset", FAMILIES)
def test_bf16_autocast_trains_every_family_on_cpu(env, preset):
    tmp, corpus = env
    trainer = Trainer(_cfg(corpus, preset, amp="bf16"), tmp / preset, quiet=True)
    try:
        assert trainer.amp_dtype == torch.bfloat16
        ids = torch.from_numpy(trainer.valid_tokens[:17].astype("int64"))[None]
        with autocast_context(trainer.device, trainer.amp_dtype):
            assert trainer.model(ids[:, :-1]).logits.dtype == torch.bfloat16  # really bf16
        res = trainer.fit()
    finally:
        trainer.close()
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 masters


def test_cuda_autocast_defaults_to_bf16_and_keeps_fp16_with_a_scaler(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = torch.device("cuda", 0)
    assert resolve_amp("auto", cuda) == (torch.bfloat16, False)
    assert resolve_amp("fp16", cuda) == (torch.float16, True)
    assert resolve_amp("bf16", torch.device("cpu")) == (torch.bfloat16, False)
    assert resolve_amp("auto", torch.device("cpu")) == (None, False)


def test_compile_true_trains_exactly_like_eager(env, monkeypatch):
    """The trainer's plumbing: every block compiled in place, same losses as eager. Inductor's
    code generation is held to eager by tests/models/test_compile.py; here the blocks are traced by
    dynamo and AOT autograd but run without generated kernels, which keeps the test short."""
    tmp, corpus = env
    torch._dynamo.reset()
    compile_module = torch.nn.Module.compile
    compiled_blocks = []

    def compile_traced(self, **kw):
        compiled_blocks.append(type(self).__name__)
        return compile_module(self, backend="aot_eager", **kw)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_traced)
    eager = train(_cfg(corpus, "tiny-switchhead", steps=3), tmp / "eager", quiet=True)
    compiled = train(_cfg(corpus, "tiny-switchhead", steps=3, compile=True), tmp / "compiled",
                     quiet=True)
    for s in (1, 2, 3):
        assert abs(compiled.losses[s] - eager.losses[s]) < 1e-5, (s, compiled.losses,
                                                                  eager.losses)
    assert abs(compiled.valid["loss"] - eager.valid["loss"]) < 1e-5
    assert compiled_blocks == ["TransformerBlock", "TransformerBlock"]


def test_activation_checkpointing_with_compile_trains_like_eager(env, monkeypatch):
    """activation_checkpointing=block with compile=true (blocks traced by dynamo and AOT
    autograd, the checkpointed region recomputed in the compiled backward), on Switch with the
    global-batch balance loss and 2 micro-batches (one block, to keep the tracing short): the
    same losses as the plain eager run."""
    tmp, corpus = env
    torch._dynamo.reset()
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, backend="aot_eager", **kw))
    kw = dict(steps=2, grad_accum=2, model_overrides=(
        "model.d_model=32", "model.n_layers=1", "model.context_length=16",
        "model.feedforward.balance_scope=global"))
    eager = train(_cfg(corpus, "tiny-switch", **kw), tmp / "eager", quiet=True)
    both = train(_cfg(corpus, "tiny-switch", compile=True, activation_checkpointing="block",
                      **kw), tmp / "ac", quiet=True)
    for s in (1, 2):
        assert abs(both.losses[s] - eager.losses[s]) < 1e-5, (s, both.losses, eager.losses)


def test_unknown_parallel_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="parallel must be one of ddp, fsdp"):
        TrainConfig().with_overrides(["parallel=zero3"])
    assert TrainConfig().with_overrides(["compile=true", "parallel=fsdp"]).compile is True
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, block"):
        TrainConfig().with_overrides(["activation_checkpointing=layers"])
    assert TrainConfig().with_overrides(
        ["activation_checkpointing=block"]).activation_checkpointing == "block"
