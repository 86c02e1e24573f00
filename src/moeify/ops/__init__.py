"""Pure tensor functions: routing, the expert matmul, aux losses, attention and positional maths.

No nn.Module and no config objects live here (the layering: docs/development/layout.md)."""

from moeify.ops.moe import RoutingPlan, expert_matmul, make_plan
from moeify.ops.routing import (
    TopK,
    capacity_mask,
    expert_capacity,
    expert_choice,
    expert_choice_count,
    sigmoid_topk,
    softmax_topk,
)

__all__ = [
    "RoutingPlan", "expert_matmul", "make_plan", "TopK", "capacity_mask", "expert_capacity",
    "expert_choice", "expert_choice_count", "sigmoid_topk", "softmax_topk",
]
