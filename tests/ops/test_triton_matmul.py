"""The "triton" expert matmul (moeify.ops.moe.kernels.scatter_gemm) against the pair-by-pair float64
definition (references.ref_expert_rows): outputs and the x, w and gate gradients, for every
output contract, widths that are not multiples of the tiles, empty experts, skewed routing,
one expert per row (plain stores instead of atomics), fp32 and fp16; then partial gradients,
torch.compile, and the errors where it cannot run.

On a machine without CUDA the kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 must
be in the environment when the kernels are decorated (moeify.ops.moe.kernels._triton_jit, imported on
first use) and, for older Triton, when triton is first imported, so it is set here before
triton is imported and restored when the module ends. With CUDA the same tests run the compiled
kernels on the GPU. Skipped where triton is not installed. Tiny shapes: the interpreter runs
every program of the grid in Python.

Shape legend: M rows, K experts per row, E experts, D input width, F output width, G output
groups, R rows summed per output, B sequences.
"""

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
_SAVED_ENV = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e "
                             "'.[triton]' in the checkout); the fused expert-matmul kernels need it")

from moeify.ops.moe.kernels import scatter_gemm as triton_matmul  # noqa: E402
from moeify.ops.moe import expert_matmul, make_plan
from moeify.ops.moe import resolved_impl  # noqa: E402
from references import ref_expert_matmul_grads, ref_expert_rows, routed_inputs  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
# Largest error over the largest reference entry.
TOL = {f32: 1e-5, f16: 5e-3, bf16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def interpreter_env():
    kernels = sys.modules.get("moeify.ops.moe.kernels._triton_jit")
    if not CUDA and kernels is not None and not kernels.INTERPRET:
        pytest.skip("the Triton kernels were decorated without TRITON_INTERPRET=1 earlier in "
                    "this process; run this file alone (or with TRITON_INTERPRET=1 set)")
    yield
    if _SAVED_ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    elif not CUDA:
        os.environ["TRITON_INTERPRET"] = _SAVED_ENV


def rel_err(got, want):
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def check(x, idx, w, gates, tol, plan=None, **kw):
    """impl="triton" on DEVICE against the reference: output, dtypes and every gradient."""
    want, g, want_grads = ref_expert_matmul_grads(x, idx, w, gates, **kw)
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, w, gates) if t is not None]
    y = expert_matmul(inputs[0], idx.to(DEVICE), inputs[1],
                      inputs[2] if gates is not None else None, impl="triton", plan=plan, **kw)
    assert y.dtype == x.dtype and y.shape == want.shape
    assert rel_err(y, want) <= tol, "output"
    grads = torch.autograd.grad(y, inputs, g.to(DEVICE, y.dtype))
    for name, a, t, b in zip(("x", "w", "gates"), grads, inputs, want_grads):
        assert a.dtype == t.dtype, name
        assert rel_err(a, b) <= tol, f"grad {name}"


# contract: (M, K, E, groups, sum_rows, batch, gated); the ids of a row are K distinct experts
# in units of K / max(G, R), unit u in group u % max(G, R) (SwitchHead's per-head experts).
CONTRACTS = {
    "rows": (9, 3, 5, 1, 1, None, False),  # [M, K, F]
    "sum": (12, 2, 5, 1, 1, None, True),  # [M, F]: sigma-MoE, Switch
    "k1": (12, 1, 4, 1, 1, None, True),  # one expert per row: stores, no atomics
    "groups2": (8, 4, 10, 2, 1, None, True),  # [M, G, F]: SwitchHead's value experts
    "sum_rows2": (12, 2, 10, 1, 2, None, True),  # [M / R, F]: SwitchHead's output experts
    "batch": (12, 4, 10, 2, 1, 3, True),  # [B, G, S, F]
}


