"""The pre-LN Transformer block (SwitchHead appendix), generic over its attention and feedforward.

    x = x + Drop(Att(LN1(x), LN1([mem ; x])))
    x = x + Drop(FF(LN2(x)))            (the feedforward applies its own inner dropout)

Interfaces the block relies on (every attention / feedforward module in moeify.layers has them):

    attention(q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
              valid_k=None) -> (y_BTD, Aux)
    feedforward(x_BTD, *, valid_BT=None) -> (y_BTD, Aux)

Shape legend: B batch, T current tokens, M memory tokens, S = M + T source tokens, D d_model.
"""

from __future__ import annotations

import torch
from torch import nn

from moeify.layers.common import Aux
from moeify.layers.norm import NormConfig


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, attention: nn.Module, feedforward: nn.Module,
                 dropout: float = 0.0, norm: NormConfig | None = None):
        super().__init__()
        norm = norm or NormConfig()  # the papers' LayerNorm unless the model says otherwise
        self.ln1 = norm.build(d_model)
        self.attention = attention
        self.ln2 = norm.build(d_model)
        self.feedforward = feedforward
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        mem_BMD: torch.Tensor | None = None,
        *,
        cache=None,
        positions_BT: torch.Tensor | None = None,
        valid_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Aux]:
        """``mem_BMD``: the previous chunk's input to this block (XL memory, already detached).
        ``positions_BT``: explicit token positions (Mixture-of-Depths passes the positions of the
        tokens it routed); None means contiguous positions after the memory / cache.
        ``valid_BT``: False for padding, which no query attends to and the feedforward's aux
        losses ignore. The memory carries no validity: every memory token counts as valid."""
        if positions_BT is not None and mem_BMD is not None:
            raise ValueError("explicit token positions (Mixture-of-Depths) cannot be combined with "
                             "XL memory; use a RoPE or position-free model without memory")
        h_BTD = self.ln1(x_BTD)
        # LN1([mem ; x]) = [LN1(mem) ; LN1(x)] (a row-wise norm): normalising the parts keeps
        # for backward only tensors that live anyway (the memory, x), not a copy of [mem ; x]
        kv_BSD = None if mem_BMD is None else torch.cat([self.ln1(mem_BMD), h_BTD], 1)
        valid_k = valid_BT
        if valid_BT is not None and mem_BMD is not None:
            valid_k = torch.cat([valid_BT.new_ones(mem_BMD.shape[:2]), valid_BT], 1)
        a_BTD, aux = self.attention(h_BTD, kv_BSD, causal=True, cache=cache,
                                    pos_q=positions_BT, pos_k=positions_BT, valid_k=valid_k)
        x_BTD = x_BTD + self.drop(a_BTD)
        f_BTD, ff_aux = self.feedforward(self.ln2(x_BTD), valid_BT=valid_BT)
        x_BTD = x_BTD + self.drop(f_BTD)
        return x_BTD, Aux().update(aux, "attn.").update(ff_aux, "ff.")
