"""Mixture-of-Recursions (layers/recursion.py) against the paper's equations transcribed in
tests/references.py (ref_mor_expert, ref_mor_token), in float64: outputs, auxiliary losses and
every gradient; padding; recursion-wise KV caching (cached decoding equals the full forward for
token-choice, and the causal threshold rule for expert-choice); the auxiliary router's stop-
gradient; configuration errors.

The shared stack is two moeify pre-LN blocks of dense RoPE attention and a dense feedforward;
the references call it one sequence at a time on the tokens a step runs, at their positions.

Legend: B batch, T tokens, D d_model, N recursions."""

import copy

import pytest
import torch
from torch import nn

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.block import TransformerBlock
from moeify.layers.feedforward import DenseFFConfig
from moeify.layers.recursion import MoRConfig
from tests.references import ref_mor_expert, ref_mor_token

D = 8


def _stack(m=2):
    return nn.ModuleList(
        TransformerBlock(D, DenseAttentionConfig(d_model=D, n_heads=2, d_head=4,
                                                 pos="rope").build(),
                         DenseFFConfig(d_model=D, d_ff=16).build()) for _ in range(m))


def _mor(seed=0, w_std=0.5, **kw):
    torch.manual_seed(seed)
    mor = MoRConfig(d_model=D, **kw).build(_stack()).double().train()
    with torch.no_grad():
        mor.w_router.normal_(0.0, w_std)  # scores well apart: no near-ties in the top-k
    return mor


def _f(blocks):
    def f(x_1KD, pos_1K, r):
        for b in blocks:
            x_1KD, _ = b(x_1KD, positions_BT=pos_1K)
        return x_1KD
    return f


