"""Switch feedforward against a dense transcription of Switch Transformer (Fedus et al. 2022, §2),
with capacity dropping replayed by a plain loop in the position-priority order.

Legend: M tokens, E real experts, R = E + no-op experts router outputs, K choices, D d_model."""

import dataclasses
import math

import pytest
import torch

from moeify.layers.switch_ff import SwitchFeedForward, SwitchFFConfig
from references import assert_same_outputs_and_gradients, ref_expert_mlp


def _probs32(x_MD, w_RD):
    # Router in float32 whatever the input dtype (Switch's selective precision).
    return torch.softmax(x_MD.float() @ w_RD.float().T, -1).to(x_MD.dtype)


def _choices(p_MR, k):
    # The k best experts of every token, best first (ties do not occur with random inputs).
    return [sorted(range(p_MR.shape[1]), key=lambda e: -p_MR[m, e].item())[:k]
            for m in range(p_MR.shape[0])]


def _keep_by_position_priority(choices, E, capacity, valid=None):
    """Replay of the rule: all first choices (in token order) claim capacity before any second
    choice; padding claims nothing; no-op experts (id >= E) are never 'kept' (no compute)."""
    M, K = len(choices), len(choices[0])
    used = {}
    keep = torch.zeros(M, K, dtype=torch.bool)
    for j in range(K):
        for m in range(M):
            if valid is not None and not valid[m]:
                continue
            e = choices[m][j]
            if capacity is None or used.get(e, 0) < capacity:
                keep[m, j] = e < E
            used[e] = used.get(e, 0) + 1
    return keep


def _dense_switch(x_MD, w_RD, w_in, w_out, keep_MK, choices):
    """y_m = sum over kept choices e of p_e · W_out,e ReLU(W_in,e x_m), every expert computed."""
    E = w_in.shape[0]
    p_MR = _probs32(x_MD, w_RD)
    gate_ME = torch.zeros(x_MD.shape[0], E, dtype=x_MD.dtype)
    for m, cm in enumerate(choices):
        for j, e in enumerate(cm):
            if keep_MK[m, j]:
                gate_ME[m, e] = 1.0
    gate_ME = gate_ME * p_MR[:, :E]
    h_MEF = torch.relu(torch.einsum("md,edf->mef", x_MD, w_in))
    return torch.einsum("mef,efd,me->md", h_MEF, w_out, gate_ME)


def _params(m):
    return [m.w_router, m.experts.w_in, m.experts.w_out]


def _check_against_dense(m, x_BTD, valid_BT=None, capacity=None):
    x = x_BTD.clone().requires_grad_()
    y, aux = m(x, valid_BT=valid_BT)
    x_MD = x_BTD.reshape(-1, x_BTD.shape[-1])
    c = m.config
    choices = _choices(_probs32(x_MD, m.w_router.detach()), c.k)
    valid = None if valid_BT is None else valid_BT.reshape(-1).tolist()
    keep = _keep_by_position_priority(choices, c.n_experts, capacity, valid)
    refs = [p.detach().clone().requires_grad_() for p in _params(m)]
    xr = x_BTD.clone().requires_grad_()
    y_ref = _dense_switch(xr.reshape(-1, xr.shape[-1]), *refs, keep, choices).view_as(y)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    for p, r in zip(_params(m), refs):
        torch.testing.assert_close(p.grad, r.grad)
    return y, aux, keep, choices


@pytest.mark.parametrize("impl", ["reference", "gather", "segment", "auto"])
@pytest.mark.parametrize("k", [1, 2])
def test_dropless_matches_dense_transcription(impl, k):
    torch.manual_seed(0)
    m = SwitchFFConfig(d_model=6, d_ff=5, n_experts=4, k=k, dropless=True,
                       expert_impl=impl).build().double()
    _check_against_dense(m, torch.randn(2, 5, 6, dtype=torch.float64))


