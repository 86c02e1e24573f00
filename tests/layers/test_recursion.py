"""Mixture-of-Recursions (layers/recursion.py) against the paper's equations transcribed in
tests/references.py (ref_mor_expert, ref_mor_token), in float64: outputs, auxiliary losses and
every gradient; padding; recursion-wise KV caching and recursive KV sharing (cached decoding
equals the full forward for token-choice, and the causal threshold rule for expert-choice);
loss-free balancing's bias; the auxiliary router's stop-gradient; compile; configuration errors.

The shared stack is two moeify pre-LN blocks of dense RoPE attention and a dense feedforward;
the references call it one sequence at a time on the tokens a step runs, at their positions.
Under recursive KV sharing (``kv``) the references run that stack written out from the blocks'
weights (ref_shared_kv_stack), whose later steps attend to the first step's keys and values.

Legend: B batch, T tokens, D d_model, N recursions."""

import copy

import pytest
import torch
from torch import nn

from moeify.layers.attention import DenseAttentionConfig
from moeify.layers.block import TransformerBlock
from moeify.layers.feedforward import DenseFFConfig
from moeify.layers.kv_cache import KVCache, SharedKVCache
from moeify.layers.recursion import MoRConfig
from tests.references import ref_mor_expert, ref_mor_token, ref_shared_kv_stack

D = 8
KV = [False, True]


def _stack(m=2):
    return nn.ModuleList(
        TransformerBlock(D, DenseAttentionConfig(d_model=D, n_heads=2, d_head=4,
                                                 pos="rope").build(),
                         DenseFFConfig(d_model=D, d_ff=16).build()) for _ in range(m))


def _mor(seed=0, w_std=0.5, m=2, **kw):
    torch.manual_seed(seed)
    mor = MoRConfig(d_model=D, **kw).build(_stack(m)).double().train()
    with torch.no_grad():
        mor.w_router.normal_(0.0, w_std)  # scores well apart: no near-ties in the top-k
        if kw.get("kv_sharing"):  # LayerNorm affine away from (1, 0), which the reference sees
            for b in mor.blocks:
                b.ln1.weight.normal_(1.0, 0.2)
                b.ln2.bias.normal_(0.0, 0.2)
    return mor


def _f(blocks, kv=False):
    """The shared stack as the references call it: the moeify blocks themselves, or under KV
    sharing the stack written out from their weights (2 heads, RoPE on 2 of 4 channels)."""
    if kv:
        return ref_shared_kv_stack([dict(
            ln1=(b.ln1.weight, b.ln1.bias), ln2=(b.ln2.weight, b.ln2.bias), w_q=b.attention.w_q,
            w_k=b.attention.w_k, w_v=b.attention.w_v, w_o=b.attention.w_o,
            w1=b.feedforward.w1.weight, b1=b.feedforward.w1.bias, w2=b.feedforward.w2.weight,
            b2=b.feedforward.w2.bias) for b in blocks], 2, 2)

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


@pytest.mark.parametrize("N,T,gate,alpha,kv", [(3, 12, "sigmoid", 0.1, False),
                                               (4, 11, "tanh", 0.5, False),
                                               (3, 12, "sigmoid", 0.1, True)])
def test_expert_choice_matches_the_paper_equations_in_float64(N, T, gate, alpha, kv):
    mor = _mor(n_recursions=N, gate=gate, alpha=alpha, aux_coef=0.01, z_coef=0.0,
               kv_sharing=kv)
    ref_blocks = copy.deepcopy(mor.blocks)
    w_ref = mor.w_router.detach().clone().requires_grad_(True)
    x = torch.randn(3, T, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = mor(x)
    betas = [(N - r) / N for r in range(N)]
    y_ref, bce_ref, kept = ref_mor_expert(x_ref, w_ref, _f(ref_blocks, kv), betas, gate,
                                          alpha)
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


@pytest.mark.parametrize("kv", KV)
def test_expert_choice_padding_routes_each_row_as_if_alone(kv):
    mor = _mor(n_recursions=3, kv_sharing=kv)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 7:] = False
    y, aux = mor(x, valid_BT=valid)
    y_ref, _, _ = ref_mor_expert(x, mor.w_router.detach(), _f(mor.blocks, kv),
                                 [1, 2 / 3, 1 / 3], valid_BT=valid)
    torch.testing.assert_close(y[valid], y_ref[valid])
    alone, _ = mor(x[1:, :7])
    torch.testing.assert_close(y[1, :7], alone[0])
    torch.testing.assert_close(y[1, 7:], x[1, 7:])  # padding is never routed