def contract_inputs(name, D, F, dtype, skew=False, seed=1):
    M, K, E, G, R, B, gated = CONTRACTS[name]
    n = max(G, R)
    x, idx, w, gates = routed_inputs(M, K, E, D, F, dtype=dtype, seed=seed, skew=skew,
                                     gated=gated, n_groups=n, unit=K // n)
    return x, idx, w, gates, dict(groups=G, sum_rows=R, batch=B)


@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_every_contract_fp32_odd_widths(contract):
    """D 41 and F 76: neither a multiple of the tiles (masks on every load and store)."""
    x, idx, w, gates, kw = contract_inputs(contract, 41, 76, f32)
    check(x, idx, w, gates, TOL[f32], **kw)


@pytest.mark.parametrize("contract", ["rows", "sum", "k1", "sum_rows2"])
def test_unpadded_widths_give_the_same_results(contract, monkeypatch):
    """MOEIFY_TRITON_PAD=0: the kernels see D 41 and F 76 as they are (the masks alone keep the
    tiles in bounds), and still agree with the definition."""
    monkeypatch.setenv("MOEIFY_TRITON_PAD", "0")
    x, idx, w, gates, kw = contract_inputs(contract, 41, 76, f32)
    check(x, idx, w, gates, TOL[f32], **kw)


@pytest.mark.parametrize("pad", ["1", "0"])
def test_every_launch_sees_aligned_widths_and_rows(pad, monkeypatch):
    """The widths and row strides handed to every kernel are multiples of 16 elements (what
    Triton's divisibility marks need to vectorise the loads), and the tensors contiguous, at
    widths that are not (D 41, F 76); with MOEIFY_TRITON_PAD=0 they are passed as they are."""
    monkeypatch.setenv("MOEIFY_TRITON_PAD", pad)
    seen = []
    real = triton_matmul._launch

    def spy(name, grid_fn, *args, **kwargs):
        seen.append((name, args))
        return real(name, grid_fn, *args, **kwargs)

    monkeypatch.setattr(triton_matmul, "_launch", spy)
    x, idx, w, gates, kw = contract_inputs("sum", 41, 76, f32)
    check(x, idx, w, gates, TOL[f32], **kw)
    assert sorted({name for name, _ in seen}) == ["bwd_w", "bwd_x", "fwd"]
    for name, args in seen:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        D, F = args[len(tensors) + 1], args[len(tensors) + 2]  # after N
        strides = [a for a in args[len(tensors) + 4:] if isinstance(a, int)]
        assert all(t.is_contiguous() for t in tensors), name
        if pad == "1":
            assert (D, F) == (48, 80), name
            assert all(s % 16 == 0 for s in strides if s != 1), (name, strides)
        else:
            assert (D, F) == (41, 76), name


@pytest.mark.parametrize("contract", ["rows", "groups2", "sum_rows2"])
def test_fp16(contract):
    x, idx, w, gates, kw = contract_inputs(contract, 24, 40, f16)
    check(x, idx, w, gates, TOL[f16], **kw)


@pytest.mark.skipif(not CUDA, reason="bf16 tl.dot is wrong in Triton's CPU interpreter")
@pytest.mark.parametrize("contract", ["rows", "groups2", "sum_rows2"])
def test_bf16(contract):
    x, idx, w, gates, kw = contract_inputs(contract, 41, 76, bf16)
    check(x, idx, w, gates, TOL[bf16], **kw)


def test_skewed_routing_spans_several_tiles():
    """Expert 0 in every row: its pairs fill several BLOCK_M tiles (and grad_w chunks) while
    the others have a few or none."""
    x, idx, w, gates = routed_inputs(40, 2, 6, 20, 12, dtype=f32, seed=3, skew=True)
    assert int((idx == 0).sum()) == 40
    check(x, idx, w, gates, TOL[f32])


def test_empty_experts_get_zero_weight_gradient():
    x, idx, w, gates = routed_inputs(10, 2, 6, 17, 9, dtype=f32, seed=4)
    idx = torch.where(idx >= 3, idx - 3, idx)  # experts 3, 4, 5 empty; repeats within a row
    check(x, idx, w, gates, TOL[f32])
    ws = w.clone().requires_grad_()
    expert_matmul(x.to(DEVICE), idx.to(DEVICE), ws.to(DEVICE), gates.to(DEVICE),
                  impl="triton").sum().backward()
    assert ws.grad[3:].abs().max() == 0


def test_no_rows():
    x, idx, w, gates = routed_inputs(0, 2, 4, 8, 8, dtype=f32)
    xs, ws = x.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    y = expert_matmul(xs, idx.to(DEVICE), ws, gates.to(DEVICE), impl="triton")
    assert y.shape == (0, 8)
    y.sum().backward()
    assert ws.grad.abs().max() == 0


def test_no_rows_compiled_with_a_gate_gradient():
    """A compiled graph with no rows (an expert-parallel rank that received no token) and gates
    that need a gradient: the kept products are [0, F], still kept products."""
    x, idx, w, gates = routed_inputs(0, 2, 4, 8, 8, dtype=f32)
    xs, ws, gs = (t.to(DEVICE).requires_grad_() for t in (x, w, gates))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, idx, w, gates):
        return expert_matmul(x, idx, w, gates, impl="triton")

    torch._dynamo.reset()
    y = f(xs, idx.to(DEVICE), ws, gs)
    assert y.shape == (0, 8)
    gx, gw, gg = torch.autograd.grad(y.sum(), (xs, ws, gs))
    assert gx.shape == (0, 8) and gg.shape == (0, 2) and gw.abs().max() == 0


