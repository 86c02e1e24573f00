"""Hugging Face MoE checkpoints in, native Hugging Face models out (moeify.interop): tiny Mixtral,
Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints written here by transformers with random weights are
imported and compared logit for logit; imported, evaluated and trained runs are exported with
``--format native`` and loaded back by plain transformers (no moeify, no remote code); dense
imports (GPT-2, Llama, Mistral, Qwen2) go back to their own model_type; models without a native
form are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_checkpoints import (cached_decoding_diff, hf_transformers, imported_logit_diff,
                            padded_batch, randomise, save_checkpoint)

transformers = hf_transformers()

from moeify.cli.main import main  # noqa: E402
from moeify.interop import export_hf, import_hf  # noqa: E402
from moeify.models.params import model_parameters  # noqa: E402
from moeify.rundir import load_trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
V = 300
TOL = 1e-5  # float32 round-off: the bar for every comparison here
MAX_DIFF: dict[str, float] = {}
BODY = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

MOE_CONFIGS = {
    # Mixtral: always renormalised top-k, untied.
    "mixtral": lambda: transformers.MixtralConfig(
        **BODY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # Qwen2-MoE: Q/K/V biases, the sigmoid-gated shared expert, raw softmax gates.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **BODY, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=16, norm_topk_prob=False),
    # Qwen3-MoE: per-head q/k norms, head_dim != hidden/heads, a dense first layer
    # (decoder_sparse_step=2), renormalised gates, tied embeddings.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **BODY, head_dim=16, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True,
        tie_word_embeddings=True),
    # OLMoE: full-width q/k norms, raw softmax gates.
    "olmoe": lambda: transformers.OlmoeConfig(
        **BODY, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, pad_token_id=1, eos_token_id=0),
}
DENSE_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(
        **BODY, intermediate_size=48, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "llama-bias-tied": lambda: transformers.LlamaConfig(
        **{**BODY, "num_key_value_heads": 1}, intermediate_size=48, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(**BODY, intermediate_size=48,
                                                  sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**BODY, intermediate_size=48,
                                              tie_word_embeddings=True),
}
HF_CONFIGS = {**MOE_CONFIGS, **DENSE_CONFIGS}  # the checkpoints of hf_dirs (conftest.py)




def make_checkpoint(root: Path, name: str, seed: int = 0, **overrides):
    cfg = HF_CONFIGS[name]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return save_checkpoint(cfg, root, name, seed)


def _batch(seed: int = 1):
    return padded_batch(V, seed)


def _load_native(path: Path, model_type: str):
    """Plain transformers: no trust_remote_code, every tensor of the checkpoint used."""
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == model_type and "auto_map" not in config
    assert not (path / "modeling_moeify.py").exists()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                    output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


# ---------------------------------------------------------------------- import

@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_imported_moe_logits_equal_transformers(name, hf_dirs, imported):
    hf_model, model = hf_dirs[name][0], load_trained(imported[name]).model
    diff = imported_logit_diff(hf_model, model, V)
    MAX_DIFF[f"import {name}"] = diff
    assert diff < TOL, diff
    ids, _ = _batch()
    with torch.no_grad():
        loss_want = hf_model(ids[:1], labels=ids[:1]).loss
        loss_got = model(ids[:1, :-1], ids[:1, 1:]).loss
    assert abs(loss_got.item() - loss_want.item()) < TOL


def test_imported_moe_configs_state_the_routing(imported):
    """What each family's import says about its routing, read back from model.json."""
    def ff(name, layer=-1):
        return load_trained(imported[name]).model_config.feedforward_layers()[layer]

    mixtral, qwen2, qwen3, olmoe = (ff(n) for n in MOE_CONFIGS)
    assert all(f.gated and f.dropless and f.activation == "silu" and f.k == 2
               for f in (mixtral, qwen2, qwen3, olmoe))
    assert mixtral.renormalize and qwen3.renormalize
    assert not qwen2.renormalize and not olmoe.renormalize
    assert qwen2.shared.d_ff == 16 and qwen2.shared_gate and mixtral.shared is None
    assert type(ff("qwen3_moe", 0)).__name__ == "GatedMLPConfig"  # decoder_sparse_step=2
    attn = {n: load_trained(imported[n]).model_config.attention[0] for n in MOE_CONFIGS}
    assert (attn["qwen3_moe"].qk_norm, attn["olmoe"].qk_norm) == ("head", "full")
    assert attn["qwen2_moe"].qkv_bias and not attn["qwen2_moe"].out_bias


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_count_prices_imported_moe_exactly(name, hf_dirs, imported):
    hf_model, _ = hf_dirs[name]
    assert model_parameters(load_trained(imported[name]).model_config)["total"] == \
        hf_model.num_parameters()


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_imported_moe_cached_decoding_equals_full_forward(name, imported):
    assert cached_decoding_diff(load_trained(imported[name]).model, V) < TOL


