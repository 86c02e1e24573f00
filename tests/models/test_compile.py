"""torch.compile: every family's blocks compile as one graph each (fullgraph=True fails on any
graph break, so the hot path has no host sync and no data-dependent Python branch), and the
compiled model agrees with the eager one in float32: loss, logits, every gradient and the
routing-usage buffers. One small model per family (compiling is slow on a busy CPU)."""

import copy

import pytest
import torch

from moeify.models.presets import get_preset
from moeify.ops.expert_matmul import choose_impl, compiled_impl, expert_matmul
from moeify.train.config import apply_model_overrides

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
# Every family, in four compiles: SwitchAll = SwitchHead + sigma-MoE, MoDE = Mixture-of-Depths
# + Switch.
FAMILIES = ("tiny-dense", "tiny-switchall", "tiny-moa", "tiny-mode")


def _small(preset: str):
    extra = ("model.feedforward.d_ff=64",) if preset in ("tiny-dense", "tiny-moa") else ()
    return apply_model_overrides(get_preset(preset), SMALL + extra)


def _run(model, ids_BT, memory=None):
    out = model(ids_BT[:, :-1], ids_BT[:, 1:], memory=memory)
    (out.loss + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    bufs = {n: b.clone() for n, b in model.named_buffers() if n.split(".")[-1].startswith(
        ("usage", "dropped"))}
    return out, grads, bufs


@pytest.mark.parametrize("preset", FAMILIES)
def test_compiled_blocks_have_no_graph_break_and_match_eager(preset):
    torch._dynamo.reset()
    cfg = _small(preset)
    torch.manual_seed(0)
    eager = cfg.build().train()
    compiled = copy.deepcopy(eager)
    for block in compiled.blocks:
        block.compile(fullgraph=True)  # raises on a graph break
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1), generator=g)
    memory = None
    if cfg.xl_memory:  # the XL path with a memory chunk, as in training
        with torch.no_grad():
            memory = eager.eval()(ids_BT[:, :-1]).memory
        eager.train()
    out_e, grads_e, bufs_e = _run(eager, ids_BT, memory)
    out_c, grads_c, bufs_c = _run(compiled, ids_BT, memory)
    torch.testing.assert_close(out_c.loss, out_e.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(out_c.aux_loss, out_e.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(out_c.logits, out_e.logits, rtol=0, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5,
                                   msg=name)
    # Routing statistics are counted inside the compiled graph exactly as in eager mode.
    assert bufs_c.keys() == bufs_e.keys()
    for name in bufs_e:
        assert torch.equal(bufs_c[name], bufs_e[name]), name
    if preset != "tiny-dense":
        assert any(b.sum() > 0 for b in bufs_e.values())


def test_auto_takes_a_sync_free_expert_matmul_only_inside_a_compiled_graph():
    x, w = torch.randn(4, 8), torch.randn(3, 8, 8)
    assert choose_impl("auto", x, w) == "segment"
    assert compiled_impl(x, w) == "reference"
    seen = []

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        seen.append(choose_impl("auto", x, w))
        return x + 1

    f(x)
    assert seen == ["reference"]
    # An explicit choice is kept.
    assert choose_impl("padded", x, w) == "padded"


@pytest.mark.parametrize("groups", [1, 2])
def test_the_traced_grouped_path_matches_the_reference(groups):
    """The grouped GEMM as a plain differentiable op (what "auto" takes in a compiled bf16 CUDA
    graph), checked eagerly on the CPU against the reference: outputs and gradients."""
    from moeify.ops.expert_matmul import _grouped_traced, make_plan

    g = torch.Generator().manual_seed(0)
    M, K, E, D, F = 24, 4, 6, 16, 8
    x = torch.randn(M, D, generator=g, dtype=torch.float64)
    w = torch.randn(E, D, F, generator=g, dtype=torch.float64)
    gates = torch.rand(M, K, generator=g, dtype=torch.float64)
    idx = torch.rand(M, E, generator=g).topk(K, -1).indices
    gy = torch.randn(M, groups, F, generator=g, dtype=torch.float64).squeeze(1)

    def run(fn, dtype):
        xs, ws, gs = (t.detach().to(dtype).requires_grad_() for t in (x, w, gates))
        y = fn(xs, ws, gs)
        (y * gy.to(y.dtype)).sum().backward()
        return [t.double() for t in (y, xs.grad, ws.grad, gs.grad)]

    want = run(lambda a, b, c: expert_matmul(a, idx, b, c, groups=groups, impl="reference"),
               torch.float64)
    got = run(lambda a, b, c: _grouped_traced(a, b, c, make_plan(idx, E), K, groups),
              torch.bfloat16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
