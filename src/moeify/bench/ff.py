"""Benchmark of the feedforward MoEs at equal shapes and multiply-adds, side by side: sigma-MoE,
Switch (dropless and with capacity), a dense MLP with the same active multiply-adds, and, when
transformers is installed, Hugging Face's Mixtral sparse MoE block with each of its experts
implementations.

Shape legend: M tokens, D d_model, E experts, K experts per token, G expert size (hidden units
per expert of sigma-MoE and Switch), I Mixtral's intermediate size.

Matched multiply-adds: a sigma-MoE or Switch expert costs 2·D·G per token (ReLU MLP), a Mixtral
expert 3·D·I (SwiGLU: gate, up and down projections), so I = 2·G / 3; the dense MLP has
d_ff = K·G. Every router is D·E. The "expert MACs" column states what each case does.

Every case runs in training mode on the same input [1, M, D] with the same fixed output
gradient, on ``device``, in float32 or under autocast to ``dtype`` (weights stay float32, as
training runs); "fwd" runs under ``torch.no_grad``, "fwd+bwd" is a training call whose backward also
takes moeify's auxiliary losses (Mixtral's block has none: its balance loss is computed by the
model). Times are medians of interleaved repeats (``interleaved_median_times``: CUDA events on a
GPU, else wall time) and, for forward+backward, also the process's CPU time (on a machine shared by more jobs than cores,
wall time favours code with fewer parallel regions, which waits less for a core). The "impl"
column names the expert-matmul implementations that really ran (read from a profiled call,
``expert_impls_run``), or the Hugging Face experts implementation.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moeify.bench.attention import autocast_for, omp_wait_policy
from moeify.bench.timing import expert_impls_run, format_table, interleaved_median_times
from moeify.errors import install_hint
from moeify.layers.feedforward import DenseFFConfig
from moeify.layers.sigma_moe import SigmaMoEConfig
from moeify.layers.switch_ff import SwitchFFConfig
from moeify.ops.moe import implementations

DENSE = "dense MLP (equal MACs)"
HF_PREFIX = "HF Mixtral "
# batched_mm copies both weight matrices of a pair's expert per routed pair; skipped above this.
HF_COPY_LIMIT_GIB = 2.0


def hf_experts_implementations() -> list[str]:
    """Hugging Face's registered experts implementations ("eager" first); [] without
    transformers."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return []
    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def _hf_block(D: int, I: int, E: int, K: int, impl: str, seed: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E,
                        num_experts_per_tok=K, hidden_act="silu", router_jitter_noise=0.0)
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():  # the block's own init leaves the 3-D expert weights empty
        block.gate.weight.normal_(0, D ** -0.5)
        block.experts.gate_up_proj.normal_(0, D ** -0.5)
        block.experts.down_proj.normal_(0, I ** -0.5)
    return block


def _moeify_cases(D, G, E, K, impls, seed):
    cases = []
    for impl in impls:
        tag = "" if impl == "auto" else f" [{impl}]"
        cases += [
            (f"sigma-MoE{tag}", SigmaMoEConfig(d_model=D, n_experts=E, expert_size=G, k=K,
                                               expert_impl=impl), 2 * D * G * K),
            (f"Switch dropless{tag}", SwitchFFConfig(d_model=D, d_ff=G, n_experts=E, k=K,
                                                     dropless=True, expert_impl=impl),
             2 * D * G * K),
            (f"Switch capacity 1.25{tag}", SwitchFFConfig(d_model=D, d_ff=G, n_experts=E, k=K,
                                                          capacity_factor=1.25,
                                                          expert_impl=impl), 2 * D * G * K),
        ]
    out = []
    for label, cfg, macs in cases:
        torch.manual_seed(seed)
        out.append((label, cfg.build(), macs, True))
    return out


def _hf_cases(D, G, E, K, M, seed, hf_impls):
    I = max(1, round(2 * G / 3))
    out, skipped = [], {}
    for impl in hf_impls:
        if impl == "batched_mm":
            gib = M * K * 3 * D * I * 4 / 2 ** 30
            if gib > HF_COPY_LIMIT_GIB:
                skipped[HF_PREFIX + impl] = (f"copies the weights per routed pair: {gib:.1f} GiB "
                                             f"at these shapes")
                continue
        out.append((HF_PREFIX + impl, _hf_block(D, I, E, K, impl, seed), 3 * D * I * K, False))
    return out, skipped, I


def _phases(module, x, grad_y, returns_aux: bool, device: str, dtype: str):
    params = list(module.parameters())

    def call():
        with autocast_for(device, dtype):
            if returns_aux:
                y, aux = module(x)
                return y, list(aux.losses.values())
            return module(x), []

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        y, losses = call()
        torch.autograd.backward([y, *losses],
                                [grad_y.to(y.dtype)] + [torch.ones_like(v) for v in losses])
        x.grad = None
        for p in params:
            p.grad = None

    return fwd, fwd_bwd


