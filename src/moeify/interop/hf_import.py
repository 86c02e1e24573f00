"""Import a Hugging Face causal LM checkpoint (a ``save_pretrained`` directory) as a moeify run.

    import_hf(src, out)  ->  out/ model.json, config.json, tokenizer.json + hf_tokenizer.json,
                             hf_config.json (the source config), hf_tokenizer_config.json
                             (its special tokens), checkpoints/step-00000000/ (weights only)

Supported: GPT-2 (``GPT2LMHeadModel``), the Llama family (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``) and its MoE relatives (``MixtralForCausalLM``,
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM``). The conversion preserves
the function: the moeify model computes the same logits as the transformers model for any batch
within the context (float32 weights; tests/interop/test_hf.py holds the dense families to 1e-4,
tests/interop/test_hf_moe.py the MoE families to 1e-5, padded batches too):

    GPT-2  learned absolute positions, LayerNorm (eps from the config), multi-head attention
           with Q/K/V and output biases (Conv1D [in, out] weights transposed, c_attn split into
           Q, K, V), GELU MLP with biases (gelu_new = tanh approximation), tied embeddings.
    Llama  RMSNorm (eps from the config), grouped-query attention with full-width RoPE of the
           config's base and scaling (Hugging Face's rotate-half layout is moeify's: no
           permutation),
           optional biases (Qwen2: Q/K/V), SwiGLU MLP, tied or untied embeddings.
    MoE    the Llama body with a Switch feedforward (moeify.layers.switch_ff) whose options
           state the checkpoint's routing: router logits and softmax over the E experts in
           float32, top-k, the k gates renormalised to sum 1 (Mixtral always; Qwen2-MoE,
           Qwen3-MoE and OLMoE when ``norm_topk_prob``), SwiGLU experts (gated=True), dropless
           (Hugging Face's MoE blocks drop no token). Per family: Mixtral no attention biases;
           Qwen2-MoE Q/K/V biases (``qkv_bias``), a shared SwiGLU expert scaled by
           sigmoid(shared_expert_gate · x), dense SwiGLU layers where ``decoder_sparse_step``
           / ``mlp_only_layers`` say so; Qwen3-MoE RMSNorm of each query and key head
           (qk_norm="head"), the same dense layers; OLMoE RMSNorm over the whole query and key
           projections (qk_norm="full"). Training after the import uses moeify's Switch
           balance loss (the top-1 form) weighted by the checkpoint's ``router_aux_loss_coef``
           and no z-loss; Hugging Face's load-balancing loss counts all k choices.

RoPE scaling (``rope_type`` llama3, linear, dynamic, yarn: Llama 3.x and other long-context
checkpoints) is read into ``GroupedQueryAttentionConfig.rope_scaling`` as transformers defines it
(moeify.interop.hf_mapping.rope_from_hf); the run's context is the checkpoint's
``max_position_embeddings``. The weights keep their dtype (one of float32 / bfloat16 / float16;
float32 for a mix); FP8 block-scaled weights (``quantization_config`` quant_method "fp8",
``weight_scale_inv``) are dequantised to float32 (``dequantize_fp8``). A tokenizer whose ids
reach past the embedding is refused, naming both sizes.

Not preserved: dropout rates (the imported model has none), and anything the config marks as a
variant moeify does not implement (``longrope``, GPT-2's layer-index attention scaling, OLMoE's
``clip_qkv``, Mixtral's ``router_jitter_noise``, other quantisations...), which is refused in one
line. A sliding window (Mistral, Mixtral, Qwen-MoE with ``use_sliding_window``) is not applied:
the context length is capped at the window instead, where windowed and full attention agree.
Nothing is downloaded: the directory must hold config.json, the weights (model.safetensors, or
shards with model.safetensors.index.json) and tokenizer.json. Config keys and tensor names and
layouts are the family's rows and links (moeify.interop.hf_mapping), which the native export
reads the other way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from moeify.data.cache import atomic_directory, sweep_stale_directories
from moeify.data.hf_tokenizer import HFTokenizer
from moeify.errors import MoeifyError
from moeify.interop.hf_mapping import (ARCHITECTURES, config_from_hf, from_hf, moe_block,
                                       tensor_links)
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.norm import NormConfig
from moeify.layers.switch_ff import SwitchFFConfig
from moeify.models.config import ModelConfig
from moeify.rundir.files import model_config_dict, write_run_files
from moeify.rundir import write as run_write
from moeify.rundir.model import weights_dtype
from moeify.train.config import RUN_MODEL_PRESET, TrainConfig

SUPPORTED_ARCHITECTURES = ARCHITECTURES  # model_type -> class (moeify.interop.hf_mapping)
HF_CONFIG_COPY = "hf_config.json"
# The special tokens and chat template of tokenizer_config.json, kept for the export.
HF_TOKENIZER_CONFIG_COPY = "hf_tokenizer_config.json"
TOKENIZER_CONFIG_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")
# The end-of-sequence ids of generation_config.json (what transformers' generate stops at).
HF_GENERATION_CONFIG_COPY = "hf_generation_config.json"


def offline() -> None:
    """Keep the Hugging Face libraries from reaching the network (nothing is downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES.values())


