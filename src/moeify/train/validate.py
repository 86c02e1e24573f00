"""Validation during training: the stream perplexity of moeify.eval.adapters (re-exported here
for the trainer)."""

from moeify.eval.adapters import autocast_context, evaluate_stream  # noqa: F401
