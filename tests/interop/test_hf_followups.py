"""Hugging Face export of the follow-ups: a MoEUT model (shared peri-layernorm blocks, one KV
cache per layer application) and an MoH model (Mixture-of-Head attention) export through the
remote-code model and decode greedily as moeify does; the native format refuses MoH in one line
naming the format that holds it; MoSA is refused with the reason (its prefix-routing cache is not
a transformers cache layer)."""

from __future__ import annotations

import os

import pytest
import torch

from hf_checkpoints import hf_transformers, random_run

transformers = hf_transformers()

from moeify.cli.main import main  # noqa: E402
from moeify.errors import MoeifyError  # noqa: E402
from moeify.eval.generate import generate  # noqa: E402
from moeify.interop import export_hf  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402


def make_run(root, preset, *overrides):
    return random_run(root, preset, overrides=("model.context_length=32", *overrides))


@pytest.mark.parametrize("preset, overrides", [("tiny-moeut", ()),
                                               ("tiny-moh", ("model.n_layers=2",))],
                         ids=["tiny-moeut", "tiny-moh"])
def test_exports_and_generates_as_moeify(preset, overrides, tmp_path):
    run = make_run(tmp_path, preset, *overrides)
    out = export_hf(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    model = load_trained(run).model
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids, use_cache=False).logits - model(ids).logits).abs().max() < 1e-5
    new = generate(model, ids[0, :6].tolist(), max_new_tokens=10, temperature=0.0)
    assert hf.generate(ids[:1, :6], max_new_tokens=10, do_sample=False)[0, 6:].tolist() == new


def test_moh_native_export_is_refused_naming_the_moeify_format(tmp_path, capsys):
    """transformers has no Mixture-of-Head attention: --format native says so in one line and
    names the format that exports it, before anything is written."""
    run, out = make_run(tmp_path, "tiny-moh", "model.n_layers=2"), tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out), "--format", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MoH" in err and "--format moeify" in err, err
    assert not out.exists()


def test_mosa_export_is_refused_with_the_reason(tmp_path):
    run = make_run(tmp_path, "tiny-mosa")
    with pytest.raises(MoeifyError, match="MoSA"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_exported_files_share_one_mode(tmp_path):
    """model.safetensors (safetensors writes 0600) gets the mode of the other files: what
    open() makes under the umask, 0644 under umask 022."""
    old = os.umask(0o022)
    try:
        out = export_hf(make_run(tmp_path, "tiny-dense"), tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()}
    assert modes["model.safetensors"] == "0o644" and set(modes.values()) == {"0o644"}, modes
