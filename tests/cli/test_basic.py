"""The moeify command: help, the demo, and the expert-matmul benchmark's JSON."""

import json
import subprocess
import sys

import pytest

from moeify.cli.main import COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in COMMANDS:
        assert name in out
    # What a newcomer must find from the first screen: every model family, and the options
    # that widen count and export beyond the obvious.
    for text in ("MoEUT", "MoSA", "--run", "--config", "--format native"):
        assert text in out, text


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "moeify.cli.main", "demo", "--rows", "64"],
                       capture_output=True, text=True, check=True)
    assert "reference" in r.stdout and "segment" in r.stdout


def test_bench_expert_matmul_json(capsys):
    assert main(["bench", "expert-matmul", "-M", "64", "-E", "4", "-D", "32", "-F", "16",
                 "--repeats", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    names = [r["implementation"] for r in res["rows"]]
    assert names[0].startswith("dense") and {"gather", "segment", "grouped"} <= set(names)
    assert all(r["fwd+bwd ms"] > 0 for r in res["rows"])
    assert res["fastest"] in names


def test_bad_input_is_an_error_message_not_a_traceback(capsys):
    code = main(["bench", "expert-matmul", "-M", "8", "-K", "3", "-E", "2", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "error" in err and "Traceback" not in err


# A stand-in with the API of the SwitchHead authors' cvmm.py (cvmm_prepare_sel2, cvmm), in plain
# torch: what the adapter in moeify.bench.peers calls, not their code.
_CVMM_STANDIN = '''
import torch
from dataclasses import dataclass

@dataclass
class CVMMSel:
    raw_sel: torch.Tensor
    reduction_weight: torch.Tensor

def cvmm_prepare_sel2(sel, w=None):
    return CVMMSel(sel, w)

def cvmm(x, sel, keys):
    out = torch.einsum("md,mkdf->mkf", x, keys[sel.raw_sel.long()])
    return (out * SCALE * sel.reduction_weight.unsqueeze(-1)).sum(1)
'''


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_bench_expert_matmul_times_a_peer_checked_against_the_reference(tmp_path, capsys, scale):
    peer = tmp_path / "cvmm.py"
    peer.write_text(_CVMM_STANDIN.replace("SCALE", str(scale)))
    assert main(["bench", "expert-matmul", "-M", "32", "-E", "4", "-D", "16", "-F", "8",
                 "--impl", "segment", "--repeats", "1", "--peer", f"cvmm={peer}", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["implementation"] for r in res["rows"]] == [
        "dense route-shaped (equal MACs)", "dense concatenated (equal MACs)", "segment",
        "cvmm (peer)"]
    assert res["errors"]["segment"] < 1e-6  # moeify's own kernels are checked too
    err = res["peer_errors"]["cvmm (peer)"]
    assert err < 1e-6 if scale == 1.0 else abs(err - 0.5) < 1e-6


@pytest.mark.parametrize("spec, message", [
    ("cvmm", "give KIND=PATH"),
    ("nope=x.py", "unknown peer 'nope'"),
    ("cvmm=/nonexistent/cvmm.py", "no such file"),
    ("cvmm={empty}", "has no cvmm, cvmm_prepare_sel2"),
    ("cvmm={broken}", "does not import: ZeroDivisionError"),
    ("cvmm={cuda_only}", "the peer cvmm failed on these inputs (it runs on CUDA only: add "
     "--device cuda): AssertionError: Torch not compiled with CUDA enabled"),
    ("cvmm={wrong_shape}", "the peer cvmm returned (8, 2, 64) where the gated sum is (8, 64)"),
])
def test_bench_peer_bad_input_is_one_line(tmp_path, capsys, spec, message):
    (tmp_path / "empty.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    (tmp_path / "cuda_only.py").write_text(  # as the authors' file fails on a CPU tensor
        "def cvmm_prepare_sel2(sel, w=None):\n    return sel\n\n"
        "def cvmm(x, sel, keys):\n"
        "    raise AssertionError('Torch not compiled with CUDA enabled')\n")
    (tmp_path / "wrong_shape.py").write_text(  # the per-choice products, not their gated sum
        "import torch\n\ndef cvmm_prepare_sel2(sel, w=None):\n    return sel\n\n"
        "def cvmm(x, sel, keys):\n"
        "    return torch.zeros(x.shape[0], sel.shape[1], keys.shape[-1])\n")
    spec = spec.format(empty=tmp_path / "empty.py", broken=tmp_path / "broken.py",
                       cuda_only=tmp_path / "cuda_only.py",
                       wrong_shape=tmp_path / "wrong_shape.py")
    assert main(["bench", "expert-matmul", "-M", "8", "--repeats", "1", "--peer", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_debug_and_malloc_switches_read_0_as_off(capsys, monkeypatch):
    for off in ("0", "false", "No", "off"):  # MOEIFY_DEBUG=0 means no traceback
        monkeypatch.setenv("MOEIFY_DEBUG", off)
        assert main(["count", "--preset", "nope"]) == 2
        assert "error: unknown preset" in capsys.readouterr().err
    from moeify.errors import env_flag

    for value, on in (("", False), ("0", False), ("off", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("MOEIFY_NO_MALLOC_TUNING", value)
        assert env_flag("MOEIFY_NO_MALLOC_TUNING") is on
    from moeify.runtime import MALLOC_ENV
    from moeify.sweep.scheduler import child_env

    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MOEIFY_NO_MALLOC_TUNING", "0")  # compare/sweep children keep the tuning
    assert all(child_env(1).get(k) == v for k, v in MALLOC_ENV.items())


def test_an_unknown_value_of_an_on_off_switch_is_refused_in_one_line(capsys, monkeypatch):
    """MOEIFY_TRITON_PAD=disable (and any value not on/off) is an error, not read as on."""
    from moeify.errors import env_flag

    monkeypatch.setenv("MOEIFY_TRITON_PAD", "disable")
    with pytest.raises(ValueError, match=r"MOEIFY_TRITON_PAD='disable' is not an on/off value"):
        env_flag("MOEIFY_TRITON_PAD", default=True)
    for value, on in (("ON", True), ("True", True), (" 1 ", True), ("No", False)):
        monkeypatch.setenv("MOEIFY_TRITON_PAD", value)
        assert env_flag("MOEIFY_TRITON_PAD", default=True) is on
    monkeypatch.setenv("MOEIFY_DEBUG", "verbose")  # read by the error handler itself
    assert main(["count", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MOEIFY_DEBUG='verbose' is not an on/off value" in err
