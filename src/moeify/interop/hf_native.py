"""Native Hugging Face export (``moeify export --format native``): a moeify model whose
computation is exactly one of transformers' own architectures is written as that ``model_type``,
with transformers' tensor names and config keys, so plain transformers loads it without moeify
and without remote code.

    gpt2       learned positions, LayerNorm, multi-head attention with biases, a biased MLP
    llama      RMSNorm, RoPE, grouped-query attention (Q/K/V and output biases both or neither),
               SwiGLU MLPs (biases or not)
    mistral    the same without any bias (kept as mistral when the run was imported from one)
    qwen2      the same with Q/K/V biases and no other
    mixtral    the Llama body with Switch feedforwards: gated (SwiGLU) experts, softmax top-k
               gates renormalised to sum 1, dropless; no attention biases
    qwen2_moe  Q/K/V biases or none; experts with a sigmoid-gated shared SwiGLU expert, gates
               renormalised or not; dense SwiGLU layers allowed (``mlp_only_layers``)
    qwen3_moe  per-head RMSNorm of queries and keys; experts without a shared one; dense layers
               allowed
    olmoe      full-width RMSNorm of queries and keys; experts without a shared one

``native_export(cfg, hf_source)`` picks the type: the imported checkpoint's own ``model_type``
when the model still matches it, else the first of the list above that matches; when none does
it raises a one-line error naming, per type, the first difference (e.g. a sigma-MoE's sigmoid
router, a Switch model's ReLU experts or capacity limit, XL memory). Dropout, which these types
apply differently or not at all, must be 0 (it changes training, not the logits, but an export
that trained differently in transformers would not be the same model).

Config: the source's config.json (same type) is the base, so token ids, the sliding window (the
moeify run's context was capped at it: within the context both agree) and the initializer range
survive a round trip; every structural key is then written from the moeify model by the
family's rows (moeify.interop.hf_mapping.CONFIG_KEYS, which the import reads the other way);
RoPE scaling (linear, dynamic, YaRN, Llama 3.1) is written back as ``rope_parameters``.
Weights: in the run's dtype (a bfloat16 import stays bfloat16), the per-expert layout
save_pretrained writes (transformers fuses the experts on load), named by the same links the
import reads (moeify.interop.hf_mapping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeify.errors import MoeifyError
from moeify.interop.hf_import import offline
from moeify.interop.hf_mapping import (ARCHITECTURES, DENSE_TYPES, MOE_TYPES, activation_to_hf,
                                       config_to_hf, tensor_links, to_hf)
from moeify.rundir.model import weights_dtype
from moeify.layers.gqa import GroupedQueryAttentionConfig
from moeify.layers.mlp import GatedMLPConfig, MLPConfig
from moeify.layers.switch_ff import SwitchFFConfig

NATIVE_TYPES = DENSE_TYPES + MOE_TYPES
# Keys of a source config that describe a structure the export sets itself (or drops).
_DROP = ("rope_theta", "rope_scaling", "architectures", "auto_map", "transformers_version",
         "torch_dtype", "dtype", "_name_or_path", "quantization_config", "layer_types")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class Mismatch(Exception):
    """The model is not exactly this native type: the message says why."""


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise Mismatch(why)


@dataclass
class _Model:
    """What the native types are told apart by, read once from a ModelConfig."""

    cfg: Any
    attn: Any  # the one GroupedQueryAttentionConfig of every layer
    ffs: list  # the feedforward config of each layer
    moe: Any  # the one SwitchFFConfig of every MoE layer (None: dense model)
    dense: Any  # the one dense MLP config of every dense layer (None: none)


def _read(cfg) -> _Model:
    _need(not cfg.xl_memory, "it carries Transformer-XL memory (xl_memory=True)")
    _need(all(d is None for d in cfg.depth), "it routes depth (Mixture-of-Depths)")
    attns = cfg.attention_layers()  # the layer kind first: it matters more than its options
    _need(all(isinstance(a, GroupedQueryAttentionConfig) for a in attns),
          f"its attention is {type(attns[0]).__name__}, not grouped-query attention" if not
          isinstance(attns[0], GroupedQueryAttentionConfig) else
          "some layers' attention is not grouped-query attention")
    _need(cfg.dropout == 0, f"its residual dropout is {cfg.dropout} (needs 0)")
    _need(not cfg.output_bias, "its output layer has a bias")
    _need(all(a == attns[0] for a in attns), "its layers' attention configs differ")
    attn = attns[0]
    _need(attn.attn_dropout == 0, f"its attention dropout is {attn.attn_dropout} (needs 0)")
    ffs = cfg.feedforward_layers()
    moes = [f for f in ffs if isinstance(f, SwitchFFConfig)]
    denses = [f for f in ffs if isinstance(f, (GatedMLPConfig, MLPConfig))]
    for f in ffs:
        _need(isinstance(f, (SwitchFFConfig, GatedMLPConfig, MLPConfig)),
              f"its feedforward is {type(f).__name__}" + (
                  " (a sigmoid router without renormalisation: every native MoE type routes "
                  "by softmax)" if type(f).__name__ == "SigmaMoEConfig" else ""))
    _need(all(m == moes[0] for m in moes), "its MoE layers' configs differ")
    _need(all(d == denses[0] for d in denses), "its dense layers' MLP configs differ")
    for d in denses:
        _need(d.dropout == 0, f"its MLP dropout is {d.dropout} (needs 0)")
    return _Model(cfg, attn, ffs, moes[0] if moes else None, denses[0] if denses else None)


def _rms_llama(m: _Model, qk_norm: str = "none") -> None:
    c, a = m.cfg, m.attn
    _need(c.norm.kind == "rmsnorm", f"its norm is {c.norm.kind}, not RMSNorm")
    _need(c.max_positions == 0, "it has learned absolute positions")
    _need(a.pos == "rope" and a.rope_fraction == 1.0,
          f"its attention positions are {a.pos!r} (rope_fraction {a.rope_fraction}), not "
          "full-width RoPE")
    _need(a.qk_norm == qk_norm, f"its query/key norm is {a.qk_norm!r}, not {qk_norm!r}")
    if qk_norm != "none":
        _need(a.qk_norm_eps == c.norm.eps, f"its query/key norm eps {a.qk_norm_eps} differs "
              f"from the model's RMSNorm eps {c.norm.eps} (one rms_norm_eps in transformers)")


def _dense_swiglu(m: _Model, bias_ok: bool) -> None:
    _need(m.moe is None, "it has MoE feedforwards")
    _need(isinstance(m.dense, GatedMLPConfig), f"its MLP is {type(m.dense).__name__}, not SwiGLU")
    _need(activation_to_hf(m.dense.activation, gpt2=False) is not None,
          f"its MLP activation is {m.dense.activation}")
    _need(bias_ok or not m.dense.bias, "its MLP has biases")


def _experts(m: _Model, *, renormalize: bool | None, shared: bool, dense_ok: bool) -> None:
    f = m.moe
    _need(f is not None, "it has no MoE feedforward")
    _need(f.gated, "its experts are not gated (SwiGLU): act(W_in x) alone, as in Switch, has "
          "no native form")
    _need(activation_to_hf(f.activation, gpt2=False) is not None and not f.bias,
          f"its experts have biases or activation {f.activation}")
    _need(f.noop_experts == 0, "it has no-op experts (integrated MoDE)")
    _need(f.dropless, "its routing has a capacity limit (dropless=False) that drops tokens; "
          "transformers' MoE blocks drop none")
    _need(f.expert_dropout == 0, f"its expert dropout is {f.expert_dropout} (needs 0)")
    _need(f.lossfree_rate == 0, "its routing adds a loss-free balancing bias to the scores "
          "(lossfree_rate), which transformers' MoE blocks do not")
    _need(f.n_shared == 0, "its shared experts are given as n_shared (DeepSeekMoE form)")
    if renormalize is not None:
        _need(f.renormalize == renormalize, "its top-k gates are " +
              ("not renormalised" if renormalize else "renormalised to sum 1"))
    _need((f.shared is not None) == shared, "it has a shared expert" if f.shared is not None
          else "it has no shared expert")
    if shared:
        _need(f.shared_gate, "its shared expert has no sigmoid gate")
        _need(f.shared.activation == f.activation and not f.shared.bias
              and f.shared.dropout == 0, "its shared expert differs from the experts' SwiGLU")
    if m.dense is not None:
        _need(dense_ok, "some of its layers are dense")
        _need(isinstance(m.dense, GatedMLPConfig) and not m.dense.bias
              and m.dense.activation == f.activation,
              "its dense layers are not SwiGLU MLPs like the experts")


def _check(kind: str, m: _Model) -> None:
    """Raises Mismatch unless the model is exactly ``kind``."""
    a = m.attn
    if kind == "gpt2":
        c = m.cfg
        _need(c.norm.kind == "layernorm" and c.norm.bias, "its norm is not LayerNorm with bias")
        _need(c.max_positions > 0 and a.pos == "absolute", "it has no learned absolute positions")
        _need(a.n_kv_heads == a.n_heads and a.n_heads * a.d_head == c.d_model,
              "its attention is not plain multi-head with H · d_head = d_model")
        _need(a.qkv_bias and a.out_bias and a.qk_norm == "none",
              "its attention is not GPT-2's (biases everywhere, no query/key norm)")
        _need(m.moe is None and isinstance(m.dense, MLPConfig) and m.dense.bias,
              "its feedforward is not a biased two-layer MLP")
        _need(activation_to_hf(m.dense.activation, gpt2=True) is not None,
              f"its MLP activation is {m.dense.activation}")
        return
    if kind in MOE_TYPES:  # the experts first: for an MoE model their form matters most
        _experts(m, renormalize=True if kind == "mixtral" else None,
                 shared=kind == "qwen2_moe", dense_ok=kind in ("qwen2_moe", "qwen3_moe"))
    _rms_llama(m, {"qwen3_moe": "head", "olmoe": "full"}.get(kind, "none"))
    if kind == "llama":
        _need(a.qkv_bias == a.out_bias, "its attention has Q/K/V biases but no output bias")
        _dense_swiglu(m, bias_ok=True)
    elif kind == "mistral":
        _need(not a.qkv_bias and not a.out_bias, "its attention has biases")
        _dense_swiglu(m, bias_ok=False)
    elif kind == "qwen2":
        _need(a.qkv_bias and not a.out_bias, "its attention is not Q/K/V-biased only")
        _dense_swiglu(m, bias_ok=False)
    elif kind == "mixtral":
        _need(not a.qkv_bias and not a.out_bias, "its attention has biases")
    elif kind == "qwen2_moe":
        _need(not a.out_bias, "its attention has an output bias")
    elif kind in ("qwen3_moe", "olmoe"):
        _need(a.qkv_bias == a.out_bias, "its attention has Q/K/V biases but no output bias")
        _need(kind != "olmoe" or a.n_heads * a.d_head == m.cfg.d_model,
              "its heads are not d_model / n_heads wide (OLMoE's query/key norms assume it)")
    else:
        raise AssertionError(kind)


def native_type(cfg, hf_source: dict | None = None) -> str:
    """The native ``model_type`` the model is exactly (module docstring), or a one-line
    MoeifyError naming each type's first difference."""
    source = (hf_source or {}).get("model_type")
    try:
        m = _read(cfg)
    except Mismatch as e:
        raise MoeifyError(f"the model has no native Hugging Face form: {e}; export it with "
                          "--format moeify") from None
    order = ([source] if source in NATIVE_TYPES else []) + [
        t for t in NATIVE_TYPES if t != source]
    why = {}
    for kind in order:
        try:
            _check(kind, m)
            return kind
        except Mismatch as e:
            why[kind] = str(e)
    parts = [f"it no longer matches its source's model_type {source}: {why[source]}"] \
        if source in why else []
    family = MOE_TYPES if m.moe is not None else DENSE_TYPES
    if source not in family:  # a dense source turned MoE (upcycled): say what the MoE types want
        by_reason: dict[str, list[str]] = {}
        for t in family:
            by_reason.setdefault(why[t], []).append(t)
        parts += [f"not {' / '.join(ts)}: {reason}" for reason, ts in by_reason.items()]
    detail = "; ".join(parts)
    raise MoeifyError(f"the model has no native Hugging Face form ({detail}); export it with "
                      "--format moeify")