@pytest.mark.parametrize("impl", ["reference", "gather", "segment", "auto"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_biases_and_activation_match_the_per_pair_loop(impl, activation):
    torch.manual_seed(4)
    k = 2
    m = SwitchFFConfig(d_model=6, d_ff=5, n_experts=4, k=k, dropless=True, bias=True,
                       activation=activation, expert_impl=impl).build().double()
    with torch.no_grad():  # non-zero biases, so that a misplaced one shows
        m.experts.bias_in.normal_()
        m.bias_out.normal_()
    params = [m.w_router, m.experts.w_in, m.experts.w_out, m.experts.bias_in, m.bias_out]
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    y, _ = m(x)
    refs = [p.detach().clone().requires_grad_() for p in params]
    xr = x.detach().clone().requires_grad_()
    xr_MD = xr.reshape(-1, 6)
    gates_MK, idx_MK = _probs32(xr_MD, refs[0]).topk(k, -1)
    y_ref = ref_expert_mlp(xr_MD, idx_MK, *refs[1:3], gates_MK, activation,
                           *refs[3:]).view_as(y)
    assert_same_outputs_and_gradients(y, y_ref, x, xr, params, refs)


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_that_fits_every_token_equals_dropless(k):
    torch.manual_seed(1)
    cfg = SwitchFFConfig(d_model=6, d_ff=5, n_experts=3, k=k, capacity_factor=3.0)
    capped = cfg.build().double()
    dropless = SwitchFFConfig(**{**cfg.__dict__, "dropless": True}).build().double()
    dropless.load_state_dict(capped.state_dict())
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    assert capped.capacity(12) >= 12 * k  # ceil(M·k/E·3) with E = 3: nothing can drop
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, auxa = capped(xa)
    yb, _ = dropless(xb)
    torch.testing.assert_close(ya, yb)
    assert auxa.stats["fraction_dropped"] == 0
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    for p, q in zip(_params(capped), _params(dropless)):
        torch.testing.assert_close(p.grad, q.grad)


def _skewed(k, E=3, M=12, D=6, noop=0, **kw):
    """A router that sends most tokens to expert 0: feature 0 of every token is 1 and only
    expert 0 reads it strongly."""
    torch.manual_seed(2)
    m = SwitchFFConfig(d_model=D, d_ff=4, n_experts=E, k=k, capacity_factor=1.0,
                       noop_experts=noop, **kw).build().double()
    with torch.no_grad():
        m.w_router.normal_(0, 0.3)
        m.w_router[0, 0] = 3.0
    x = torch.randn(1, M, D, dtype=torch.float64)
    x[..., 0] = 1.0
    return m, x


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_one_on_skewed_routing_drops_exactly_the_predicted_tokens(k):
    m, x = _skewed(k)
    cap = math.ceil(12 * k / 3 * 1.0)
    assert m.capacity(12) == cap
    y, aux, keep, choices = _check_against_dense(m, x, capacity=cap)
    n_to_0 = sum(c[0] == 0 for c in choices)
    assert n_to_0 > cap  # the routing really is skewed, so something drops
    real = torch.tensor([[e < 3 for e in c] for c in choices])
    dropped = (real & ~keep).sum()
    assert dropped > 0
    torch.testing.assert_close(aux.stats["fraction_dropped"], dropped / real.sum().float())
    if k == 1:
        # A dropped token's output is exactly zero (the residual carries it).
        assert torch.equal(y[0][~keep[:, 0]], torch.zeros_like(y[0][~keep[:, 0]]))
        # Position priority: the kept tokens of expert 0 are its first `cap` tokens.
        first = [m_ for m_, c in enumerate(choices) if c[0] == 0][:cap]
        assert keep[first, 0].all() and keep[:, 0].sum() == sum(
            min(cap, sum(c[0] == e for c in choices)) for e in range(3))


def test_eval_uses_the_evaluation_capacity_factor():
    m, x = _skewed(1, eval_capacity_factor=3.0)
    m.eval()
    assert m.capacity(12) == 12
    _, aux = m(x)
    assert aux.stats["fraction_dropped"] == 0
    m.train()
    _, aux = m(x)
    assert aux.stats["fraction_dropped"] > 0


def _hand_losses(x_MD, w_RD, alpha, beta):
    logits = x_MD.float() @ w_RD.float().T
    p = torch.softmax(logits, -1)
    R = p.shape[1]
    f = torch.zeros(R)
    for e in p.argmax(-1).tolist():
        f[e] += 1.0 / p.shape[0]
    P = p.mean(0)
    balance = alpha * R * (f * P).sum()  # Switch Eq. 4: alpha · N · sum f_i P_i
    lse = torch.log(torch.exp(logits).sum(-1))
    z = beta * (lse ** 2).mean()  # ST-MoE Eq. 5
    return balance, z


@pytest.mark.parametrize("noop", [0, 2])
def test_balance_and_z_losses_equal_hand_computation_and_ignore_padding(noop):
    torch.manual_seed(3)
    m = SwitchFFConfig(d_model=5, d_ff=4, n_experts=4, noop_experts=noop,
                       balance_coef=0.01, z_coef=0.001).build()
    x = torch.randn(2, 6, 5)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 4:] = False
    valid[1, 5] = False
    _, aux = m(x, valid_BT=valid)
    w = m.w_router.detach().clone().requires_grad_()
    balance, z = _hand_losses(x[valid], w, 0.01, 0.001)  # the 9 real tokens only
    torch.testing.assert_close(aux.losses["balance"], balance)
    torch.testing.assert_close(aux.losses["z"], z)
    # Gradients: f carries none (argmax), P and the z-loss do.
    (aux.losses["balance"] + aux.losses["z"]).backward()
    (balance + z).backward()
    torch.testing.assert_close(m.w_router.grad, w.grad)


def test_padding_takes_no_capacity_gets_zero_output_and_is_not_counted():
    m, x = _skewed(1, M=12)
    valid = torch.ones(1, 12, dtype=torch.bool)
    valid[0, :3] = False  # padding at the front would otherwise claim expert 0's capacity
    y, aux, keep, choices = _check_against_dense(m, x, valid_BT=valid, capacity=4)
    assert torch.equal(y[0, :3], torch.zeros_like(y[0, :3]))
    counts = torch.zeros(3, dtype=torch.long)
    for mm in range(3, 12):
        counts[choices[mm][0]] += 1
    assert torch.equal(aux.routing["router"].counts[0], counts)
    p = _probs32(x[0, 3:], m.w_router.detach()).float()
    torch.testing.assert_close(aux.stats["router_entropy"], -(p * p.log()).sum(-1).mean())
    kept_real = keep[3:, 0].sum()
    torch.testing.assert_close(aux.stats["fraction_dropped"], 1 - kept_real / 9.0)


def test_noop_experts_integrated_mode():
    m, x = _skewed(2, E=3, noop=2)
    # Capacity counts the no-op experts among the E + Z choices (documented routing choice).
    assert m.capacity(12) == math.ceil(12 * 2 / 5)
    y, aux, keep, choices = _check_against_dense(m, x, capacity=m.capacity(12))
    noop_pairs = sum(e >= 3 for c in choices for e in c)
    assert noop_pairs > 0
    torch.testing.assert_close(aux.stats["fraction_noop"], torch.tensor(noop_pairs / 24.0))
    assert aux.routing["router"].counts[0].shape == (5,)
    m_dl = SwitchFFConfig(**{**m.config.__dict__, "dropless": True}).build().double()
    m_dl.load_state_dict(m.state_dict())
    _check_against_dense(m_dl, x)


def test_statistics_buffers_change_in_training_only():
    m, x = _skewed(1)
    m.eval()
    _, aux = m(x)
    assert torch.count_nonzero(m.usage) == 0 and m.dropped == 0
    assert set(aux.losses) == {"balance", "z"}  # computed in eval too: no flag to forget
    m.train()
    _, aux = m(x)
    _, aux = m(x)
    assert torch.equal(m.usage, 2 * aux.routing["router"].counts[0])
    routed = aux.routing["router"].counts[0].sum()
    assert m.dropped == 2 * torch.round(aux.stats["fraction_dropped"] * routed).long()
    assert all(not v.requires_grad for v in aux.stats.values())
    none = SwitchFFConfig(d_model=6, d_ff=4, n_experts=3, balance_coef=0, z_coef=0).build()
    assert none(x.float())[1].losses == {}


def test_expert_dropout_acts_in_training_only():
    torch.manual_seed(4)
    m = SwitchFFConfig(d_model=6, d_ff=32, n_experts=2, dropless=True,
                       expert_dropout=0.5).build().double()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    m.eval()
    _check_against_dense(m, x)
    m.train()
    y1, _ = m(x)
    m.eval()
    y0, _ = m(x)
    assert not torch.allclose(y1, y0)


@pytest.mark.parametrize("mode", ["bf16 module", "autocast"])
def test_router_is_float32_with_low_precision_inputs(mode):
    # The losses are float32 in any case (aux_losses upcasts); their VALUES show whether the
    # router ran in float32: a bfloat16 router is off by ~1e-2 relative.
    torch.manual_seed(5)
    m = SwitchFFConfig(d_model=32, d_ff=8, n_experts=4, balance_coef=1.0, z_coef=1.0).build()
    x = torch.randn(4, 16, 32)
    if mode == "bf16 module":
        m, x = m.bfloat16(), x.bfloat16()
        y, aux = m(x)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, aux = m(x)
    assert y.dtype == torch.bfloat16
    w = m.w_router.detach().double()
    balance, z = _hand_losses(x.reshape(-1, 32).double(), w, 1.0, 1.0)
    torch.testing.assert_close(aux.losses["z"].double(), z.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux.losses["balance"].double(), balance.double(),
                               rtol=1e-5, atol=1e-6)


def test_init_is_a_tenth_of_the_usual_scale():
    torch.manual_seed(6)
    m = SwitchFFConfig(d_model=128, d_ff=256, n_experts=8).build()
    for w, fan_in in ((m.w_router, 128), (m.experts.w_in, 128), (m.experts.w_out, 256)):
        std = math.sqrt(0.1 / fan_in)
        assert abs(w.std().item() / (0.8796 * std) - 1) < 0.05  # trunc-normal at 2 std
        assert w.abs().max().item() <= 2 * std + 1e-7


@pytest.mark.parametrize("bad,match", [
    (dict(k=4), "k must lie"), (dict(k=0), "k must lie"), (dict(n_experts=0), "n_experts"),
    (dict(capacity_factor=0.0), "capacity_factor"), (dict(eval_capacity_factor=-1.0),
                                                     "eval_capacity_factor"),
    (dict(balance_coef=-0.1), "balance_coef"), (dict(z_coef=-1.0), "z_coef"),
    (dict(expert_dropout=1.5), "expert_dropout"), (dict(noop_experts=-1), "noop_experts"),
    (dict(expert_impl="cuda"), "expert_impl"), (dict(d_ff=0), "d_ff"),
    (dict(activation="tanh"), "activation must be one of"),
])
def test_config_validation(bad, match):
    kw = dict(d_model=4, d_ff=4, n_experts=3) | bad
    with pytest.raises(ValueError, match=match):
        SwitchFFConfig(**kw)


def _decode_token_by_token(model, ids):
    cache = model.new_cache()
    return torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(ids.shape[1])], 1)


