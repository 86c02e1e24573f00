"""Independent transcriptions of the papers' equations, which the tests compare the library
against. There is one copy of each, so a fix to a reference reaches every test that relies on it.

- RoPE (RoFormer, arXiv 2104.09864, §3.2; as SwitchHead uses it): the first n_rot channels
  of each head, taken as pairs (i, i + n_rot/2), are rotated as the complex number
  x_i + j·x_{i+n_rot/2} multiplied by exp(j·p·base^(-2i/n_rot)). The remaining channels are
  left as they are.
- Transformer-XL relative positions (Dai et al. 2019; SwitchHead appendix): the sinusoid of every
pairwise
  distance p_i - p_j, with a sin block followed by a cos block, projected by W and dotted with
  the query one pair at a time. There is no relative shift and no identity trick.
- Routed two-layer experts (sigma-MoE, arXiv 2310.10837; Switch, Fedus et al. 2022): each token's
output is the
  gate-weighted sum over its chosen experts of act(x · W_in,e + b_in,e) · W_out,e, plus an
  ungated output bias, one (token, choice) pair at a time. GELU (tanh) is written out from its
  formula 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))) (Hendrycks & Gimpel 2016).
- Default positions (SwitchHead Eq. 7-10, XL memory): queries are the last T of the S sources
  [memory ; x], so they sit at S-T .. S-1 and keys at 0 .. S-1.
- MoH (Jin et al., ICML 2025, arXiv 2410.11842v3, Sec. 3.2, Eqs. 4-7): y_t = Σ_i g_i H^i_t
  W_O^i, every head written out on its own; the gates of Eqs. 5-6 one token at a time (shared
  heads α1 · Softmax(W_s x), the Top-K routed heads α2 · Softmax(W_r x), [α1, α2] =
  Softmax(W_h x)), with the authors' code's factors as a separate, named step; the query-norm
  router's gates quantised to 1 (Sec. 4.4, Eq. 9); the balance loss E Σ f_i P_i (Eq. 7).

- Mixture-of-Recursions (Bae et al., NeurIPS 2025, arXiv 2507.10524, Sec. 2.2.1): expert-choice
  (Eq. 2): at step r, g_t = alpha * sigmoid(theta_r . H_t) (or alpha * tanh); the step keeps the
  floor(beta_r * T) (at least 1) candidates with the largest g (ties: lowest position), the
  candidates being the tokens the previous step kept; a kept token becomes
  H_t + g_t * f(H_t), f run on the kept tokens of the sequence alone at their positions; the
  auxiliary loss is the mean over the step's candidates of the binary cross-entropy of the
  logit against "kept". Token-choice (Eq. 3): g = alpha * softmax(Theta^T H^1) over N_r depths,
  i = argmax; the token runs f i + 1 times (ungated in between) among the tokens still running,
  and ends as H^1 + g_i * f(...); balance loss N_r * sum_i f_i P_i (f_i the share of tokens at
  depth i, P_i the mean probability), z-loss mean logsumexp(logits)^2. Loss-free balancing (the
  authors' code, after arXiv 2408.15664): i = argmax(g + b) for a bias b, the gate still g_i.
  Recursive KV sharing (Sec. 2.2.2): the first step computes the keys and values of every
  token; every later step's queries attend to those, causal in position, and compute none.
- A pre-LN block (SwitchHead appendix) with dense RoPE attention and a ReLU feedforward, one
  sequence: x + W_O·concat_h softmax(q_h k_hᵀ / sqrt(C), causal) v_h, q = RoPE(LN1(x) W_Q),
  k = RoPE(LN1(x) W_K), v = LN1(x) W_V; then + W_2 ReLU(W_1 LN2(x) + b_1) + b_2; LayerNorm
  (x - mean) / sqrt(var + eps) · w + b, the biased variance.
- ReMoE (Wang et al., ICLR 2025, arXiv 2412.14711, Sec. 3): ReLU routing, R(x) = ReLU(x W_r),
  y = Σ_e R(x)_e · expert_e(x) over the experts with R(x)_e > 0, any number per token; the
  load-balanced L1 regulariser: L_reg = Σ_e f_e · mean_t R(x_t)_e with
  f_e = E / (k · T) · #{t: R(x_t)_e > 0}; the adaptive coefficient's update:
  lambda <- lambda · alpha^sign((1 - k/E) - S), S the fraction of zero routing outputs,
  dividing when S reaches the target.
- MoSA's local heads (arXiv 2505.00315 Sec. 3.4, as the authors' code runs them with the
  local-attention package): a query at position i attends to the keys j <= i with
  j // w >= i // w - 1, softmax scale 1/sqrt(C), every channel rotated by RoPE; each head its own
  W_Q, W_K, W_V, W_O, the outputs summed.

Nothing here imports moeify. A reference built on the library's own positional code would test
that code against itself.

Shape legend: B batch, H heads (MoA: experts), T queries, S keys / sources, C head channels,
D sinusoid width (d_model for the attention layers).
"""

