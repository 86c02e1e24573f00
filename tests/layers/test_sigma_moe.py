"""sigma-MoE against dense einsum transcriptions of its formula (arXiv 2310.10837).

Legend: M tokens, E experts, G expert size, D d_model."""

import math

import pytest
import torch
import torch.nn.functional as F

from moeify.layers.sigma_moe import SigmaMoE, SigmaMoEConfig
from references import ref_expert_mlp

IMPLS = ["reference", "gather", "segment", "auto"]


def _topk_mask(scores_ME, k):
    # Membership by rank: expert e is chosen iff fewer than k experts score strictly higher.
    higher = (scores_ME[:, None, :] > scores_ME[:, :, None]).sum(-1)
    return (higher < k).to(scores_ME.dtype)


def _sigmoid32(x_MD, w_ED):
    # The spec computes the selection in float32 whatever the input precision.
    return torch.sigmoid(x_MD.float() @ w_ED.float().T).to(x_MD.dtype)


def _dense_sigma_moe(x_MD, w_sel_ED, keys_EDG, values_EGD, k):
    """y = sum over the top-k experts e of sigmoid(x·w_sel_e) · ReLU(x·K_e)·V_e, computed for every
    expert and masked (E times the work, obviously correct)."""
    s_ME = _sigmoid32(x_MD, w_sel_ED)
    gate_ME = s_ME * _topk_mask(s_ME.detach(), k)
    h_MEG = torch.relu(torch.einsum("md,edg->meg", x_MD, keys_EDG))
    return torch.einsum("meg,egd,me->md", h_MEG, values_EGD, gate_ME)


def _params(m):
    return [m.w_router, m.experts.w_in, m.experts.w_out]


def _compare(m, x_BTD, y_ref_fn, params=_params):
    x = x_BTD.clone().requires_grad_()
    y, _ = m(x)
    refs = [p.detach().clone().requires_grad_() for p in params(m)]
    xr = x_BTD.clone().requires_grad_()
    y_ref = y_ref_fn(xr.reshape(-1, xr.shape[-1]), *refs).view_as(y)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    for p, r in zip(params(m), refs):
        torch.testing.assert_close(p.grad, r.grad)


def test_one_expert_k1_is_sigmoid_gate_times_dense_relu_mlp():
    torch.manual_seed(0)
    m = SigmaMoEConfig(d_model=6, n_experts=1, expert_size=12, k=1).build().double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)

    def dense(x_MD, w_sel, keys, values):
        # A plain two-layer ReLU MLP without biases, scaled by one sigmoid gate.
        return _sigmoid32(x_MD, w_sel) * (torch.relu(x_MD @ keys[0]) @ values[0])

    _compare(m, x, dense)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("E,k", [(5, 2), (4, 4), (6, 1)])
def test_matches_dense_einsum_transcription(impl, E, k):
    torch.manual_seed(1)
    m = SigmaMoEConfig(d_model=7, n_experts=E, expert_size=3, k=k,
                       expert_impl=impl).build().double()
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    _compare(m, x, lambda x_MD, w, kk, v: _dense_sigma_moe(x_MD, w, kk, v, k))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_biases_and_activation_match_the_per_pair_loop(impl, activation):
    torch.manual_seed(2)
    k = 2
    m = SigmaMoEConfig(d_model=7, n_experts=5, expert_size=3, k=k, bias=True,
                       activation=activation, expert_impl=impl).build().double()
    with torch.no_grad():  # non-zero biases, so that a misplaced one shows
        m.experts.bias_in.normal_()
        m.bias_out.normal_()

    def ref(x_MD, w_sel, keys, values, b_in, b_out):
        gates_MK, idx_MK = _sigmoid32(x_MD, w_sel).topk(k, -1)
        return ref_expert_mlp(x_MD, idx_MK, keys, values, gates_MK, activation, b_in, b_out)

    _compare(m, torch.randn(3, 4, 7, dtype=torch.float64), ref,
             params=lambda m: _params(m) + [m.experts.bias_in, m.bias_out])


