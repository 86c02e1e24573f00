"""Hugging Face configuration of an exported moeify model (``moeify export``).

This file is copied next to config.json; transformers loads it with trust_remote_code=True. The
model is described by ``moeify_config``, the moeify ModelConfig as JSON; the other fields are the
usual transformers names, for tools that read them.
"""

from transformers import PreTrainedConfig


class MoeifyConfig(PreTrainedConfig):
    model_type = "moeify"

    moeify_config: dict | None = None
    vocab_size: int = 256
    hidden_size: int = 128
    num_hidden_layers: int = 1
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
