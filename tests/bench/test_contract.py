"""The cost contract (moeify.bench.contract): every case's multiply-adds, operators, host
read-backs and memory equal the committed expectations (tests/bench/contract_expectations.json)
exactly, so a change that adds a GEMM, a copy, an operator or a sync fails here; and the meter
itself against work counted by hand.

The layers run one sequence of 64 queries; the steps the whole 47M models at batch 64 under
fake tensors (no arithmetic; a test holds a step counted so equal to the real one) and a
two-block 47M model on 32 tokens with real tensors for the kernels that read the routing on
the host. To accept a deliberate change: run
`moeify bench contract --write` from the repository root and commit the file with the change
that explains it (docs/cost-contract.md)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moeify.bench.contract import CASES, Case, bench_contract, differences, run_case
from moeify.bench.cost_meter import CostMeter, HostReadUnderFakeTensors, measure

EXPECTED = Path(__file__).resolve().parent / "contract_expectations.json"


@pytest.fixture(scope="module")
def measured():
    return bench_contract()["cases"]


@pytest.fixture(scope="module")
def expected():
    return json.loads(EXPECTED.read_text())


def test_the_expectations_cover_every_case(expected):
    assert sorted(expected["cases"]) == sorted(c.name for c in CASES)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_case_costs_what_it_is_expected_to(name, measured, expected):
    diff = differences(expected["cases"][name], measured[name])
    assert not diff, (f"{name} costs differ from tests/bench/contract_expectations.json:\n  "
                      + "\n  ".join(diff) + "\nif deliberate: moeify bench contract --write")


def test_switchhead_layers_cost_less_than_dense(measured):
    """The paper's claim at the layer level (fewer MACs than the dense baseline: SwitchHead,
    Table 1's MAC column), for every kernel that runs the routed pairs without padding."""
    for size in ("47m", "262m"):
        dense = measured[f"layer wt103-{size}-dense b1 T64"]["macs"]
        for k in ("segment", "grouped"):
            assert measured[f"layer wt103-{size}-switchhead {k} b1 T64"]["macs"] < dense


def test_fake_tensors_count_what_real_tensors_do():
    """A training step counted under fake tensors (no arithmetic) equals the same step run for
    real, every field and every operator (the weights, AdamW's state and the step's memory
    included): what makes the steps counted only so stand for the real ones."""
    case = Case("step", "wt103-47m-dense", 1, 16, blocks=1)
    real = run_case(case)
    fake = run_case(dataclasses.replace(case, fake=True))
    assert real["macs"] and real["peak"] and real["kernels"]
    assert not differences(real, fake), differences(real, fake)


def test_concat_saved_trades_the_recomputation_for_memory(measured):
    """SwitchHead 47M's attention (value and output experts, 2 heads x 5): "concat_saved"
    skips exactly the products "concat" recomputes in the backward, worked out by hand from
    the preset: the value experts' x @ W_cat over the S = 128 source rows (M·D·E·F =
    128·412·10·76) and the output experts' gated inputs (T·E·R·A = 64·10·2·76, two heads
    summed per token); it holds them from the forward to the backward instead."""
    concat = measured["layer wt103-47m-switchhead concat b1 T64"]
    saved = measured["layer wt103-47m-switchhead concat_saved b1 T64"]
    assert concat["macs"] - saved["macs"] == 128 * 412 * 10 * 76 + 64 * 10 * 2 * 76
    assert saved["working"] > concat["working"]


def test_a_host_read_under_fake_tensors_fails_clearly():
    def setup():
        x = torch.ones(3)
        return {"call": lambda: x.sum().item()}

    with pytest.raises(HostReadUnderFakeTensors, match="reads tensor data on the host"):
        measure(setup, setup_counted=True, fake=True)


def _known_work():
    a = torch.ones(8, 16)  # created before the meter: not counted
    b = torch.ones(16, 4)

    def call():
        c = a @ b  # 8·16·4 = 512 MACs, 128 bytes
        t = torch.empty(1024)  # 4096 bytes, freed at once
        del t
        d = torch.bmm(c.view(2, 4, 4), c.view(2, 4, 4))  # 2·4·4·4 = 128 MACs, 128 bytes
        v = c.sum()  # 4 bytes
        v.item()  # a read-back
        d.tolist()  # another
        d.view(-1)  # a view: an operator, not a kernel, no allocation
        return d

    return {"call": call}


def test_the_meter_counts_work_known_by_hand():
    res = measure(_known_work, setup_counted=False)
    c = res["phases"]["call"]
    assert c["macs"] == 512 + 128
    assert c["allocated"] == 128 + 4096 + 128 + 4 and c["allocations"] == 4
    assert res["peak"] == 128 + 4096  # the 4 KiB buffer, freed before the rest came
    assert c["sync_ops"] == {"_local_scalar_dense": 1, "tolist": 1}
    assert c["op_counts"]["view"] == 3 and c["kernels"] == c["ops"] - 3 - 1  # - item's read


def test_memory_held_by_a_reference_cycle_counts():
    """The cyclic collector is off while measuring: a tensor kept by a cycle stays held."""
    def leak():
        cycle = [torch.empty(256)]  # 1 KiB
        cycle.append(cycle)

    res = measure(lambda: {"call": leak}, setup_counted=False)
    assert res["phases"]["call"]["working"] == 1024


def test_a_matrix_product_without_a_formula_fails():
    def call():
        torch.mv(torch.ones(3, 3), torch.ones(3))

    with pytest.raises(RuntimeError, match="no MAC formula for aten.mv"):
        measure(lambda: {"call": call}, setup_counted=False)
    assert not any(isinstance(m, CostMeter)
                   for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack())
