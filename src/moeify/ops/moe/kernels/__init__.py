"""The built-in expert kernels, one module each, registered on import (moeify.ops.moe.registry):
dense (reference, gather, pairs, all), segment, grouped, padded, triton; SwitchHead's "sets"
lives with its layout in moeify.ops.moe.switchhead."""

from moeify.ops.moe.kernels import dense, grouped, padded, segment  # noqa: F401