def test_partial_gradients_and_a_shared_plan():
    """Only some inputs require grad (the kernels skip the rest); one plan for two calls."""
    x, idx, w, gates, kw = contract_inputs("groups2", 20, 12, f32)
    want, g, (gx, gw, gg) = ref_expert_matmul_grads(x, idx, w, gates, **kw)
    plan = make_plan(idx.to(DEVICE), w.shape[0])
    for needs, wants in (((False, False, True), (gg,)), ((True, False, False), (gx,)),
                         ((False, True, False), (gw,))):
        ins = [t.to(DEVICE).requires_grad_(n) for t, n in zip((x, w, gates), needs)]
        y = expert_matmul(ins[0], idx.to(DEVICE), ins[1], ins[2], impl="triton", plan=plan,
                          **kw)
        got = torch.autograd.grad(y, [t for t in ins if t.requires_grad], g.to(DEVICE, f32))
        for a, b in zip(got, wants):
            assert rel_err(a, b) <= TOL[f32]


def test_stride_zero_and_non_contiguous_inputs():
    x, idx, w, gates = routed_inputs(8, 2, 4, 12, 16, dtype=f32, seed=5)
    w_nc = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, D, F] with F-major strides
    xs, ws = x.to(DEVICE).detach().requires_grad_(), w_nc.to(DEVICE).detach().requires_grad_()
    y = expert_matmul(xs, idx.to(DEVICE), ws, gates.to(DEVICE), impl="triton")
    y.sum().backward()  # a stride-0 output gradient
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_expert_rows(xr, idx, wr, gates.double()).sum().backward()
    assert rel_err(xs.grad, xr.grad) <= TOL[f32] and rel_err(ws.grad, wr.grad) <= TOL[f32]


def test_autocast_runs_in_the_autocast_dtype():
    """Under autocast expert_matmul casts x and w; the Function itself runs with autocast off
    and casts the incoming gradient to its operands' dtype."""
    x, idx, w, gates = routed_inputs(8, 2, 4, 16, 16, dtype=f32, seed=6)
    xs, ws, gs = (t.to(DEVICE).requires_grad_() for t in (x, w, gates))
    dt = bf16 if CUDA else f16
    with torch.autocast(DEVICE, dtype=dt):
        y = expert_matmul(xs, idx.to(DEVICE), ws, gs, impl="triton")
    assert y.dtype == dt
    y.float().sum().backward()
    assert xs.grad.dtype == ws.grad.dtype == gs.grad.dtype == f32


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False)],
                         ids=["all-grads", "x-grad-only"])
def test_compiled_graph_keeps_the_registered_ops(needs):
    """fullgraph: no graph break around the kernels (aot_eager: no code generation needed);
    also with gradients for x alone (the registered backward returns distinct empty tensors)."""
    x, idx, w, gates, kw = contract_inputs("groups2", 20, 12, f32)
    want, g, want_grads = ref_expert_matmul_grads(x, idx, w, gates, **kw)
    ins = [t.to(DEVICE).requires_grad_(n) for t, n in zip((x, w, gates), needs)]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, idx, w, gates):
        return expert_matmul(x, idx, w, gates, impl="triton", **kw)

    torch._dynamo.reset()
    y = f(ins[0], idx.to(DEVICE), ins[1], ins[2])
    assert rel_err(y, want) <= TOL[f32]
    got = torch.autograd.grad(y, [t for t in ins if t.requires_grad], g.to(DEVICE, f32))
    for a, b in zip(got, [b for b, n in zip(want_grads, needs) if n]):
        assert rel_err(a, b) <= TOL[f32]


def test_auto_takes_triton_on_cuda_only():
    x, idx, w, _ = routed_inputs(8, 2, 4, 16, 16, dtype=f32)
    assert resolved_impl("auto", x, idx, w) != "triton"  # never on the CPU, interpreter or not
    if CUDA:
        assert resolved_impl("auto", x.cuda(), idx.cuda(), w.cuda()) == "triton"


