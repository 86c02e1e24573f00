"""Mixture-of-Depths and staged MoDE against a per-sequence reference written from the paper
(Raposo et al. 2024, arXiv 2404.02258): pick the top-C tokens of each sequence by router score, run
the
block on them alone at their original positions, add r · (f(x) - x), leave the rest untouched.

The blocks are moeify TransformerBlocks around a small attention written here (single head,
causal softmax with a distance penalty so that outputs depend on the positions the block is
given, honouring pos_q / pos_k / valid_k and a simple cache).

Legend: B batch, T tokens, C routed tokens per sequence, D d_model."""

import math

import pytest
import torch
from torch import nn

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.block import TransformerBlock
from moeify.layers.common import Aux
from moeify.layers.depth import MixtureOfDepths, MoDConfig
from moeify.layers.feedforward import DenseFFConfig, SigmaMoEConfig, SwitchFFConfig


class _Cache:
    def __init__(self):
        self.k = self.v = self.pos = self.valid = None


class TinyAttention(nn.Module):
    """The attention interface of docs/interfaces.md in a dozen lines: one head, causal mask by
    position, logits minus slope · |pos_q - pos_k| (position-dependent like RoPE or XL)."""

    def __init__(self, d, slope=0.4):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.slope = slope

    def new_cache(self):
        return _Cache()

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        src = q_BTD if kv_BSD is None else kv_BSD
        B, T, _ = q_BTD.shape
        S = src.shape[1]
        past = 0 if cache is None or cache.k is None else cache.k.shape[1]
        if pos_k is None:
            pos_k = (past + torch.arange(S)).expand(B, S)
        if pos_q is None:
            pos_q = (past + S - T + torch.arange(T)).expand(B, T)
        if valid_k is None:
            valid_k = torch.ones(B, S, dtype=torch.bool)
        k, v = self.wk(src), self.wv(src)
        if cache is not None:
            if cache.k is not None:
                k, v = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
                pos_k = torch.cat([cache.pos, pos_k], 1)
                valid_k = torch.cat([cache.valid, valid_k], 1)
            cache.k, cache.v, cache.pos, cache.valid = k, v, pos_k, valid_k
        logits = self.wq(q_BTD) @ k.transpose(1, 2) / math.sqrt(k.shape[-1])
        logits = logits - self.slope * (pos_q[:, :, None] - pos_k[:, None, :]).abs()
        allowed = valid_k[:, None, :].expand_as(logits)
        if causal:
            allowed = allowed & (pos_k[:, None, :] <= pos_q[:, :, None])
        att = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        return self.wo(att @ v), Aux()


class _ZeroUpdateBlock(nn.Module):
    """A block with the block signature that changes nothing: training the causal rule does not
    need the block's output, so the learning test skips its cost."""

    def forward(self, x_BTD, mem_BMD=None, *, cache=None, positions_BT=None, valid_BT=None):
        return x_BTD, Aux()


def _block(d, ff=None):
    ff = ff or DenseFFConfig(d_model=d, d_ff=2 * d).build()
    return TransformerBlock(d, TinyAttention(d), ff)


def _mod(d=6, capacity=0.125, ff=None, **kw):
    torch.manual_seed(0)
    mod = MoDConfig(d_model=d, capacity=capacity, **kw).build(_block(d, ff)).double()
    with torch.no_grad():
        mod.bias_router.fill_(0.3)  # exercised (it starts at 0)
    return mod


def _r(x_BTD, w_D, b=0.0):
    # The router logit r = wᵀx + b, computed in float32 like the layer does.
    b = b.float() if isinstance(b, torch.Tensor) else b  # the bias is [1]: it would promote
    return (x_BTD.float() @ w_D.float() + b).to(x_BTD.dtype)


def _reference(mod, x_BTD, capacity, positions_BT=None, valid_BT=None):
    # Each row as if alone and unpadded: it routes ceil(capacity * its valid tokens) of them
    # (expert_choice_count: ceil, documented), and the block sees only those.
    B, T, _ = x_BTD.shape
    r = _r(x_BTD, mod.w_router, mod.bias_router)
    block = mod.block
    pos = torch.arange(T).expand(B, T) if positions_BT is None else positions_BT
    rows = []
    for b in range(B):
        score = r[b].detach().clone()
        n_valid = T
        if valid_BT is not None:
            score[~valid_BT[b]] = -float("inf")
            n_valid = int(valid_BT[b].sum())
        C = math.ceil(capacity * n_valid)
        sel = torch.sort(torch.argsort(score, descending=True)[:C]).values
        xs = x_BTD[b, sel][None]
        y, _ = block(xs, positions_BT=pos[b, sel][None])
        row = x_BTD[b].clone()
        row[sel] = (xs + r[b, sel][None, :, None] * (y - xs))[0]
        rows.append(row)
    return torch.stack(rows)


