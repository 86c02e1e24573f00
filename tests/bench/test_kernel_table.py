"""Kernel choice by a measured per-device table (moeify.ops.moe.device_table): the matching
rule on a made-up table, the device classes, the committed tables, and the whole loop on the
CPU: the bench writes a table, "auto" reads it, and a SwitchHead layer runs what it says.

Shape legend: M rows, K experts per row, E experts, D input width, F output width."""

import json

import pytest
import torch

from moeify.bench.expert_matmul import bench_kernel_table, preset_shapes
from moeify.bench.timing import expert_impls_run
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.ops.moe import implementations, make_plan
from moeify.ops.moe.device_table import (
    TABLE_DIR,
    class_of_name,
    load_table,
    table_choice,
    table_entry,
)
from moeify.ops.moe.policy import choose_impl, measured_impl

SHAPE = dict(M=32768, K=4, E=10, D=412, F=76)
MADE_UP = {"device": {"name": "made up"}, "source": "test", "entries": [
    table_entry(SHAPE, "bfloat16", True, {"triton": 3.0, "padded": 2.0, "concat": 1.0}),
    table_entry(dict(SHAPE, D=76, F=412, K=2), "bfloat16", True, {"triton": 1.0, "segment": 2.0}),
    table_entry(SHAPE, "float32", True, {"segment": 1.0, "concat": 2.0}),
    table_entry(SHAPE, "bfloat16", False, {"gather": 1.0}),
]}


def anything(name):
    return True


def test_the_nearest_entry_within_reach_decides():
    bf16 = torch.bfloat16
    assert table_choice(MADE_UP, SHAPE, bf16, True, anything) == "concat"
    # Within reach: widths within 2x, rows within 8x; the nearest entry (the output shape here).
    assert table_choice(MADE_UP, dict(SHAPE, D=80, F=400, K=2, M=4096), bf16, True,
                        anything) == "triton"
    assert table_choice(MADE_UP, dict(SHAPE, D=1024), bf16, True, anything) is None
    assert table_choice(MADE_UP, dict(SHAPE, M=2048), bf16, True, anything) is None
    # The dtype and the gating must match.
    assert table_choice(MADE_UP, SHAPE, torch.float32, True, anything) == "segment"
    assert table_choice(MADE_UP, SHAPE, bf16, False, anything) == "gather"
    assert table_choice(MADE_UP, SHAPE, torch.float16, True, anything) is None
    # The fastest measured kernel that may run the call, else None (the fallback rule).
    assert table_choice(MADE_UP, SHAPE, bf16, True, lambda n: n != "concat") == "padded"
    assert table_choice(MADE_UP, SHAPE, bf16, True, lambda n: False) is None


def test_device_classes():
    assert class_of_name("NVIDIA H100 80GB HBM3") == "h100"
    assert class_of_name("NVIDIA H200") == "h200"
    assert class_of_name("NVIDIA A100-SXM4-80GB") is None


def test_the_committed_tables_hold_registered_kernels_only():
    tables = sorted(TABLE_DIR.glob("*.json"))
    for path in tables:
        table = json.loads(path.read_text())
        assert table["device"]["class"] == path.stem and table["source"]
        for e in table["entries"]:
            assert e["ms"] and set(e["ms"]) <= set(implementations()), path
            assert e["fastest"] == min(e["ms"], key=e["ms"].get)


def test_the_policy_reads_the_table_of_the_device_class(monkeypatch, tmp_path):
    path = tmp_path / "made-up.json"
    path.write_text(json.dumps(MADE_UP))
    monkeypatch.setenv("MOEIFY_KERNEL_TABLE", str(path))
    assert load_table(None)["source"] == "test"
    x, w = torch.empty(4096, 400, dtype=torch.bfloat16), torch.empty(10, 400, 80,
                                                                       dtype=torch.bfloat16)
    # Under the registered op only slot-layout kernels may run; compiled, traceable ones too.
    assert measured_impl(x, w, None, gated=True, n_pairs=4 * 4096) == "concat"
    assert measured_impl(x, w, None, gated=True, n_pairs=4 * 4096, layouts_only=True) == "padded"
    assert measured_impl(x, w, None, gated=True, n_pairs=4 * 4096, compiled=True) == "concat"
    # Out of reach: the device's own rule decides (here the CPU's).
    small = torch.randn(64, 16)
    plan = make_plan(torch.randint(0, 4, (64, 2)), 4)
    assert measured_impl(small, torch.randn(4, 16, 8), plan, gated=True) is None
    assert choose_impl("auto", small, torch.randn(4, 16, 8), plan, k=2) != "concat"
    monkeypatch.setenv("MOEIFY_KERNEL_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read the kernel table"):
        load_table(None)