def test_float32_and_grouped_request_fall_back_correctly():
    torch.manual_seed(2)
    m = SigmaMoEConfig(d_model=16, n_experts=4, expert_size=8, k=2, expert_impl="grouped").build()
    x = torch.randn(2, 6, 16)
    y, _ = m(x)
    y_ref = _dense_sigma_moe(x.view(-1, 16), *[p.detach() for p in _params(m)], 2).view_as(y)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)


def test_entropy_regulariser_equals_hand_computation_and_ignores_padding():
    torch.manual_seed(3)
    coef = 1e-3
    m = SigmaMoEConfig(d_model=5, n_experts=4, expert_size=2, k=2, entropy_coef=coef).build()
    x = torch.randn(2, 6, 5)
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    _, aux = m(x, valid_BT=valid)
    logits = x[valid] @ m.w_router.T  # only the 9 real tokens
    p_bar = torch.softmax(logits, -1).mean(0)
    want = coef * (p_bar * p_bar.log()).sum()  # gamma · (−H(mean softmax))
    torch.testing.assert_close(aux.losses["entropy"], want)
    # The loss has a gradient into the selection weights.
    aux.losses["entropy"].backward()
    assert m.w_router.grad is not None and m.w_router.grad.abs().sum() > 0


def test_statistics_count_only_valid_tokens_and_match_the_selection():
    torch.manual_seed(4)
    E, k = 5, 2
    m = SigmaMoEConfig(d_model=6, n_experts=E, expert_size=3, k=k).build()
    x = torch.randn(2, 7, 6)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 4:] = False
    _, aux = m(x, valid_BT=valid)
    s = torch.sigmoid(x[valid] @ m.w_router.T)
    counts = _topk_mask(s, k).sum(0).long()
    assert torch.equal(aux.routing["router"].counts[0], counts)
    assert aux.routing["router"].counts[0].sum() == valid.sum() * k
    assert aux.stats["dead_experts"] == (counts == 0).sum()
    p = torch.softmax(x[valid] @ m.w_router.T, -1)
    torch.testing.assert_close(aux.stats["router_entropy"], -(p * p.log()).sum(-1).mean())
    p_bar = p.mean(0)
    torch.testing.assert_close(aux.stats["batch_entropy"], -(p_bar * p_bar.log()).sum())
    assert all(not v.requires_grad for v in aux.stats.values())


def test_usage_buffer_counts_in_training_only_and_loss_always_present():
    torch.manual_seed(5)
    m = SigmaMoEConfig(d_model=4, n_experts=3, expert_size=2, k=1).build()
    x = torch.randn(2, 5, 4)
    m.eval()
    _, aux = m(x)
    assert torch.count_nonzero(m.usage) == 0
    assert "entropy" in aux.losses  # computed in eval too: no flag to forget
    m.train()
    _, aux = m(x)
    assert torch.equal(m.usage, aux.routing["router"].counts[0])
    assert m.usage.sum() == 10
    m0 = SigmaMoEConfig(d_model=4, n_experts=3, expert_size=2, k=1, entropy_coef=0).build()
    assert m0(x)[1].losses == {}


