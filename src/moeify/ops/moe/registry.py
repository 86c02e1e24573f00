"""The registry of expert kernels: every way moeify runs the per-expert GEMMs, by name.

Two kinds of kernel share the registry:

``ExpertKernel`` (segment, grouped, padded, triton): the GEMMs over a slot layout, three entry
points and nothing else. The gathers, the gates, the group and row sums, the gate gradient and
the autograd are written once, for all of them (moeify.ops.moe.combine, moeify.ops.moe.function
and moeify.ops.moe.mlp). A kernel is a module that defines a subclass and registers an instance:

    class LoopKernel(ExpertKernel):
        name = "loop"
        def forward(self, a, w_EAB, lay, k=None):  # [P, B]: every slot times its expert
            ...
        def weight_grad(self, a, g_PB, lay, n_experts, k=None):  # [E, A, B]
            ...
    register(LoopKernel())

after which ``expert_matmul(..., impl="loop")``, the expert MLP, a layer's ``expert_impl`` and
torch.compile (through the registered op of moeify.ops.moe.compiled) all run it
(tests/ops/test_kernel_registry.py). The test matrices iterate over the built-in kernels
(``IMPLEMENTATIONS``), not over kernels registered later, nor over variants: a kernel with
``variant_of`` set runs another kernel's arithmetic and differs only in what it trades (memory
kept for the backward against recomputation: "concat_saved" of "concat"); the matrices run
the kernel it varies, and its own tests run both (tests/ops/test_concat_kernel.py). The benches,
the device table and the cost contract measure variants like every kernel.

``WholeKernel`` (reference, gather, concat, pairs, all, sets): an implementation of the whole contract
in one ``run`` (composites of differentiable torch ops, or with a layout of their own); they
need no routing plan unless they say so.

Entry points of an ExpertKernel (A, B the widths of the side being multiplied; rows of ``a``):
    forward(a, w_EAB, lay, k)      [P, B]: slot p times its expert's matrix. With ``k`` the rows
                                   of ``a`` are input rows and slot p reads row pair_P[p] // k;
                                   with k None ``a`` already holds one row per slot.
    input_grad(g_PB, w_EAB, lay, k, n_rows)
                                   with k None: [P, A], g[p] @ w[e]ᵀ per slot; with k: those
                                   summed into the [n_rows, A] rows of the slots' pairs.
    weight_grad(a, g_PB, lay, n_experts, k)
                                   [E, A, B]: Σ over each expert's slots of aᵀ g (``a`` read as in
                                   ``forward``).
A kernel with ``gathers_rows`` is handed input rows (``k``) and reads them through the layout
itself, with no [P, A] copy; the others are handed slot rows already gathered (k None), and the
base class does the gathers and sums for them.
"""

from __future__ import annotations

import torch

from moeify.ops.moe.layout import SlotLayout, gather_rows, slot_sums, sorted_layout
from moeify.ops.moe.plan import RoutingPlan


class ExpertKernel:
    """GEMMs over a slot layout (module docstring)."""

    name: str = ""
    # Reads input rows through the layout itself (module docstring).
    gathers_rows: bool = False
    # Keep the narrow [P, F] products between the passes for the gate gradient when F < D
    # (a dot over F instead of a second gather and GEMM in the backward); False trades that
    # time for the memory (the padded layout, whose P includes its padding).
    keeps_narrow_products: bool = True
    # The entry points read ``lay.plan`` (its sort, counts or offsets), so the autograd
    # Functions keep the plan until the backward; False (a layout that holds all its backward
    # needs) lets the routing's sort and ids go after the forward.
    reads_plan: bool = True
    # The kernel this one varies (module docstring), or "".
    variant_of: str = ""
    # ``sorted_mlp(x, w1, w2, gates, plan, k)``: the ReLU expert MLP over this kernel's own
    # entry points with the hidden units in expert order (moeify.ops.moe.mlp), for a kernel
    # that reads rows itself ("triton"), or None.
    sorted_mlp = None

    def unavailable(self, x: torch.Tensor, w: torch.Tensor) -> str | None:
        """Why this kernel cannot run on these operands (what to do instead), or None."""
        return None

    def layout(self, plan: RoutingPlan) -> SlotLayout:
        """The slots this kernel multiplies (default: the pairs sorted by expert)."""
        return sorted_layout(plan)

    def forward(self, a: torch.Tensor, w_EAB: torch.Tensor, lay: SlotLayout,
                k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def input_grad(self, g_PB: torch.Tensor, w_EAB: torch.Tensor, lay: SlotLayout,
                   k: int | None = None, n_rows: int = 0) -> torch.Tensor:
        ga_PA = self.forward(g_PB, w_EAB.transpose(1, 2), lay)
        return ga_PA if k is None else slot_sums(ga_PA, lay.slot_N, None, k)

    def weight_grad(self, a: torch.Tensor, g_PB: torch.Tensor, lay: SlotLayout,
                    n_experts: int, k: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def slot_rows(self, a: torch.Tensor, lay: SlotLayout, k: int | None) -> torch.Tensor:
        """``a`` as one row per slot: gathered when ``k`` says its rows are input rows."""
        return a if k is None else gather_rows(a, lay, lay.rows(k))


class WholeKernel:
    """A kernel that runs the whole expert-matmul contract itself (module docstring)."""

    name: str = ""
    needs_plan: bool = False
    # Static shapes and no host read-back: torch.compile traces ``run`` (and ``mlp``) in place
    # of the registered op (moeify.ops.moe.compiled), so the graph fuses around it.
    traceable: bool = False
    # ``mlp(x, idx, w1, w2, gates)``: the ReLU expert MLP in one piece (moeify.ops.moe.mlp), or
    # None for the composite of two ``run`` calls.
    mlp = None
    # The kernel this one varies (module docstring), or "".
    variant_of: str = ""

    def unavailable(self, x: torch.Tensor, w: torch.Tensor) -> str | None:
        return None

    def run(self, x_MD, idx_MK, w_EDF, gates_MK, *, groups: int, sum_rows: int,
            plan: RoutingPlan | None, batch: int | None) -> torch.Tensor:
        """expert_matmul's contract (moeify.ops.moe.matmul), inputs validated; returns
        [M, K, F], [M / R, F], [M, G, F], or [B, G, S, F] when it lays out ``batch`` itself."""
        raise NotImplementedError


KERNELS: dict[str, ExpertKernel | WholeKernel] = {}


def register(kernel: ExpertKernel | WholeKernel) -> ExpertKernel | WholeKernel:
    """Add ``kernel`` to the registry under its name (replacing a kernel of that name)."""
    if not kernel.name or kernel.name == "auto":
        raise ValueError(f"a kernel needs a name other than 'auto', got {kernel.name!r}")
    KERNELS[kernel.name] = kernel
    return kernel


def get_kernel(name: str) -> ExpertKernel | WholeKernel:
    """The registered kernel ``name``; ValueError naming the choices otherwise."""
    kernel = KERNELS.get(name)
    if kernel is None:
        raise ValueError(f"unknown expert-matmul implementation {name!r}; choose one of "
                         f"{', '.join(implementations() + ('auto',))}")
    return kernel


def implementations(variants: bool = True) -> tuple[str, ...]:
    """The registered names, in registration order; without the variants (module docstring)
    when ``variants`` is False."""
    return tuple(n for n, k in KERNELS.items() if variants or not k.variant_of)


__all__ = ["ExpertKernel", "KERNELS", "WholeKernel", "get_kernel", "implementations",
           "register"]