def test_fused_expert_tensors_import_too(hf_dirs, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2F, D], experts.down_proj
    [E, D, F], under mlp.) is read as well as save_pretrained's per-expert tensors."""
    from safetensors.torch import load_file, save_file

    hf_model, src = hf_dirs["mixtral"]
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (fused / f).write_bytes((src / f).read_bytes())
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()},
              str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(fused / "model.safetensors")
    model = load_trained(import_hf(fused, tmp_path / "run")).model
    ids, _ = _batch(3)
    with torch.no_grad():
        assert (model(ids).logits - hf_model(ids).logits).abs().max() < TOL


REFUSED_IMPORTS = {
    "olmoe": ({"clip_qkv": 8.0}, "clip_qkv=8.0"),
    "mixtral": ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
}


@pytest.mark.parametrize("name", list(REFUSED_IMPORTS))
def test_unsupported_moe_features_are_refused_in_one_line(name, hf_dirs, tmp_path, capsys):
    import shutil

    change, message = REFUSED_IMPORTS[name]
    src = tmp_path / "src"
    shutil.copytree(hf_dirs[name][1], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    assert main(["import", "--hf", str(src), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "does not implement" in err, err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- the round trip

@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_import_eval_train_export_native_round_trip(name, hf_dirs, tmp_path, capsys,
                                                    monkeypatch):
    """moeify import -> eval (perplexity) -> train --resume (the weights move, the loss falls)
    -> export --format native -> plain transformers computes moeify's logits."""
    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    hf_model, src = hf_dirs[name]
    run, out = tmp_path / "run", tmp_path / "hf"
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of a small corpus about cats and mats"
                              for i in range(200)))
    assert main(["import", "--hf", str(src), "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--task", "ppl", "--data", str(text),
                 "--limit", "128", "--json"]) == 0
    ppl = json.loads(capsys.readouterr().out)
    assert ppl["tokens"] == 128 and 1.0 < ppl["ppl"] < float("inf")
    ids = torch.tensor(load_trained(run).tokenizer.encode(text.read_text())[:2 * 33])
    ids = ids.view(2, 33)
    with torch.no_grad():  # the run's imported loss is transformers' loss on the same tokens
        before = hf_model(ids, labels=ids).loss.item()
        assert abs(load_trained(run).model(ids[:, :-1], ids[:, 1:]).loss.item() - before) < TOL
    assert main(["train", "--resume", str(run), "--data", str(text), "--steps", "4", "--quiet",
                 "--set", "batch_size=2", "--set", "warmup_steps=0", "--set", "lr=3e-3",
                 "--set", "eval_every=0", "--set", "eval_tokens=64"]) == 0
    trained = load_trained(run)
    assert trained.checkpoint.step == 4
    with torch.no_grad():
        after = trained.model(ids[:, :-1], ids[:, 1:]).loss.item()
    assert after < before - 0.05, (before, after)

    assert main(["export", "--run", str(run), "--out", str(out), "--format", "native"]) == 0
    back = _load_native(out, name)
    ids2, mask = _batch(5)
    with torch.no_grad():
        want = trained.model(ids2, valid_BT=mask.bool()).logits
        got = back(ids2, attention_mask=mask).logits
    diff = (got - want)[mask.bool()].abs().max().item()
    MAX_DIFF[f"native export after training {name}"] = diff
    assert diff < TOL, diff
    with torch.no_grad():  # the training moved the weights transformers now holds
        assert (got - hf_model(ids2, attention_mask=mask).logits)[mask.bool()].abs().max() > 1e-3
    from moeify.eval.generate import generate  # greedy decoding, each with its own cache

    prompt = ids2[0, :5].tolist()
    new_ids = back.generate(ids2[:1, :5], max_new_tokens=6, do_sample=False,
                            attention_mask=torch.ones(1, 5, dtype=torch.long))
    assert new_ids[0, 5:].tolist() == generate(trained.model, prompt, max_new_tokens=6,
                                               temperature=0.0)
    readme = (out / "README.md").read_text()
    assert "without moeify" in readme and "trust_remote_code" not in readme
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Hello").input_ids == trained.tokenizer.encode("Hello")


@pytest.mark.parametrize("name", list(DENSE_CONFIGS))
def test_dense_imports_export_to_their_own_model_type(name, hf_dirs, imported, tmp_path):
    hf_model, _ = hf_dirs[name]
    kind = json.loads((hf_dirs[name][1] / "config.json").read_text())["model_type"]
    back = _load_native(export_hf(imported[name], tmp_path / "hf", format="native"), kind)
    ids, mask = _batch(6)
    with torch.no_grad():
        want = hf_model(ids, attention_mask=mask).logits
        got = back(ids, attention_mask=mask).logits
        mine = load_trained(imported[name]).model(ids, valid_BT=mask.bool()).logits
    diff = (got - mine)[mask.bool()].abs().max().item()
    MAX_DIFF[f"native export {name}"] = diff
    assert diff < TOL and (got - want)[mask.bool()].abs().max() < TOL, diff
    assert hf_model.num_parameters() == back.num_parameters()


def test_mistral_sliding_window_survives_the_round_trip(tmp_path):
    """The import caps the context at the window (where windowed and full attention agree);
    the native export gives the window back."""
    hf_model, src = make_checkpoint(tmp_path, "mistral", sliding_window=16)
    run = import_hf(src, tmp_path / "run")
    assert load_trained(run).model_config.context_length == 16
    back = _load_native(export_hf(run, tmp_path / "hf", format="native"), "mistral")
    assert back.config.sliding_window == 16
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (back(ids).logits - hf_model(ids).logits).abs().max() < TOL


def _native_moeify_model(kind: str):
    """A moeify model built in Python, never imported, with a native type's semantics."""
    from moeify.layers.gqa import GroupedQueryAttentionConfig
    from moeify.layers.mlp import GatedMLPConfig
    from moeify.layers.norm import NormConfig
    from moeify.layers.switch_ff import SwitchFFConfig
    from moeify.models.config import ModelConfig

    qwen3 = kind == "qwen3_moe"
    attn = GroupedQueryAttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, d_head=8,
                                       n_layers=2, qk_norm="head" if qwen3 else "none",
                                       qk_norm_eps=1e-5)
    moe = SwitchFFConfig(d_model=32, d_ff=24, n_experts=4, k=2, gated=True, activation="silu",
                         dropless=True, renormalize=not qwen3)
    ff = (GatedMLPConfig(d_model=32, d_ff=40, n_layers=2), moe) if qwen3 else moe
    return ModelConfig(vocab_size=256, d_model=32, n_layers=2, context_length=32,
                       attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="rmsnorm", eps=1e-5, bias=False),
                       output_bias=False)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_moeify_built_moe_exports_to_the_type_it_matches(kind, tmp_path):
    from moeify.data.tokenizers import ByteTokenizer
    from moeify.rundir.write import save_checkpoint
    from moeify.train.config import RUN_MODEL_PRESET, TrainConfig
    from moeify.rundir.files import model_config_dict, write_run_files

    cfg = _native_moeify_model(kind)
    model = cfg.build()
    randomise(model, 4)
    run = tmp_path / "run"
    write_run_files(run, TrainConfig(preset=RUN_MODEL_PRESET, tokenizer="byte256"), cfg,
                    ByteTokenizer())
    save_checkpoint(run, 1, model.state_dict(), {"step": 1},
                    meta={"preset": RUN_MODEL_PRESET, "model_config": model_config_dict(cfg)})
    back = _load_native(export_hf(run, tmp_path / "hf", format="native"), kind)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = load_trained(run).model(ids).logits
        diff = (back(ids).logits - want).abs().max().item()
    assert want.abs().max() > 1.0
    MAX_DIFF[f"native export of a moeify-built {kind}"] = diff
    assert diff < TOL, diff