def _layer():
    cfg = SwitchHeadConfig(d_model=16, n_heads=2, d_head=8, n_experts=4, k=2, n_layers=2)
    torch.manual_seed(0)
    return cfg.build()


def test_the_bench_writes_a_table_that_auto_and_a_layer_follow(monkeypatch, tmp_path):
    # The layer's value experts: M = B·T source rows (no memory), K = H·k, E = H·E, D 16, F 8;
    # its output experts: M = B·T·H units, K = k, D 8, F 16.
    B, T = 2, 8
    shapes = [dict(name="value", M=B * T, K=4, E=8, D=16, F=8, groups=2, sum_rows=1),
              dict(name="output", M=B * T * 2, K=2, E=8, D=8, F=16, groups=1, sum_rows=2)]
    monkeypatch.setattr("moeify.bench.expert_matmul.preset_shapes", lambda presets, b: shapes)
    path = tmp_path / "table.json"
    res = bench_kernel_table(("unused",), dtype=torch.float32, device="cpu",
                             impls=["segment", "concat"], repeats=1, path=path)
    table = json.loads(path.read_text())
    assert [e["name"] for e in table["entries"]] == ["value", "output"]
    assert all(set(e["ms"]) == {"segment", "concat"} for e in table["entries"])
    assert all(set(e["baselines_ms"]) == {"dense route-shaped (equal MACs)",
                                          "dense concatenated (equal MACs)"}
               for e in table["entries"])
    assert len(res["results"]) == 2
    # A table that says "concat" everywhere: the layer runs it for both expert matmuls.
    for e in table["entries"]:
        e["ms"] = {"concat": 1.0, "segment": 2.0}
    path.write_text(json.dumps(table))
    m, x = _layer(), torch.randn(B, T, 16)
    assert "concat" not in expert_impls_run(lambda: m(x, x)[0].sum().backward())
    monkeypatch.setenv("MOEIFY_KERNEL_TABLE", str(path))
    assert expert_impls_run(lambda: m(x, x)[0].sum().backward()) == ["concat"]


def test_preset_shapes_follow_the_layer():
    v, o = preset_shapes(("wt103-47m-switchhead",), batch=64)
    # [memory ; x] = 512 source rows per sequence; 2 heads x 5 experts, k 2; d_head 76.
    assert (v["M"], v["K"], v["E"], v["D"], v["F"], v["groups"]) == (32768, 4, 10, 412, 76, 2)
    assert (o["M"], o["K"], o["E"], o["D"], o["F"], o["sum_rows"]) == (32768, 2, 10, 76, 412, 2)


def test_the_table_lookup_holds_in_a_fullgraph_compile(monkeypatch, tmp_path):
    # Inside a compiled graph the table is read while tracing (not traced: no file read in the
    # graph), and the graph keeps the kernel it names.
    path = tmp_path / "made-up.json"
    path.write_text(json.dumps({"device": {}, "source": "test", "entries": [table_entry(
        dict(M=8, K=2, E=4, D=16, F=8), "float32", True, {"concat": 1.0, "segment": 2.0})]}))
    monkeypatch.setenv("MOEIFY_KERNEL_TABLE", str(path))

    def pick(x, w):
        name = measured_impl(x, w, None, gated=True, compiled=True, n_pairs=16)
        return x * 2 if name == "concat" else x

    torch._dynamo.reset()
    x = torch.randn(8, 16)
    y = torch.compile(pick, fullgraph=True, backend="eager")(x, torch.randn(4, 16, 8))
    torch.testing.assert_close(y, 2 * x)