import math

import torch

f64 = torch.float64


def ref_rope(x_BHTC, pos_BT, n_rot, base=10000.0, freq=None, scale=1.0):
    """RoPE as a complex rotation of the channel pairs (i, i + n_rot/2), with the angle in f64;
    ``freq`` replaces the frequencies and ``scale`` multiplies the rotation (YaRN)."""
    half = n_rot // 2
    z = torch.complex(x_BHTC[..., :half], x_BHTC[..., half:n_rot])
    if freq is None:
        freq = base ** (-2.0 * torch.arange(half, dtype=f64) / n_rot)
    theta = pos_BT.to(f64)[:, None, :, None] * freq
    z = z * torch.exp(1j * theta) * scale
    return torch.cat([z.real, z.imag, x_BHTC[..., n_rot:]], -1)


def ref_llama3_freq(n_rot, base, factor, low, high, original):
    """Llama 3.1's frequencies one at a time: wavelength 2π/ω above original/low is
    interpolated (ω / factor), below original/high kept, and blended linearly in
    original/wavelength between."""
    out = []
    for i in range(n_rot // 2):
        w = base ** (-2.0 * i / n_rot)
        wavelen = 2 * math.pi / w
        if wavelen < original / high:
            out.append(w)
        elif wavelen > original / low:
            out.append(w / factor)
        else:
            s = (original / wavelen - low) / (high - low)
            out.append((1 - s) * w / factor + s * w)
    return torch.tensor(out, dtype=f64)


def ref_yarn_freq(n_rot, base, factor, original, beta_fast, beta_slow):
    """YaRN's frequencies one at a time (Peng et al. 2023, Eq. 17-18 with transformers'
    floor / ceil of the correction range): dimension i keeps ω_i above the range, ω_i / factor
    below it, and a linear ramp in i between."""
    def dim(rotations):
        return n_rot * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), n_rot - 1)
    out = []
    for i in range(n_rot // 2):
        w = base ** (-2.0 * i / n_rot)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
        out.append(w * (1 - ramp) + w / factor * ramp)
    return torch.tensor(out, dtype=f64)


def ref_sinusoid(dist, D):
    """Transformer-XL sinusoid of (real) distances, any shape -> [..., D]: sin block, then cos,
    one frequency 10000^(-2f/D) at a time."""
    out = torch.empty(*dist.shape, D, dtype=f64)
    n_sin = (D + 1) // 2
    for f in range(n_sin):
        w = 10000.0 ** (-2.0 * f / D)
        out[..., f] = torch.sin(dist.to(f64) * w)
        if n_sin + f < D:
            out[..., n_sin + f] = torch.cos(dist.to(f64) * w)
    return out


def ref_xl(q_BHTC, w_DHC, pos_q_BT, pos_k_BS):
    """XL position logits q_t · (sinusoid(p_t - p_s) W): every (query, key) pair, [B, H, T, S].
    The sinusoid width D is w's first dimension. Expand a shared projection to [D, H, C] first."""
    emb_BTSD = ref_sinusoid(pos_q_BT[:, :, None] - pos_k_BS[:, None, :], w_DHC.shape[0])
    p_BHTSC = torch.einsum("btsd,dhc->bhtsc", emb_BTSD.to(q_BHTC.dtype), w_DHC)
    return torch.einsum("bhtc,bhtsc->bhts", q_BHTC, p_BHTSC)


def ref_positions(B, T, S, pos_q=None, pos_k=None):
    """Default positions of T queries over S sources [memory ; x], unless given: queries are
    S-T .. S-1, keys 0 .. S-1. Returns ([B, T], [B, S])."""
    pq = torch.arange(S - T, S).expand(B, T) if pos_q is None else pos_q
    pk = torch.arange(S).expand(B, S) if pos_k is None else pos_k
    return pq, pk


def ref_expert_rows(x, idx, w, gates=None, groups=1, sum_rows=1):
    """The expert matmul's definition, one (row, expert) pair at a time: x[m] @ w[idx[m, k]],
    gate-weighted and summed over each of ``groups`` consecutive groups of k, then over every
    ``sum_rows`` consecutive rows."""
    M, K = idx.shape
    out = torch.stack([torch.stack([x[m] @ w[int(idx[m, k])] for k in range(K)])
                       for m in range(M)]) if M else x.new_zeros(0, K, w.shape[-1])
    if gates is None:
        return out
    y = (out * gates.to(x.dtype)[..., None]).view(M, groups, K // groups, -1).sum(2)
    y = y[:, 0] if groups == 1 else y
    return y.view(M // sum_rows, sum_rows, -1).sum(1) if sum_rows > 1 else y



def ref_expert_matmul_grads(x, idx, w, gates, groups=1, sum_rows=1, batch=None, seed=7):
    """``ref_expert_rows`` in float64 of the same (rounded) inputs, laid out [B, G, S, F] with
    ``batch``: (output, a random output gradient, the x, w and gate gradients for it)."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    gr = None if gates is None else gates.detach().double().requires_grad_()
    y = ref_expert_rows(xr, idx, wr, gr, groups, sum_rows)
    if batch is not None:
        y = y.view(batch, -1, groups, y.shape[-1]).transpose(1, 2)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grads = torch.autograd.grad(y, [t for t in (xr, wr, gr) if t is not None], g)
    return y.detach(), g, grads


def assert_kernel_matches_reference(impl, M, K, E, D, F, *, groups, sum_rows, gated, seed=0):
    """Expert-matmul kernel ``impl`` on ``routed_inputs(M, K, E, D, F)`` under one contract
    (``groups``, ``sum_rows``, gated or not): its output and its x, w and gate gradients equal
    ``ref_expert_matmul_grads``'."""
    from moeify.ops.moe import expert_matmul

    x, idx, w, gates = routed_inputs(M, K, E, D, F, gated=gated, seed=seed)
    want, gy, want_grads = ref_expert_matmul_grads(x, idx, w, gates, groups=groups,
                                                   sum_rows=sum_rows)
    inputs = [t.clone().requires_grad_() for t in (x, w, gates) if t is not None]
    y = expert_matmul(inputs[0], idx, inputs[1], inputs[2] if gated else None, groups=groups,
                      sum_rows=sum_rows, impl=impl)
    torch.testing.assert_close(y, want)
    for got, ref in zip(torch.autograd.grad(y, inputs, gy), want_grads):
        torch.testing.assert_close(got, ref)

def routed_inputs(M, K, E, D, F, *, dtype=f64, seed=0, skew=False, gated=True, idx=None,
                  n_groups=1, unit=None):
    """The one input factory of the expert-matmul tests: x [M, D], expert ids [M, K], w [E, D, F]
    and gates [M, K] (float64 in float64, else float32 as routers produce them). No gradients.

    Each row's K ids are K // ``unit`` units of ``unit`` (default K) distinct experts, the top
    ``unit`` of random scores. With ``n_groups`` > 1 the E experts form n_groups groups of
    E // n_groups consecutive ids, and unit u (counted over all rows) picks its experts in group
    u % n_groups: SwitchHead's per-head experts, what ``make_plan(..., group_size=E //
    n_groups)`` describes. ``skew`` puts (local) expert 0 in every unit: the padding of the
    other experts is large."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=f64).to(dtype)
    w = torch.randn(E, D, F, generator=g, dtype=f64).to(dtype)
    if idx is None:
        unit = K if unit is None else unit
        U, E_g = M * K // unit, E // n_groups
        scores = torch.rand(U, E_g, generator=g)
        if skew:
            scores[:, 0] = 2.0
        group_U = torch.arange(U) % n_groups
        idx = (scores.topk(unit, -1).indices + group_U[:, None] * E_g).reshape(M, K)
    gate_dtype = f64 if dtype == f64 else torch.float32
    gates = torch.rand(M, K, generator=g, dtype=gate_dtype) if gated else None
    return x, idx, w, gates


def ref_softmax_attention(logits_BHTS, v_BHSC, pos_q, pos_k, causal, valid_k=None):
    """softmax over the keys a query may see (causal: pos_k <= pos_q; valid_k), then @ V."""
    B, _, T, S = logits_BHTS.shape
    allowed = torch.ones(B, T, S, dtype=torch.bool)
    if causal:
        allowed &= pos_k[:, None, :] <= pos_q[:, :, None]
    if valid_k is not None:
        allowed &= valid_k[:, None, :]
    # A finite fill keeps rows without any visible key finite; those rows are then zeroed.
    logits = logits_BHTS.masked_fill(~allowed[:, None], -1e30)
    nonempty = allowed.any(-1)[:, None, :, None].to(v_BHSC.dtype)
    return (torch.softmax(logits, -1) @ v_BHSC) * nonempty


REF_ACTIVATIONS = {
    "relu": lambda h: torch.clamp(h, min=0),
    "silu": lambda h: h / (1 + torch.exp(-h)),
    "gelu_tanh": lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5
                                                      * (h + 0.044715 * h ** 3))),
}


def ref_expert_mlp(x, idx, w1, w2, gates, activation="relu", b1=None, b2=None):
    """The expert MLP's definition (sigma-MoE, Switch), one (row, expert) pair at a time:
    y[m] = Σ_k gates[m, k] · act(x[m] @ w1[e] (+ b1[e])) @ w2[e] (+ b2) with e = idx[m, k]."""
    act = REF_ACTIVATIONS[activation]
    M, K = idx.shape
    rows = []
    for m in range(M):
        y = x.new_zeros(w2.shape[-1])
        for k in range(K):
            e = int(idx[m, k])
            h = x[m] @ w1[e]
            y = y + gates[m, k].to(x.dtype) * (act(h if b1 is None else h + b1[e]) @ w2[e])
        rows.append(y if b2 is None else y + b2)
    return torch.stack(rows) if M else x.new_zeros(0, w2.shape[-1])


def ref_varlen_expert_mlp(x, gates_ME, w1, w2, w_up=None, activation="relu"):
    """A variable number of experts per row, one (row, expert) pair at a time: y[m] = Σ over the
    e with gates[m, e] != 0 of gates[m, e] · h @ w2[e], h = act(x[m] @ w1[e]) (⊙ x[m] @ w_up[e]
    in the gated form)."""
    act = REF_ACTIVATIONS[activation]
    M, E = gates_ME.shape
    rows = []
    for m in range(M):
        y = x.new_zeros(w2.shape[-1])
        for e in range(E):
            if gates_ME[m, e] != 0:
                h = act(x[m] @ w1[e])
                if w_up is not None:
                    h = h * (x[m] @ w_up[e])
                y = y + gates_ME[m, e].to(x.dtype) * (h @ w2[e])
        rows.append(y)
    return torch.stack(rows) if M else x.new_zeros(0, w2.shape[-1])


def ref_local_heads(x_BTD, w_q, w_k, w_v, w_o, window, rope=True, valid_BT=None):
    """MoSA's local heads, one (sequence, head, query) at a time (module docstring): [B, T, D].
    A padded key is never attended to; a padded query attends to itself."""
    import math

    B, T, D = x_BTD.shape
    H, _, C = w_q.shape
    out = torch.zeros_like(x_BTD)
    pos = torch.arange(T)
    for b in range(B):
        for h in range(H):
            q, k, v = x_BTD[b] @ w_q[h], x_BTD[b] @ w_k[h], x_BTD[b] @ w_v[h]
            if rope:
                n = C - C % 2
                q = ref_rope(q[None, None], pos[None], n)[0, 0]
                k = ref_rope(k[None, None], pos[None], n)[0, 0]
            rows = []
            for i in range(T):
                js = [j for j in range(i + 1) if j // window >= i // window - 1
                      and (valid_BT is None or valid_BT[b, j] or j == i)]
                logits = torch.stack([q[i] @ k[j] for j in js]) / math.sqrt(C)
                rows.append(torch.softmax(logits, -1) @ v[js])
            out[b] = out[b] + torch.stack(rows) @ w_o[h]
    return out


def ref_remoe_l1(route_ME, k):
    """ReMoE's load-balanced L1 regulariser (Sec. 3) of the ReLU outputs [T, E] at target
    k: Σ_e f_e · (1/T) Σ_t R_te, f_e = E / (k · T) · (tokens with R_te > 0); f_e is a count
    (no gradient)."""
    T, E = route_ME.shape
    total = route_ME.new_zeros(())
    for e in range(E):
        f_e = E / (k * T) * float((route_ME[:, e] > 0).sum())
        total = total + f_e * route_ME[:, e].sum() / T
    return total


def ref_remoe_coef_update(lam, sparsity, k, E, alpha):
    """ReMoE's adaptive coefficient update (Sec. 3): lambda · alpha if the sparsity is below
    1 - k/E, else lambda / alpha."""
    return lam * alpha if sparsity < 1 - k / E else lam / alpha


# ---------------------------------------------------------------------------- tiny corpora

def english_corpus(path, n_sentences=1500, seed=0):
    """A small English-like corpus (subject verb object.) with enough structure for a tiny model
    to learn in a few dozen steps."""
    import random

    rng = random.Random(seed)
    subj = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child"]
    verb = ["sees", "likes", "finds", "wants", "hears", "follows"]
    obj = ["the ball", "a red apple", "the small house", "her friend", "the river", "a book"]
    path.write_text("\n".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}."
                              for _ in range(n_sentences)) + "\n")
    return path


def word_soup_corpus(path, n_lines=800, seed=1):
    """Lines of eight words drawn uniformly from eight: a corpus with almost no structure."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "tau", "rho"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(8))
                              for _ in range(n_lines)) + "\n")
    return path


def assert_same_outputs_and_gradients(y, y_ref, x, x_ref, params, refs):
    """The fast path's output ``y`` equals ``y_ref``, and under one random output gradient so do
    the input's (``x`` against its clone ``x_ref``) and every parameter's (against its clone)."""
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.grad, r.grad)


