"""The built-in expert kernels, one module each, registered on import (moeify.ops.moe.registry):
dense (reference, gather, pairs, all), segment, grouped, padded, triton; SwitchHead's "sets"
lives with its layout in moeify.ops.moe.switchhead."""

# In this order: the registry lists kernels as registered.
from moeify.ops.moe.kernels import dense  # noqa: F401, I001
from moeify.ops.moe.kernels import segment  # noqa: F401
from moeify.ops.moe.kernels import grouped  # noqa: F401
from moeify.ops.moe.kernels import padded  # noqa: F401
