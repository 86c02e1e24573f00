"""The trainer where models are trained at scale, on CPU: bf16 autocast trains every family, the
CUDA autocast defaults (bf16, fp16 with a scaler on request), and compile=true trains exactly
like eager."""

import math
from pathlib import Path

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


# The compiled runs of the two tests below. Blocks are traced by dynamo and AOT autograd but run
# without generated kernels (backend aot_eager), which keeps them short; inductor's code
# generation, and every family's compiled blocks against eager, are held by
# tests/models/test_compile.py. Tracing is most of each test and each run is one thread, so both
# compiled runs train side by side in two forked processes (``compiled_runs``) while the tests
# train their eager references. The trainer's plumbing on sigma-MoE (routing-usage buffers
# changed in the compiled forward), whose blocks trace in two thirds of SwitchHead's time.
COMPILE_PRESET, COMPILE_KW = "tiny-sigmamoe", dict(steps=3)
# Switch with the global-batch balance loss and 2 micro-batches, one block (the tracing is
# shorter); 2 of 3 planned steps, so no validation (whose eval-mode graphs this test does not
# compare) is compiled.
AC_KW = dict(steps=3, grad_accum=2, model_overrides=(
    "model.d_model=32", "model.n_layers=1", "model.context_length=16",
    "model.feedforward.balance_scope=global"))


def _compiled_run(preset, kw, stop_after, run_dir, cache, out):
    """In a forked process: train ``preset`` with compile=true and the settings ``kw`` (to
    ``stop_after`` steps), every block traced with aot_eager; writes the losses, the validation
    and the classes of the compiled modules to ``out``."""
    import os

    os.environ["MOEIFY_CACHE_DIR"] = cache
    torch.set_num_threads(1)
    torch._dynamo.reset()
    compile_module = torch.nn.Module.compile
    compiled = []

    def compile_traced(self, **kw):
        compiled.append(type(self).__name__)
        return compile_module(self, backend="aot_eager", **kw)

    torch.nn.Module.compile = compile_traced
    try:
        from references import english_corpus

        corpus = english_corpus(Path(run_dir).parent / "corpus.txt")
        trainer = Trainer(_cfg(corpus, preset, compile=True, **kw), run_dir, quiet=True)
        try:
            res = trainer.fit(stop_after=stop_after)
        finally:
            trainer.close()
        got = {"losses": res.losses, "valid": res.valid, "compiled": compiled}
    except Exception as e:  # reported by the test
        got = {"error": f"{type(e).__name__}: {e}"}
    torch.save(got, out)


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    """name -> a function that waits for that compiled run and returns its record."""
    import gc

    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("compiled")
    runs = {"compile": (COMPILE_PRESET, COMPILE_KW, None),
            "ac": ("tiny-switch", {**AC_KW, "activation_checkpointing": "block"}, 2)}
    gc.collect()  # as in test_fsdp._fork
    procs = {}
    for name, (preset, kw, stop_after) in runs.items():
        (tmp / name).mkdir()
        p = mp.get_context("fork").Process(target=_compiled_run, args=(
            preset, kw, stop_after, str(tmp / name / "run"), str(tmp / name / "cache"),
            str(tmp / name / "out.pt")))
        p.start()
        procs[name] = p

    def result(name):
        procs[name].join(600)
        assert procs[name].exitcode == 0, (name, procs[name].exitcode)
        got = torch.load(tmp / name / "out.pt")
        assert "error" not in got, got["error"]
        return got

    yield result
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join()


def test_compile_true_trains_exactly_like_eager(env, compiled_runs):
    """The trainer's plumbing: every block compiled in place, same losses and validation as
    eager."""
    tmp, corpus = env
    eager = train(_cfg(corpus, COMPILE_PRESET, **COMPILE_KW), tmp / "eager", quiet=True)
    compiled = compiled_runs("compile")
    for s in (1, 2, 3):
        assert abs(compiled["losses"][s] - eager.losses[s]) < 1e-5, (s, compiled["losses"],
                                                                     eager.losses)
    assert abs(compiled["valid"]["loss"] - eager.valid["loss"]) < 1e-5
    assert compiled["compiled"] == ["TransformerBlock", "TransformerBlock"]


def test_activation_checkpointing_with_compile_trains_like_eager(env, compiled_runs):
    """activation_checkpointing=block with compile=true (blocks traced by dynamo and AOT
    autograd, the checkpointed region recomputed in the compiled backward), on Switch with the
    global-batch balance loss and 2 micro-batches (one block, to keep the tracing short): the
    same losses as the plain eager run."""
    tmp, corpus = env
    trainer = Trainer(_cfg(corpus, "tiny-switch", **AC_KW), tmp / "eager", quiet=True)
    try:
        eager = trainer.fit(stop_after=2)
    finally:
        trainer.close()
    both = compiled_runs("ac")
    assert both["compiled"] == ["TransformerBlock"]
    for s in (1, 2):
        assert abs(both["losses"][s] - eager.losses[s]) < 1e-5, (s, both["losses"],
                                                                 eager.losses)


def test_unknown_parallel_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="parallel must be one of ddp, fsdp"):
        TrainConfig().with_overrides(["parallel=zero3"])
    assert TrainConfig().with_overrides(["compile=true", "parallel=fsdp"]).compile is True
    with pytest.raises(ValueError, match="activation_checkpointing must be one of none, block"):
        TrainConfig().with_overrides(["activation_checkpointing=layers"])
    assert TrainConfig().with_overrides(
        ["activation_checkpointing=block"]).activation_checkpointing == "block"