# ---------------------------------------------------------------------------- MoH

def ref_moh_gates(x_D, q_HC, *, n_shared, k, router="learned", weights="authors", w_r=None,
                  w_s=None, w_h=None):
    """MoH's routing scores g_i of one token (Jin et al. 2025, arXiv 2410.11842v3, Sec. 3.2):
    Eq. 5 g_i = α1 Softmax(W_s x)_i for the h_s shared heads, α2 Softmax(W_r x)_{i-h_s} for
    the Top-K routed heads, 0 for the others; Eq. 6 [α1, α2] = Softmax(W_h x).
    ``weights="authors"`` applies the authors' code's factors on top: routed gates renormalised
    over the Top-K and times K, shared times h_s, α times 2 (h_s = 1: the shared softmax is 1).
    ``router="query_norm"`` (Sec. 4.4, as their MoH-LLaMA3 code computes it): routed head
    scores ‖q_i‖ / std(‖q‖), gates quantised to 1 for the shared and the Top-K heads (Eq. 9),
    a Top-K head's gate with the gradient of its softmax probability (Eq. 10, straight-through). Returns (g [H], the routed softmax
    [R], the Top-K set)."""
    H = q_HC.shape[0]
    R = H - n_shared
    g = [0.0] * H
    probs, chosen = None, []
    if R:
        if router == "query_norm":
            norms = torch.stack([q_HC[n_shared + i].norm() for i in range(R)])
            scores = norms / norms.std()
        else:
            scores = torch.stack([w_r[i] @ x_D for i in range(R)])
        probs = torch.softmax(scores, 0)
        chosen = sorted(range(R), key=lambda i: (-float(probs[i].detach()), i))[:k]
        kept_sum = sum(probs[i] for i in chosen)
        for i in chosen:
            if router == "query_norm":
                g[n_shared + i] = 1 + (probs[i] - probs[i].detach())  # Eqs. 9-10
            elif weights == "authors":
                g[n_shared + i] = probs[i] / kept_sum * k
            else:
                g[n_shared + i] = probs[i]
    if n_shared:
        if router == "learned" and n_shared > 1:
            s = torch.softmax(torch.stack([w_s[i] @ x_D for i in range(n_shared)]), 0)
        else:
            s = torch.ones(n_shared, dtype=x_D.dtype)
        for i in range(n_shared):
            g[i] = s[i] * (n_shared if router == "learned" and weights == "authors" else 1)
    if router == "learned" and n_shared and R:
        alpha = torch.softmax(torch.stack([w_h[0] @ x_D, w_h[1] @ x_D]), 0)
        if weights == "authors":
            alpha = alpha * 2
        g = [g[i] * (alpha[0] if i < n_shared else alpha[1]) for i in range(H)]
    return torch.stack([torch.as_tensor(v, dtype=x_D.dtype) for v in g]), probs, chosen