def _grads(module_params, out, g):
    return torch.autograd.grad((out * g).sum(), module_params)


def test_capacity_one_equals_plain_block_with_router_weighted_update():
    mod = _mod(capacity=1.0)
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    y, aux = mod(x)
    yb, _ = mod.block(x)
    want = x + _r(x, mod.w_router, mod.bias_router)[..., None] * (yb - x)
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    params = [x, mod.w_router] + list(mod.block.parameters())
    for a, b in zip(_grads(params, y, g), _grads(params, want, g)):
        torch.testing.assert_close(a, b)
    assert aux.stats["mod.fraction_routed"] == 1.0


@pytest.mark.parametrize("T", [16, 20, 5])
def test_partial_capacity_routes_ceil_tokens_and_matches_reference(T):
    mod = _mod(capacity=0.125)
    x = torch.randn(3, T, 6, dtype=torch.float64, requires_grad=True)
    y, aux = mod(x)
    C = math.ceil(0.125 * T)
    changed = (y != x).any(-1)
    assert torch.equal(changed.sum(1), torch.full((3,), C))  # exactly ceil(12.5% of T) enter
    assert torch.equal(y[~changed], x[~changed])  # skipped tokens keep x bit for bit
    want = _reference(mod, x, 0.125)
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    params = [x, mod.w_router] + list(mod.block.parameters())
    got, ref = _grads(params, y, g), _grads(params, want, g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert got[1].abs().sum() > 0  # the router receives a gradient through r · (f(x) - x)
    torch.testing.assert_close(aux.stats["mod.fraction_routed"], torch.tensor(C / T))


def test_block_sees_original_positions_and_padding_is_never_routed():
    mod = _mod(capacity=0.5)
    x = torch.randn(2, 10, 6, dtype=torch.float64)
    positions = 3 * torch.arange(10).expand(2, 10) + 7  # gaps: distances matter
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, 6:] = False
    y, aux = mod(x, positions_BT=positions, valid_BT=valid)
    torch.testing.assert_close(y, _reference(mod, x, 0.5, positions, valid))
    assert torch.equal(y[1, 6:], x[1, 6:])
    # Row 0 routes 5 of 10 tokens, row 1 (6 real tokens) 3 of them.
    torch.testing.assert_close(aux.stats["mod.fraction_routed"], torch.tensor(8 / 16))
    # Positions reach the attention: contiguous positions give a different answer.
    y_contig, _ = mod(x, valid_BT=valid)
    assert not torch.allclose(y, y_contig)


def _membership(x_BTD, mod, capacity, valid_BT=None):
    r = _r(x_BTD, mod.w_router, mod.bias_router).detach()
    n_valid = torch.full((x_BTD.shape[0],), x_BTD.shape[1])
    if valid_BT is not None:
        r = r.masked_fill(~valid_BT, -float("inf"))
        n_valid = valid_BT.sum(1)
    C = torch.ceil(capacity * n_valid).long()  # per row, as if unpadded
    kth = r.sort(-1, descending=True).values.gather(1, (C - 1)[:, None])
    return r >= kth


def test_aux_bce_loss_equals_hand_computation_and_trains_the_router():
    mod = _mod(capacity=0.25, causal_router="aux_bce", aux_coef=0.1)
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 7] = False
    _, aux = mod(x, valid_BT=valid)
    t = _membership(x, mod, 0.25, valid).double()
    z = (x.float() @ mod.w_router.float() + mod.bias_router.float()).detach()
    bce = -(t * torch.log(torch.sigmoid(z)) + (1 - t) * torch.log(1 - torch.sigmoid(z)))
    want = 0.1 * bce[valid].mean()
    torch.testing.assert_close(aux.losses["mod.router_bce"], want.float())
    rule = z > 0
    acc = (rule == t.bool())[valid].float().mean()
    torch.testing.assert_close(aux.stats["mod.predictor_accuracy"], acc)
    (gw,) = torch.autograd.grad(aux.losses["mod.router_bce"], [mod.w_router])
    assert gw.abs().sum() > 0


