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
           config's base (Hugging Face's rotate-half layout is moeify's: no permutation),
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

Not preserved: dropout rates (the imported model has none), the weights' dtype (stored as
float32), and anything the config marks as a variant moeify does not implement (RoPE scaling,
GPT-2's layer-index attention scaling, OLMoE's ``clip_qkv``, Mixtral's ``router_jitter_noise``...),
which is refused in one line. A sliding window (Mistral, Mixtral, Qwen-MoE with
``use_sliding_window``) is not applied: the context length is capped at the window instead, where
windowed and full attention agree. Nothing is downloaded: the
directory must hold config.json, the weights (model.safetensors, or shards with
model.safetensors.index.json) and tokenizer.json.
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
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.norm import NormConfig
from moeify.layers.switch_ff import SwitchFFConfig
from moeify.models.config import ModelConfig
from moeify.rundir.files import model_config_dict, write_run_files
from moeify.train import checkpoint as train_checkpoint
from moeify.train.config import RUN_MODEL_PRESET, TrainConfig

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
SUPPORTED_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                           "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           **MOE_ARCHITECTURES}
HF_CONFIG_COPY = "hf_config.json"
# The special tokens and chat template of tokenizer_config.json, kept for the export.
HF_TOKENIZER_CONFIG_COPY = "hf_tokenizer_config.json"
TOKENIZER_CONFIG_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")
# context_length is the training chunk and the generation window, not a limit of the weights:
# long-context checkpoints get this default (change it with --set model.context_length=N).
MAX_IMPORTED_CONTEXT = 2048
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
             "relu": "relu", "silu": "silu"}


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


