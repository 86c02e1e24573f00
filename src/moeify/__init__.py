"""moeify: Mixture-of-Experts everywhere inside a Transformer.

Layers (SwitchHead, MoA, sigma-MoE, Switch, Mixture-of-Depths, MoDE), the language models and
paper presets built from them, and the tools around them: training, evaluation, cost
accounting, benchmarks and plots. See README.md.
"""

__version__ = "0.1.0"


def _register_hf_legacy_names() -> None:
    """transformers is imported before moeify when an exported Hugging Face directory's remote
    code imports moeify: let transformers read the parameter names of directories exported
    before the naming convention (moeify.interop.hf_legacy)."""
    import sys

    if "transformers" in sys.modules:
        from moeify.interop.hf_legacy import register_legacy_key_renames

        register_legacy_key_renames()


_register_hf_legacy_names()