def test_expert_dropout_drops_scores_before_topk_in_training_only():
    torch.manual_seed(6)
    p, E, k = 0.5, 6, 2
    m = SigmaMoEConfig(d_model=5, n_experts=E, expert_size=2, k=k,
                       expert_dropout=p).build().double()
    x_MD = torch.randn(40, 5, dtype=torch.float64)
    s = _sigmoid32(x_MD, m.w_router.detach())
    m.eval()
    _, gates, idx = m.route(x_MD)
    assert torch.equal(gates, s.float().gather(-1, idx))  # no dropout in eval
    m.train()
    torch.manual_seed(7)
    _, gates, idx = m.route(x_MD)
    torch.manual_seed(7)
    dropped = torch.rand(40, E) < p  # one independent draw per token and expert
    s_drop = s.float().masked_fill(dropped, 0.0)  # spec: dropped experts' scores set to 0
    # Surviving experts chosen: the top-k among the survivors; dropped ones only fill up a row
    # with fewer than k survivors (which of them is arbitrary, and their gate is 0).
    want_survivors = _topk_mask(s_drop.masked_fill(dropped, -1.0), k) * ~dropped
    got_mask = torch.zeros(40, E).scatter_(1, idx, 1.0)
    torch.testing.assert_close(got_mask * ~dropped, want_survivors.float())
    assert torch.equal(got_mask.sum(1), torch.full((40,), float(k)))
    torch.testing.assert_close(gates, s_drop.gather(-1, idx))
    assert (gates == 0).any()  # some tokens had fewer than k surviving experts


def test_init_follows_the_spec():
    torch.manual_seed(8)
    L, d, E, G = 8, 128, 16, 64
    m = SigmaMoEConfig(d_model=d, n_experts=E, expert_size=G, k=4, n_layers=L).build()
    s = math.sqrt(2 / L)
    assert abs(m.experts.w_in.std().item() / (s / math.sqrt(d)) - 1) < 0.02
    assert abs(m.experts.w_out.std().item() / (s / math.sqrt(E * G)) - 1) < 0.02
    assert abs(m.w_router.std().item() / (s / math.sqrt(d)) - 1) < 0.1
    norms = m.w_router.norm(dim=1)
    torch.testing.assert_close(norms, norms.mean().expand(E))  # rows renormalised


def test_router_runs_in_float32_for_low_precision_inputs():
    torch.manual_seed(9)
    m = SigmaMoEConfig(d_model=8, n_experts=4, expert_size=4, k=2).build().bfloat16()
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    logits, gates, _ = m.route(x.view(-1, 8))
    assert logits.dtype == torch.float32 and gates.dtype == torch.float32
    y, aux = m(x)
    assert y.dtype == torch.bfloat16 and aux.losses["entropy"].dtype == torch.float32


def test_router_runs_in_float32_under_autocast():
    # Mixed-precision training (SwitchHead appendix) must not put the selection in half precision.
    torch.manual_seed(10)
    m = SigmaMoEConfig(d_model=32, n_experts=8, expert_size=4, k=2, entropy_coef=1.0).build()
    x = torch.randn(4, 16, 32)
    x_MD = x.view(-1, 32)
    want = x_MD.double() @ m.w_router.detach().double().T
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, gates, idx = m.route(x_MD)
        _, aux = m(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)
    s = torch.sigmoid(want)
    assert torch.equal(_topk_mask(s, 2).bool(),
                       torch.zeros_like(s, dtype=torch.bool).scatter_(1, idx, True))
    p_bar = torch.softmax(want, -1).mean(0)
    torch.testing.assert_close(aux.losses["entropy"].double(), (p_bar * p_bar.log()).sum(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(k=5), "k must lie"), (dict(k=0), "k must lie"), (dict(n_experts=0), "n_experts"),
    (dict(expert_size=0), "expert_size"), (dict(entropy_coef=-1.0), "entropy_coef"),
    (dict(expert_dropout=1.0), "expert_dropout"), (dict(dropout=-0.5), "dropout"),
    (dict(expert_impl="fast"), "expert_impl"), (dict(n_layers=0), "n_layers"),
    (dict(activation="tanh"), "activation must be one of"),
    (dict(expert_impl="sets"), "expert_impl"),  # sets: experts routed in groups (SwitchHead)
])
def test_config_validation(bad, match):
    kw = dict(d_model=4, n_experts=4, expert_size=2, k=2) | bad
    with pytest.raises(ValueError, match=match):
        SigmaMoEConfig(**kw)