def _need(hf: dict, key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    if value is None:
        raise MoeifyError(f"config.json has no {key!r}; it is needed to rebuild the model")
    return value


# ---------------------------------------------------------------------- configs

def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a supported Hugging Face config (a dict read from config.json)."""
    try:
        return _gpt2_config(hf) if hf["model_type"] == "gpt2" else _llama_config(hf)
    except (TypeError, ValueError) as e:
        raise MoeifyError(f"config.json describes a model moeify cannot rebuild: {e}") from None


def _gpt2_config(hf: dict) -> ModelConfig:
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise MoeifyError(f"config.json sets {key}=true, a GPT-2 variant moeify does not "
                              "implement")
    if hf.get("scale_attn_weights") is False:
        raise MoeifyError("config.json sets scale_attn_weights=false (unscaled attention), a "
                          "GPT-2 variant moeify does not implement")
    act = _need(hf, "activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise MoeifyError(f"config.json: activation_function {act!r} is not supported; "
                          f"moeify has {', '.join(_GPT2_ACT)}")
    D, L, H = _need(hf, "n_embd"), _need(hf, "n_layer"), _need(hf, "n_head")
    P = _need(hf, "n_positions")
    if D % H:
        raise MoeifyError(f"config.json: n_embd={D} is not a multiple of n_head={H}")
    attn = GroupedQueryAttentionConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=D // H,
                                       pos="absolute", qkv_bias=True, out_bias=True,
                                       n_layers=L)
    ff = MLPConfig(d_model=D, d_ff=hf.get("n_inner") or 4 * D, activation=_GPT2_ACT[act],
                   bias=True, n_layers=L)
    return ModelConfig(vocab_size=_need(hf, "vocab_size"), d_model=D, n_layers=L,
                       context_length=P, attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="layernorm", eps=float(hf.get("layer_norm_epsilon",
                                                                           1e-5))),
                       max_positions=P, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                       output_bias=False)


def _rope(hf: dict) -> tuple[float, float]:
    """(base, fraction) from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_scaling`` (earlier configs); scaled RoPE variants are refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise MoeifyError(f"config.json uses RoPE scaling {kind!r}; moeify implements plain RoPE "
                          "only (rope_type 'default')")
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(base), float(fraction)


_ACTS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _act(hf: dict) -> str:
    act = _need(hf, "hidden_act", "silu")
    if act not in _ACTS:
        raise MoeifyError(f"config.json: hidden_act {act!r} is not supported; moeify has "
                          f"{', '.join(_ACTS)}")
    return _ACTS[act]


def _attention_biases(hf: dict) -> tuple[bool, bool]:
    """(Q/K/V bias, output bias) as each family's attention code builds them."""
    kind = hf["model_type"]
    if kind == "qwen2":
        return True, False
    if kind == "qwen2_moe":  # its own key; Qwen1.5-MoE configs, without it, have the biases
        return bool(hf.get("qkv_bias", True)), False
    if kind == "mixtral":
        return False, False
    bias = bool(hf.get("attention_bias", False))  # llama, mistral, qwen3_moe, olmoe: all four
    return bias, bias


def _llama_config(hf: dict) -> ModelConfig:
    """The Llama family (Llama, Mistral, Qwen2) and its MoE relatives (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE): RMSNorm, RoPE, grouped-query attention, SwiGLU MLPs or experts."""
    kind = hf["model_type"]
    act = _act(hf)
    D, L = _need(hf, "hidden_size"), _need(hf, "num_hidden_layers")
    H = _need(hf, "num_attention_heads")
    Hk = hf.get("num_key_value_heads") or H
    C = hf.get("head_dim") or D // H
    qkv_bias, out_bias = _attention_biases(hf)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    base, fraction = _rope(hf)
    qk_norm = {"qwen3_moe": "head", "olmoe": "full"}.get(kind, "none")
    if kind == "olmoe" and hf.get("clip_qkv") is not None:
        raise MoeifyError(f"config.json sets clip_qkv={hf['clip_qkv']} (OLMoE's clamping of "
                          "queries, keys and values), which moeify does not implement")
    attn = GroupedQueryAttentionConfig(
        d_model=D, n_heads=H, n_kv_heads=Hk, d_head=C, pos="rope", rope_base=base,
        rope_fraction=fraction, qkv_bias=qkv_bias, out_bias=out_bias, n_layers=L,
        qk_norm=qk_norm, qk_norm_eps=eps if qk_norm != "none" else 1e-6)
    if kind in MOE_ARCHITECTURES:
        ff = _moe_layers(hf, D, L, act)
    else:
        ff = GatedMLPConfig(d_model=D, d_ff=_need(hf, "intermediate_size"), activation=act,
                            bias=bool(hf.get("mlp_bias", False)), n_layers=L)
    T = min(int(_need(hf, "max_position_embeddings", MAX_IMPORTED_CONTEXT)),
            MAX_IMPORTED_CONTEXT)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window:
        T = min(T, int(window))
    tied = bool(hf.get("tie_word_embeddings", False))
    return ModelConfig(vocab_size=_need(hf, "vocab_size"), d_model=D, n_layers=L,
                       context_length=T, attention=attn, feedforward=ff, xl_memory=False,
                       norm=NormConfig(kind="rmsnorm", eps=eps, bias=False),
                       tie_embeddings=tied, output_bias=False)


def moe_layer_indices(hf: dict) -> list[bool]:
    """Which layers of a Hugging Face MoE config hold experts (the others a dense SwiGLU MLP):
    Qwen-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``; every layer elsewhere."""
    L = int(_need(hf, "num_hidden_layers"))
    if hf["model_type"] not in ("qwen2_moe", "qwen3_moe"):
        return [True] * L
    E = _n_experts(hf)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return [i not in dense and E > 0 and (i + 1) % step == 0 for i in range(L)]


def _n_experts(hf: dict) -> int:
    key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    return int(_need(hf, key))


def _moe_layers(hf: dict, D: int, L: int, act: str) -> tuple:
    """The feedforward of every layer: a Switch feedforward with the checkpoint's routing
    (softmax over the experts in float32, top-k, renormalised as the family defines, no
    capacity limit: Hugging Face's MoE blocks drop no token) or, in Qwen-MoE's dense layers,
    a SwiGLU MLP."""
    kind = hf["model_type"]
    if float(hf.get("router_jitter_noise") or 0.0) > 0:
        raise MoeifyError(f"config.json sets router_jitter_noise={hf['router_jitter_noise']} "
                          "(multiplicative router noise in training), which moeify does not "
                          "implement")
    qwen = kind in ("qwen2_moe", "qwen3_moe")
    F = int(_need(hf, "moe_intermediate_size" if qwen else "intermediate_size"))
    shared = None
    if kind == "qwen2_moe" and int(_need(hf, "shared_expert_intermediate_size")) > 0:
        shared = GatedMLPConfig(d_model=D, d_ff=int(hf["shared_expert_intermediate_size"]),
                                activation=act, n_layers=L)
    moe = SwitchFFConfig(
        d_model=D, d_ff=F, n_experts=_n_experts(hf), k=int(_need(hf, "num_experts_per_tok")),
        dropless=True, gated=True, activation=act,
        renormalize=True if kind == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        shared=shared, shared_gate=shared is not None,
        balance_coef=float(hf.get("router_aux_loss_coef") or 0.0), z_coef=0.0)
    dense = None
    layers = moe_layer_indices(hf)
    if not all(layers):
        dense = GatedMLPConfig(d_model=D, d_ff=int(_need(hf, "intermediate_size")),
                               activation=act, n_layers=L)
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


class _Weights:
    """The checkpoint's tensors by name, with a clear error for a missing one."""

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, model_type: str = ""):
        self.tensors, self.prefix, self.model_type = tensors, prefix, model_type

    def __call__(self, name: str) -> torch.Tensor:
        key = self.prefix + name
        if key not in self.tensors:
            raise MoeifyError(f"the checkpoint has no tensor {key!r}: the weights do not match "
                              "config.json (missing or from another model)")
        return self.tensors[key].float()


