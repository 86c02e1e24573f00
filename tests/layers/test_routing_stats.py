"""The typed routing record (layers/common.py RoutingStats): one way to count, the metrics
training logs, and what the model reports per layer."""

import math

import pytest
import torch

from moeify.layers.common import RoutingStats, routing_record
from moeify.layers.switchhead import SwitchHeadConfig
from moeify.models.presets import get_preset
from moeify.ops.routing import count_selections


def test_count_selections_by_hand():
    idx = torch.tensor([[0, 2], [2, 1], [3, 2]])
    keep = torch.tensor([[True], [False], [True]])
    assert count_selections(idx, 4).tolist() == [1, 1, 3, 1]
    assert count_selections(idx, 4, keep).tolist() == [1, 0, 2, 1]


def test_metrics_by_hand():
    counts = torch.tensor([[3, 1, 0, 0], [2, 2, 0, 0]])
    r = RoutingStats("switchhead", counts, torch.tensor(4.0), serves=("v",))
    m = r.metrics()
    h0 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert m["usage_entropy"].item() == pytest.approx((h0 + math.log(2)) / 2, rel=1e-6)
    assert m["dead_experts"].item() == 4
    assert m["gate_mean"].item() == pytest.approx(0.5)
    assert r.label == "SwitchHead V experts"
    noop = RoutingStats("switch", torch.tensor([[2, 0, 5]]), torch.tensor(1.0), n_real=2)
    assert noop.metrics()["dead_experts"].item() == 1  # the no-op column is not an expert


def test_switchhead_record_counts_and_gates_match_its_selection():
    torch.manual_seed(0)
    m = SwitchHeadConfig(d_model=8, n_heads=2, d_head=4, n_experts=3, k=2).build()
    x = torch.randn(2, 5, 8)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    _, aux = m(x, valid_k=valid)
    sel = m.select(x)["src"]
    r = aux.routing["src"]
    keep = valid.reshape(-1, 1, 1).expand_as(sel.ids)
    want = torch.zeros(6, dtype=torch.int64)
    for i, ok in zip(sel.ids.reshape(-1).tolist(), keep.reshape(-1).tolist()):
        want[i] += ok
    assert torch.equal(r.counts, want.view(2, 3)) and r.serves == ("v",)
    torch.testing.assert_close(r.gate_sum, (sel.gates * keep).sum())
    assert aux.routing["dst"].serves == ("o",)


def test_model_reports_every_routing_record_with_its_layer_and_logged_names():
    torch.manual_seed(0)
    model = get_preset("tiny-switchall").build()
    out = model(torch.randint(0, 256, (2, 16)))
    assert sorted(out.routing) == sorted(f"layers.{i}.{k}" for i in range(4)
                                         for k in ("attn.src", "attn.dst", "ff.router"))
    assert all(r.layer == int(k.split(".")[1]) for k, r in out.routing.items())
    for name in ("counts", "usage_entropy", "dead_experts", "gate_mean"):
        assert f"layers.3.ff.router.{name}" in out.stats
        assert f"layers.0.attn.dst.{name}" in out.stats
    assert "layers.0.ff.router_entropy" in out.stats and "layers.0.ff.dead_experts" in out.stats


def test_routing_record_groups():
    r = routing_record("moa", torch.tensor([[0, 1], [1, 2]]), 3, torch.ones(2, 2))
    assert r.counts.tolist() == [[1, 2, 1]] and r.gate_sum.item() == 4.0


def test_records_count_only_when_read_and_copies_count_once(monkeypatch):
    # Decoding never reads the records: counting is deferred to the first read, and a model's
    # per-layer copy (with_layer) shares the one count.
    import moeify.layers.common as common
    calls = []
    real = common.count_selections
    monkeypatch.setattr(common, "count_selections",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    m = SwitchHeadConfig(d_model=8, n_heads=2, d_head=4, n_experts=3, k=2).build().eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        _, aux = m(x)
    assert calls == []
    r = aux.routing["src"].with_layer(4)
    assert r.layer == 4 and r.serves == ("v",) and aux.routing["src"].layer is None
    assert r.counts.sum().item() == 2 * 5 * 2 * 2 and len(calls) == 1
    assert torch.equal(aux.routing["src"].counts, r.counts) and len(calls) == 1
    with pytest.raises(AttributeError, match="immutable"):
        r.layer = 1
    m.train()
    m(x)  # training reads the counts into the usage buffers
    assert len(calls) == 3 and m.usage_v.sum().item() == 2 * 5 * 2 * 2


def test_a_record_needs_counts_or_a_deferred_count():
    with pytest.raises(TypeError, match="needs counts"):
        RoutingStats("switch", None, None)