def test_predictor_loss_is_stop_gradient():
    mod = _mod(capacity=0.25, causal_router="predictor", aux_coef=1.0)
    x = torch.randn(2, 8, 6, dtype=torch.float64, requires_grad=True)
    _, aux = mod(x)
    assert set(k for k in aux.losses if k.startswith("mod.")) == {"mod.predictor_bce"}
    t = _membership(x, mod, 0.25).float()
    p = mod.predictor(x.detach()).squeeze(-1).float()
    want = torch.nn.functional.binary_cross_entropy_with_logits(p, t)
    torch.testing.assert_close(aux.losses["mod.predictor_bce"], want)
    aux.losses["mod.predictor_bce"].backward()
    assert x.grad is None and mod.w_router.grad is None  # no effect on the LM path
    assert all(p.grad is not None for p in mod.predictor.parameters())


@pytest.mark.parametrize("method,capacity", [("predictor", 0.5), ("aux_bce", 0.25)])
def test_causal_rule_learns_topk_membership_above_90_percent(method, capacity):
    # Untrained, the rules agree with top-k membership on about 45% (predictor) and 73% (router
    # at capacity 0.25) of the tokens.
    torch.manual_seed(0)
    d, T = 8, 64
    mod = MoDConfig(d_model=d, capacity=capacity, causal_router=method, aux_coef=1.0,
                    predictor_hidden=32).build(_ZeroUpdateBlock())
    if method == "predictor":
        mod.w_router.requires_grad_(False)  # a fixed target: membership of the frozen router
    opt = torch.optim.Adam([p for p in mod.parameters() if p.requires_grad], lr=3e-2)
    gen = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread hand-offs would cost more than the maths
    try:
        for _ in range(150):
            _, aux = mod(torch.randn(16, T, d, generator=gen))
            opt.zero_grad()
            aux.total_loss().backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        _, aux = mod(torch.randn(32, T, d, generator=gen))
    assert aux.stats["mod.predictor_accuracy"] > 0.9


def _causal_reference(mod, x_BTD):
    """Routing by the causal rule (sigmoid(logit) > 0.5), block on the routed tokens only."""
    B, T, _ = x_BTD.shape
    r = _r(x_BTD, mod.w_router, mod.bias_router)
    z = r if mod.predictor is None else mod.predictor(x_BTD).squeeze(-1)
    out = x_BTD.clone()
    for b in range(B):
        sel = torch.nonzero(torch.sigmoid(z[b]) > 0.5).flatten()
        if len(sel):
            xs = x_BTD[b, sel][None]
            y, _ = mod.block(xs, positions_BT=sel[None])
            out[b, sel] = (xs + r[b, sel][None, :, None] * (y - xs))[0]
    return out, z > 0


@pytest.mark.parametrize("method", ["aux_bce", "predictor"])
def test_decoding_routes_causally_and_matches_full_causal_forward(method):
    mod = _mod(capacity=0.125, causal_router=method)
    with torch.no_grad():
        mod.w_router.mul_(8.0)  # logits spread on both sides of 0
    mod.eval()
    x = torch.randn(2, 12, 6, dtype=torch.float64)
    with torch.no_grad():
        want, routed = _causal_reference(mod, x)
        assert routed.any() and (~routed).any() and routed.float().mean() > 0.2
        cache = mod.block.attention.new_cache()
        outs = [mod(x[:, :5], cache=cache)[0]]  # prefill, then token by token
        for t in range(5, 12):
            y, aux = mod(x[:, t : t + 1], cache=cache)
            outs.append(y)
    # float32 router logits: a one-ulp difference between batch shapes is allowed
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache.valid, routed)  # skipped tokens' keys are stored as invalid
    skipped = ~routed
    assert torch.equal(torch.cat(outs, 1)[skipped], x[skipped])
    assert "mod.fraction_routed" in aux.stats


