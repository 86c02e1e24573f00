"""Benchmark of the expert-matmul implementations against the two equal-MAC dense matmuls, and
the per-device kernel table that "auto" reads on CUDA (moeify.ops.moe.device_table)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from moeify.bench.timing import format_table, interleaved_median_times, kernel_profile
from moeify.data.cache import atomic_write
from moeify.ops.moe import expert_matmul, get_kernel, implementations, make_plan, resolved_impl
from moeify.ops.moe.device_table import class_of_name, table_entry
from moeify.ops.moe.policy import planless


ROUTE = "dense route-shaped (equal MACs)"
CONCAT = "dense concatenated (equal MACs)"
BASELINES = (ROUTE, CONCAT)
# The largest difference from the float32 reference, relative to its largest value, that a
# kernel's output may show in each dtype (bf16 keeps 8 bits of mantissa).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# Not timed unless named: the reference, and the decoding layouts (made for a handful of rows:
# ``moeify bench generate`` measures them where they apply). The kernel table also leaves out
# the gathered baseline (never a choice, and its [M·K, D, F] weight copies exhaust a GPU at the
# 262M shapes).
DEFAULT_SKIP = ("reference", "pairs", "all")
TABLE_SKIP = DEFAULT_SKIP + ("gather",)


def bench_expert_matmul(M=8192, K=2, E=8, D=512, F=64, *, groups=1, sum_rows=1,
                        dtype=torch.float32, device="cpu", impls=None, warmup=2, repeats=7,
                        seed=0, profile=False, peers=None, skip=DEFAULT_SKIP) -> dict:
    """Forward+backward time of each implementation and of the two dense matmuls with the same
    number of multiply-adds, measured side by side (median of ``repeats``): route-shaped,
    [M*K, D] x [D, F] (what the SwitchHead authors' kernels are compared with), and
    concatenated, [M, D] x [D, K*F]. ``groups`` / ``sum_rows``: the gated contract (SwitchHead's
    value experts sum per head, groups = heads; its output experts over the heads of a token,
    sum_rows = heads). The E experts form groups of E / max(groups, sum_rows), each row's K
    experts a set per group ("sets" applies); every call sorts the routing (``make_plan``) as a
    layer does. Every kernel's output is first checked against the float32 reference (a kernel
    off by more than ``TOLERANCE`` raises ValueError: its timing would mean nothing), as are
    the ``peers`` ({name: function (x, idx, w, gates) -> [M, F]}, ``moeify.bench.peers``:
    reported, ``errors``). ``profile``: after the timing, one profiled call of each case
    (``kernel_profile``: how many kernels it launches and where its time goes), under the
    result's "profile"."""
    n_groups = max(groups, sum_rows)
    if not 1 <= K * sum_rows <= E or K % groups or E % n_groups or M % sum_rows:
        raise ValueError(f"K (experts per row) must lie in [1, E={E} / groups], K divisible by "
                         f"groups={groups}, E by the groups and M by sum_rows={sum_rows}; got "
                         f"K={K}, M={M}")
    E_g = E // n_groups
    kw = dict(groups=groups, sum_rows=sum_rows)
    o = _operands(M, K, E, D, F, E_g=E_g, dtype=dtype, device=device, seed=seed, **kw)
    # By default not ``skip``, nor a kernel that cannot run on these operands ("triton" off
    # CUDA, "grouped" at widths grouped_mm cannot take); a kernel named in ``impls`` runs or
    # raises.
    impls = list(impls or [i for i in implementations() if i not in skip
                           and get_kernel(i).unavailable(o.x, o.w) is None])
    errors = _errors(o.x, o.idx, o.w, o.gates, impls, peers or {}, E_g, kw)
    fns = _timed_calls(o, impls, peers or {}, E_g, kw)
    times = interleaved_median_times(fns, warmup=warmup, repeats=repeats, device=device)
    base, base_concat = times[ROUTE], times[CONCAT]
    rows = [{"implementation": name, "fwd+bwd ms": t * 1e3, "x dense": t / base,
             "x concat": t / base_concat, "error": errors.get(name)}
            for name, t in times.items()]
    fastest = min(impls, key=lambda i: times[i])
    profiles = ({name: kernel_profile(fn, device) for name, fn in fns.items()} if profile
                else None)
    peer_errors = {k: v for k, v in errors.items() if k.endswith("(peer)")}
    return {
        "shape": {"M": M, "K": K, "E": E, "D": D, "F": F, **kw},
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "auto": resolved_impl("auto", o.x, o.idx, o.w, group_size=E_g, groups=groups),
        "fastest": fastest,
        "rows": rows,
        "errors": errors,
        "fastest_vs_dense": times[fastest] / base,
        "fastest_vs_concat": times[fastest] / base_concat,
        "fastest_speedup_vs_gather": (times["gather"] / times[fastest] if "gather" in times
                                      else None),
        **({"peer_errors": peer_errors} if peer_errors else {}),
        **({"profile": profiles} if profiles is not None else {}),
    }


