"""Hugging Face directories exported (moeify format) before the parameter-naming convention of
moeify.layers.common hold the earlier names. transformers loads weights by name without torch's
load_state_dict hooks, so moeify registers the renames with transformers
(moeify.interop.hf_legacy): such a directory still loads, with the logits of the run it was
exported from, and saving it again writes the current names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: "
                                   "pip install -e '.[hf]'")
from safetensors.torch import load_file, save_file  # noqa: E402

from moeify.interop import export_hf  # noqa: E402
from moeify.interop.hf_legacy import register_legacy_key_renames  # noqa: E402
from moeify.rundir.model import load_trained  # noqa: E402
from hf_checkpoints import random_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
REPO = Path(__file__).resolve().parents[2]

# The earlier names, written out here (by layer: the same current name had several).
EARLIER = {
    "attention": {"w_router_src": "w_sel_src", "w_router_dst": "w_sel_dst", "w_router": "w_sel"},
    "sigma": {"w_router": "w_sel_ED", "w_in": "keys_EDG", "w_out": "values_EGD",
              "bias_in": "bias_EG", "bias_out": "bias_D"},
    "switch": {"w_router": "w_router_RD", "w_in": "w_in_EDF", "w_out": "w_out_EFD",
               "w_gate": "w_gate_EDF", "bias_in": "bias_EF", "bias_out": "bias_D"},
    "mod": {"w_router": "router_D", "bias_router": "router_bias"},
}


def _earlier(key: str, ff: str) -> str:
    head, _, last = key.rpartition(".")
    if head.endswith(".attention"):
        table = EARLIER["attention"]
    elif head.endswith(".feedforward"):
        table = EARLIER[ff]
    else:  # a Mixture-of-Depths wrapper: blocks.i
        table = EARLIER["mod"]
    return f"{head}.{table.get(last, last)}"


def _old_export(root: Path, preset: str, ff: str) -> tuple[Path, Path]:
    run = random_run(root, preset, 0, ("model.n_layers=2", "model.context_length=32"))
    out = export_hf(run, root / f"{preset}-hf")
    weights = out / "model.safetensors"
    state = load_file(str(weights))
    old = {_earlier(k, ff): v for k, v in state.items()}
    assert len(old) == len(state) and old.keys() != state.keys()
    save_file(old, str(weights), metadata={"format": "pt"})
    return run, out


@pytest.fixture(scope="module")
def old_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy")
    return {preset: _old_export(root, preset, ff)
            for preset, ff in (("tiny-switchall", "sigma"), ("tiny-mode", "switch"))}


def _ids():
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-mode"])
def test_an_old_export_loads_with_the_runs_logits_and_saves_current_names(preset, old_exports,
                                                                          tmp_path):
    run, out = old_exports[preset]
    assert register_legacy_key_renames()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        got = hf(_ids(), use_cache=False).logits
        want = load_trained(run).model(_ids()).logits
    assert (got - want).abs().max().item() < 1e-5
    hf.save_pretrained(tmp_path / "again")
    saved = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(saved) == {f"model.{k}" for k in load_trained(run).model.state_dict()}


def test_a_fresh_process_registers_the_renames_when_the_remote_code_imports_moeify(
        old_exports, tmp_path):
    """What a user's script does: import transformers (not moeify), load the old directory;
    the remote code's import of moeify registers the renames before the weights are read."""
    run, out = old_exports["tiny-switchall"]
    script = (
        "import sys, torch, transformers\n"
        "assert 'moeify' not in sys.modules\n"
        f"hf = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, "
        "trust_remote_code=True).eval()\n"
        "ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))\n"
        "with torch.no_grad():\n"
        f"    torch.save(hf(ids, use_cache=False).logits, {str(tmp_path / 'logits.pt')!r})\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path,
                   capture_output=True)
    with torch.no_grad():
        want = load_trained(run).model(_ids()).logits
    got = torch.load(tmp_path / "logits.pt")
    assert (got - want).abs().max().item() < 1e-5
    assert json.loads((out / "config.json").read_text())["auto_map"]
