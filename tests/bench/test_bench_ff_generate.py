"""``moeify bench ff`` and ``moeify bench generate``: rows, matched multiply-adds, what ran, and
the KV-cache bytes by hand. (Timings themselves are not tested.)"""

import json

import pytest
import torch

from moeify.bench.ff import DENSE, HF_PREFIX, bench_ff
from moeify.bench.generate import bench_generate, cache_bytes
from moeify.cli.main import main
from moeify.models.presets import get_preset

SMALL = dict(tokens=64, d_model=16, n_experts=4, k=2, expert_size=6, repeats=1, warmup=0)


def test_bench_ff_rows_report_equal_macs_and_what_ran():
    res = bench_ff(**SMALL, impls=["auto", "segment"], hf=False)
    rows = {r["case"]: r for r in res["rows"]}
    assert list(rows)[0] == DENSE and rows[DENSE]["fwd+bwd x dense"] == 1.0
    assert {r["expert MACs"] for r in rows.values()} == {2 * 16 * 6 * 2}
    assert rows["sigma-MoE [segment]"]["impl"] == "segment"
    assert rows["Switch capacity 1.25 [segment]"]["impl"] == "segment"
    want = "padded" if torch.get_num_threads() > 1 else None
    if want:
        assert rows["sigma-MoE"]["impl"] == want
    assert all(r["fwd x HF best"] is None for r in rows.values())


def test_bench_ff_hugging_face_rows():
    pytest.importorskip("transformers", reason="the Mixtral rows need transformers "
                        "(pip install -e '.[hf]')")
    res = bench_ff(**SMALL, hf_impls=["eager", "grouped_mm"])
    rows = {r["case"]: r for r in res["rows"]}
    assert res["shape"]["hf_intermediate"] == 4  # 3 · D · I = 2 · D · G
    assert rows[HF_PREFIX + "eager"]["expert MACs"] == rows["sigma-MoE"]["expert MACs"]
    hf = [r["fwd+bwd x HF best"] for c, r in rows.items() if c.startswith(HF_PREFIX)]
    assert min(hf) == 1.0
    with pytest.raises(ValueError, match="Hugging Face experts implementation"):
        bench_ff(**SMALL, hf_impls=["no-such"])


def test_bench_ff_rejects_bad_input():
    with pytest.raises(ValueError, match="k must"):
        bench_ff(**{**SMALL, "k": 5})
    with pytest.raises(ValueError, match="implementation"):
        bench_ff(**SMALL, impls=["sets"])


def test_cache_bytes_by_hand():
    cfg = get_preset("tiny-dense")
    model = cfg.build().eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(2, 10, dtype=torch.long), cache=cache)
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache)  # grows a buffer: not counted
    attn = cfg.attention_layers()[0]
    per_token = 2 * attn.n_heads * attn.d_head * 4 + 8 + 1  # keys, values, position, valid
    assert cache_bytes(cache) == cfg.n_layers * 2 * 11 * per_token


def test_bench_generate_rows_and_ratios():
    res = bench_generate(["tiny-switchhead", "tiny-dense", "tiny-moa"], contexts=[12, 20],
                         batches=[1, 2], tokens=2, warmup=0)
    assert len(res["cells"]) == 4
    for cell in res["cells"]:
        rows = {r["case"]: r for r in cell["rows"]}
        assert cell["baseline"] == "tiny-dense" and list(rows)[0] == "tiny-dense"
        assert rows["tiny-dense"]["KV x"] == 1.0 == rows["tiny-dense"]["decode x"]
        assert all(r["decode tok/s"] > 0 and r["prefill tok/s"] > 0 for r in rows.values())
    sizes = {(c["batch"], c["context"]): c["rows"][0]["KV MiB"] for c in res["cells"]}
    assert sizes[(2, 20)] == pytest.approx(2 * sizes[(1, 12)] * 20 / 12)


def test_cli_bench_ff_and_generate(capsys):
    assert main(["bench", "ff", "--tokens", "32", "--d-model", "8", "--experts", "4",
                 "--expert-size", "3", "--no-hf", "--repeats", "1", "--warmup", "0",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["bench"] == "ff" and res["rows"][0]["case"] == DENSE
    assert main(["bench", "generate", "--preset", "tiny-dense", "--context", "8", "--batch", "1",
                 "--tokens", "1", "--warmup", "0"]) == 0
    assert "tiny-dense" in capsys.readouterr().out
    assert main(["bench", "generate", "--preset", "tiny-dense", "--context", "0"]) == 2
    assert "contexts" in capsys.readouterr().err


def test_cpu_times_are_reported_beside_wall_times():
    from moeify.bench.timing import interleaved_median_times

    cpu = {}
    wall = interleaved_median_times({"a": lambda: sum(range(20000))}, warmup=0, repeats=3,
                                    cpu_times=cpu)
    assert set(cpu) == {"a"} and cpu["a"] > 0 and wall["a"] > 0
    res = bench_ff(**SMALL, hf=False)
    assert all(r["fwd+bwd cpu ms"] > 0 for r in res["rows"]) and res["rows"][0]["cpu x dense"] == 1
