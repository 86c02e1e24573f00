"""torch.compile: every family's blocks compile as one graph each (fullgraph=True fails on any
graph break, so the hot path has no host sync and no data-dependent Python branch), and the
compiled model agrees with the eager one in float32: loss, logits, every gradient and the
routing-usage buffers. One small model per family (compiling is slow on a busy CPU)."""

import copy

import pytest
import torch

from moeify.models.presets import get_preset
from moeify.ops.moe import choose_impl, expert_matmul, make_plan
from moeify.ops.moe.policy import compiled_impl
from moeify.train.config import apply_model_overrides

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = ("model.d_model=32", "model.n_layers=2", "model.context_length=16")
# Every family, in four compiles: SwitchAll = SwitchHead + sigma-MoE, MoDE = Mixture-of-Depths
# + Switch. The dense model's blocks hold nothing the others' do not lower through inductor (the
# attention core is SwitchHead's and MoA's, the dense feedforward MoA's): it is traced whole
# (graph breaks, AOT autograd) with the aot_eager backend, which skips inductor's code generation.
FAMILIES = ("tiny-dense", "tiny-switchall", "tiny-moa", "tiny-mode")
BACKEND = {"tiny-dense": "aot_eager"}


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
        block.compile(fullgraph=True, backend=BACKEND.get(preset, "inductor"))  # raises on a break
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


class GraphRecorder:
    """A torch.compile backend that keeps every graph dynamo hands it (then runs it eagerly)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def calls(self) -> list:
        return [n for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("preset", ("tiny-switchall", "tiny-moa", "tiny-mode", "tiny-moeut"))
def test_compiled_moe_blocks_keep_the_sparse_expert_op(preset):
    """Every MoE family's compiled graph calls the registered expert op, moeify::expert_matmul,
    for each of its expert matmuls (two or more per block), and no dense matmul over all
    experts (the reference kernel's einsum "md,edf->mef"). The traced graphs compute what the
    eager model does (MoEUT: its shared blocks, applied G times each, trace once)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _small(preset).build().train()
    eager = copy.deepcopy(model)
    rec = GraphRecorder()
    for block in model.blocks:
        block.compile(fullgraph=True, backend=rec)
    ids_BT = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    out, grads, _ = _run(model, ids_BT)
    out_e, grads_e, _ = _run(eager, ids_BT)
    torch.testing.assert_close(out.loss + out.aux_loss, out_e.loss + out_e.aux_loss,
                               rtol=0, atol=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
    calls = rec.calls()
    n_ops = sum(n.target is torch.ops.moeify.expert_matmul.default for n in calls)
    assert n_ops >= 2 * len(rec.graphs)  # the blocks of one kind share a graph
    dense = [n for n in calls if n.target is torch.einsum and "edf" in str(n.args[0])]
    assert not dense


def test_the_compiled_op_picks_a_slot_layout_kernel():
    x, w = torch.randn(4, 8), torch.randn(3, 8, 8)
    assert compiled_impl("auto", x, w) == "auto"  # resolved inside the op, from the routing
    assert compiled_impl("padded", x, w) == "padded"  # an explicit layout kernel is kept
    assert compiled_impl("reference", x, w) == "auto"  # whole-contract kernels give way
    idx = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    plan = make_plan(idx, 3)
    assert choose_impl("auto", x, w, plan, k=2, layouts_only=True) in ("padded", "segment")


@pytest.mark.parametrize("impl", ["auto", "segment", "grouped", "padded"])
@pytest.mark.parametrize("contract", ["rows", "sum", "groups", "sum_rows"])
def test_the_registered_op_matches_the_reference(impl, contract):
    """moeify::expert_matmul (what a compiled graph runs) called directly, against the float64
    pair-by-pair reference: outputs and the x, w and gate gradients; and torch.library's own
    checks of its fake implementation and autograd registration (opcheck)."""
    from moeify.ops.moe.compiled import expert_matmul_fwd, expert_matmul_op
    from references import ref_expert_matmul_grads

    g = torch.Generator().manual_seed(0)
    M, K, E, D, F = 24, 4, 6, 16, 8
    groups, sum_rows, gated = dict(rows=(1, 1, False), sum=(1, 1, True), groups=(2, 1, True),
                                   sum_rows=(1, 2, True))[contract]
    x = torch.randn(M, D, generator=g, dtype=torch.float64)
    w = torch.randn(E, D, F, generator=g, dtype=torch.float64)
    gates = torch.rand(M, K, generator=g, dtype=torch.float64) if gated else None
    idx = torch.rand(M, E, generator=g).topk(K, -1).indices
    want, gy, want_grads = ref_expert_matmul_grads(x, idx, w, gates, groups=groups,
                                                   sum_rows=sum_rows)
    dtype = torch.float32  # grouped_mm has no float64
    inputs = [t.detach().to(dtype).requires_grad_() for t in (x, w, gates) if t is not None]
    y = expert_matmul_op(inputs[0], idx, inputs[1], inputs[2] if gated else None, groups,
                         sum_rows, None, impl)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(torch.autograd.grad(y, inputs, gy.to(dtype)), want_grads):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    args = (inputs[0].detach().requires_grad_(), idx, inputs[1].detach().requires_grad_(),
            inputs[2].detach().requires_grad_() if gated else None, groups, sum_rows, impl, 0,
            False)
    torch.library.opcheck(expert_matmul_fwd, args)


@pytest.mark.parametrize("impl", ["auto", "grouped", "segment", "padded"])
def test_the_compiled_expert_mlp_runs_the_registered_op(impl):
    """expert_mlp in a fullgraph: its two expert matmuls are the registered op whatever the
    implementation named (widths of 8 and 16 floats, rows grouped_mm can take), equal to
    eager."""
    from moeify.ops.moe import expert_mlp

    g = torch.Generator().manual_seed(0)
    M, K, E, D, G = 12, 2, 4, 8, 16
    x = torch.randn(M, D, generator=g, requires_grad=True)
    w1 = torch.randn(E, D, G, generator=g, requires_grad=True)
    w2 = torch.randn(E, G, D, generator=g, requires_grad=True)
    gates = torch.rand(M, K, generator=g, requires_grad=True)
    idx = torch.rand(M, E, generator=g).topk(K, -1).indices
    rec = GraphRecorder()
    torch._dynamo.reset()
    f = torch.compile(lambda *a: expert_mlp(*a, impl=impl), fullgraph=True, backend=rec)
    y = f(x, idx, w1, w2, gates)
    want = expert_mlp(x, idx, w1, w2, gates, impl="reference")
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(y.sum(), (x, w1, w2, gates))
    ref = torch.autograd.grad(want.sum(), (x, w1, w2, gates))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sum(n.target is torch.ops.moeify.expert_matmul.default for n in rec.calls()) == 2


def test_float_expert_ids_are_refused_compiled_too():
    x, w = torch.randn(4, 8), torch.randn(3, 8, 5)
    f = torch.compile(lambda x, i, w: expert_matmul(x, i, w), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="expert ids must be an integer tensor"):
        f(x, torch.zeros(4, 2), w)
