"""Hugging Face wrapper of an exported moeify model (``moeify export``).

Requires the moeify package (installed from its source checkout: ``pip install -e .`` there): the layers themselves (SwitchHead, MoA,
sigma-MoE, Switch, Mixture-of-Depths, the dense layers) are moeify's code, imported below, so the
exported model computes exactly what moeify computes. This file is copied next to config.json;
load the directory with ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``.

Cache: ``generate()`` runs with moeify's own per-layer KV caches wrapped in ``MoeifyCache`` (a
transformers ``Cache``); the model replaces the empty DynamicCache that generate() offers with
one, and returns it as ``cache``. ``attention_mask`` marks padding (0) among the keys; positions
count from the first token of each row, so left-padded batches are exact for RoPE, XL and
position-free models but not for learned absolute positions (pad on the right there).
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from moeify.models.config import ModelConfig

from .configuration_moeify import MoeifyConfig


class MoeifyCacheLayer(CacheLayerMixin):
    """One block's moeify KVCache (keys, values, positions, validity) as a transformers layer."""

    is_sliding = False

    def __init__(self, kv):
        super().__init__()
        self.kv = kv

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("moeify attention layers fill their own cache")

    def get_mask_sizes(self, query_length):
        return self.kv.length + query_length, 0

    def get_seq_length(self):
        return self.kv.length

    def get_max_length(self):
        return -1

    def reset(self):
        self.kv.reset()

    def _select(self, fn):
        kv = self.kv
        if kv.keys is not None:
            kv.keys, kv.values = fn(kv.keys), fn(kv.values)
            kv.positions, kv.valid = fn(kv.positions), fn(kv.valid)

    def reorder_cache(self, beam_idx):
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._select(lambda t: t.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices):
        self._select(lambda t: t[indices])


class MoeifyCache(Cache):
    """The per-block KV caches of a moeify TransformerLM (``model.new_cache()``)."""

    def __init__(self, lm):
        super().__init__(layers=[MoeifyCacheLayer(kv) for kv in lm.new_cache()])

    @property
    def kv_caches(self):
        return [layer.kv for layer in self.layers]


class MoeifyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoeifyConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = []

    def __init__(self, config):
        super().__init__(config)
        self.model = ModelConfig.from_dict(config.moeify_config).build()
        self.post_init()

    def _init_weights(self, module):
        """moeify layers initialise themselves (the papers' recipes); nothing to do here."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading, then the non-persistent buffers (routing-usage counters,
        SwitchHead's head offsets), which no checkpoint holds and which loading leaves
        uninitialised, are taken from a freshly built model."""
        model = super().from_pretrained(*args, **kwargs)
        fresh = ModelConfig.from_dict(model.config.moeify_config).build()
        ours = dict(model.model.named_modules())
        with torch.no_grad():
            for name, module in fresh.named_modules():
                for buf in module._non_persistent_buffers_set:
                    target = getattr(ours[name], buf)
                    target.copy_(getattr(module, buf).to(target.device))
        return model

    def get_input_embeddings(self):
        return self.model.embedding

    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None,
                labels=None, **kwargs):
        if input_ids is None:
            raise ValueError("moeify models take input_ids (inputs_embeds is not supported)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, MoeifyCache):
            if cache.get_seq_length() > 0:
                raise ValueError("moeify models keep their own cache (MoeifyCache); pass the "
                                 "cache this model returned, or none")
            cache = None  # the empty DynamicCache generate() prepares for every model
        if cache is None and use_cache:
            cache = MoeifyCache(self.model)
        T = input_ids.shape[1]
        valid = None if attention_mask is None else attention_mask[:, -T:].bool()
        out = self.model(input_ids, cache=None if cache is None else cache.kv_caches,
                         valid_BT=valid)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(out.logits[:, :-1].float().flatten(0, 1),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits,
                                      cache=cache if use_cache else None)