def test_cannot_run_raises_a_value_error_that_says_what_to_do(monkeypatch):
    x, idx, w, gates = routed_inputs(4, 2, 4, 8, 8, dtype=f32)
    with pytest.raises(ValueError, match="float64"):
        expert_matmul(x.double().to(DEVICE), idx.to(DEVICE), w.double().to(DEVICE),
                      impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        expert_matmul(x, idx, w, gates, impl="triton")
    monkeypatch.setattr(triton_matmul, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[triton\]'"):
        expert_matmul(x, idx, w, gates, impl="triton")


@pytest.mark.skipif(CUDA, reason="on a GPU the tests above compile and run the kernels for real")
def test_every_kernel_compiles_for_hopper():
    """The real compiler (not the interpreter) for sm_90, bf16 at the 47M SwitchHead shape: each
    kernel's largest autotune configuration compiles and fits in shared memory
    (scripts/triton_compile_check.py; without --largest it checks every configuration)."""
    import json
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), env.get("PYTHONPATH", "")])
    script = str(repo / "scripts" / "triton_compile_check.py")
    # The expert MLP's variants (hidden units read or written in expert order) too.
    res = subprocess.run([sys.executable, script, "--largest", "--mlp", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout)["rows"]
    assert len(rows) == 5 and all(r["ok"] and r["traffic"] == "vector" for r in rows), rows
    # At the padded widths every kernel moves its tiles by 16-byte asynchronous copies; at 412
    # and 76 as given, the compiler can prove no row aligned and loads 2 bytes at a time.
    traffic = {}
    for unpadded in (False, True):
        res = subprocess.run([sys.executable, script, "--largest", "--json"]
                             + ["--unpadded"] * unpadded, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        rows = json.loads(res.stdout)["rows"]
        traffic[unpadded] = {r["kernel"]: r["traffic"] for r in rows}
    assert len(traffic[False]) == 4 and set(traffic[False].values()) == {"vector"}
    assert set(traffic[True].values()) == {"scalar"}


@pytest.mark.parametrize("K", [2, 1])
def test_expert_mlp_keeps_its_hidden_units_in_expert_order(K, monkeypatch):
    """sigma-MoE / Switch (moeify.ops.moe.mlp): with impl="triton" the two matmuls run on the
    kernels with the hidden units in expert order between them (the first writes them sorted,
    the second reads them there; the backward's four products likewise), with atomics (K = 2)
    and stores (K = 1), at widths that are not multiples of the tiles; outputs and every
    gradient against the float64 definition."""
    from moeify.ops.moe import expert_mlp
    from references import ref_expert_mlp

    launches = []
    launch = triton_matmul._launch

    def spy(name, grid, *args, **kw):
        launches.append((name, *(kw.get(m) for m in ("X_ROWS", "Y_ROWS", "G_ROWS"))))
        return launch(name, grid, *args, **kw)

    monkeypatch.setattr(triton_matmul, "_launch", spy)
    x, idx, w1, gates = routed_inputs(10, K, 4, 12, 20, dtype=f32, seed=8)
    w2 = torch.randn(4, 20, 12, generator=torch.Generator().manual_seed(9))
    ins = [t.to(DEVICE).requires_grad_() for t in (x, w1, w2, gates)]
    y = expert_mlp(ins[0], idx.to(DEVICE), ins[1], ins[2], ins[3], impl="triton")
    row, pair, srt = triton_matmul.ROW, triton_matmul.PAIR, triton_matmul.SORTED
    assert launches == [("fwd", row, srt, None), ("fwd", srt, pair, None)]
    refs = [t.detach().double().requires_grad_() for t in (x, w1, w2, gates)]
    want = ref_expert_mlp(refs[0], idx, refs[1], refs[2], refs[3])
    assert rel_err(y, want) <= TOL[f32]
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(10), dtype=f64)
    for a, b in zip(torch.autograd.grad(y, ins, g.to(DEVICE, f32)),
                    torch.autograd.grad(want, refs, g)):
        assert rel_err(a, b) <= TOL[f32]
    assert launches[2:] == [("fwd", row, srt, None), ("bwd_w", srt, None, row),
                            ("bwd_w", row, None, srt), ("bwd_x", None, None, srt)]


def _tilings() -> int:
    """How many tilings each kernel's autotune list holds (the three lists are as long)."""
    from moeify.ops.moe.kernels import _triton_jit as k

    return len(k.FWD_CONFIGS)


@pytest.mark.parametrize("i", range(_tilings()))
def test_every_autotune_configuration_computes_the_definition(i, monkeypatch):
    """The i-th tiling of each kernel's autotune list (the GPU's choices; the suite otherwise
    runs one fixed tiling), launched with its meta-parameters (in the interpreter on CPU),
    against the definition: outputs and every gradient, with atomics (K = 2) and stores
    (K = 1), at widths that are not multiples of the tiles."""
    from moeify.ops.moe.kernels import _triton_jit as k

    assert len(k.FWD_CONFIGS) == len(k.BWD_X_CONFIGS) == len(k.BWD_W_CONFIGS) >= 6
    kernels = {name: (kernel, dict(configs[i].kwargs)) for name, kernel, configs in
               (("fwd", k._fwd, k.FWD_CONFIGS), ("bwd_x", k._bwd_x, k.BWD_X_CONFIGS),
                ("bwd_w", k._bwd_w, k.BWD_W_CONFIGS))}
    monkeypatch.setattr(triton_matmul, "_kernels", lambda: kernels)
    for contract in ("sum", "k1"):
        x, idx, w, gates, kw = contract_inputs(contract, 41, 76, f32, seed=i)
        check(x, idx, w, gates, TOL[f32], **kw)


def test_autotune_off_gives_each_gpu_kernel_its_first_configuration(monkeypatch):
    from moeify.ops.moe.kernels import _triton_jit as k

    monkeypatch.setattr(k, "INTERPRET", False)
    monkeypatch.setattr(k, "AUTOTUNE", False)
    fixed = k.build()
    assert fixed["autotuned"] is False
    for name, configs in (("fwd", k.FWD_CONFIGS), ("bwd_w", k.BWD_W_CONFIGS)):
        kernel, meta = fixed[name]
        c = configs[0]
        assert meta == {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
    monkeypatch.setattr(k, "AUTOTUNE", True)
    assert k.build()["autotuned"] is True


@pytest.mark.skipif(CUDA, reason="on a GPU autotuning picks among the configurations")
def test_the_tilings_that_fit_width_76_compute_the_same(monkeypatch):
    """The configurations that tile F by 16 (76 padded to 80: five tiles, nothing wasted), run in
    the interpreter as the fixed configuration of every kernel: the value experts' contract
    against the reference (outputs and every gradient)."""
    from moeify.ops.moe.kernels import _triton_jit as k

    narrow = {name: next(c for c in configs if c.kwargs["BLOCK_F"] == 16)
              for name, configs in (("fwd", k.FWD_CONFIGS), ("bwd_x", k.BWD_X_CONFIGS),
                                    ("bwd_w", k.BWD_W_CONFIGS))}
    kernels = {"fwd": k._fwd, "bwd_x": k._bwd_x, "bwd_w": k._bwd_w}
    built = {name: (kernels[name], dict(c.kwargs)) for name, c in narrow.items()}
    monkeypatch.setattr(triton_matmul, "_kernels", lambda: dict(built, autotuned=False))
    x, idx, w, gates, kw = contract_inputs("groups2", 24, 76, f32, seed=3)
    check(x, idx, w, gates, TOL[f32], **kw)


@pytest.mark.parametrize("gated", [False, True])
def test_variable_k_expert_mlp_fp32(gated):
    """ReMoE's variable number of experts per row (moeify.ops.moe.pairs) with impl="triton":
    rows with no expert, one and all, against the pair-by-pair float64 definition."""
    from moeify.ops.moe import mask_expert_mlp
    from references import ref_varlen_expert_mlp

    g = torch.Generator().manual_seed(3)
    M, E, D, G = 10, 4, 41, 24
    x, logits = torch.randn(M, D, generator=g, dtype=f64), torch.randn(M, E, generator=g,
                                                                         dtype=f64)
    logits[0], logits[1] = -1.0, 1.0
    w1, w2, wu = (torch.randn(*s, generator=g, dtype=f64) / 4
                  for s in ((E, D, G), (E, G, D), (E, D, G)))
    act = "silu" if gated else "relu"
    leaves = [t.clone().requires_grad_() for t in (x, logits, w1, w2, wu)]
    want = ref_varlen_expert_mlp(leaves[0], torch.relu(leaves[1]), leaves[2], leaves[3],
                                 leaves[4] if gated else None, act)
    dev = [t.detach().to(DEVICE, f32).requires_grad_() for t in (x, logits, w1, w2, wu)]
    y = mask_expert_mlp(dev[0], torch.relu(dev[1]), dev[2], dev[3],
                        w_up_EDG=dev[4] if gated else None, activation=act, impl="triton")
    assert rel_err(y, want) <= TOL[f32]
    gy = torch.randn(M, D, generator=g, dtype=f64)
    n = 5 if gated else 4
    for a, b in zip(torch.autograd.grad(y, dev[:n], gy.to(DEVICE, f32)),
                    torch.autograd.grad(want, leaves[:n], gy)):
        assert rel_err(a, b) <= TOL[f32]
