"""Hugging Face directories exported (moeify format, ``export_hf``) before the parameter-naming
convention of moeify.layers.common hold the earlier parameter names. transformers loads weights
by name itself, without torch's load_state_dict hooks (which is where the layers rename them):
without help, such a directory would load with the renamed parameters left uninitialised.

``register_legacy_key_renames`` registers the renames with transformers
(``register_checkpoint_conversion_mapping`` for the remote-code class ``MoeifyForCausalLM``),
so ``from_pretrained`` reads both names. The exported remote code (hf_remote/modeling_moeify.py)
calls it when a directory is loaded; importing moeify changes nothing in transformers.
The renames apply on loading only: transformers would otherwise revert them in
``save_pretrained``, writing earlier names (even for a model built in the process, where it
reverts every registered rename); here their reverse renames nothing, so whatever is saved
carries the current names.

Shape of a rename: the last component of a key, earlier name -> current name (no shapes
changed)."""

from __future__ import annotations

# earlier name -> current name (moeify.layers.common's table, without the pre-core attention
# keys, which no exported directory holds: export came after the core)
LEGACY_KEY_RENAMES = {
    "w_sel": "w_router", "w_sel_src": "w_router_src", "w_sel_dst": "w_router_dst",  # SwitchHead
    "w_sel_ED": "w_router", "keys_EDG": "w_in", "values_EGD": "w_out",  # sigma-MoE
    "bias_EG": "bias_in", "bias_D": "bias_out",  # sigma-MoE and Switch
    "w_router_RD": "w_router", "w_in_EDF": "w_in", "w_out_EFD": "w_out",  # Switch
    "w_gate_EDF": "w_gate", "bias_EF": "bias_in",
    "router_D": "w_router", "router_bias": "bias_router",  # Mixture-of-Depths
}
REMOTE_CLASS = "MoeifyForCausalLM"


def register_legacy_key_renames() -> bool:
    """Register the renames for ``MoeifyForCausalLM`` with transformers; False where this
    transformers has no conversion registry (then nothing is renamed)."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return False
    class LoadOnlyRenaming(WeightRenaming):
        """A rename on loading whose reverse (what save_pretrained applies) is the identity."""

        __slots__ = ()

        def reverse_transform(self):
            current = self._original_target_patterns
            return WeightRenaming(source_patterns=list(current), target_patterns=list(current))

    # ".name" with the name ending the key (transformers appends the end-of-name guard): the
    # renamed component, never a longer name that starts with it (w_sel vs w_sel_src).
    register_checkpoint_conversion_mapping(
        REMOTE_CLASS, [LoadOnlyRenaming(source_patterns=f".{old}", target_patterns=f".{new}")
                       for old, new in LEGACY_KEY_RENAMES.items()], overwrite=True)
    return True
