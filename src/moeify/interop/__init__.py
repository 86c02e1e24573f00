"""Interoperability with other tools: Hugging Face checkpoints in (``import_hf``) and out
(``export_hf``), and lm-evaluation-harness (``moeify.interop.harness``: the model type ``moeify``
and task definitions that read local files). Optional dependencies (transformers, tokenizers:
``pip install -e '.[hf]'`` in the checkout; lm-eval: ``pip install -e '.[harness]'``) are
imported lazily; the rest of moeify never needs this package."""

from moeify.interop.hf_export import export_hf
from moeify.interop.hf_import import SUPPORTED_ARCHITECTURES, import_hf

__all__ = ["SUPPORTED_ARCHITECTURES", "import_hf", "export_hf"]