@torch.no_grad()
def test_cached_decoding_equals_the_dropless_full_forward():
    # The decoding rule (layers/switch_ff.py): a call of one token per sequence never drops, so
    # token-by-token decoding of a capacity model is the full forward of the dropless one.
    from moeify.models.presets import get_preset

    torch.manual_seed(0)
    base = get_preset("tiny-switch")
    # A small evaluation capacity, so that the full pass surely drops tokens.
    cfg = dataclasses.replace(base, feedforward=tuple(
        dataclasses.replace(f, eval_capacity_factor=0.5) for f in base.feedforward))
    capped = cfg.build().double().eval()
    dropless_cfg = dataclasses.replace(cfg, feedforward=tuple(
        dataclasses.replace(f, dropless=True) for f in cfg.feedforward))
    dropless = dropless_cfg.build().double().eval()
    dropless.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 256, (3, 24))
    decoded = _decode_token_by_token(capped, ids)
    torch.testing.assert_close(decoded, dropless(ids).logits, rtol=1e-6, atol=1e-6)
    full = capped(ids)
    dropped = [v for k, v in full.stats.items() if k.endswith("fraction_dropped")]
    assert any(d > 0 for d in dropped)  # the full pass drops, so the two differ (the rule)
    assert not torch.allclose(decoded, full.logits, rtol=1e-6, atol=1e-6)


def test_one_token_per_sequence_is_dropless_even_when_sequences_collide():
    torch.manual_seed(0)
    m = SwitchFFConfig(d_model=8, d_ff=16, n_experts=4, capacity_factor=0.25,
                       eval_capacity_factor=0.25).build().eval()
    x = torch.randn(6, 1, 8)
    _, aux = m(x)
    assert aux.stats["fraction_dropped"].item() == 0.0
    _, aux_chunk = m(x.view(1, 6, 8))  # the same tokens as one sequence: capacity applies
    assert aux_chunk.stats["fraction_dropped"].item() > 0.0


def test_tied_gates_keep_the_routers_tie_break():
    """Re-sorting the chosen gates best first is stable: with every score equal (a zero router)
    the choices stay in the router's documented order, lowest expert first, on every token."""
    m = SwitchFFConfig(d_model=8, d_ff=4, n_experts=6, k=3, dropless=True).build()
    with torch.no_grad():
        m.w_router.zero_()
    seen = []
    m.experts.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
    m(torch.randn(4, 64, 8))
    assert torch.equal(seen[0], torch.tensor([[0, 1, 2]]).expand(4 * 64, 3))