def read_hf_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not src.is_dir():
        raise MoeifyError(f"{src} is not a directory: give a Hugging Face checkpoint directory "
                          "(written by save_pretrained)")
    if not path.is_file():
        raise MoeifyError(f"{src} has no config.json: it is not a Hugging Face checkpoint "
                          "directory (save the model with save_pretrained)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MoeifyError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(hf, dict):
        raise MoeifyError(f"{path} does not hold a JSON object")
    arch = hf.get("model_type")
    if arch is None:
        by_class = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        archs = hf.get("architectures")
        hint = [by_class[a] for a in (archs if isinstance(archs, list) else [])
                if isinstance(a, str) and a in by_class]
        fix = (f'add "model_type": "{hint[0]}" (what its "architectures" entry names)'
               if hint else "add the model_type of the model "
               f"({', '.join(SUPPORTED_ARCHITECTURES)}) or save it again with save_pretrained")
        raise MoeifyError(f"{path} has no \"model_type\", which says which architecture the "
                          f"weights are for; {fix}")
    if arch not in SUPPORTED_ARCHITECTURES:
        names = hf.get("architectures") or [arch]
        raise MoeifyError(f"{src}: architecture {', '.join(map(str, names))} (model_type "
                          f"{arch!r}) is not supported; moeify imports {_supported()}")
    return hf


# ---------------------------------------------------------------------- configs

def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a supported Hugging Face config (a dict read from config.json), built
    from the fields its family's rows read (moeify.interop.hf_mapping.config_from_hf)."""
    try:
        fields = config_from_hf(hf)
        return _gpt2_config(fields) if hf["model_type"] == "gpt2" else _llama_config(fields)
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"config.json describes a model moeify cannot rebuild: {e}") from None


def _gpt2_config(f: dict[str, Any]) -> ModelConfig:
    """GPT-2: learned positions, LayerNorm, multi-head attention and a two-layer MLP, all with
    biases."""
    D, L, H = f["d_model"], f["n_layers"], f["n_heads"]
    if D % H:
        raise MoeifyError(f"config.json: n_embd={D} is not a multiple of n_head={H}")
    attn = GroupedQueryAttentionConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=D // H,
                                       pos="absolute", qkv_bias=True, out_bias=True,
                                       n_layers=L)
    ff = MLPConfig(d_model=D, d_ff=f["d_ff"], activation=f["activation"], bias=True, n_layers=L)
    return ModelConfig(vocab_size=f["vocab_size"], d_model=D, n_layers=L,
                       context_length=f["context_length"], attention=attn, feedforward=ff,
                       xl_memory=False, norm=NormConfig(kind="layernorm", eps=f["norm_eps"]),
                       max_positions=f["max_positions"], tie_embeddings=f["tie_embeddings"],
                       output_bias=False)


