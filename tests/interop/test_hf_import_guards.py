"""Import guards: an FP8 checkpoint (float8_e4m3fn weights with block scales, the layout of the
DeepSeek-V3 and Qwen3 FP8 releases) is dequantised exactly, or refused in one line; a tokenizer
whose ids reach past the embedding is refused naming both sizes; a bfloat16 checkpoint is stored
and exported as bfloat16."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_checkpoints import hf_transformers, save_checkpoint

transformers = hf_transformers()
from safetensors.torch import load_file, save_file  # noqa: E402

from moeify.cli.main import main  # noqa: E402
from moeify.interop import export_hf, import_hf  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
V = 256
BLOCK = (8, 16)  # [out, in] block of one scale (128 x 128 in the releases)


def llama_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, **extra)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint(llama_config(), tmp_path_factory.mktemp("llama"), "llama")


def dequantized_by_loop(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[o, i] = q[o, i] · scale[o // bo, i // bi], block by block, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bo, bi = BLOCK
    for a in range(scale.shape[0]):
        for b in range(scale.shape[1]):
            rows, cols = slice(a * bo, (a + 1) * bo), slice(b * bi, (b + 1) * bi)
            out[rows, cols] = q[rows, cols].double() * scale[a, b].double()
    return out


def fp8_checkpoint(src, dst):
    """``src`` with every projection quantised to float8_e4m3fn in blocks (scale = block max
    / 448, as the releases do), 40 = 2.5 blocks of 16 columns wide: ragged edge blocks."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, want = {}, {}
    for name, w in tensors.items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        bo, bi = BLOCK
        rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
        padded = torch.zeros(rows * bo, cols * bi)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.abs().reshape(rows, bo, cols, bi).amax((1, 3))
        scale = amax.clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:w.shape[0], :w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q, scale
        want[name] = dequantized_by_loop(q, scale)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    return want


def test_fp8_block_scaled_checkpoint_is_dequantised_exactly(llama, tmp_path):
    hf_model, src = llama
    want = fp8_checkpoint(src, tmp_path / "fp8")
    run = import_hf(tmp_path / "fp8", tmp_path / "run")
    tm = load_trained(run)
    state = tm.model.state_dict()
    assert state["blocks.0.attention.w_q.weight"].dtype == torch.float32
    # Every weight equals the block-scaled product, rounded once to float32.
    for i in range(2):
        for ours, theirs in (("attention.w_q", "self_attn.q_proj"),
                             ("feedforward.w_up", "mlp.up_proj"),
                             ("feedforward.w_down", "mlp.down_proj")):
            got = state[f"blocks.{i}.{ours}.weight"]
            assert torch.equal(got, want[f"model.layers.{i}.{theirs}.weight"].float()), ours
    # ... hence the logits of transformers' model holding the dequantised weights.
    deq = {k: (want[k].float() if k in want else v) for k, v in hf_model.state_dict().items()}
    ref = hf_model.__class__(hf_model.config).eval()
    ref.load_state_dict(deq)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ref(ids).logits - tm.model(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def _same(x):
    return x


def _qc(c, **change):
    return {**c, "quantization_config": {**c["quantization_config"], **change}}


# (edit the tensors, edit config.json, what the one line says)
FP8_REFUSALS = {
    "no scales": (lambda t: {k: v for k, v in t.items() if not k.endswith("_scale_inv")}, _same,
                  "has no model.layers.0.mlp.down_proj.weight_scale_inv"),
    "no quantization_config": (_same, lambda c: {k: v for k, v in c.items()
                                                 if k != "quantization_config"},
                               "float8 weights (model.layers"),
    "static activations": (_same, lambda c: _qc(c, activation_scheme="static"),
                           "activation_scheme 'static'"),
    "another method": (_same, lambda c: {**c, "quantization_config": {"quant_method": "awq"}},
                       "quant_method 'awq'"),
    "wrong scale shape": (lambda t: {**t, "model.layers.0.mlp.up_proj.weight_scale_inv":
                                     torch.ones(1, 1)}, _same, "in blocks of 8x16 needs (5, 2)"),
}


@pytest.mark.parametrize("case", list(FP8_REFUSALS))
def test_fp8_checkpoints_moeify_cannot_read_are_refused_in_one_line(case, llama, tmp_path, capsys):
    src = tmp_path / "fp8"
    fp8_checkpoint(llama[1], src)
    edit_tensors, edit_config, message = FP8_REFUSALS[case]
    save_file(edit_tensors(load_file(str(src / "model.safetensors"))),
              str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(edit_config(
        json.loads((src / "config.json").read_text()))))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_naming_both(llama, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(llama[1], src)
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["model"]["vocab"]["h"] = 300  # 256 tokens, but one id past the 256-row embedding
    (src / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "ids up to 300" in err and "embedding has 256 rows" in err, err


def test_bfloat16_checkpoint_stays_bfloat16_through_import_and_export(llama, tmp_path):
    hf_model, src = llama
    bf16 = tmp_path / "bf16"
    hf_model.to(torch.bfloat16).save_pretrained(bf16)
    hf_model.float()
    shutil.copy(src / "tokenizer.json", bf16 / "tokenizer.json")
    run = import_hf(bf16, tmp_path / "run")
    stored = load_file(str(run / "checkpoints" / "step-00000000" / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    tm = load_trained(run)
    assert {p.dtype for p in tm.model.parameters()} == {torch.bfloat16}
    for fmt in ("native", "moeify"):
        out = export_hf(run, tmp_path / fmt, format=fmt)
        assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == \
            {torch.bfloat16}, fmt
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_file(str(tmp_path / "native" / "model.safetensors"))
    theirs = load_file(str(bf16 / "model.safetensors"))
    assert back.keys() == theirs.keys()
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)  # bit-exact round trip