# ---------------------------------------------------------------------- config.json

def _fields(m: _Model) -> dict[str, Any]:
    """The moeify fields of the family rows (moeify.interop.hf_mapping.config_to_hf) read off
    the model: the inverse of what hf_import builds from them."""
    c, a, dense = m.cfg, m.attn, m.dense
    fields = dict(vocab_size=c.vocab_size, d_model=c.d_model, n_layers=c.n_layers,
                  n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, d_head=a.d_head,
                  norm_eps=c.norm.eps, context_length=c.context_length,
                  max_positions=c.max_positions, tie_embeddings=c.tie_embeddings,
                  activation=(m.moe or dense).activation, qkv_bias=a.qkv_bias,
                  out_bias=a.out_bias, qk_norm=a.qk_norm, rope_base=a.rope_base,
                  rope_scaling=a.rope_scaling, d_ff=None if dense is None else dense.d_ff,
                  mlp_bias=None if dense is None else dense.bias)
    f = m.moe
    if f is not None:
        fields.update(n_experts=f.n_experts, k=f.k, expert_d_ff=f.d_ff,
                      renormalize=f.renormalize, balance_coef=f.balance_coef,
                      shared_d_ff=0 if f.shared is None else f.shared.d_ff, sparse_step=1,
                      mlp_only_layers=[i for i, x in enumerate(m.ffs)
                                       if not isinstance(x, SwitchFFConfig)])
    return fields