# ---------------------------------------------------------------------- refusals

def _preset_run(root: Path, preset: str, *overrides: str) -> Path:
    from moeify.data.tokenizers import ByteTokenizer
    from moeify.rundir.write import save_checkpoint
    from moeify.train.config import TrainConfig, resolve_model_config
    from moeify.rundir.files import model_config_dict, write_run_files

    cfg = TrainConfig(preset=preset, tokenizer="byte256",
                      model_overrides=("model.n_layers=2", "model.context_length=32",
                                       *overrides))
    model_cfg = resolve_model_config(cfg, 256)
    run = root / preset
    write_run_files(run, cfg, model_cfg, ByteTokenizer())
    save_checkpoint(run, 1, model_cfg.build().state_dict(), {"step": 1},
                    meta={"preset": preset, "model_config": model_config_dict(model_cfg)})
    return run


def test_native_export_refuses_a_paper_preset_in_one_line(tmp_path, capsys):
    run = _preset_run(tmp_path, "tiny-switch")
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out), "--format", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Transformer-XL memory" in err, err
    assert "--format moeify" in err and not out.exists()


def _upcycled_gpt2(imported, ff):
    import dataclasses

    return dataclasses.replace(load_trained(imported["gpt2"]).model_config, feedforward=ff)


def test_native_export_names_the_expert_difference(imported):
    """GPT-2 upcycled to Switch (ReLU-free GELU experts, capacity routing) or sigma-MoE: what
    no native MoE type computes is named."""
    from moeify.errors import MoeifyError
    from moeify.interop.hf_native import native_type
    from moeify.layers.feedforward import SigmaMoEConfig, SwitchFFConfig

    switch = SwitchFFConfig(d_model=32, d_ff=128, n_experts=2, activation="gelu_tanh",
                            bias=True)
    sigma = SigmaMoEConfig(d_model=32, n_experts=4, expert_size=32, k=2, n_layers=2)
    for ff, why in ((switch, "its experts are not gated (SwiGLU)"), (sigma, "sigmoid router")):
        with pytest.raises(MoeifyError, match="no native Hugging Face form") as e:
            native_type(_upcycled_gpt2(imported, ff), {"model_type": "gpt2"})
        assert why in str(e.value) and "\n" not in str(e.value), e.value
    import dataclasses

    gated = dataclasses.replace(switch, gated=True, bias=False, activation="silu")
    with pytest.raises(MoeifyError, match="dropless=False"):
        native_type(_upcycled_gpt2(imported, gated))
    # A loss-free balancing bias, or shared experts given as n_shared, have no native form.
    for change, why in (({"lossfree_rate": 1e-3}, "loss-free balancing bias"),
                        ({"n_shared": 1}, "n_shared")):
        with pytest.raises(MoeifyError, match=why):
            native_type(_upcycled_gpt2(imported, dataclasses.replace(gated, dropless=True,
                                                                      **change)))