def _llama_config(f: dict[str, Any]) -> ModelConfig:
    """The Llama family (Llama, Mistral, Qwen2) and its MoE relatives (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE): RMSNorm, RoPE, grouped-query attention, SwiGLU MLPs or experts."""
    D, L = f["d_model"], f["n_layers"]
    qk_norm = f.get("qk_norm", "none")
    attn = GroupedQueryAttentionConfig(
        d_model=D, n_heads=f["n_heads"], n_kv_heads=f["n_kv_heads"], d_head=f["d_head"],
        pos="rope", rope_base=f["rope_base"], rope_fraction=f["rope_fraction"],
        rope_scaling=f["rope_scaling"], qkv_bias=f["qkv_bias"], out_bias=f["out_bias"],
        n_layers=L, qk_norm=qk_norm, qk_norm_eps=f["norm_eps"] if qk_norm != "none" else 1e-6)
    if "n_experts" in f:
        ff = _moe_layers(f)
    else:
        ff = GatedMLPConfig(d_model=D, d_ff=f["d_ff"], activation=f["activation"],
                            bias=f.get("mlp_bias", False), n_layers=L)
    T = f["context_length"]
    # A family without use_sliding_window (Mistral, Mixtral) applies its window when it has one.
    window = f.get("sliding_window") if f.get("use_sliding_window", True) else None
    if window:
        T = min(T, int(window))
    return ModelConfig(vocab_size=f["vocab_size"], d_model=D, n_layers=L, context_length=T,
                       attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="rmsnorm", eps=f["norm_eps"], bias=False),
                       tie_embeddings=f["tie_embeddings"], output_bias=False)


def moe_layer_indices(f: dict[str, Any]) -> list[bool]:
    """Which layers of a Hugging Face MoE model hold experts (the others a dense SwiGLU MLP):
    Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` (a config without experts: none);
    every layer elsewhere."""
    if "sparse_step" not in f:
        return [True] * f["n_layers"]
    dense, step = set(f["mlp_only_layers"]), f["sparse_step"]
    return [i not in dense and f["n_experts"] > 0 and (i + 1) % step == 0
            for i in range(f["n_layers"])]


def _moe_layers(f: dict[str, Any]) -> tuple:
    """The feedforward of every layer: a Switch feedforward with the checkpoint's routing
    (softmax over the experts in float32, top-k, renormalised as the family defines, no
    capacity limit: Hugging Face's MoE blocks drop no token) or, in Qwen-MoE's dense layers,
    a SwiGLU MLP."""
    D, L, act = f["d_model"], f["n_layers"], f["activation"]
    shared = None
    if f.get("shared_d_ff", 0) > 0:
        shared = GatedMLPConfig(d_model=D, d_ff=f["shared_d_ff"], activation=act, n_layers=L)
    moe = SwitchFFConfig(
        d_model=D, d_ff=f["expert_d_ff"], n_experts=f["n_experts"], k=f["k"], dropless=True,
        gated=True, activation=act, renormalize=f["renormalize"], shared=shared,
        shared_gate=shared is not None, balance_coef=f["balance_coef"], z_coef=0.0)
    layers = moe_layer_indices(f)
    dense = None
    if not all(layers):
        dense = GatedMLPConfig(d_model=D, d_ff=f["d_ff"], activation=act, n_layers=L)
    return tuple(moe if is_moe else dense for is_moe in layers)


# ---------------------------------------------------------------------- weights