@dataclass
class _Operands:
    """The routed operands (x [M, D], idx [M, K], w [E, D, F], gates [M, K]), the two equal-MAC
    dense matmuls' operands, and a fixed output gradient for each."""

    x: torch.Tensor
    w: torch.Tensor
    idx: torch.Tensor
    gates: torch.Tensor
    grad_out: torch.Tensor
    grad_route: torch.Tensor
    x_route: torch.Tensor
    w_route: torch.Tensor
    w_concat: torch.Tensor
    grad_concat: torch.Tensor


def _operands(M, K, E, D, F, *, E_g, groups, sum_rows, dtype, device, seed) -> _Operands:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(E, D, F, generator=g) / D**0.5).to(device, dtype).requires_grad_()
    idx = _routing(M, K, E_g, groups, sum_rows, g).to(device)
    gates = torch.rand(M, K, generator=g).to(device).requires_grad_()
    out_shape = (M // sum_rows, F) if groups == 1 else (M, groups, F)
    grad_out = torch.randn(*out_shape, generator=g).to(device, dtype)
    grad_route = torch.randn(M * K, F, generator=g).to(device, dtype)
    x_route = torch.randn(M * K, D, generator=g).to(device, dtype).requires_grad_()
    w_route = w[0].detach().clone().requires_grad_()
    w_concat = torch.randn(D, K * F, generator=g).to(device, dtype).requires_grad_()
    grad_concat = torch.randn(M, K * F, generator=g).to(device, dtype)
    return _Operands(x=x, w=w, idx=idx, gates=gates, grad_out=grad_out, grad_route=grad_route,
                     x_route=x_route, w_route=w_route, w_concat=w_concat,
                     grad_concat=grad_concat)


def _timed_calls(o: _Operands, impls, peers: dict, E_g: int, kw: dict) -> dict:
    """{name: one forward+backward}: the two dense matmuls, each kernel (sorting the routing
    first, as a layer does), each peer."""
    x, idx, w, gates, grad_out = o.x, o.idx, o.w, o.gates, o.grad_out

    def run_impl(impl):
        def fn():
            plan = None if planless(impl) else make_plan(idx, w.shape[0], group_size=E_g)
            y = expert_matmul(x, idx, w, gates, impl=impl, plan=plan, **kw)
            torch.autograd.backward(y, grad_out)
            x.grad = w.grad = gates.grad = None
        return fn

    def dense(a, b, grad):
        def fn():
            torch.autograd.backward(a @ b, grad)
            a.grad = b.grad = None
        return fn

    def run_peer(peer):
        def fn():
            torch.autograd.backward(peer(x, idx, w, gates), grad_out)
            x.grad = w.grad = gates.grad = None
        return fn

    fns = {ROUTE: dense(o.x_route, o.w_route, o.grad_route),
           CONCAT: dense(x, o.w_concat, o.grad_concat)}
    fns.update({impl: run_impl(impl) for impl in impls})
    fns.update({f"{name} (peer)": run_peer(peer) for name, peer in peers.items()})
    return fns


def _routing(M: int, K: int, E_g: int, groups: int, sum_rows: int, g) -> torch.Tensor:
    """[M, K] ids of SwitchHead's per-head experts, E_g per head: with groups = H a row picks
    K / H distinct experts of each head's; with sum_rows = H row m is a (token, head) unit and
    picks K of head m % H's."""
    if sum_rows > 1:
        local = torch.rand(M, E_g, generator=g).topk(K, -1).indices
        return local + (torch.arange(M) % sum_rows)[:, None] * E_g
    local = torch.rand(M, groups, E_g, generator=g).topk(K // groups, -1).indices
    return (local + torch.arange(groups)[:, None] * E_g).reshape(M, K)


def _errors(x, idx, w, gates, impls, peers, E_g, kw) -> dict:
    """Each kernel's and peer's largest difference from the float32 reference, relative to its
    largest value; a kernel beyond ``TOLERANCE`` or a peer that fails raises ValueError."""
    errors = {}
    with torch.no_grad():
        ref = expert_matmul(x.float(), idx, w.float(), gates, impl="reference", **kw)

        def error(out):
            return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()

        for impl in impls:
            plan = None if planless(impl) else make_plan(idx, w.shape[0], group_size=E_g)
            errors[impl] = error(expert_matmul(x, idx, w, gates, impl=impl, plan=plan, **kw))
            if not errors[impl] <= TOLERANCE[x.dtype]:
                raise ValueError(f"kernel {impl!r} differs from the reference by "
                                 f"{errors[impl]:.2e} (tolerance {TOLERANCE[x.dtype]:.0e} in "
                                 f"{x.dtype}) at {tuple(x.shape)} x {tuple(w.shape)}: a kernel "
                                 "bug; its timing is not reported")
        for name, peer in peers.items():
            if kw["sum_rows"] != 1 or kw["groups"] != 1:
                raise ValueError("peers take the [M, F] contract: run them with groups and "
                                 "sum_rows 1")
            try:
                out = peer(x, idx, w, gates)
            except Exception as e:  # noqa: BLE001 - foreign code: any failure, one line
                hint = " (it runs on CUDA only: add --device cuda)" if x.device.type != \
                    "cuda" else ""
                raise ValueError(f"the peer {name} failed on these inputs{hint}: "
                                 f"{type(e).__name__}: {e}") from None
            if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"the peer {name} returned {got} where the gated sum is "
                                 f"{tuple(ref.shape)} (rows x F): is it the kernel its "
                                 "adapter expects (moeify.bench.peers), unmodified?")
            errors[f"{name} (peer)"] = error(out)
    return errors


def table(result: dict) -> str:
    s = result["shape"]
    contract = "".join(f" {k}={s[k]}" for k in ("groups", "sum_rows") if s.get(k, 1) != 1)
    head = (f"expert matmul fwd+bwd, M={s['M']} K={s['K']} E={s['E']} D={s['D']} F={s['F']}"
            f"{contract}, {result['dtype']} on {result['device']} ({result['threads']} threads); "
            f"auto -> {result['auto']}; x dense: vs [M*K, D] @ [D, F], x concat: vs "
            f"[M, D] @ [D, K*F]; error: vs the float32 reference")
    rows = [dict(r, error=None if r.get("error") is None else f"{r['error']:.1e}")
            for r in result["rows"]]
    out = head + "\n" + format_table(rows, ["implementation", "fwd+bwd ms", "x dense",
                                            "x concat", "error"])
    for name, err in result.get("peer_errors", {}).items():
        out += f"\n{name}: output differs from the reference by {err:.2e} (relative to its largest)"
    for name, prof in result.get("profile", {}).items():
        out += (f"\n\n{name}: {prof['launches']} {prof['counted']}"
                f", {prof['total_us']:.0f} us ({prof['timer']})\n"
                + format_table(prof["top"], ["kernel", "calls", "us", "share"]))
    return out


# The presets whose expert-matmul shapes the kernel table measures by default: SwitchHead 47M
# and 262M (the paper's Table 5 rows).
TABLE_PRESETS = ("wt103-47m-switchhead", "wt103-262m-switchhead")


def preset_shapes(presets=TABLE_PRESETS, batch: int = 64) -> list[dict]:
    """The expert-matmul calls of each preset's SwitchHead layer at ``batch`` sequences:
    {name, M, K, E, D, F, groups, sum_rows}. Value (and key) experts: rows are the S source
    tokens ([memory ; x] with XL memory, S = 2T), K = H·k picks among H·E experts, summed per
    head (groups = H); output (and query) experts: rows are the T·H (token, head) units, k picks
    each, summed over a token's heads (sum_rows = H)."""
    from moeify.layers.switchhead import SwitchHeadConfig
    from moeify.models.presets import get_preset

    shapes = []
    for name in presets:
        cfg = get_preset(name)
        for att in {a for a in cfg.attention if isinstance(a, SwitchHeadConfig)}:
            H, T = att.n_heads, cfg.context_length
            S = 2 * T if cfg.xl_memory else T
            tag = name.removeprefix("wt103-")
            if att.experts & {"v", "k"}:
                shapes.append(dict(name=f"{tag} value", M=batch * S, K=H * att.k,
                                   E=H * att.n_experts, D=att.d_model, F=att.d_head, groups=H,
                                   sum_rows=1))
            if att.experts & {"o", "q"}:
                shapes.append(dict(name=f"{tag} output", M=batch * T * H, K=att.k,
                                   E=H * att.n_experts, D=att.d_head, F=att.d_model, groups=1,
                                   sum_rows=H))
    return shapes


def device_info(device) -> dict:
    """The device a table was measured on: name, class, capability, versions."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    return {"name": name, "class": class_of_name(name) if cuda else None,
            "capability": list(torch.cuda.get_device_capability(dev)) if cuda else None,
            "torch": torch.__version__}


def kernel_table(results: list[dict], device: dict, source: str) -> dict:
    """The per-device table "auto" reads (moeify.ops.moe.device_table) from expert-matmul bench
    results: per shape, every kernel's measured time and the two baselines."""
    entries = []
    for res in results:
        ms = {r["implementation"]: r["fwd+bwd ms"] for r in res["rows"]
              if r["implementation"] not in BASELINES and not r["implementation"].endswith(")")}
        base = {r["implementation"]: r["fwd+bwd ms"] for r in res["rows"]
                if r["implementation"] in BASELINES}
        contract = {k: res["shape"].get(k, 1) for k in ("groups", "sum_rows")}
        entries.append(table_entry(res["shape"], res["dtype"], True, ms, baselines_ms=base,
                                   **contract, **({"name": res["name"]} if "name" in res else {})))
    return {"device": device, "source": source, "entries": entries}


def bench_kernel_table(presets=TABLE_PRESETS, *, batch: int = 64, dtype=torch.bfloat16,
                       device="cuda", impls=None, repeats: int = 3, source: str = "",
                       path=None) -> dict:
    """Every kernel at the expert-matmul shapes of ``presets`` (``preset_shapes``), as the
    device table "auto" reads on CUDA; written atomically to ``path`` when given."""
    results = []
    for shape in preset_shapes(presets, batch):
        res = bench_expert_matmul(shape["M"], shape["K"], shape["E"], shape["D"], shape["F"],
                                  groups=shape["groups"], sum_rows=shape["sum_rows"],
                                  dtype=dtype, device=device, impls=impls, repeats=repeats,
                                  skip=TABLE_SKIP)
        results.append(dict(res, name=shape["name"]))
    table = kernel_table(results, device_info(device),
                         source or f"moeify bench expert-matmul --preset-shapes, batch {batch}")
    if path is not None:
        with atomic_write(path, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
    return dict(table, results=results)


def table_summary(result: dict) -> str:
    """One table per measured shape, then where the kernel table was written."""
    return "\n\n".join(f"{r['name']}: " + table(r) for r in result["results"])