@pytest.mark.parametrize("gate,alpha,kv", [("softmax", 1.0, False), ("sigmoid", 0.1, False),
                                          ("softmax", 1.0, True)])
def test_token_choice_matches_the_paper_equations_in_float64(gate, alpha, kv):
    N = 3
    mor = _mor(n_recursions=N, routing="token", gate=gate, alpha=alpha, balance_coef=0.1,
               z_coef=1e-3, kv_sharing=kv)
    ref_blocks = copy.deepcopy(mor.blocks)
    w_ref = mor.w_router.detach().clone().requires_grad_(True)
    x = torch.randn(3, 10, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = mor(x)
    y_ref, bal, zl, depth = ref_mor_token(x_ref, w_ref, _f(ref_blocks, kv), gate, alpha)
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


def test_token_choice_loss_free_bias_moves_the_depth_not_the_gate():
    N = 3
    mor = _mor(n_recursions=N, routing="token", balance_coef=0.0, z_coef=0.0,
               lossfree_rate=1e-3)
    assert not mor.expert_bias.any() and not mor.expert_bias.requires_grad
    bias = torch.tensor([0.3, -0.2, 0.1])
    with torch.no_grad():
        mor.expert_bias.copy_(bias)
    ref_blocks = copy.deepcopy(mor.blocks)
    w_ref = mor.w_router.detach().clone().requires_grad_(True)
    x = torch.randn(3, 10, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, aux = mor(x)
    y_ref, _, _, depth = ref_mor_token(x_ref, w_ref, _f(ref_blocks), bias_N=bias.double())
    plain = (x.detach() @ mor.w_router.detach().t()).argmax(-1)
    assert (depth != plain).any() and len(depth.unique()) > 1  # the bias changed the choice
    assert aux.routing["mor"].counts.tolist() == [[(depth == i).sum().item() for i in range(N)]]
    assert set(aux.losses) == set()  # the authors' loss_free: no balancing loss
    torch.testing.assert_close(y, y_ref)
    _check_grads(mor, ref_blocks, w_ref, x, x_ref, y, y_ref, 0.0, 0.0)
    with torch.no_grad():  # decoding routes with the bias too
        got, _ = _decode(mor.eval(), x.detach())
        full, _ = mor(x.detach())
    torch.testing.assert_close(got, full)


def _decode(mor, x, prefill=4):
    cache = mor.new_cache()
    with torch.no_grad():
        outs = [mor(x[:, :prefill], cache=cache)[0]]
        outs += [mor(x[:, t:t + 1], cache=cache)[0] for t in range(prefill, x.shape[1])]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("kv", KV)
def test_token_choice_cached_decoding_equals_the_full_forward(kv):
    mor = _mor(n_recursions=3, routing="token", kv_sharing=kv).eval()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        full, _ = mor(x)
    got, cache = _decode(mor, x)
    torch.testing.assert_close(got, full)
    assert len(cache) == 11
    if kv:  # one cache, the first step's: every token's keys and values, valid
        assert len(cache.caches) == 1 and all(c.all_valid for c in cache.caches[0])
        return
    depth = (x @ mor.w_router.detach().t()).argmax(-1)
    for r in range(3):  # recursion-wise caching: step r's keys are valid iff the token took r
        for c in cache.caches[r]:
            assert torch.equal(c.valid, depth >= r)


def _causal_reference(mor, x, kv=False):
    """Expert-choice decoding's rule over a whole sequence: a token takes step r iff it took
    step r - 1 and (beta_r < 1) its router logit is positive (sigmoid > 1/2)."""
    B, T, _ = x.shape
    fs = [_f(mor.blocks, kv) for _ in range(B)]  # one per sequence: KV sharing keeps state
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
            y = fs[b](h[b, sel][None], sel[None], r)[0]
            h[b, sel] = h[b, sel] + g[b, sel, None] * y
    return h


@pytest.mark.parametrize("kv", KV)
def test_expert_choice_decoding_follows_the_causal_rule_and_caches_by_step(kv):
    mor = _mor(n_recursions=3, w_std=2.0, kv_sharing=kv).eval()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    got, cache = _decode(mor, x)
    with torch.no_grad():
        want = _causal_reference(mor, x, kv)
        one_shot, aux = mor(x, cache=mor.new_cache())
    frac = [aux.stats[f"mor.fraction_r{r}"] for r in range(3)]
    assert frac[0] == 1 and 0 < frac[2] < frac[1] < 1  # the threshold skips some tokens
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(one_shot, want)
    if kv:
        assert len(cache.caches) == 1 and cache.caches[0][1].all_valid
        return
    assert torch.equal(cache.caches[0][0].valid, torch.ones(2, 12, dtype=torch.bool))
    assert cache.caches[2][1].valid.sum() < cache.caches[1][1].valid.sum() < 24


@pytest.mark.parametrize("kv", KV)
def test_expert_choice_at_full_capacity_decodes_as_its_forward(kv):
    mor = _mor(n_recursions=2, capacities=(1.0, 1.0), kv_sharing=kv).eval()
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


def test_kv_sharing_later_steps_see_tokens_that_stopped():
    # the same weights under recursion-wise caching: later steps attend among their own tokens
    shared = _mor(n_recursions=3, kv_sharing=True)
    plain = copy.deepcopy(shared)
    plain.config = MoRConfig(d_model=D, n_recursions=3)
    x = torch.randn(2, 12, D, dtype=torch.float64)
    with torch.no_grad():
        (ys, aux_s), (yp, aux_p) = shared(x), plain(x)
    assert not torch.allclose(ys, yp)
    for r in range(3):  # the same tokens take each step
        assert aux_s.stats[f"mor.fraction_r{r}"] == aux_p.stats[f"mor.fraction_r{r}"]


def test_a_shared_kv_cache_reads_a_filled_one_and_stores_nothing():
    first = KVCache()
    shared = SharedKVCache(first)
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="holds no tokens"):
        shared.append(k, k, torch.arange(3)[None])
    first.append(k, 2 * k, torch.arange(3)[None])
    got = shared.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4),
                        torch.tensor([[3]]))
    assert torch.equal(got[0], k) and torch.equal(got[1], 2 * k) and len(first) == 3
    with pytest.raises(ValueError, match="batch 1 with 2 heads"):
        shared.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4),
                      torch.tensor([[3], [3]]))