def _check_grads(mor, ref_blocks, w_ref, x, x_ref, y, y_ref, loss, loss_ref):
    g = torch.randn_like(y)
    ((y * g).sum() + loss).backward()
    ((y_ref * g).sum() + loss_ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(mor.w_router.grad, w_ref.grad)
    for p, q in zip(mor.blocks.parameters(), ref_blocks.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("N,T,gate,alpha", [(3, 12, "sigmoid", 0.1), (4, 11, "tanh", 0.5)])
def test_expert_choice_matches_the_paper_equations_in_float64(N, T, gate, alpha):
    mor = _mor(n_recursions=N, gate=gate, alpha=alpha, aux_coef=0.01, z_coef=0.0)
    ref_blocks = copy.deepcopy(mor.blocks)
    w_ref = mor.w_router.detach().clone().requires_grad_(True)
    x = torch.randn(3, T, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = mor(x)
    betas = [(N - r) / N for r in range(N)]
    y_ref, bce_ref, kept = ref_mor_expert(x_ref, w_ref, _f(ref_blocks), betas, gate, alpha)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(aux.losses["mor.router_bce"], 0.01 * bce_ref)
    # the routing record counts tokens by final depth: kept at step r, not at r + 1
    per_depth = [sum(len(k[r]) - (len(k[r + 1]) if r + 1 < N else 0) for k in kept)
                 for r in range(N)]
    assert aux.routing["mor"].counts.tolist() == [per_depth]
    _check_grads(mor, ref_blocks, w_ref, x, x_ref, y, y_ref, aux.losses["mor.router_bce"],
                 0.01 * bce_ref)


def test_expert_choice_kept_tokens_are_unchanged_elsewhere_and_capacities_truncate():
    mor = _mor(n_recursions=3, capacities=(1.0, 0.5, 0.2))
    x = torch.randn(2, 9, D, dtype=torch.float64)
    y, aux = mor(x)
    # floor(0.5 * 9) = 4 tokens take step 2, floor(0.2 * 9) = 1 step 3 (authors' int())
    assert aux.stats["mor.fraction_r1"] * 9 == 4 and aux.stats["mor.fraction_r2"] * 9 == 1
    with torch.no_grad():
        mor.w_router.zero_()  # every gate alpha / 2: step 0 still runs every token
    y0, _ = mor(x)
    assert not torch.equal(y0, x)


def test_expert_choice_padding_routes_each_row_as_if_alone():
    mor = _mor(n_recursions=3)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 7:] = False
    y, aux = mor(x, valid_BT=valid)
    y_ref, _, _ = ref_mor_expert(x, mor.w_router.detach(), _f(mor.blocks), [1, 2 / 3, 1 / 3],
                                 valid_BT=valid)
    torch.testing.assert_close(y[valid], y_ref[valid])
    alone, _ = mor(x[1:, :7])
    torch.testing.assert_close(y[1, :7], alone[0])
    torch.testing.assert_close(y[1, 7:], x[1, 7:])  # padding is never routed


@pytest.mark.parametrize("gate,alpha", [("softmax", 1.0), ("sigmoid", 0.1)])
def test_token_choice_matches_the_paper_equations_in_float64(gate, alpha):
    N = 3
    mor = _mor(n_recursions=N, routing="token", gate=gate, alpha=alpha, balance_coef=0.1,
               z_coef=1e-3)
    ref_blocks = copy.deepcopy(mor.blocks)
    w_ref = mor.w_router.detach().clone().requires_grad_(True)
    x = torch.randn(3, 10, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = mor(x)
    y_ref, bal, zl, depth = ref_mor_token(x_ref, w_ref, _f(ref_blocks), gate, alpha)
    assert 0 < (depth == 0).sum() < depth.numel()  # several depths in use
    torch.testing.assert_close(y, y_ref)
    # the shared balancing / z-loss ops compute in float32
    torch.testing.assert_close(aux.losses["mor.balance"], 0.1 * bal.float(), rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(aux.losses["mor.z_loss"], 1e-3 * zl.float(), rtol=1e-6,
                               atol=1e-9)
    counts = torch.stack([(depth == i).sum() for i in range(N)])
    assert aux.routing["mor"].counts.tolist() == [counts.tolist()]
    _check_grads(mor, ref_blocks, w_ref, x, x_ref, y, y_ref,
                 aux.losses["mor.balance"].double() + aux.losses["mor.z_loss"].double(),
                 0.1 * bal + 1e-3 * zl)


def _decode(mor, x, prefill=4):
    cache = mor.new_cache()
    with torch.no_grad():
        outs = [mor(x[:, :prefill], cache=cache)[0]]
        outs += [mor(x[:, t:t + 1], cache=cache)[0] for t in range(prefill, x.shape[1])]
    return torch.cat(outs, 1), cache


def test_token_choice_cached_decoding_equals_the_full_forward():
    mor = _mor(n_recursions=3, routing="token").eval()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        full, _ = mor(x)
    got, cache = _decode(mor, x)
    torch.testing.assert_close(got, full)
    depth = (x @ mor.w_router.detach().t()).argmax(-1)
    for r in range(3):  # recursion-wise caching: step r's keys are valid iff the token took r
        for c in cache.caches[r]:
            assert torch.equal(c.valid, depth >= r)
    assert len(cache) == 11


def _causal_reference(mor, x):
    """Expert-choice decoding's rule over a whole sequence: a token takes step r iff it took
    step r - 1 and (beta_r < 1) its router logit is positive (sigmoid > 1/2)."""
    B, T, _ = x.shape
    blocks = mor.blocks
    h = x.clone()
    took = torch.ones(B, T, dtype=torch.bool)
    for r, beta in enumerate(mor.config.betas):
        logit = h @ mor.w_router[r]
        if beta < 1:
            took = took & (logit > 0)
        g = 0.1 * torch.sigmoid(logit)
        for b in range(B):
            sel = took[b].nonzero()[:, 0]
            if len(sel) == 0:
                continue
            y = _f(blocks)(h[b, sel][None], sel[None], r)[0]
            h[b, sel] = h[b, sel] + g[b, sel, None] * y
    return h


def test_expert_choice_decoding_follows_the_causal_rule_and_caches_recursion_wise():
    mor = _mor(n_recursions=3, w_std=2.0).eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    got, cache = _decode(mor, x)
    with torch.no_grad():
        want = _causal_reference(mor, x)
        one_shot, aux = mor(x, cache=mor.new_cache())
    frac = [aux.stats[f"mor.fraction_r{r}"] for r in range(3)]
    assert frac[0] == 1 and 0 < frac[2] < frac[1] < 1  # the threshold skips some tokens
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(one_shot, want)
    assert torch.equal(cache.caches[0][0].valid, torch.ones(2, 12, dtype=torch.bool))
    assert cache.caches[2][1].valid.sum() < cache.caches[1][1].valid.sum() < 24


def test_expert_choice_at_full_capacity_decodes_as_its_forward():
    mor = _mor(n_recursions=2, capacities=(1.0, 1.0)).eval()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        full, _ = mor(x)
    got, _ = _decode(mor, x)
    torch.testing.assert_close(got, full)


def test_aux_router_is_trained_by_the_bce_without_touching_the_model():
    mor = _mor(n_recursions=3, causal="aux_router", aux_coef=1.0)
    x = torch.randn(2, 12, D, dtype=torch.float64, requires_grad=True)
    y, aux = mor(x)
    assert set(aux.losses) == {"mor.aux_router_bce"}
    aux.losses["mor.aux_router_bce"].backward()
    assert mor.w_aux_router.grad.abs().sum() > 0
    assert x.grad is None and mor.w_router.grad is None  # stop-gradient input, own weights
    assert all(p.grad is None for p in mor.blocks.parameters())


def test_usage_buffer_changes_in_training_only():
    mor = _mor(n_recursions=3)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    mor(x)
    assert mor.usage.tolist() == [2 * 4, 2 * 4, 2 * 4]  # 12 -> 8 -> 4 tokens per row
    mor.eval()
    mor(x)
    assert mor.usage.sum() == 24


@pytest.mark.parametrize("kw,match", [
    (dict(n_recursions=1), "n_recursions"),
    (dict(routing="both"), "routing"),
    (dict(capacities=(0.5, 1.0, 0.2)), "descending"),
    (dict(capacities=(1.0, 0.5)), "n_recursions=3"),
    (dict(routing="token", gate="tanh"), "gate"),
    (dict(alpha=0.0), "alpha"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        MoRConfig(d_model=D, **kw)


def test_xl_memory_and_bad_input_are_clear_errors():
    mor = _mor()
    x = torch.randn(1, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="XL memory"):
        mor(x, x)
    with pytest.raises(ValueError, match="d_model=8"):
        mor(torch.randn(1, 4, D + 1, dtype=torch.float64))