def ref_moh(x_BTD, w_q_HDC, w_k_GDC, w_v_GDC, w_o_HCD, *, n_shared, k, router="learned",
            weights="authors", w_r=None, w_s=None, w_h=None, n_rot=0, causal=True,
            b_q=None, b_k=None, b_v=None, b_o=None):
    """MoH attention (Eq. 4): y_t = Σ_i g_i H^i_t W_O^i (+ b_O), every head H^i the causal (or
    bidirectional) softmax attention of its own query over key/value head i // (H / G) (G key /
    value heads), RoPE on the first ``n_rot`` channels, gates from ``ref_moh_gates`` one token
    at a time; and the authors' load-balance loss E Σ_i f_i P_i over the routed heads (Eq. 7
    times E; f_i the fraction of tokens choosing head i, P_i the mean routed softmax), before
    β (Eq. 8). Returns (y, loss or None)."""
    B, T, D = x_BTD.shape
    H, _, C = w_q_HDC.shape
    G = w_k_GDC.shape[0]
    pos = torch.arange(T).expand(B, T)
    heads, queries = [], []
    for i in range(H):
        j = i // (H // G)
        q = x_BTD @ w_q_HDC[i] + (0 if b_q is None else b_q[i])
        kk = x_BTD @ w_k_GDC[j] + (0 if b_k is None else b_k[j])
        v = x_BTD @ w_v_GDC[j] + (0 if b_v is None else b_v[j])
        queries.append(q)
        qr = ref_rope(q[:, None], pos, n_rot)[:, 0] if n_rot else q
        kr = ref_rope(kk[:, None], pos, n_rot)[:, 0] if n_rot else kk
        logits = (qr @ kr.transpose(1, 2))[:, None] / C ** 0.5
        heads.append(ref_softmax_attention(logits, v[:, None], pos, pos, causal)[:, 0])
    y = torch.zeros_like(x_BTD)
    R = H - n_shared
    f = torch.zeros(R, dtype=x_BTD.dtype)
    P = torch.zeros(R, dtype=x_BTD.dtype)
    for b in range(B):
        for t in range(T):
            q_HC = torch.stack([queries[i][b, t] for i in range(H)])
            g, probs, chosen = ref_moh_gates(x_BTD[b, t], q_HC, n_shared=n_shared, k=k,
                                             router=router, weights=weights, w_r=w_r, w_s=w_s,
                                             w_h=w_h)
            for i in range(H):
                y[b, t] = y[b, t] + g[i] * (heads[i][b, t] @ w_o_HCD[i])
            if R:
                P = P + probs / (B * T)
                for i in chosen:
                    f[i] += 1.0 / (B * T)
    if b_o is not None:
        y = y + b_o
    return y, (R * (f * P).sum() if R else None)