def _gpt2_state(w: _Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    D = cfg.d_model
    sd = {"embedding.weight": w("wte.weight"), "pos_embedding.weight": w("wpe.weight"),
          "ln_f.weight": w("ln_f.weight"), "ln_f.bias": w("ln_f.bias")}
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        qkv_w, qkv_b = w(h + "attn.c_attn.weight"), w(h + "attn.c_attn.bias")  # Conv1D: [in, out]
        for j, name in enumerate(("w_q", "w_k", "w_v")):
            sd[b + f"attention.{name}.weight"] = qkv_w[:, j * D:(j + 1) * D].t()
            sd[b + f"attention.{name}.bias"] = qkv_b[j * D:(j + 1) * D]
        sd[b + "attention.w_o.weight"] = w(h + "attn.c_proj.weight").t()
        sd[b + "attention.w_o.bias"] = w(h + "attn.c_proj.bias")
        sd[b + "feedforward.w1.weight"] = w(h + "mlp.c_fc.weight").t()
        sd[b + "feedforward.w1.bias"] = w(h + "mlp.c_fc.bias")
        sd[b + "feedforward.w2.weight"] = w(h + "mlp.c_proj.weight").t()
        sd[b + "feedforward.w2.bias"] = w(h + "mlp.c_proj.bias")
        for ln, hf_ln in (("ln1", "ln_1"), ("ln2", "ln_2")):
            sd[b + f"{ln}.weight"] = w(h + f"{hf_ln}.weight")
            sd[b + f"{ln}.bias"] = w(h + f"{hf_ln}.bias")
    return sd


def _llama_state(w: _Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    sd = {"embedding.weight": w("embed_tokens.weight"), "ln_f.weight": w("norm.weight")}
    a = cfg.attention[0]
    names = [("w_q", "self_attn.q_proj", a.qkv_bias), ("w_k", "self_attn.k_proj", a.qkv_bias),
             ("w_v", "self_attn.v_proj", a.qkv_bias), ("w_o", "self_attn.o_proj", a.out_bias)]
    for i, f in enumerate(cfg.feedforward_layers()):
        h, b = f"layers.{i}.", f"blocks.{i}."
        for ours, theirs, bias in names:
            sd[b + f"attention.{ours}.weight"] = w(h + theirs + ".weight")
            if bias:
                sd[b + f"attention.{ours}.bias"] = w(h + theirs + ".bias")
        if a.qk_norm != "none":
            sd[b + "attention.q_norm.weight"] = w(h + "self_attn.q_norm.weight")
            sd[b + "attention.k_norm.weight"] = w(h + "self_attn.k_norm.weight")
        if isinstance(f, SwitchFFConfig):
            sd.update(_experts_state(w, f, h, b + "feedforward."))
        else:
            sd.update(_gated_mlp_state(w, h + "mlp.", b + "feedforward.", f.bias))
        sd[b + "ln1.weight"] = w(h + "input_layernorm.weight")
        sd[b + "ln2.weight"] = w(h + "post_attention_layernorm.weight")
    return sd


def _gated_mlp_state(w: _Weights, theirs: str, ours: str, bias: bool = False):
    sd = {}
    for o, t in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        sd[f"{ours}{o}.weight"] = w(f"{theirs}{t}.weight")
        if bias:
            sd[f"{ours}{o}.bias"] = w(f"{theirs}{t}.bias")
    return sd


# Where each family keeps its MoE block, and its experts' per-expert names (gate, up, down), as
# save_pretrained writes them; transformers' fused in-memory form (experts.gate_up_proj
# [E, 2F, D], experts.down_proj [E, D, F]) is read too.
_MOE_BLOCK = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"))}
_MOE_DEFAULT = ("mlp.", ("gate_proj", "up_proj", "down_proj"))


def _experts_state(w: _Weights, f: SwitchFFConfig, h: str, ours: str):
    """A Switch feedforward's tensors from a Hugging Face MoE block: the router [E, D] as is,
    expert e's gate / up [F, D] and down [D, F] matrices transposed into [E, D, F] / [E, F, D]."""
    block, (g, u, d) = _MOE_BLOCK.get(w.model_type, _MOE_DEFAULT)
    if (w.prefix + h + "mlp.experts.down_proj") in w.tensors:  # fused form
        block = "mlp."
    sd = {ours + "w_router": w(h + block + "gate.weight")}
    fused = h + block + "experts.gate_up_proj"
    if (w.prefix + fused) in w.tensors:
        gate_up = w(fused)  # [E, 2F, D]: gate rows first, then up
        F = gate_up.shape[1] // 2
        sd[ours + "experts.w_gate"] = gate_up[:, :F].transpose(1, 2)
        sd[ours + "experts.w_in"] = gate_up[:, F:].transpose(1, 2)
        sd[ours + "experts.w_out"] = w(h + block + "experts.down_proj").transpose(1, 2)
    else:
        def stack(name):
            return torch.stack([w(f"{h}{block}experts.{e}.{name}.weight").t()
                                for e in range(f.n_experts)])
        sd[ours + "experts.w_gate"], sd[ours + "experts.w_in"], sd[ours + "experts.w_out"] = (
            stack(g), stack(u), stack(d))
    if f.shared is not None:
        sd.update(_gated_mlp_state(w, h + block + "shared_expert.", ours + "shared."))
        sd[ours + "shared_gate.weight"] = w(h + block + "shared_expert_gate.weight")
    return sd


def state_from_hf(tensors: dict[str, torch.Tensor], hf: dict, cfg: ModelConfig,
                  ) -> dict[str, torch.Tensor]:
    """The moeify state dict of ``cfg`` from the checkpoint's tensors, checked name by name and
    shape by shape against the model ``cfg`` builds."""
    gpt2 = hf["model_type"] == "gpt2"
    body = "transformer." if gpt2 else "model."
    prefix = body if any(k.startswith(body) for k in tensors) else ""
    sd = (_gpt2_state if gpt2 else _llama_state)(_Weights(tensors, prefix, hf["model_type"]), cfg)
    if not cfg.tie_embeddings:
        head = tensors.get("lm_head.weight")
        if head is None:
            raise MoeifyError("the checkpoint has no lm_head.weight but config.json says the "
                              "embeddings are not tied")
        sd["output.weight"] = head.float()
    with torch.device("meta"):
        want = cfg.build().state_dict()
    for key, t in want.items():
        if key not in sd or tuple(sd[key].shape) != tuple(t.shape):
            got = tuple(sd[key].shape) if key in sd else "nothing"
            raise MoeifyError(f"the checkpoint's weights do not match config.json: {key} needs "
                              f"shape {tuple(t.shape)}, the checkpoint gives {got}")
    return {k: sd[k].contiguous() for k in want}


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
    tensors = read_hf_weights(src)
    _check_finite(src, tensors)
    state = state_from_hf(tensors, hf, cfg)

    with atomic_directory(out, "import") as tmp:
        write_run_files(tmp, TrainConfig(preset=RUN_MODEL_PRESET), cfg, tokenizer)
        (tmp / HF_CONFIG_COPY).write_text(json.dumps(hf, indent=2) + "\n")
        (tmp / HF_TOKENIZER_CONFIG_COPY).write_text(json.dumps(_special_tokens(src)) + "\n")
        meta = {"preset": RUN_MODEL_PRESET, "model_config": model_config_dict(cfg),
                "weights_only": True,
                "imported_from": {"path": str(src.resolve()),
                                  "architecture": SUPPORTED_ARCHITECTURES[hf["model_type"]]}}
        train_checkpoint.save_checkpoint(tmp, 0, state, {"step": 0, "weights_only": True},
                                         meta=meta)
    return out
