"""Benchmark of the expert-matmul implementations against an equal-MAC dense matmul."""

from __future__ import annotations

import torch

from moeify.bench.timing import format_table, interleaved_median_times, kernel_profile
from moeify.ops.moe import IMPLEMENTATIONS, expert_matmul, make_plan, resolved_impl
from moeify.ops.moe.kernels.scatter_gemm import unavailable_reason
from moeify.ops.moe.policy import planless


def bench_expert_matmul(M=8192, K=2, E=8, D=512, F=64, *, dtype=torch.float32, device="cpu",
                        impls=None, warmup=2, repeats=7, seed=0, profile=False,
                        peers=None) -> dict:
    """Forward+backward time of each implementation and of the dense matmul with the same number
    of multiply-adds, [M*K, D] x [D, F], measured side by side (median of ``repeats``). The E
    experts form one group, so each row's K experts are a set ("sets" applies); every call sorts
    the routing (``make_plan``) as a layer does. ``profile``: after the timing, one profiled
    call of each case (``kernel_profile``: how many kernels it launches and where its time
    goes), under the result's "profile". ``peers``: {name: function (x, idx, w, gates) -> [M, F]}
    (``moeify.bench.peers.load_peer``), other kernels timed beside these, each first run on the
    same inputs as the reference and its difference reported (``peer_errors``: the largest
    difference relative to the reference's largest value); a peer that raises is a ValueError."""
    if not 1 <= K <= E:
        raise ValueError(f"K (experts per row) must lie in [1, E={E}], got {K}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(E, D, F, generator=g) / D**0.5).to(device, dtype).requires_grad_()
    idx = torch.rand(M, E, generator=g).topk(K, -1).indices.to(device)  # K distinct experts
    gates = torch.rand(M, K, generator=g).to(device).requires_grad_()
    x_dense = torch.randn(M * K, D, generator=g).to(device, dtype).requires_grad_()
    w_dense = w[0].detach().clone().requires_grad_()
    grad_out = torch.randn(M, F, generator=g).to(device, dtype)

    def run_impl(impl):
        def fn():
            plan = None if planless(impl) else make_plan(idx, E, group_size=E)
            y = expert_matmul(x, idx, w, gates, impl=impl, plan=plan)
            torch.autograd.backward(y, grad_out)
            x.grad = w.grad = gates.grad = None
        return fn

    def dense():
        y = x_dense @ w_dense
        torch.autograd.backward(y, grad_out.repeat_interleave(K, 0))
        x_dense.grad = w_dense.grad = None

    # By default not the reference, nor the decoding layouts (made for a handful of rows:
    # ``moeify bench generate`` measures them where they apply).
    # "triton" by default only where it can run (CUDA; the CPU interpreter is for tests).
    skip = ("reference", "pairs", "all") + (("triton",) if unavailable_reason(x) else ())
    impls = list(impls or [i for i in IMPLEMENTATIONS if i not in skip])
    def run_peer(peer):
        def fn():
            torch.autograd.backward(peer(x, idx, w, gates), grad_out)
            x.grad = w.grad = gates.grad = None
        return fn

    fns = {"dense (equal MACs)": dense}
    for impl in impls:
        fns[impl] = run_impl(impl)
    peer_errors = {}
    if peers:
        with torch.no_grad():
            ref = expert_matmul(x, idx, w, gates, impl="reference").float()
            for name, peer in peers.items():
                try:
                    out = peer(x, idx, w, gates)
                except Exception as e:  # noqa: BLE001 - foreign code: any failure, one line
                    hint = " (it runs on CUDA only: add --device cuda)" if x.device.type != \
                        "cuda" else ""
                    raise ValueError(f"the peer {name} failed on these inputs{hint}: "
                                     f"{type(e).__name__}: {e}") from None
                if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else \
                        type(out).__name__
                    raise ValueError(f"the peer {name} returned {got} where the gated sum is "
                                     f"{tuple(ref.shape)} (rows x F): is it the kernel its "
                                     "adapter expects (moeify.bench.peers), unmodified?")
                err = (out.float() - ref).abs().max() / ref.abs().max()
                peer_errors[f"{name} (peer)"] = err.item()
                fns[f"{name} (peer)"] = run_peer(peer)
    times = interleaved_median_times(fns, warmup=warmup, repeats=repeats, device=device)
    base = times["dense (equal MACs)"]
    rows = [{"implementation": name, "fwd+bwd ms": t * 1e3, "x dense": t / base}
            for name, t in times.items()]
    fastest = min(impls, key=lambda i: times[i])
    profiles = ({name: kernel_profile(fn, device) for name, fn in fns.items()} if profile
                else None)
    return {
        "shape": {"M": M, "K": K, "E": E, "D": D, "F": F},
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "auto": resolved_impl("auto", x, idx, w, group_size=E),
        "fastest": fastest,
        "rows": rows,
        "fastest_vs_dense": times[fastest] / base,
        "fastest_speedup_vs_gather": times["gather"] / times[fastest] if "gather" in times else None,
        **({"peer_errors": peer_errors} if peer_errors else {}),
        **({"profile": profiles} if profiles is not None else {}),
    }


def table(result: dict) -> str:
    s = result["shape"]
    head = (f"expert matmul fwd+bwd, M={s['M']} K={s['K']} E={s['E']} D={s['D']} F={s['F']}, "
            f"{result['dtype']} on {result['device']} ({result['threads']} threads); "
            f"auto -> {result['auto']}")
    out = head + "\n" + format_table(result["rows"], ["implementation", "fwd+bwd ms", "x dense"])
    for name, err in result.get("peer_errors", {}).items():
        out += f"\n{name}: output differs from the reference by {err:.2e} (relative to its largest)"
    for name, prof in result.get("profile", {}).items():
        out += (f"\n\n{name}: {prof['launches']} {prof['counted']}"
                f", {prof['total_us']:.0f} us ({prof['timer']})\n"
                + format_table(prof["top"], ["kernel", "calls", "us", "share"]))
    return out