def ref_switchhead_selection_init(w_XD):
    """SwitchHead's selection-matrix initialisation as the authors' code defines it
    (``SwitchHeadCore.renorm_rows``, github.com/RobertCsordas/moeut; arXiv 2312.07987), one row
    at a time: row i is its unit vector u_i times its own unbiased standard deviation s_i,
    divided by the unbiased standard deviation of the matrix of unit vectors."""
    X, D = w_XD.shape
    units, stds = [], []
    for i in range(X):
        row = w_XD[i]
        mean = row.sum() / D
        stds.append((((row - mean) ** 2).sum() / (D - 1)).sqrt())
        units.append(row / (row * row).sum().sqrt())
    u = torch.stack(units)
    mu = u.sum() / (X * D)
    sigma = (((u - mu) ** 2).sum() / (X * D - 1)).sqrt()
    return torch.stack([units[i] * stds[i] / sigma for i in range(X)])


def ref_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_prenorm_block(x_TD, pos_T, p, n_heads, n_rot, kv=None):
    """The pre-LN block of the module docstring on one sequence. ``p``: ln1 / ln2 (weight,
    bias), w_q, w_k, w_v [D, H·C] and w_o [H·C, D] (x @ w), w1 [F, D], b1, w2 [D, F], b2.
    ``kv``: (k_HSC, v_HSC, pos_S) to attend to instead of the block's own keys and values
    (recursive KV sharing). Returns (out_TD, the (k, v, pos) attended to)."""
    T, _ = x_TD.shape
    C = p["w_q"].shape[1] // n_heads
    h = ref_layer_norm(x_TD, *p["ln1"])

    def heads(w):
        return (h @ w).view(T, n_heads, C).transpose(0, 1)

    q = ref_rope(heads(p["w_q"])[None], pos_T[None], n_rot)[0]
    if kv is None:
        kv = (ref_rope(heads(p["w_k"])[None], pos_T[None], n_rot)[0], heads(p["w_v"]), pos_T)
    k, v, pos_S = kv
    logits = q @ k.transpose(-1, -2) / math.sqrt(C)
    a = ref_softmax_attention(logits[None], v[None], pos_T[None], pos_S[None], True)[0]
    x = x_TD + a.transpose(0, 1).reshape(T, n_heads * C) @ p["w_o"]
    u = torch.clamp(ref_layer_norm(x, *p["ln2"]) @ p["w1"].t() + p["b1"], min=0)
    return x + u @ p["w2"].t() + p["b2"], kv


