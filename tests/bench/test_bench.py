"""The benchmarks: the textbook dense layer against DenseAttention (outputs and gradients), the
structure of `moeify bench attention` / `bench step` results, and the peak-memory probe.

Shape legend: B batch, T queries, S sources (memory + current), D d_model.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from moeify.bench.attention import (
    add_dense_baselines,
    bench_attention,
    dense_baseline_for,
    group_by_shape,
    layer_phases,
    resolve_cases,
)
from moeify.bench.memory import peak_memory, run_phases
from moeify.bench.step import bench_step, model_forward_macs
from moeify.bench.textbook import textbook_attention
from moeify.cli.main import main
from moeify.layers.attention import DenseAttentionConfig
from moeify.models.presets import get_preset

f64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


def tiny(name, T=8):
    return name, dataclasses.replace(get_preset(name), context_length=T)


# ---------------------------------------------------------------------------- textbook


@pytest.mark.parametrize("pos", ["xl", "rope", "none"])
@pytest.mark.parametrize("memory", [False, True])
def test_textbook_equals_dense_layer(pos, memory):
    torch.manual_seed(0)
    layer = DenseAttentionConfig(d_model=12, n_heads=3, d_head=6, pos=pos, n_layers=2).build()
    layer = layer.double()
    if pos == "xl":  # exercise u, v and the learned scale away from their initial values
        with torch.no_grad():
            layer.core.bias_u.normal_()
            layer.core.bias_v.normal_()
            layer.core.scale.fill_(0.3)
    B, T, M, D = 2, 5, 4, 12
    x = torch.randn(B, T, D, dtype=f64, requires_grad=True)
    mem = torch.randn(B, M, D, dtype=f64)
    kv = (lambda: torch.cat([mem, x], 1)) if memory else (lambda: None)
    g = torch.randn(B, T, D, dtype=f64)
    params = [x] + list(layer.parameters())
    y_ref, _ = layer(x, kv())
    y_tb = textbook_attention(layer, x, kv())
    torch.testing.assert_close(y_tb, y_ref, rtol=1e-10, atol=1e-12)
    g_ref = torch.autograd.grad((y_ref * g).sum(), params)
    g_tb = torch.autograd.grad((y_tb * g).sum(), params)
    for a, b in zip(g_tb, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_textbook_rejects_short_source():
    layer = DenseAttentionConfig(d_model=8, n_heads=2, d_head=4, pos="xl").build()
    with pytest.raises(ValueError, match="source"):
        textbook_attention(layer, torch.randn(1, 4, 8), torch.randn(1, 3, 8))


# ---------------------------------------------------------------------------- attention bench


def test_grouping_puts_dense_first_and_splits_shapes():
    cases = resolve_cases([tiny("tiny-switchhead"), tiny("tiny-dense"),
                           tiny("tiny-moa", T=16)])
    groups = group_by_shape(cases)
    assert [[n for n, _ in g] for g in groups] == [["tiny-dense", "tiny-switchhead"],
                                                   ["tiny-moa"]]


def test_dense_baseline_is_the_paper_rows_dense_preset():
    cases = resolve_cases(["wt103-47m-switchhead-experts-vok", "wt103-45m-rope-switchhead"])
    names = [n for n, _ in add_dense_baselines(cases)]
    assert names == ["wt103-47m-dense", "wt103-45m-rope-dense", "wt103-47m-switchhead-experts-vok",
                     "wt103-45m-rope-switchhead"]
    assert dense_baseline_for(*tiny("tiny-switchhead", T=8)) is None  # tiny-dense has T = 128
    assert dense_baseline_for("tiny-switchhead", get_preset("tiny-switchhead"))[0] == "tiny-dense"
    # A group that has a dense case keeps it as its baseline.
    assert len(add_dense_baselines(resolve_cases(["tiny-moa", "tiny-dense"]))) == 2


def test_bench_attention_rows_and_ratios():
    res = bench_attention([tiny("tiny-switchhead"), tiny("tiny-dense"), tiny("tiny-moa")],
                          batch=2, repeats=1, warmup=0, memory=False)
    (group,) = res["groups"]
    assert group["baseline"] == "tiny-dense" and group["batch"] == 2 and group["S"] == 16
    assert res["threads"] == 1 and isinstance(res["omp_wait_policy"], str)
    rows = {r["case"]: r for r in group["rows"]}
    assert list(rows) == ["tiny-dense", "tiny-dense (textbook)", "tiny-switchhead", "tiny-moa"]
    base = rows["tiny-dense"]
    assert base["fwd x"] == 1.0 and base["fwd+bwd x"] == 1.0 and base["MACs x"] == 1.0
    for r in rows.values():
        assert r["fwd ms"] > 0 and r["fwd+bwd ms"] > 0 and r["peak MiB"] is None
        assert r["fwd+bwd x"] == pytest.approx(r["fwd+bwd ms"] / base["fwd+bwd ms"])
    # moeify.models.cost by hand, T = 8, C = 2: dense XL H=4 d_h=32 d=128; SwitchHead H=2 d_h=32
    # E=4 k=2 VO
    T, C, d = 8, 2, 128
    dense = 2 * 4 * 32 * C * T * T + 4 * d * 4 * 32 * T + 2 * 4 * d * T * 32 * C
    sh = (2 * 2 * 32 * C * T * T + (2 * 2 + 2) * d * 2 * 32 * T + 2 * 2 * 2 * T * 32
          + 2 * 4 * d * T * C + 2 * 2 * d * T * 32)
    assert rows["tiny-switchhead"]["MACs"] == sh
    assert rows["tiny-switchhead"]["MACs x"] == pytest.approx(sh / dense)
    assert rows["tiny-dense (textbook)"]["MACs"] == dense


def test_layer_phases_backward_reaches_input_and_weights():
    name, cfg = tiny("tiny-switchhead")
    ph = layer_phases(cfg.to_json(), batch=1)
    ph["fwd"]()
    ph["fwd+bwd"]()  # runs, and leaves no gradients behind for the next repeat
    with pytest.raises(ValueError, match="dense attention"):
        layer_phases(cfg.to_json(), batch=1, textbook=True)


def test_peak_memory_sees_the_attention_matrices():
    # Dense XL, B=4, H=4, T=128, S=256: each [B, H, T, S] float32 tensor is 2 MiB and the
    # backward holds several (logits, probabilities, their gradients).
    cfg = get_preset("tiny-dense")
    peaks = peak_memory("moeify.bench.attention:layer_phases",
                        dict(config_json=cfg.to_json(), batch=4))
    assert set(peaks) == {"fwd", "fwd+bwd"}
    assert 4.0 <= peaks["fwd+bwd"]["working"] < 500.0
    assert peaks["fwd"]["working"] <= peaks["fwd+bwd"]["working"] <= peaks["fwd+bwd"]["peak"]


_KEPT = []


def _known_allocations():
    """Phase "a": 8 MiB allocated and freed. Phase "b": 4 MiB kept, then 2 MiB on top, freed."""
    def a():
        x = torch.empty(2 * 1024 * 1024)  # float32: 8 MiB
        x.fill_(1.0)
        del x

    def b():
        _KEPT.append(torch.ones(1024 * 1024))  # 4 MiB, still held after the phase
        y = torch.ones(512 * 1024)  # 2 MiB on top
        del y

    return {"a": a, "b": b}


class _Temporary(torch.autograd.Function):
    """Holds an 8 MiB temporary inside its forward; returns a small tensor."""

    @staticmethod
    def forward(ctx, x):
        t = x.new_ones(2 * 1024 * 1024)
        return t[:4] * x

    @staticmethod
    def backward(ctx, g):
        return g


class _TwoTemporaries(_Temporary):
    """Inside its forward: an 8 MiB temporary freed by Python, then a second one, then the
    result. Never more than 8 MiB held at once."""

    @staticmethod
    def forward(ctx, x):
        t = x.new_ones(2 * 1024 * 1024)
        s = t.sum()
        del t
        u = x.new_ones(2 * 1024 * 1024)
        return u[:4] * s


def _temporary_in_a_function():
    return {"call": lambda: _Temporary.apply(torch.ones(4))}


def _two_temporaries():
    return {"call": lambda: _TwoTemporaries.apply(torch.ones(4))}


@pytest.mark.parametrize("factory", ["_temporary_in_a_function", "_two_temporaries"])
def test_memory_timeline_books_frees_inside_a_function_at_their_time(factory):
    # One temporary: a free inside a custom Function is booked to its range and must count by
    # the range's end (8 MiB). Two, one after the other: each free counts at its own time;
    # booked at the range's end both would count (16 MiB).
    out = run_phases(f"{__name__}:{factory}", {})
    assert out["call"]["working"] == pytest.approx(8.0, abs=0.1)


def test_memory_timeline_by_hand():
    out = run_phases(f"{__name__}:_known_allocations", {})
    assert out["a"]["working"] == pytest.approx(8.0, abs=0.1)
    assert out["a"]["peak"] == pytest.approx(8.0, abs=0.1)
    assert out["b"]["working"] == pytest.approx(6.0, abs=0.1)
    assert out["b"]["peak"] == pytest.approx(8.0, abs=0.1)  # the peak so far was phase a's
    _KEPT.clear()


def test_step_memory_counts_weights_and_optimizer_state():
    _, cfg = tiny("tiny-switchhead")
    out = run_phases("moeify.bench.step:step_phases",
                     dict(config_json=cfg.to_json(), batch=1, steps=2), baseline="before_setup")
    n_params = sum(p.numel() for p in cfg.build().parameters())
    state = 3 * 4 * n_params / 2**20  # weights + AdamW's two moments, float32
    assert out["step 2"]["peak"] >= state
    assert 0 < out["step 2"]["working"] < out["step 2"]["peak"]


def test_cli_bench_attention_json(capsys):
    assert main(["bench", "attention", "--preset", "tiny-dense", "--preset", "tiny-switchhead",
                 "--batch", "1", "--repeats", "1", "--warmup", "0", "--no-memory",
                 "--no-textbook", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["case"] for r in res["groups"][0]["rows"]] == ["tiny-dense", "tiny-switchhead"]


def test_bench_expert_matmul_profile_counts_the_kernels_of_each_case(capsys):
    """``--profile``: one profiled call per case. The per-expert loop runs one matmul per expert
    for each of its three products (forward, input and weight gradients), the dense case three
    in all; the shares are of the whole call."""
    E = 4
    assert main(["bench", "expert-matmul", "-M", "256", "-D", "128", "-E", str(E), "-K", "2",
                 "-F", "64", "--repeats", "1", "--impl", "segment", "--profile", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    prof = res["profile"]
    route, concat = "dense route-shaped (equal MACs)", "dense concatenated (equal MACs)"
    assert set(prof) == {route, concat, "segment"}
    mm = {name: {r["kernel"]: r["calls"] for r in p["top"]}.get("aten::mm")
          for name, p in prof.items()}
    assert mm == {route: 3, concat: 3, "segment": 3 * E}
    for p in prof.values():
        assert p["counted"] == "operations"
        assert p["launches"] >= sum(r["calls"] for r in p["top"])
        assert 0 < sum(r["share"] for r in p["top"]) <= 1 + 1e-9
        assert sum(r["us"] for r in p["top"]) <= p["total_us"] + len(p["top"])  # rounded


def test_cli_bench_rejects_bad_input(capsys):
    assert main(["bench", "attention", "--preset", "no-such-preset", "--no-memory"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["bench", "step", "--batch", "0", "--no-memory"]) == 2
    assert "batch" in capsys.readouterr().err


# ---------------------------------------------------------------------------- step bench


def test_bench_step_puts_the_dense_baseline_first():
    res = bench_step(["tiny-switchhead"], batch=1, repeats=1, warmup=0, memory=False)
    assert [r["case"] for r in res["rows"]] == ["tiny-dense", "tiny-switchhead"]


def test_bench_step_rows():
    res = bench_step([tiny("tiny-dense"), tiny("tiny-switchhead"), tiny("tiny-sigmamoe")],
                     batch=2, repeats=1, warmup=0, memory=False)
    rows = {r["case"]: r for r in res["rows"]}
    assert res["baseline"] == "tiny-dense" and rows["tiny-dense"]["time x"] == 1.0
    assert all(r["step ms"] > 0 for r in rows.values())
    assert rows["tiny-sigmamoe"]["model MACs x"] is None  # no formula for a MoE feedforward
    assert rows["tiny-sigmamoe"]["attn MACs x"] == 1.0  # same dense attention


def test_model_forward_macs_by_hand():
    _, cfg = tiny("tiny-dense")
    attn, total = model_forward_macs(cfg)
    T, C, d, L, V, d_ff = 8, 2, 128, 4, 256, 512
    per_layer = 2 * 4 * 32 * C * T * T + 4 * d * 4 * 32 * T + 2 * 4 * d * T * 32 * C
    assert attn == L * per_layer
    assert total == L * (per_layer + 2 * d * d_ff * T) + d * V * T


def test_step_phases_run_in_order():
    from moeify.bench.step import step_phases

    _, cfg = tiny("tiny-switchhead")
    ph = step_phases(cfg.to_json(), batch=1, steps=2)
    assert list(ph) == ["step 1", "step 2"]
    ph["step 1"]()
    ph["step 2"]()


def test_cli_bench_step_and_attention_compile_report_compiled_beside_eager(capsys,
                                                                          monkeypatch):
    # Structure only: dynamo + AOT autograd without generated kernels keeps this short; inductor
    # itself is held to eager by tests/models/test_compile.py.
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{"backend": "aot_eager", **kw}))
    torch._dynamo.reset()
    monkeypatch.setenv("MOEIFY_COMPILE_BACKEND", "aot_eager")  # the step bench's own switch
    res = bench_step([tiny("tiny-dense", T=4)], batch=1, repeats=1, warmup=0, memory=False,
                     compile=("default", "reduce-overhead"))
    rows = {r["case"]: r for r in res["rows"]}
    assert list(rows) == ["tiny-dense", "tiny-dense compiled", "tiny-dense cuda-graphs"]
    assert res["warmup"] == 3 and res["compile"] == ["default", "reduce-overhead"]
    assert [r["compile"] for r in res["rows"]] == [None, "default", "reduce-overhead"]
    assert rows["tiny-dense"]["vs eager"] == 1.0
    for row in ("tiny-dense compiled", "tiny-dense cuda-graphs"):
        assert rows[row]["vs eager"] == pytest.approx(
            rows[row]["step ms"] / rows["tiny-dense"]["step ms"])
    with pytest.raises(ValueError, match="compile mode"):
        bench_step([tiny("tiny-dense", T=4)], compile=("max-speed",))
    assert main(["bench", "attention", "--preset", "tiny-dense", "--batch", "1", "--repeats",
                 "1", "--warmup", "0", "--no-memory", "--no-textbook", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "tiny-dense compiled" in out and "vs eager" in out


@pytest.mark.parametrize("bench", ["ff", "generate"])
def test_cli_bench_without_compiled_rows_refuses_compile(bench, capsys):
    # ff and generate time eager code only: --compile is refused rather than silently ignored.
    with pytest.raises(SystemExit) as e:
        main(["bench", bench, "--compile"])
    assert e.value.code == 2
    assert "unrecognized arguments: --compile" in capsys.readouterr().err


@pytest.mark.parametrize("flag, policy", [([], "default"), (["--omp-wait", "passive"], "PASSIVE")])
def test_cli_bench_omp_wait_policy_is_set_before_torch_loads(flag, policy):
    # libgomp reads the policy once, when torch loads: only a fresh process shows it taking effect.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import sys; from moeify.cli.main import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "bench", "generate", "--preset", "tiny-dense",
                          "--context", "4", "--batch", "1", "--tokens", "1", "--warmup", "0",
                          "--json", *flag], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["omp_wait_policy"] == policy


# ---------------------------------------------------------------------------- by operation


def test_op_times_counts_every_dispatched_operation_backward_included():
    from moeify.bench.op_times import GEMM_OPS, op_times

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    a, b = torch.randn(2, 4, 6), torch.randn(2, 6, 7)

    def fn():
        (x @ w).sum().backward()  # forward mm, then the two gradient mms
        torch.bmm(a, b)
        for _ in range(3):
            torch.softmax(b, -1)
        x.grad = w.grad = None

    res = op_times(fn, repeats=2, top=50)
    calls = {}
    for t in res["top"]:
        calls[t["op"]] = calls.get(t["op"], 0) + t["calls"]
    assert calls["mm"] == 3 and calls["bmm"] == 1 and calls["_softmax"] == 3
    by_shape = {(t["op"], tuple(map(tuple, t["shapes"]))) for t in res["top"]}
    assert ("bmm", ((2, 4, 6), (2, 6, 7))) in by_shape and ("mm", ((4, 3), (3, 5))) in by_shape
    gemm = sum(t["ms"] for t in res["top"] if t["op"] in GEMM_OPS)
    assert res["gemm ms"] == pytest.approx(gemm)  # every operation is in the top 50 here
    assert res["ops ms"] == pytest.approx(sum(t["ms"] for t in res["top"]))
    assert res["other ms"] == pytest.approx(res["ops ms"] - res["gemm ms"])
    assert [t["ms"] for t in res["top"]] == sorted((t["ms"] for t in res["top"]), reverse=True)
    assert 0 < res["ops ms"] <= res["wall ms"]
    assert len(op_times(fn, repeats=1, top=2)["top"]) == 2
    with pytest.raises(ValueError, match="repeats"):
        op_times(fn, repeats=0)


def test_bench_attention_splits_each_case_by_operation():
    from moeify.bench.attention import table

    res = bench_attention([tiny("tiny-dense"), tiny("tiny-switchhead")], batch=1, repeats=1,
                          warmup=0, memory=False, textbook=False, ops=4)
    rows = {r["case"]: r for r in res["groups"][0]["rows"]}
    base = rows["tiny-dense"]["ops"]
    for r in rows.values():
        assert len(r["ops"]["top"]) == 4
        assert 0 < r["ops"]["gemm ms"] < r["ops"]["ops ms"]
        assert r["GEMM x"] == pytest.approx(r["ops"]["gemm ms"] / base["ops ms"])
    assert rows["tiny-dense"]["GEMM x"] < 1
    text = table(res)
    assert "fwd+bwd by operation" in text and "slowest operations of tiny-switchhead" in text
    calls = [line.split()[-1] for part in text.split("slowest operations of")[1:]
             for line in part.splitlines()[3:] if line.strip()]
    assert calls and all(c.isdigit() for c in calls), calls  # whole calls, not "4.000"
    assert "ops" not in bench_attention([tiny("tiny-dense")], batch=1, repeats=1, warmup=0,
                                        memory=False, textbook=False)["groups"][0]["rows"][0]


def test_cli_bench_attention_ops_json(capsys):
    assert main(["bench", "attention", "--preset", "tiny-dense", "--preset", "tiny-switchhead",
                 "--batch", "1", "--repeats", "1", "--warmup", "0", "--no-memory",
                 "--no-textbook", "--ops", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ops"] == 3
    assert all(len(r["ops"]["top"]) == 3 for r in res["groups"][0]["rows"])