def _check_runs(label: str, fwd_bwd) -> str | None:
    try:
        fwd_bwd()
    except (RuntimeError, NotImplementedError, ImportError, KeyError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


def bench_ff(*, tokens: int = 4096, d_model: int = 512, n_experts: int = 8, k: int = 2,
             expert_size: int = 384, impls: Sequence[str] = ("auto",), hf: bool = True,
             hf_impls: Sequence[str] | None = None, warmup: int = 2, repeats: int = 5,
             seed: int = 0, device: str = "cpu", dtype: str = "float32") -> dict:
    """Time every case (module docstring); ratios to the dense MLP and to the fastest Hugging
    Face experts implementation of the same phase."""
    if min(tokens, d_model, n_experts, expert_size, repeats) < 1 or warmup < 0:
        raise ValueError("tokens, d_model, experts, expert size and repeats must be positive, "
                         "warmup non-negative")
    if not 1 <= k <= n_experts:
        raise ValueError(f"k must lie in [1, experts={n_experts}], got {k}")
    bad = [i for i in impls if i not in implementations() + ("auto",) or i == "sets"]
    if bad:
        raise ValueError(f"unknown feedforward expert implementation(s) {bad}; choose from auto, "
                         + ", ".join(i for i in implementations() if i != "sets"))
    autocast_for(device, dtype)  # validates dtype
    D, G, E, K, M = d_model, expert_size, n_experts, k, tokens
    torch.manual_seed(seed)
    cases = [(DENSE, DenseFFConfig(d_model=D, d_ff=K * G).build(), 2 * D * G * K, True)]
    cases += _moeify_cases(D, G, E, K, impls, seed)
    available = hf_experts_implementations() if hf else []
    skipped, I = {}, None
    if available:
        wanted = list(hf_impls) if hf_impls else available
        unknown = [i for i in wanted if i not in available]
        if unknown:
            raise ValueError(f"unknown Hugging Face experts implementation(s) {unknown}; "
                             f"installed: {', '.join(available)}")
        hf_cases, skipped, I = _hf_cases(D, G, E, K, M, seed, wanted)
        cases += hf_cases
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, M, D, generator=g).to(device).requires_grad_()
    grad_y = torch.randn(1, M, D, generator=g).to(device)
    fns, ran = {}, {}
    for label, module, _, ours in cases:
        module.to(device).train()
        fwd, fwd_bwd = _phases(module, x, grad_y, ours, device, dtype)
        why = _check_runs(label, fwd_bwd)
        if why is not None:
            skipped[label] = why
            continue
        fns[(label, "fwd")], fns[(label, "fwd+bwd")] = fwd, fwd_bwd
        ran[label] = ("+".join(expert_impls_run(fwd_bwd)) or "-") if ours else \
            label.removeprefix(HF_PREFIX)
    cpu: dict = {}
    times = interleaved_median_times(fns, warmup=warmup, repeats=repeats, cpu_times=cpu,
                                     device=device)
    return _result(cases, times, cpu, ran, skipped, dict(tokens=M, d_model=D, experts=E, k=K,
                                                    expert_size=G, hf_intermediate=I),
                   warmup, repeats, available, device, dtype)


def _result(cases, times, cpu, ran, skipped, shape, warmup, repeats, available, device,
            dtype) -> dict:
    labels = [c[0] for c in cases if c[0] in ran]
    hf = [lb for lb in labels if lb.startswith(HF_PREFIX)]
    best = {ph: min((times[(lb, ph)] for lb in hf), default=None) for ph in ("fwd", "fwd+bwd")}
    best_cpu = min((cpu[(lb, "fwd+bwd")] for lb in hf), default=None)
    rows = []
    for label, _, macs, _ in cases:
        if label not in ran:
            continue
        row = {"case": label, "impl": ran[label], "expert MACs": macs}
        for ph in ("fwd", "fwd+bwd"):
            t = times[(label, ph)]
            row[f"{ph} ms"] = t * 1e3
            row[f"{ph} x dense"] = t / times[(DENSE, ph)]
            row[f"{ph} x HF best"] = None if best[ph] is None else t / best[ph]
        c = cpu[(label, "fwd+bwd")]
        row["fwd+bwd cpu ms"] = c * 1e3
        row["cpu x dense"] = c / cpu[(DENSE, "fwd+bwd")]
        row["cpu x HF best"] = None if best_cpu is None else c / best_cpu
        rows.append(row)
    return {"bench": "ff", "device": str(device), "dtype": dtype,
            "threads": torch.get_num_threads(), "omp_wait_policy": omp_wait_policy(),
            "warmup": warmup, "repeats": repeats, "shape": shape,
            "hf_implementations": available, "skipped": skipped, "rows": rows}


COLUMNS = ["case", "impl", "expert MACs", "fwd ms", "fwd x dense", "fwd x HF best",
           "fwd+bwd ms", "fwd+bwd x dense", "fwd+bwd x HF best", "fwd+bwd cpu ms", "cpu x dense",
           "cpu x HF best"]


def table(result: dict) -> str:
    s = result["shape"]
    hf = (f"Mixtral I={s['hf_intermediate']}" if s["hf_intermediate"] else
          f"transformers not installed ({install_hint('hf')} for the Mixtral rows)")
    head = (f"feedforward MoEs, {s['tokens']} tokens, d={s['d_model']}, E={s['experts']}, "
            f"k={s['k']}, G={s['expert_size']}, {hf}; {result['dtype']} on {result['device']} "
            f"({result['threads']} "
            f"threads, OpenMP {result['omp_wait_policy']}), median of {result['repeats']}; "
            "expert MACs per token; x = time ratio; cpu: this process's CPU time per fwd+bwd call")
    out = head + "\n" + format_table(result["rows"], COLUMNS)
    for label, why in result["skipped"].items():
        out += f"\nskipped {label}: {why}"
    return out