def ref_shared_kv_stack(params, n_heads, n_rot):
    """The shared stack ``f(x_1KD, pos_1K, r)`` of ``ref_mor_expert`` / ``ref_mor_token`` under
    recursive KV sharing: step 0 runs ``ref_prenorm_block`` on its tokens (every token of the
    sequence) and keeps each block's keys and values; a later step's blocks attend to those.
    Called one sequence at a time, step 0 first (as both references do)."""
    kept = {}

    def f(x_1KD, pos_1K, r):
        x, pos = x_1KD[0], pos_1K[0]
        for j, p in enumerate(params):
            x, kv = ref_prenorm_block(x, pos, p, n_heads, n_rot, None if r == 0 else kept[j])
            if r == 0:
                kept[j] = kv
        return x[None]
    return f


def ref_mor_expert(x_BTD, w_ND, f, betas, gate="sigmoid", alpha=0.1, valid_BT=None):
    """Mixture-of-Recursions expert-choice routing, one sequence and one step at a time.
    ``f(x_1KD, pos_1K, r)`` is the shared stack as step r. Returns (out, the summed auxiliary
    BCE over the steps, [kept position lists per step and row])."""
    B, T, _ = x_BTD.shape
    rows, bce, kept = [], 0.0, []
    losses = [[] for _ in betas]  # per step: (row's BCE sum, row's candidates)
    for b in range(B):
        n = T if valid_BT is None else int(valid_BT[b].sum())
        h = x_BTD[b, :n]
        cand = list(range(n))
        kept_b = []
        for r, beta in enumerate(betas):
            logit = h @ w_ND[r]
            g = alpha * torch.sigmoid(logit) if gate == "sigmoid" else alpha * torch.tanh(logit)
            k = max(1, int(beta * n))
            order = sorted(cand, key=lambda t: (-float(g[t].detach()), t))
            sel = sorted(order[:k])
            y = f(h[sel][None], torch.tensor(sel)[None], r)[0]
            target = torch.tensor([1.0 if t in sel else 0.0 for t in cand], dtype=h.dtype)
            z = logit[cand]
            # BCE with logits, written out: max(z, 0) - z y + log(1 + exp(-|z|))
            term = (z.clamp_min(0) - z * target + torch.log1p(torch.exp(-z.abs()))).sum()
            losses[r].append((term, len(cand)))
            upd = h.clone()
            upd[sel] = h[sel] + g[sel][:, None] * y
            h, cand = upd, sel
            kept_b.append(sel)
        rows.append(torch.cat([h, x_BTD[b, n:]], 0))
        kept.append(kept_b)
    for per_row in losses:
        bce = bce + sum(t for t, _ in per_row) / sum(c for _, c in per_row)
    return torch.stack(rows), bce, kept


