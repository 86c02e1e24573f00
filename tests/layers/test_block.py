"""The pre-LN Transformer block (SwitchHead appendix) against a hand transcription of its equation,
and padding with XL memory.

    x = x + Drop(Att(LN1(x), LN1([mem ; x])))
    x = x + Drop(FF(LN2(x)))

Shape legend: B batch, T tokens, M memory tokens, D d_model."""

import pytest
import torch
import torch.nn.functional as F

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.block import TransformerBlock
from moeify.layers.feedforward import DenseFFConfig, SigmaMoEConfig

D = 8


def _block(ff=None, pos="xl", dropout=0.0):
    torch.manual_seed(0)
    att = DenseAttentionConfig(d_model=D, n_heads=2, d_head=4, pos=pos).build()
    ff = ff or DenseFFConfig(d_model=D, d_ff=16).build()
    b = TransformerBlock(D, att, ff, dropout).double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters, so LN1 and LN2 differ
        for ln in (b.ln1, b.ln2):
            ln.weight.normal_(1.0, 0.3)
            ln.bias.normal_(0.0, 0.3)
    return b


def _ln(ln, x):
    return F.layer_norm(x, (D,), ln.weight, ln.bias, ln.eps)


@pytest.mark.parametrize("with_memory", [False, True])
def test_block_is_the_pre_ln_equation(with_memory):
    b = _block()
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 3, D, dtype=torch.float64) if with_memory else None
    y, aux = b(x, mem)
    kv = None if mem is None else _ln(b.ln1, torch.cat([mem, x], 1))
    x1 = x + b.attention(_ln(b.ln1, x), kv)[0]
    want = x1 + b.feedforward(_ln(b.ln2, x1))[0]
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    params = [x, b.ln1.weight, b.ln1.bias, b.ln2.weight, b.ln2.bias]
    for a, r in zip(torch.autograd.grad((y * g).sum(), params),
                    torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a, r)


def test_residual_dropout_acts_in_training_only():
    b = _block(dropout=0.5)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    b.eval()
    torch.testing.assert_close(b(x)[0], b(x)[0])
    b.train()
    assert not torch.allclose(b(x)[0], b(x)[0])


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_padding_is_never_attended_also_with_memory(pos):
    # Padding in the middle of the chunk (left-padded prompts, packed documents): a valid query
    # must not see it, whether or not the block has XL memory.
    b = _block(pos=pos).eval()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    mem = torch.randn(2, 4, D, dtype=torch.float64)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 1:3] = False
    valid[1, 0] = False
    x2 = x.clone()
    x2[~valid] = torch.randn_like(x2[~valid])  # not a constant shift: LayerNorm would remove it
    for m in (None, mem):
        y = b(x, m, valid_BT=valid)[0]
        y2 = b(x2, m, valid_BT=valid)[0]
        torch.testing.assert_close(y[valid], y2[valid])
    # ... and the memory stays visible: it changes the valid outputs.
    assert not torch.allclose(b(x, mem, valid_BT=valid)[0][valid], b(x, valid_BT=valid)[0][valid])


def test_aux_keys_are_prefixed_and_padding_reaches_the_feedforward():
    ff = SigmaMoEConfig(d_model=D, n_experts=4, expert_size=2, k=2).build().double()
    b = _block(ff=ff)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    valid = torch.tensor([[True] * 4 + [False] * 2])
    _, aux = b(x, valid_BT=valid)
    assert set(aux.losses) == {"ff.entropy"}
    assert all(k.startswith(("attn.", "ff.")) for k in aux.stats)
    assert aux.routing["ff.router"].counts.sum() == 4 * 2  # valid tokens x k


def test_positions_with_memory_are_refused():
    b = _block(pos="rope")
    x = torch.randn(1, 3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot be combined with XL memory"):
        b(x, x, positions_BT=torch.arange(3)[None])
