"""MoEUT's block (Csordás, Irie, Schmidhuber, Potts, Manning, NeurIPS 2024, arXiv 2405.16039):
SwitchHead attention and a sigma-MoE feedforward under the paper's "peri-layernorm" scheme.

Section names, not numbers, are cited here: the paper's text was not available to this
implementation beyond its abstract and summaries; the equations follow the authors' released code
(RobertCsordas/moeut, moeut.py), which the tests transcribe independently.

Peri-layernorm normalises only the inputs of the projections that are followed by a sigmoid or
softmax, i.e. Q, K and the expert selections; V, the feedforward's experts and the residual
stream see the un-normalised x, and there is no norm on the residual path between layers (a
universal Transformer repeats the block; the paper motivates the scheme by signal propagation
through shared layers):

    h  = LN1(x)
    x  = x + Drop(SwitchHead(q = h, k = h, sel_V = h, sel_O = h, v = x))
    x  = x + Drop(sigmaMoE(experts on x, selection on LN2(x)))

(the authors' MoEUTLayer.forward: ``attention(xnorm, xnorm, x)`` and ``ffn(x, ln2(x))``). The
final LayerNorm before the output layer is the LM's ``ln_f``.

Layer grouping and weight sharing (the paper's G) live in the model (ModelConfig.group_size,
models/lm.py): G blocks are built and applied in order n_layers / G times. The blocks'
initialisation is the authors' (their reset_parameters): that of SwitchHead and sigma-MoE with
s = sqrt(2 / L), L the number of layer *applications* (the authors' ``sqrt(2 / (n_repeats *
G))``), which the layer configs' ``n_layers`` carries. Deviation, the only one in the
initialisation of a MoEUT model: the untied output layer is the library's (N(0, 1/d), a zero
bias; models/lm.py), where the authors keep PyTorch's default Linear init.

Regularisers (the authors' MoEUT.forward: ``entropy_reg * SigmaMoE.get_reg_loss() +
att_entropy_reg * SwitchHeadCore.get_reg_loss()``, gamma = 0.01, delta = 0.001): the block
passes on its layers' ``Aux.pooled`` shares ("ff.entropy", "attn.entropy.src" / ".dst"), which
the model adds over the block's applications before taking the entropy (models/lm.py); see
SigmaMoEConfig.entropy_pool and SwitchHeadConfig.entropy_coef.

Shape legend: B batch, T tokens, D d_model.
"""

from __future__ import annotations

import torch

from moeify.layers.block import TransformerBlock
from moeify.layers.common import Aux


class PeriNormBlock(TransformerBlock):
    """A TransformerBlock (same parameters: ln1, attention, ln2, feedforward) whose forward is
    MoEUT's peri-layernorm. The attention must accept ``value_BSD`` (SwitchHeadAttention) and the
    feedforward ``router_BTD`` (SigmaMoE); ModelConfig checks this."""

    def forward(
        self,
        x_BTD: torch.Tensor,
        mem_BMD: torch.Tensor | None = None,
        *,
        cache=None,
        positions_BT: torch.Tensor | None = None,
        valid_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Aux]:
        if mem_BMD is not None:
            # MoEUT is a RoPE model; V would need the raw memory beside LN1(memory).
            raise ValueError("the peri-layernorm (MoEUT) block takes no XL memory; use RoPE "
                             "attention and xl_memory=False")
        h_BTD = self.ln1(x_BTD)
        a_BTD, aux = self.attention(h_BTD, None, causal=True, cache=cache, pos_q=positions_BT,
                                    pos_k=positions_BT, valid_k=valid_BT, value_BSD=x_BTD)
        x_BTD = x_BTD + self.drop(a_BTD)
        f_BTD, ff_aux = self.feedforward(x_BTD, valid_BT=valid_BT, router_BTD=self.ln2(x_BTD))
        x_BTD = x_BTD + self.drop(f_BTD)
        return x_BTD, Aux().update(aux, "attn.").update(ff_aux, "ff.")