def test_native_export_names_what_a_changed_import_no_longer_matches(imported, tmp_path,
                                                                    capsys):
    """An imported Mixtral whose routing was switched to capacity-limited is no longer a
    Mixtral: refused, naming the change; the default format still exports it."""
    import dataclasses

    from moeify.rundir.files import model_config_dict

    run = tmp_path / "run"
    import shutil

    shutil.copytree(imported["mixtral"], run)
    cfg = load_trained(run).model_config
    changed = dataclasses.replace(cfg, feedforward=tuple(
        dataclasses.replace(f, dropless=False) for f in cfg.feedforward))
    for path in [run / "model.json", *run.glob("checkpoints/*/meta.json")]:
        if path.name == "model.json":
            path.write_text(json.dumps(model_config_dict(changed), indent=2))
        else:
            meta = json.loads(path.read_text())
            meta["model_config"] = model_config_dict(changed)
            path.write_text(json.dumps(meta))
    assert load_trained(run).model_config.feedforward[0].dropless is False
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf"),
                 "--format", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert "source's model_type mixtral" in err and "dropless=False" in err, err
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0


def test_run_files_without_the_moe_options_read_back_as_the_same_model(tmp_path):
    """model.json and checkpoint records written without the options the MoE imports use
    (qk_norm, gated, renormalize, shared: at their defaults) read back as the same model."""
    from moeify.models.config import ModelConfig
    from moeify.rundir.files import model_config_dict, same_model_config

    data = json.loads((_preset_run(tmp_path, "tiny-switch") / "model.json").read_text())
    stripped = json.loads(json.dumps(data))
    for layer in stripped["attention"] + stripped["feedforward"]:
        for key in ("qk_norm", "qk_norm_eps", "gated", "renormalize", "shared"):
            layer.pop(key, None)
    assert stripped != data
    assert ModelConfig.from_dict(stripped) == ModelConfig.from_dict(data)
    assert same_model_config(stripped, model_config_dict(ModelConfig.from_dict(data)))
    assert not same_model_config({**stripped, "d_model": 8}, model_config_dict(
        ModelConfig.from_dict(data)))


def test_report_measured_differences():
    """Prints the largest logit differences measured above (pytest -s shows them)."""
    print("\nmax |logit difference|:", json.dumps({k: f"{v:.2e}" for k, v in MAX_DIFF.items()}))
    assert all(v < TOL for v in MAX_DIFF.values())
