"""The GPU suite (``pytest -m cuda``; skipped where there is no CUDA device): every expert-matmul
implementation in bf16 and fp32 against the float64 reference (outputs and gradients), every
family's forward and backward against the same model on the CPU, the KV cache, a 50-step
training run of each family, compiled against eager, and FSDP2 on one GPU.

``MOEIFY_SUITE_DEVICE=cpu`` runs the same checks on the CPU (slowly), to check the suite itself
on a machine without a GPU; the implementations that only exist on CUDA are then skipped.
"""

import math
import os

import pytest
import torch

from moeify.models.presets import get_preset
from moeify.ops.moe import IMPLEMENTATIONS, expert_matmul, make_plan
from moeify.train.config import TrainConfig, apply_model_overrides
from moeify.train.trainer import train
from references import english_corpus
from impl_matrix import every_impl_cases, every_impl_model

DEVICE = os.environ.get("MOEIFY_SUITE_DEVICE", "cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="no CUDA device: the GPU suite (pytest -m cuda) needs one"),
]

FAMILIES = ("tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-sigmamoe", "tiny-switch",
            "tiny-mod", "tiny-switchall", "tiny-mode")
SMALL = ("model.n_layers=2", "model.context_length=32")
BF16 = dict(rtol=3e-2, atol=3e-2)  # bf16 keeps 8 bits of mantissa


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 means fp32: TF32 matmuls (10-bit mantissa) would fail the fp32 tolerances."""
    if DEVICE != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _small(preset):
    return apply_model_overrides(get_preset(preset), SMALL)


# ---------------------------------------------------------------------------- expert matmul

def _routing(M=256, E=8, K=2, D=64, F=32, G=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    w = torch.randn(E * G, D, F, generator=g) / math.sqrt(D)
    # Skewed routing (K distinct experts per row, later experts more popular), one group of E
    # experts per output group (what "sets" needs).
    scores = torch.rand(M, E, generator=g) * torch.arange(1, E + 1) ** 2
    idx = scores.topk(K, -1).indices
    idx = torch.cat([idx + j * E for j in range(G)], 1)
    gates = torch.rand(M, K * G, generator=g)
    return x, idx, w, gates


def _matmul_grads(impl, x, idx, w, gates, dtype, groups):
    x = x.to(DEVICE, dtype).requires_grad_()
    w = w.to(DEVICE, dtype).requires_grad_()
    gates = gates.to(DEVICE, dtype if dtype == torch.float64 else torch.float32).requires_grad_()
    idx = idx.to(DEVICE)
    E_group = w.shape[0] // groups
    plan = None if impl in ("reference", "gather") else make_plan(
        idx, w.shape[0], group_size=E_group if impl == "sets" else None)
    y = expert_matmul(x, idx, w, gates, groups=groups, impl=impl, plan=plan)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, y.dtype)
    (y * gy).sum().backward()
    return [t.double().cpu() for t in (y, x.grad, w.grad, gates.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS + ("auto",))
def test_every_expert_matmul_matches_the_reference(impl, dtype):
    if impl == "grouped" and DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("torch's grouped GEMM is bf16-only on CUDA (expert_matmul falls back to "
                    "segment; that case is covered by impl=segment)")
    if impl == "triton" and DEVICE != "cuda":
        pytest.skip("triton's kernels run on CUDA; on the CPU only in Triton's interpreter, whose "
                    "bf16 dot is wrong: tests/ops/test_triton_matmul.py tests them there")
    groups = 2 if impl == "sets" else 1
    x, idx, w, gates = _routing(G=groups)
    want = _matmul_grads("reference", x, idx, w, gates, torch.float64, groups)
    got = _matmul_grads(impl, x, idx, w, gates, dtype, groups)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else BF16
    for name, a, b in zip(("y", "grad x", "grad w", "grad gates"), got, want):
        scale = b.abs().max().clamp_min(1.0)
        torch.testing.assert_close(a / scale, b / scale, msg=f"{impl} {dtype} {name}", **tol)


# ---------------------------------------------------------------------------- layers, models

def _fwd_bwd(model, ids_BT, device, amp=None):
    model = model.to(device)
    ids_BT = ids_BT.to(device)
    with torch.autocast(torch.device(device).type, dtype=amp, enabled=amp is not None):
        out = model(ids_BT[:, :-1], ids_BT[:, 1:])
    (out.loss + out.aux_loss).backward()
    grads = {n: p.grad.double().cpu() for n, p in model.named_parameters()}
    return out.loss.detach().double().cpu(), out.logits.detach().double().cpu(), grads


@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_forward_backward_matches_cpu(preset):
    cfg = _small(preset)
    torch.manual_seed(0)
    ref = cfg.build().train()
    dev = [p.detach().clone() for p in ref.parameters()]
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1),
                        generator=torch.Generator().manual_seed(1))
    loss_c, logits_c, grads_c = _fwd_bwd(ref, ids, "cpu")
    model = cfg.build().train()
    with torch.no_grad():
        for p, v in zip(model.parameters(), dev):
            p.copy_(v)
    loss_g, logits_g, grads_g = _fwd_bwd(model, ids, DEVICE)
    torch.testing.assert_close(loss_g, loss_c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits_g, logits_c, rtol=1e-4, atol=1e-4)
    for name in grads_c:
        torch.testing.assert_close(grads_g[name], grads_c[name], rtol=1e-3, atol=1e-4, msg=name)
    # bf16 autocast: finite, and close to fp32 at bf16 precision.
    model.zero_grad(set_to_none=True)
    loss_b, _, grads_b = _fwd_bwd(model, ids, DEVICE, amp=torch.bfloat16)
    assert torch.isfinite(loss_b) and all(torch.isfinite(g).all() for g in grads_b.values())
    assert abs(float(loss_b - loss_c)) < 0.05 * float(loss_c)


def test_tied_router_scores_route_as_on_the_cpu():
    from moeify.ops.routing import expert_choice, sigmoid_topk, softmax_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-1, 2, (512, 10), generator=g).float()  # ties in nearly every row
    for route in (sigmoid_topk, softmax_topk):
        want = route(logits, 3).idx
        assert torch.equal(route(logits.to(DEVICE), 3).idx.cpu(), want)
    assert route(torch.zeros(64, 8, device=DEVICE), 2).idx.cpu().tolist() == [[0, 1]] * 64
    scores = torch.randint(0, 3, (4, 64), generator=g).float()
    assert torch.equal(expert_choice(scores.to(DEVICE), 0.25)[0].cpu(),
                       expert_choice(scores, 0.25)[0])


@pytest.mark.parametrize("preset,impl", list(every_impl_cases(DEVICE)))
def test_every_family_with_every_expert_impl_trains_in_bf16_autocast(preset, impl):
    """The matrix that failed on the first GPU run (SwitchHead, MoA, SwitchAll x segment,
    grouped, auto in bf16): a forward and backward under autocast on the device, close to the
    float32 loss on the CPU."""
    cfg, model = every_impl_model(preset, impl)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1),
                        generator=torch.Generator().manual_seed(1))
    loss_c, _, _ = _fwd_bwd(model, ids, "cpu")
    model.zero_grad(set_to_none=True)
    loss_b, _, grads_b = _fwd_bwd(model, ids, DEVICE, amp=torch.bfloat16)
    assert torch.isfinite(loss_b) and all(torch.isfinite(g).all() for g in grads_b.values())
    assert abs(float(loss_b - loss_c)) < 0.03 * float(loss_c)


# Mixture-of-Depths is left out: it decodes with its causal router, not the expert-choice top-k of
# a full forward (tests/test_depth.py holds each mode to its own reference).
@pytest.mark.parametrize("preset", ("tiny-dense", "tiny-switchhead", "tiny-moa", "tiny-switchall"))
def test_cached_decoding_equals_a_full_forward(preset):
    cfg = apply_model_overrides(get_preset(preset), ("model.n_layers=2",))
    torch.manual_seed(0)
    model = cfg.build().to(DEVICE).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), device=DEVICE)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :4], cache=cache).logits]
        steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(4, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- training

@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    return english_corpus(tmp_path / "corpus.txt", 3000)


def _cfg(corpus, preset, **kw):
    base = dict(preset=preset, data=str(corpus), tokenizer="byte256", steps=50, batch_size=8,
                warmup_steps=5, lr=3e-3, log_every=10, eval_every=0, eval_tokens=2048,
                eval_batch_size=8, checkpoint_every=0, device=DEVICE, model_overrides=SMALL)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("preset", FAMILIES)
def test_fifty_steps_of_every_family_train_in_the_default_autocast(tmp_path, corpus, preset):
    res = train(_cfg(corpus, preset), tmp_path / preset, quiet=True)  # amp=auto: bf16 on CUDA
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert res.valid["loss"] < math.log(256) - 1.0


# SwitchAll = SwitchHead + sigma-MoE, MoDE = Mixture-of-Depths + Switch: every MoE family in
# three compiles (bf16 takes the grouped GEMM inside the graph).
@pytest.mark.parametrize("preset,amp", [("tiny-switchall", "fp32"), ("tiny-switchall", "bf16"),
                                        ("tiny-mode", "bf16")])
def test_compiled_training_matches_eager(tmp_path, corpus, preset, amp):
    torch._dynamo.reset()
    cfg = _cfg(corpus, preset, steps=5, amp=amp)
    eager = train(cfg, tmp_path / "eager", quiet=True)
    compiled = train(TrainConfig.from_dict({**cfg.to_dict(), "compile": True}),
                     tmp_path / "compiled", quiet=True)
    tol = 1e-4 if amp == "fp32" else 2e-2  # bf16: the compiler fuses in another order
    for s in eager.losses:
        assert abs(compiled.losses[s] - eager.losses[s]) < tol * max(1.0, eager.losses[s]), s


def test_fsdp_on_one_gpu_matches_the_unsharded_run_and_its_checkpoint_loads(tmp_path, corpus):
    from moeify.rundir import load_trained
    from moeify.rundir.checkpoints import is_sharded_checkpoint

    cfg = _cfg(corpus, "tiny-switchall", steps=10, amp="fp32", checkpoint_every=5)
    plain = train(cfg, tmp_path / "plain", quiet=True)
    sharded = train(TrainConfig.from_dict({**cfg.to_dict(), "parallel": "fsdp"}),
                    tmp_path / "fsdp", quiet=True)
    for s in plain.losses:
        assert abs(sharded.losses[s] - plain.losses[s]) < 1e-4, s
    assert is_sharded_checkpoint(sharded.checkpoint)
    tm = load_trained(tmp_path / "fsdp", DEVICE)
    assert tm.checkpoint.step == 10
    # Compiled blocks under FSDP2 (compiled first, then sharded, as torchtitan does).
    torch._dynamo.reset()
    both = train(TrainConfig.from_dict({**cfg.to_dict(), "parallel": "fsdp", "compile": True}),
                 tmp_path / "fsdp-compiled", quiet=True)
    for s in plain.losses:
        assert abs(both.losses[s] - plain.losses[s]) < 1e-4, s