def ref_mor_token(x_BTD, w_ND, f, gate="softmax", alpha=1.0, bias_N=None):
    """Mixture-of-Recursions token-choice routing, one sequence at a time. ``f(x_1KD, pos_1K, r)``
    is the shared stack as step r; ``bias_N`` the loss-free balancing bias, added to the
    probabilities for the argmax only. Returns (out, balance loss, z-loss, depth_BT)."""
    B, T, _ = x_BTD.shape
    N = w_ND.shape[0]
    logits = x_BTD @ w_ND.t()
    probs = alpha * (torch.softmax(logits, -1) if gate == "softmax" else torch.sigmoid(logits))
    depth = probs.argmax(-1) if bias_N is None else (probs + bias_N).argmax(-1)
    rows = []
    for b in range(B):
        h = x_BTD[b].clone()
        out = x_BTD[b].clone()
        for r in range(N):
            run = [t for t in range(T) if int(depth[b, t]) >= r]
            if not run:
                continue
            y = f(h[run][None], torch.tensor(run)[None], r)[0]
            h = h.clone()
            out = out.clone()
            for j, t in enumerate(run):
                if int(depth[b, t]) == r:
                    out[t] = x_BTD[b, t] + probs[b, t, r] * y[j]
                else:
                    h[t] = y[j]
        rows.append(out)
    share = torch.stack([(depth == i).double().mean() for i in range(N)])
    balance = N * (share * probs.reshape(-1, N).mean(0)).sum()
    zl = torch.logsumexp(logits, -1).square().mean()
    return torch.stack(rows), balance, zl, depth
