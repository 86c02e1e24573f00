"""scripts/gpu_check.sh and scripts/gpu_summary.py: the GPU check runs as one command, also on a
CPU (SMOKE=1: every phase end to end at tiny shapes, the script's own check), with the machine's python3 and the source
tree on PYTHONPATH; the summary pairs each measured ratio with the paper's figure and the
target. Also: ``--device`` / ``--dtype`` on every bench, a clear error without CUDA, and the
memory measurement's release of cached blocks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeify.bench import memory, timing
from moeify.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_summary  # noqa: E402


def _write(d: Path, name: str, obj) -> None:
    (d / name).write_text(json.dumps(obj))


def test_summary_pairs_each_ratio_with_the_paper_and_the_target(tmp_path):
    _write(tmp_path, "device.json", {"name": "NVIDIA H200", "torch": "2.11", "cuda": "13.0",
                                     "triton": "3.6"})
    (tmp_path / "suite.txt").write_text("....\n1 failed, 44 passed, 2 skipped in 170.00s\n")
    _write(tmp_path, "expert-matmul.json", {
        "shape": {"M": 32768, "K": 4, "E": 10, "D": 412, "F": 76}, "dtype": "bfloat16",
        "rows": [{"implementation": "dense (equal MACs)", "fwd+bwd ms": 0.2, "x dense": 1.0},
                 {"implementation": "triton", "fwd+bwd ms": 0.28, "x dense": 1.4},
                 {"implementation": "segment", "fwd+bwd ms": 2.0, "x dense": 10.0}]})
    _write(tmp_path, "expert-matmul-peer.json", {
        "shape": {"M": 32768, "K": 4, "E": 10, "D": 412, "F": 76}, "dtype": "bfloat16",
        "rows": [{"implementation": "dense (equal MACs)", "fwd+bwd ms": 0.2, "x dense": 1.0},
                 {"implementation": "triton", "fwd+bwd ms": 0.29, "x dense": 1.45},
                 {"implementation": "cvmm (peer)", "fwd+bwd ms": 0.5, "x dense": 2.5}],
        "peer_errors": {"cvmm (peer)": 0.004}})
    _write(tmp_path, "expert-matmul-unpadded.json", {
        "shape": {"M": 32768, "K": 4, "E": 10, "D": 412, "F": 76}, "dtype": "bfloat16",
        "rows": [{"implementation": "dense (equal MACs)", "fwd+bwd ms": 0.2, "x dense": 1.0},
                 {"implementation": "triton", "fwd+bwd ms": 1.2, "x dense": 6.0}]})
    _write(tmp_path, "step-47m.json", {"baseline": "wt103-47m-dense", "batch": 64,
                                       "dtype": "bfloat16", "rows": [
        {"case": "wt103-47m-dense", "time x": 1.0, "peak x": 1.0, "step ms": 100.0,
         "peak MiB": 1000.0},
        {"case": "wt103-47m-switchhead", "time x": 0.7, "peak x": 0.8, "step ms": 70.0,
         "peak MiB": 800.0}]})
    assert main_summary(tmp_path) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["suite"] == {"ran": True, "failed": 1, "passed": 44, "skipped": 2}
    rows = {r["measure"]: r for r in s["rows"]}
    tri = rows["expert matmul fwd+bwd [triton] x dense GEMM"]
    assert (tri["ratio"], tri["target"], tri["met"]) == (1.4, 1.5, True)
    assert rows["expert matmul fwd+bwd [segment] x dense GEMM"]["met"] is False
    assert rows["expert matmul fwd+bwd [triton, MOEIFY_TRITON_PAD=0] x dense GEMM"]["ratio"] == 6.0
    assert tri["ratio"] == 1.4  # the peer phase's own triton row is not a second entry
    peer = rows["expert matmul fwd+bwd [cvmm (peer)] x dense GEMM"]
    assert peer["ratio"] == 2.5 and "differs from the reference by 4.0e-03" in peer["detail"]
    t = rows["47m training step time: wt103-47m-switchhead"]
    assert (t["ratio"], t["paper"], t["met"]) == (0.7, 0.72, True)
    m = rows["47m training step peak memory: wt103-47m-switchhead"]
    assert (m["ratio"], m["paper"], m["met"]) == (0.8, 0.65, False)
    # Phases that wrote nothing are reported, not dropped.
    assert rows["262m training step time x dense"]["detail"] == "no result"
    assert rows["47m attention layer fwd+bwd x dense"]["ratio"] is None
    md = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200" in md and "CUDA suite: 44 passed, 1 failed, 2 skipped" in md
    assert "| 47m training step time: wt103-47m-switchhead | 0.700 | 0.720 | 0.720 | yes |" in md
    assert "profiled" not in md  # no profile phase ran


def main_summary(out: Path) -> int:
    return gpu_summary.main([str(out)])


def test_gpu_check_smoke_runs_every_phase_on_the_cpu_with_the_source_tree_on_pythonpath(
        tmp_path):
    # TRITON_INTERPRET is the suite's own setting (tests/conftest.py); a CPU run of the script runs
    # no Triton kernel (the interpreter's bf16 dot is wrong), as on a machine without it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    # The interpreter of this venv stands in for a GPU machine's python3: the script must find
    # moeify through PYTHONPATH=src, not through an installed package or a .venv of its own.
    env.update(PY=sys.executable, SMOKE="1", OUT_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    # The phases in the order, each one done: kernels, attention, step, ff, suite.
    done = [line.split(":")[0].removeprefix("== ") for line in r.stdout.splitlines()
            if line.startswith("== ") and ": done" in line]
    assert done == ["expert-matmul", "expert-matmul-profile", "attention-47m", "step-47m", "ff",
                    "suite"], r.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["device"]["name"] == "cpu" and s["suite"]["passed"] >= 1
    measured = [r["measure"] for r in s["rows"] if r["ratio"] is not None]
    assert any("training step time: tiny-switchhead cuda-graphs" in m for m in measured)
    assert any("attention layer fwd+bwd: tiny-switchhead [concat]" in m for m in measured)
    assert any("[concat] (tiny-switchhead output)" in m for m in measured)
    table = json.loads((tmp_path / "kernel-table.json").read_text())
    assert [e["name"] for e in table["entries"]] == ["tiny-switchhead value",
                                                     "tiny-switchhead output"]
    assert "concat" in table["entries"][0]["ms"]
    step = json.loads((tmp_path / "step-47m.json").read_text())
    assert step["device"] == "cpu" and step["dtype"] == "bfloat16"
    assert step["compile"] == ["default", "reduce-overhead"]
    assert set(s["expert_matmul_profile"]) == {"dense route-shaped (equal MACs)",
                                               "dense concatenated (equal MACs)", "concat",
                                               "padded"}
    md = (tmp_path / "summary.md").read_text()
    assert "- concat: " in md and "aten::mm x" in md


def test_gpu_check_labels_a_numbered_cuda_device_by_its_name(tmp_path):
    # DEVICE=cuda:0 is a CUDA device (not "cpu"): without one visible the script says so.
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    env = dict(os.environ, PY=sys.executable, DEVICE="cuda:0", OUT_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no CUDA device visible" in r.stderr


@pytest.mark.parametrize("bench", ["ff", "generate", "step", "attention", "expert-matmul"])
def test_every_bench_takes_a_device_and_says_so_without_cuda(bench, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the message is for machines without one")
    assert main(["bench", bench, "--device", "cuda", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device is visible" in err[0]


def test_bench_ff_and_generate_run_under_autocast(capsys):
    assert main(["bench", "ff", "--tokens", "32", "--d-model", "16", "--experts", "4",
                 "--expert-size", "8", "--repeats", "1", "--warmup", "0", "--no-hf",
                 "--dtype", "bfloat16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["device"], res["dtype"]) == ("cpu", "bfloat16")
    assert main(["bench", "generate", "--preset", "tiny-dense", "--preset", "tiny-switchhead",
                 "--context", "8", "--batch", "1", "--tokens", "1", "--warmup", "0",
                 "--dtype", "bfloat16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["device"], res["dtype"]) == ("cpu", "bfloat16")
    assert len(res["cells"][0]["rows"]) == 2


def test_peak_memory_releases_the_parents_cached_cuda_blocks_first(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "release_cached_memory", lambda device: calls.append(device))
    monkeypatch.setattr(memory.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout='{"x": {"peak": 1.0, "working": 1.0}}\n', stderr=""))
    memory.peak_memory("m:f", {}, device="cuda")
    memory.peak_memory("m:f", {}, device="cpu")
    assert calls == ["cuda"]


def test_timed_call_measures_the_call(monkeypatch):
    clock = iter([10.0, 10.25])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    assert timing._timed_call(lambda: None, "cpu") == 0.25