def test_with_rope_dense_attention_training_and_decoding_match_the_references():
    torch.manual_seed(2)
    d = 8
    att = DenseAttentionConfig(d_model=d, n_heads=2, d_head=4, pos="rope").build()
    ff = SwitchFFConfig(d_model=d, d_ff=8, n_experts=2, dropless=True).build()
    mod = MoDConfig(d_model=d, capacity=0.25).build(TransformerBlock(d, att, ff)).double()
    with torch.no_grad():
        mod.w_router.mul_(8.0)
    x = torch.randn(2, 12, d, dtype=torch.float64)
    y, _ = mod(x)
    torch.testing.assert_close(y, _reference(mod, x, 0.25))
    mod.eval()
    with torch.no_grad():
        want, routed = _causal_reference(mod, x)
        assert routed.any() and (~routed).any()
        cache = att.new_cache()
        got = torch.cat([mod(x[:, t : t + 1], cache=cache)[0] for t in range(12)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 router logits


def test_decoding_never_uses_the_sequence_topk():
    mod = _mod(capacity=0.125)
    with torch.no_grad():
        mod.w_router.zero_()
        mod.bias_router.zero_()
        mod.w_router[0] = -5.0
    x = torch.randn(1, 8, 6, dtype=torch.float64)
    x[..., 0] = 1.0  # every logit is -5: the causal rule routes nothing
    mod.eval()
    with torch.no_grad():
        y_topk, _ = mod(x)  # without a cache: top-k still routes ceil(0.125 · 8) = 1 token
        cache = mod.block.attention.new_cache()
        y_dec, aux = mod(x, cache=cache)
    assert (y_topk != x).any(-1).sum() == 1
    assert torch.equal(y_dec, x)
    assert aux.stats["mod.fraction_routed"] == 0 and not cache.valid.any()


def test_router_logits_are_float32_under_autocast():
    torch.manual_seed(3)
    mod = MoDConfig(d_model=32).build(_ZeroUpdateBlock())
    with torch.no_grad():
        mod.bias_router.fill_(0.3)
    x = torch.randn(2, 16, 32)
    want = x.double() @ mod.w_router.detach().double() + 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mod.router_logits(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_xl_memory_is_rejected_with_a_clear_message():
    mod = _mod()
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="RoPE"):
        mod(x, mem_BMD=x)


def test_wrong_input_width_is_a_clear_error():
    with pytest.raises(ValueError, match=r"MixtureOfDepths expects input \[batch, tokens, "
                                         r"d_model=6\]"):
        _mod()(torch.randn(1, 4, 5, dtype=torch.float64))


def test_usage_buffer_changes_in_training_only_and_loss_always_present():
    mod = _mod(capacity=0.25)
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    mod.eval()
    _, aux = mod(x)
    assert torch.count_nonzero(mod.usage) == 0
    assert "mod.router_bce" in aux.losses  # computed whenever aux_coef != 0, eval too
    mod.train()
    mod(x)
    assert mod.usage.tolist() == [12, 4]  # [skipped, routed] valid tokens
    mod0 = MoDConfig(d_model=6, aux_coef=0.0).build(_block(6)).double()
    assert not any(k.startswith("mod.") for k in mod0(x)[1].losses)


@pytest.mark.parametrize("ff_cfg", [
    SwitchFFConfig(d_model=6, d_ff=5, n_experts=3, dropless=True),
    SigmaMoEConfig(d_model=6, n_experts=4, expert_size=3, k=2),
])
def test_staged_mode_routes_only_entered_tokens_to_the_experts(ff_cfg):
    torch.manual_seed(1)
    ff = ff_cfg.build().double()
    mod = _mod(capacity=0.25, ff=ff)
    x = torch.randn(2, 12, 6, dtype=torch.float64)
    y, aux = mod(x)
    torch.testing.assert_close(y, _reference(mod, x, 0.25))
    k = getattr(ff_cfg, "k", 1)
    assert aux.routing["ff.router"].counts.sum() == 2 * 3 * k  # B · ceil(0.25 · 12) · k
    assert any(key.startswith("ff.") for key in aux.losses)


@pytest.mark.parametrize("bad,match", [
    (dict(capacity=0.0), "capacity"), (dict(capacity=1.5), "capacity"),
    (dict(causal_router="sigmoid"), "causal_router"), (dict(aux_coef=-1.0), "aux_coef"),
    (dict(predictor_hidden=0), "predictor_hidden"), (dict(d_model=0), "d_model"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        MoDConfig(**(dict(d_model=4) | bad))


def test_mod_zero_shot_scores_do_not_depend_on_batch_padding():
    # Zero-shot scoring pads items on the right to batch them; a Mixture-of-Depths model must
    # route each item as it would alone (capacity from its own length, padding never routed).
    from moeify.eval import score_continuations
    from moeify.models.lm import TransformerLM
    from moeify.models.presets import get_preset
    from moeify.eval.adapters import stateless_logits_fn

    torch.manual_seed(0)
    model = TransformerLM(get_preset("tiny-mod")).eval()
    fn = stateless_logits_fn(model, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    items = [(torch.randint(0, 256, (n,), generator=g).tolist(),
              torch.randint(0, 256, (3,), generator=g).tolist()) for n in (5, 9, 17, 30)]
    alone = [score_continuations(fn, [item], batch_size=1)[0] for item in items]
    together = score_continuations(fn, items, batch_size=len(items))
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