def read_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json names."""
    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise MoeifyError(f"{index} is corrupt ({e})") from None
        files = [src / s for s in shards]
    else:
        raise MoeifyError(f"{src} has no model.safetensors (nor a sharded "
                          "model.safetensors.index.json); save the model with save_pretrained "
                          "(safetensors is its default)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise MoeifyError(f"{f} is missing: the checkpoint's weights are incomplete")
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types on damaged files
            raise MoeifyError(f"{f} cannot be read ({str(e).splitlines()[0]}): the weights file "
                              "is truncated or damaged") from None
    return out


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(hf: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 weight dequantised by its block scales, as
    transformers' fine-grained FP8 format defines them (DeepSeek-V3, Qwen3 FP8 releases):
    ``quantization_config`` {"quant_method": "fp8", "weight_block_size": [bo, bi]} and, beside
    each float8 ``NAME`` [O, I], ``NAME_scale_inv`` [ceil(O / bo), ceil(I / bi)] with
    W[o, i] = q[o, i] · scale_inv[o // bo, i // bi] (one scalar scale without a block size).
    The product is formed in float32, where it is exact up to the one rounding of the float32
    result (an FP8 value times a float32 scale); the result is float32. Anything else
    quantised is refused in one line."""
    qc = hf.get("quantization_config")
    fp8 = [k for k, t in tensors.items() if t.dtype in FP8_DTYPES]
    if not qc and not fp8:
        return tensors
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        what = (f"quantization_config quant_method {method!r}" if qc else
                f"float8 weights ({fp8[0]}) without a quantization_config")
        raise MoeifyError(f"config.json: {what}; moeify imports unquantised checkpoints and "
                          "block-scaled FP8 ones (quant_method 'fp8'): dequantise it first")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise MoeifyError(f"config.json: FP8 activation_scheme {qc['activation_scheme']!r} "
                          "(static activation scales) is not supported; moeify imports the "
                          "weights of 'dynamic' FP8 checkpoints")
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                              or not all(isinstance(b, int) and b > 0 for b in block)):
        raise MoeifyError(f"config.json: quantization_config weight_block_size {block!r} is "
                          "not two positive integers")
    out = {k: t for k, t in tensors.items() if not k.endswith("_scale_inv")}
    for k in fp8:
        scale = tensors.get(k + "_scale_inv")
        q = tensors[k]
        if scale is None:
            raise MoeifyError(f"the checkpoint's FP8 tensor {k} has no {k}_scale_inv: the "
                              "weights are incomplete")
        if block is not None and q.dim() == 2:
            bo, bi = block
            want = (-(-q.shape[0] // bo), -(-q.shape[1] // bi))
            if tuple(scale.shape) != want:
                raise MoeifyError(f"{k}_scale_inv has shape {tuple(scale.shape)}, but {k} "
                                  f"{tuple(q.shape)} in blocks of {bo}x{bi} needs {want}")
            scale = scale.float().repeat_interleave(bo, 0)[:q.shape[0]]
            scale = scale.repeat_interleave(bi, 1)[:, :q.shape[1]]
        elif scale.numel() != 1:
            raise MoeifyError(f"{k}_scale_inv has shape {tuple(scale.shape)}: without "
                              "weight_block_size the scale is one number per tensor")
        out[k] = q.float() * scale.float().reshape(scale.shape if scale.dim() == 2 else ())
    return out


def _hf_names(tensors: dict[str, torch.Tensor], hf: dict, cfg: ModelConfig
              ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names save_pretrained writes: the body's prefix
    ("model." / "transformer.") added where a checkpoint was saved without it, and
    transformers' fused in-memory experts (experts.gate_up_proj [E, 2F, D], gate rows first;
    experts.down_proj [E, D, F]) split into the per-expert matrices."""
    body = "transformer." if hf["model_type"] == "gpt2" else "model."
    if not any(k.startswith(body) for k in tensors):
        tensors = {(k if k.startswith("lm_head.") else body + k): v for k, v in tensors.items()}
    block, (g, u, d) = moe_block(hf["model_type"])
    out = dict(tensors)
    for i in range(cfg.n_layers):
        fused = f"model.layers.{i}.mlp.experts."
        if fused + "gate_up_proj" not in out:
            continue
        gate_up, down = out.pop(fused + "gate_up_proj"), out.pop(fused + "down_proj", None)
        if down is None:
            break  # reported as a missing tensor by state_from_hf
        F = gate_up.shape[1] // 2
        router = f"model.layers.{i}.mlp.gate.weight"
        if block != "mlp." and router in out:  # Mixtral's fused form keeps its router in mlp.
            out[f"model.layers.{i}.{block}gate.weight"] = out.pop(router)
        for e in range(gate_up.shape[0]):
            x = f"model.layers.{i}.{block}experts.{e}."
            out[x + f"{g}.weight"], out[x + f"{u}.weight"] = gate_up[e, :F], gate_up[e, F:]
            out[x + f"{d}.weight"] = down[e]
    return out


def state_from_hf(tensors: dict[str, torch.Tensor], hf: dict, cfg: ModelConfig,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The moeify state dict of ``cfg`` (in ``dtype``) from the checkpoint's tensors, read
    through the family's links (moeify.interop.hf_mapping) and checked name by name and shape
    by shape against the model ``cfg`` builds."""
    tensors = _hf_names(tensors, hf, cfg)
    sd: dict[str, torch.Tensor] = {}
    for link in tensor_links(hf["model_type"], cfg):
        for key in link.theirs:
            if key not in tensors:
                if key == "lm_head.weight":
                    raise MoeifyError("the checkpoint has no lm_head.weight but config.json "
                                      "says the embeddings are not tied")
                raise MoeifyError(f"the checkpoint has no tensor {key!r}: the weights do not "
                                  "match config.json (missing or from another model)")
        sd.update(zip(link.ours, from_hf(link, [tensors[k] for k in link.theirs])))
    with torch.device("meta"):
        want = cfg.build().state_dict()
    for key, t in want.items():
        if key not in sd or tuple(sd[key].shape) != tuple(t.shape):
            got = tuple(sd[key].shape) if key in sd else "nothing"
            raise MoeifyError(f"the checkpoint's weights do not match config.json: {key} needs "
                              f"shape {tuple(t.shape)}, the checkpoint gives {got}")
    return {k: sd[k].to(dtype).contiguous() for k in want}


# ---------------------------------------------------------------------- the run directory

def _read_tokenizer(src: Path, vocab_size: int):
    path = src / "tokenizer.json"
    if not path.is_file():
        raise MoeifyError(f"{src} has no tokenizer.json: save the tokenizer into the checkpoint "
                          "directory (tokenizer.save_pretrained(DIR)); moeify needs it to "
                          "evaluate and generate")
    return HFTokenizer(path.read_bytes(), vocab_size, where=str(path))


def _special_tokens(src: Path) -> dict[str, Any]:
    """The special-token entries of the checkpoint's tokenizer_config.json ({} without one)."""
    try:
        data = json.loads((src / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in TOKENIZER_CONFIG_KEYS if isinstance(data, dict)
            and isinstance(data.get(k), (str, dict))}


def _generation_config(src: Path) -> dict[str, Any]:
    """The token ids of the checkpoint's generation_config.json ({} without one)."""
    try:
        data = json.loads((src / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: data[k] for k in keys if isinstance(data, dict) and data.get(k) is not None}


def source_eos_ids(run_dir: str | Path) -> list[int] | None:
    """The end-of-sequence ids of an imported run's source: generation_config.json's
    ``eos_token_id`` (an int or a list), else config.json's, as transformers' generate reads
    them; None for a run that was not imported."""
    imported = False
    for name in (HF_GENERATION_CONFIG_COPY, HF_CONFIG_COPY):
        try:
            data = json.loads((Path(run_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        imported = True
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        if value is not None:
            return [v for v in (value if isinstance(value, list) else [value])
                    if isinstance(v, int)]
    return [] if imported else None


def _check_out(out: Path) -> None:
    sweep_stale_directories(out)  # what killed imports into --out left beside it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoeifyError(f"{out} already exists and is not an empty directory; choose a new "
                          "--out for the imported run")


def _check_finite(src: Path, tensors: dict[str, torch.Tensor]) -> None:
    """NaN or inf in the checkpoint's own weights: the file is damaged or was saved from a
    diverged model (nothing moeify's training settings could change)."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise MoeifyError(f"{src}: the checkpoint's weights hold NaN or inf values "
                          f"({', '.join(bad[:3])}{more}); the checkpoint is damaged or was "
                          "saved from a diverged model: import an intact checkpoint")


def import_hf(src: str | Path, out: str | Path) -> Path:
    """Convert the checkpoint directory ``src`` into the moeify run directory ``out`` (new or
    empty). Everything is read and checked before anything is written, and the run directory
    appears complete or not at all (written beside ``out``, then renamed)."""
    offline()
    src, out = Path(src), Path(out)
    _check_out(out)
    hf = read_hf_config(src)
    cfg = model_config_from_hf(hf)
    tokenizer = _read_tokenizer(src, cfg.vocab_size)
    tensors = dequantize_fp8(hf, read_hf_weights(src))
    _check_finite(src, tensors)
    state = state_from_hf(tensors, hf, cfg, weights_dtype(tensors))

    with atomic_directory(out, "import") as tmp:
        write_run_files(tmp, TrainConfig(preset=RUN_MODEL_PRESET), cfg, tokenizer)
        (tmp / HF_CONFIG_COPY).write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / HF_TOKENIZER_CONFIG_COPY).write_text(json.dumps(_special_tokens(src)) + "\n")
        generation = _generation_config(src)
        if generation:
            (tmp / HF_GENERATION_CONFIG_COPY).write_text(json.dumps(generation) + "\n")
        meta = {"preset": RUN_MODEL_PRESET, "model_config": model_config_dict(cfg),
                "weights_only": True,
                "imported_from": {"path": str(src.resolve()),
                                  "architecture": SUPPORTED_ARCHITECTURES[hf["model_type"]]}}
        run_write.save_checkpoint(tmp, 0, state, {"step": 0, "weights_only": True},
                                         meta=meta)
    return out