def native_config(kind: str, cfg, hf_source: dict | None) -> dict:
    """The config.json entries of the native export (the transformers config class fills in
    the rest): the source's own entries when it is of the same type (token ids, the sliding
    window, the initializer range survive), then the family's rows written from the model."""
    src = dict(hf_source or {})
    base = {k: v for k, v in src.items() if k not in _DROP} if src.get("model_type") == kind \
        else {k: src[k] for k in _TOKEN_IDS if k in src}
    for k in _TOKEN_IDS:
        base.setdefault(k, None)  # never a type's default id, which may lie past the vocabulary
    out = config_to_hf(kind, _fields(_read(cfg)), base)
    out.update(model_type=kind, architectures=[ARCHITECTURES[kind]], use_cache=True)
    return out


# ---------------------------------------------------------------------- weights

def native_state(kind: str, cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The moeify state dict under transformers' names and layouts for ``kind``, through the
    family's links (moeify.interop.hf_mapping: the inverse of the import), in the state's own
    dtype, contiguous."""
    sd = {k: v.detach().cpu() for k, v in state.items()}
    links = tensor_links(kind, cfg)
    unused = sorted(set(sd) - {k for link in links for k in link.ours})
    if unused:  # a tensor the mapping does not know: an export without it would be wrong
        raise MoeifyError(f"the model's tensor {unused[0]} has no place in a native {kind} "
                          "checkpoint; export it with --format moeify")
    out: dict[str, torch.Tensor] = {}
    for link in links:
        out.update(zip(link.theirs, to_hf(link, [sd[k] for k in link.ours])))
    return {k: v.contiguous() for k, v in out.items()}


def native_export(cfg, state: dict[str, torch.Tensor], hf_source: dict | None = None,
                  ) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(model_type, config.json as transformers' config class writes it, tensors) of the model,
    or a one-line MoeifyError when it has no native form."""
    offline()
    kind = native_type(cfg, hf_source)
    entries = native_config(kind, cfg, hf_source)
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise MoeifyError(f"--format native needs transformers ({e}); install the hf extra") \
            from None
    hf_cfg = AutoConfig.for_model(**entries)
    config = hf_cfg.to_dict()
    tensors = native_state(kind, cfg, state)
    config.update(architectures=[ARCHITECTURES[kind]], dtype=state_dtype_name(tensors))
    return kind, config, tensors


def state_dtype_name(state: dict[str, torch.Tensor]) -> str:
    """config.json's ``dtype`` of a state dict: its floating tensors' one dtype (float32 for a
    mix, which transformers' loading then keeps as saved)."""
    return str(weights_dtype(state)).removeprefix("torch.")


__all__ = ["NATIVE_TYPES", "native_type", "native_config", "native_state", "native_export"]
