"""Hugging Face export of the follow-ups: a MoEUT model (shared peri-layernorm blocks, one KV
cache per layer application) exports through the remote-code model and decodes greedily as
moeify does; MoSA is refused with the reason (its prefix-routing cache is not a transformers
cache layer)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: "
                                   "pip install -e '.[hf]' in the checkout")

from moeify.errors import MoeifyError  # noqa: E402
from moeify.eval.generate import generate  # noqa: E402
from moeify.interop import export_hf  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402
from hf_checkpoints import random_run  # noqa: E402


def make_run(root, preset):
    return random_run(root, preset, overrides=("model.context_length=32",))


def test_moeut_exports_and_generates_as_moeify(tmp_path):
    run = make_run(tmp_path, "tiny-moeut")
    out = export_hf(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    model = load_trained(run).model
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids, use_cache=False).logits - model(ids).logits).abs().max() < 1e-5
    new = generate(model, ids[0, :6].tolist(), max_new_tokens=10, temperature=0.0)
    assert hf.generate(ids[:1, :6], max_new_tokens=10, do_sample=False)[0, 6:].tolist() == new


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
