"""The Mixture-of-Experts ops: one routing plan, a registry of expert kernels, the shared
combine, one autograd Function over them, the expert MLP, the policy that decides "auto", and
the registered ops that torch.compile keeps whole.

    plan.py        RoutingPlan / make_plan: the routed pairs sorted by expert once
    layout.py      slot layouts, and the gathers and sums between pairs and slots
    registry.py    ExpertKernel / WholeKernel, register, get_kernel
    kernels/       the kernels every device runs, one module each
    cpu/           the CPU-only layouts (padded, sets, decoding) and the CPU policy
    combine.py     gates, groups and row sums, written once
    function.py    the autograd Function over every slot-layout kernel
    matmul.py      expert_matmul, the entry point
    mlp.py         expert_mlp, gated_expert_mlp
    pairs.py       pair_expert_mlp, mask_expert_mlp: a variable number of experts per row
    policy.py      what "auto" runs, for every layer, decoding included
    compiled.py    moeify::expert_matmul (torch.library) for torch.compile
"""

from moeify.ops.moe import kernels  # noqa: F401  (registers the built-in kernels)
from moeify.ops.moe import cpu  # noqa: F401  (registers "pairs", "all", "padded", "sets")
from moeify.ops.moe.kernels import scatter_gemm  # noqa: F401  (registers "triton")
from moeify.ops.moe.matmul import TRACE_PREFIX, expert_matmul
from moeify.ops.moe.mlp import expert_mlp, gated_expert_mlp
from moeify.ops.moe.pairs import mask_expert_mlp, pair_expert_mlp
from moeify.ops.moe.plan import RoutingPlan, make_pair_plan, make_plan
from moeify.ops.moe.policy import choose_impl, resolved_impl
from moeify.ops.moe.registry import ExpertKernel, WholeKernel, get_kernel, implementations, register

# The built-in kernels' names, less the variants ("concat_saved"; moeify.ops.moe.registry):
# what the test matrices iterate over. ``implementations()`` lists every registered kernel,
# the variants and kernels registered later included.
IMPLEMENTATIONS = implementations(variants=False)

__all__ = ["ExpertKernel", "IMPLEMENTATIONS", "RoutingPlan", "TRACE_PREFIX", "WholeKernel",
           "choose_impl", "expert_matmul", "expert_mlp", "gated_expert_mlp", "get_kernel",
           "implementations", "make_pair_plan", "make_plan", "mask_expert_mlp",
           "pair_expert_mlp", "register", "resolved_impl"]
