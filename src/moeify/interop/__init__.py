"""Interoperability with other tools: Hugging Face checkpoints in (``import_hf``: GPT-2, the
Llama family, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and out (``export_hf``: the moeify format with
remote code, or ``format="native"``, transformers' own model types, ``hf_native``), and
lm-evaluation-harness (``moeify.interop.harness``: the model type ``moeify`` and task
definitions that read local files). Optional dependencies (transformers, tokenizers:
``pip install -e '.[hf]'`` in the checkout; lm-eval: ``pip install -e '.[harness]'``) are imported lazily;
the rest of moeify never needs this package."""

from moeify.interop.hf_export import export_hf
from moeify.interop.hf_import import SUPPORTED_ARCHITECTURES, import_hf

__all__ = ["SUPPORTED_ARCHITECTURES", "import_hf", "export_hf"]