def test_kv_sharing_compiles_as_one_graph_equal_to_eager():
    # the first step's caches are made inside the forward; fullgraph raises on a graph break
    torch._dynamo.reset()
    eager = _mor(n_recursions=2, m=1, aux_coef=0.01, kv_sharing=True)
    compiled = copy.deepcopy(eager)
    compiled.compile(fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 9, D, dtype=torch.float64)
    outs = []
    for m in (eager, compiled):
        y, aux = m(x)
        ((y * torch.arange(9.0, dtype=y.dtype)[:, None]).sum()
         + aux.losses["mor.router_bce"]).backward()
        outs.append(y)
    torch.testing.assert_close(outs[1], outs[0])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("kw,match", [
    (dict(n_recursions=1), "n_recursions"),
    (dict(routing="both"), "routing"),
    (dict(capacities=(0.5, 1.0, 0.2)), "descending"),
    (dict(capacities=(1.0, 0.5)), "n_recursions=3"),
    (dict(routing="token", gate="tanh"), "gate"),
    (dict(alpha=0.0), "alpha"),
    (dict(lossfree_rate=1e-3), "token-choice"),
    (dict(routing="token", lossfree_rate=-1.0), "lossfree_rate"),
    (dict(kv_sharing=1), "kv_sharing must be True or False"),
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
