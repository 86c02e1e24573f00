"""Mixture of Sparse Attention (MoSA; Piękos, Csordás, Schmidhuber 2025, arXiv 2505.00315, §2.2).

Every MoSA head h is an expert-choice router over the tokens of the sequence: it picks k of the T
tokens and attends among those only, so a head costs O(k² + T) instead of O(T²). Per head, for a
sequence X ∈ R^{T×d} (the paper's notation; Sec. 2.2 numbers only Eqs. 1-3, the other steps
are its unnumbered displays, cited by what they define):

    r        = σ(X W_r)                      ∈ R^T     router scores, sigmoid (Sec. 2.2; float32)
    r_s, I   = TopK(r, k)                             expert choice, k = T / ρ (Sec. 2.2, 3.2)
    X_s      = X[I]                          ∈ R^{k×d} the selected tokens (Sec. 2.2)
    Q, K, V  = X_s W_Q, X_s W_K, X_s W_V     ∈ R^{k×h'} as in MHA (Sec. 2.1)
    M_ij     = 0 if I_i ≥ I_j else -∞                 causality by ORIGINAL position (Sec. 2.2)
    A        = softmax((Q Kᵀ + M) / sqrt(h')) V       Eq. 1
    Y_s      = diag(r_s) A W_O               ∈ R^{k×d} router score multiplies the output (X^o)
    Y        = scatter(Y_s, I) ∈ R^{T×d}              zero at the tokens the head did not pick

and the layer's output is the sum of its heads' Y (Eq. 3, as MHA's Eq. 2 sums its heads), plus
the dense heads' (below). The router score in the output is what trains W_r (``w_router``
[H, D]; the TopK itself has no gradient; Sec. 2.2 gives the scaling this purpose). RoPE
rotates Q and K by the original positions I, half of each head's channels (Sec. 2.2,
"Positional encodings"; moeify's ``rope_fraction`` 0.5 default). k = T // ρ clamped
to [2, T]: the paper's k = max(⌊T/ρ⌋, 2) (Sec. 3.5) and the authors' code. With
``include_first`` the first token is always selected: the paper's IsoFLOP models (Sec. 3.2)
select the first token and the k - 1 best-scored others, the first token's output scaled by its
router score like the rest (off by default, as the authors' ``include_first=0``).
tests/layers/test_mosa.py checks the layer in float64 against a transcription of these steps,
head by head; the layer follows them with no deviation found.

Hybrid: the paper's MoSA models keep a few dense heads beside the sparse ones (Sec. 2.2,
"Hybridization": 4 in its main experiments, App. B; the authors' ``MoSA(num_mosa_heads,
num_other_heads, hybrid_type="dense" | "local")``).
``n_dense_heads`` adds that many ordinary RoPE heads (a DenseAttention of the same d_head) whose
output is added.

Local hybrid (the paper's long-sequence setting, Sec. 3.4: local attention heads beside the MoSA
heads, so that no head is quadratic in T; the authors' ``hybrid_type="local"``):
``n_local_heads`` adds that many local heads with window w = ``local_window`` (the authors' w =
T_train // ρ, the tokens a MoSA head keeps). As the authors' code runs them (the
``local-attention`` package's ``LocalAttention(dim=h', window_size=w, causal=True)`` with its
defaults), the sequence is cut into blocks of w positions, and a query at position i attends to
the keys j <= i of its own block and of the block before (j // w >= i // w - 1): between w and
2w - 1 keys, never fewer than the last w tokens. Softmax scale 1/sqrt(h'), every channel
rotated by RoPE (the package's rotary embedding over the whole head, base 10000; ``pos="none"``:
no rotation), own W_Q, W_K, W_V, W_O per head, no router: the output is added to the MoSA and
dense heads'. Blocks are counted from position 0, so any T works (the package asserts T a
multiple of w; for such T the two are identical). The attention runs blocked, O(T·w) per head:
each block's w queries against its 2w keys.

Padding (``valid_k``): padded tokens are never selected and k is computed from each row's number
of valid tokens, so a right-padded sequence routes exactly as it would alone.

Decoding. The TopK over the sequence looks at tokens that come later, so a full forward pass is
not causal in its routing (as Mixture-of-Depths, layers/depth.py). moeify defines decoding with
MoSA as *prefix routing*: the output at position t is the output the full forward pass would
give at position t on the prefix x_0..x_t alone, i.e. each new token re-runs every head's TopK
over the router scores of all tokens so far (with k = (t+1) // ρ) and the new token contributes
only if its head selected it; it then attends to the selected tokens of the prefix. The cache
keeps every token's router score, its rotated key and its value (a token dropped now may be
selected later, when k has grown), so this definition does not shrink the KV cache; the paper's
smaller KV cache (Sec. 3.3, KV = T·H_dense + k·H_mosa) is a property of a fixed selection that
this definition does not make. Decoding equals the full forward of each prefix
(tests/layers/test_mosa.py), not the full forward of the whole sequence at earlier positions. In
a model of several layers, the earlier positions' outputs a later layer reads were computed when
those positions were last: decoding is then the causal model in which every MoSA layer routes
each position on its own prefix, independent of how the tokens are chunked
(tests/models/test_mosa_presets.py); it is not the teacher-forced full forward, whose routing
sees later tokens (as with Mixture-of-Depths).

Initialisation (deviation): W_Q, W_K, W_V and the router N(0, s²/d), W_O N(0, s²/((H +
H_dense + H_local)·h')) with s = sqrt(2/L), as SwitchHead's in this library (the fan-in of W_O
counts a hybrid's dense and local heads, whose outputs are added to the MoSA heads'; the local
heads are initialised the same way); the authors' code draws
uniform weights (±1/sqrt(3h') for QKV, ±1/sqrt(H·d) for O, PyTorch's Linear default for the
router). A hybrid's dense heads are a DenseAttention and keep the dense baseline's
initialisation (trunc-normal, std s/sqrt(fan_in), their W_O's fan-in H_dense·h' alone), not
the authors' uniform one either.

Shape legend: B batch, T tokens, S cached tokens, D d_model, H MoSA heads, K selected tokens per
head (k), C d_head (h').
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeify.layers.attention import DenseAttentionConfig, check_inputs
from moeify.layers.attention_core import check_core_fields
from moeify.layers.common import Aux, check_count, check_positive, init_scale
from moeify.ops.positional import apply_rope, rope_dims
from moeify.ops.routing import selection_logits, top_indices


def tokens_kept(T: int, sparsity: int) -> int:
    """k = T // ρ, at least 2 and at most T (the paper's max(⌊T/ρ⌋, 2), Sec. 3.5, and the
    authors' code): the tokens each MoSA head keeps of T."""
    return min(max(T // sparsity, 2), T)


def masked_attention(q, k, v, allowed, impl: str):
    """softmax(Q Kᵀ / sqrt(h') + M) V, M = 0 where ``allowed`` else -inf (broadcast over the
    leading dimensions): SDPA, or the explicit softmax for ``impl="reference"``."""
    if impl == "reference":
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@torch.no_grad()
def init_heads(c: "MoSAConfig", inputs: tuple[torch.Tensor, ...], w_o: torch.Tensor) -> None:
    """The initialisation of MoSA's and the local heads' weights (module docstring): ``inputs``
    (routers and W_Q, W_K, W_V, in that order) N(0, s²/d), ``w_o`` N(0, s²/((H + H_dense +
    H_local)·h')), s = sqrt(2 / L)."""
    s = init_scale(c.n_layers)
    for w in inputs:
        w.normal_(0.0, s / math.sqrt(c.d_model))
    w_o.normal_(0.0, s / math.sqrt((c.n_heads + c.n_dense_heads + c.n_local_heads) * c.d_head))


@dataclass(frozen=True, kw_only=True)
class MoSAConfig:
    """MoSA attention: ``n_heads`` sparse heads of width ``d_head``, each keeping k = T //
    ``sparsity`` tokens (at least 2), plus ``n_dense_heads`` dense RoPE heads (the paper's
    hybrid; 0 = pure MoSA) and ``n_local_heads`` local heads of window ``local_window`` (the
    long-sequence hybrid, Sec. 3.4; module docstring). ``pos``: "rope" (the paper's) or "none".
    ``n_layers``: model depth L
    for the init scale s = sqrt(2 / L)."""

    d_model: int
    n_heads: int
    d_head: int
    sparsity: int
    n_dense_heads: int = 0
    include_first: bool = False
    pos: str = "rope"
    rope_fraction: float = 0.5
    rope_base: float = 10000.0
    n_layers: int = 1
    attn_dropout: float = 0.0
    attn_impl: str = "auto"
    n_local_heads: int = 0
    local_window: int = 0

    def __post_init__(self) -> None:
        check_positive(self, "d_model", "n_heads", "d_head", "sparsity", "n_layers")
        check_count(self, "n_local_heads", "local_window")
        if self.n_local_heads and not self.local_window:
            raise ValueError("MoSAConfig.local_window must be positive with local heads: the "
                             "paper's window is the training context // sparsity")
        check_core_fields(self, ("rope", "none"))
        if self.attn_dropout != 0.0:
            raise ValueError("MoSAConfig.attn_dropout: attention dropout is not implemented "
                             "for MoSA heads (the paper uses none); set it to 0")
        check_count(self, "n_dense_heads")

    def dense_config(self) -> DenseAttentionConfig | None:
        if not self.n_dense_heads:
            return None
        return DenseAttentionConfig(d_model=self.d_model, n_heads=self.n_dense_heads,
                                    d_head=self.d_head, pos=self.pos, n_layers=self.n_layers,
                                    rope_fraction=self.rope_fraction, rope_base=self.rope_base,
                                    attn_impl=self.attn_impl)

    def tokens_kept(self, T: int) -> int:
        """k of T tokens per head (``tokens_kept``)."""
        return tokens_kept(T, self.sparsity)

    def param_count(self) -> int:
        """Per MoSA head: the router row (d), W_Q, W_K, W_V (d·h' each), W_O (h'·d); plus the
        dense and local heads' 4·d·h' each."""
        D, H, C = self.d_model, self.n_heads, self.d_head
        return H * (D + 4 * D * C) + 4 * D * (self.n_dense_heads + self.n_local_heads) * C

    def build(self) -> "MoSAAttention":
        return MoSAAttention(self)


class MoSACache:
    """Decoding state of one MoSA layer: every token's router scores [B, H, S] (float32), rotated
    keys and values [B, H, S, C], positions [B, S], validity [B, S]; and the dense heads'
    KVCache. Concatenates on append (decoding is a handful of tokens per call)."""

    def __init__(self, dense_cache=None) -> None:
        self.scores = self.keys = self.values = self.positions = self.valid = None
        self.dense = dense_cache
        # the local heads' rotated keys and values [B, H_local, S, C] (the positions and
        # validity above are shared)
        self.local_keys = self.local_values = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, scores, keys, values, positions, valid) -> None:
        if self.positions is None:
            self.scores, self.keys, self.values = scores, keys, values
            self.positions, self.valid = positions, valid
            return
        self.scores = torch.cat([self.scores, scores], -1)
        self.keys = torch.cat([self.keys, keys], -2)
        self.values = torch.cat([self.values, values], -2)
        self.positions = torch.cat([self.positions, positions], -1)
        self.valid = torch.cat([self.valid, valid], -1)


class MoSAAttention(nn.Module):
    """The attention interface of every moeify attention (docs/interfaces.md), self-attention
    only: no kv input (no XL memory, no cross-attention), causal."""

    def __init__(self, config: MoSAConfig):
        super().__init__()
        self.config = c = config
        D, H, C = c.d_model, c.n_heads, c.d_head
        # Names: moeify.layers.common (the naming convention); registration order kept.
        self.w_router = nn.Parameter(torch.empty(H, D))  # [H, D]: head h's token router
        self.w_q = nn.Parameter(torch.empty(H, D, C))
        self.w_k = nn.Parameter(torch.empty(H, D, C))
        self.w_v = nn.Parameter(torch.empty(H, D, C))
        self.w_o = nn.Parameter(torch.empty(H, C, D))
        dense = c.dense_config()
        self.dense = None if dense is None else dense.build()
        self.local = LocalHeads(c) if c.n_local_heads else None
        self.n_rot = rope_dims(C, c.rope_fraction) if c.pos == "rope" else 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_heads(self.config, (self.w_router, self.w_q, self.w_k, self.w_v), self.w_o)
        if self.local is not None:
            self.local.reset_parameters()

    def new_cache(self) -> MoSACache:
        return MoSACache(None if self.dense is None else self.dense.new_cache())

    def param_count(self) -> int:
        return self.config.param_count()

    # ------------------------------------------------------------------------------------------

    def _scores(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """r = σ(X W_r) per head, float32 [B, H, T]: the logits as SwitchHead's selection (in
        the input's precision, float32 under autocast), the sigmoid in float32."""
        B, T, D = x_BTD.shape
        logits_MH = selection_logits(x_BTD.reshape(B * T, D), self.w_router)
        return torch.sigmoid(logits_MH.float()).view(B, T, -1).transpose(1, 2)

    def _select(self, r_BHS: torch.Tensor, valid_BS: torch.Tensor | None):
        """Each head's TopK over the S tokens: idx_BHK (K = k(S)) and keep_BHK (False for the
        columns beyond a row's own k, computed from its valid tokens, and for padding). Ties go
        to the lowest position (moeify.ops.routing.top_indices)."""
        c = self.config
        B, H, S = r_BHS.shape
        K = c.tokens_kept(S)
        ranked = r_BHS.detach()
        if c.include_first:
            ranked = ranked.clone()
            ranked[..., 0] = float("inf")
        if valid_BS is not None:
            ranked = ranked.masked_fill(~valid_BS[:, None, :], float("-inf"))
        idx_BHK = top_indices(ranked, K)
        if valid_BS is None:
            return idx_BHK, None
        n_B = valid_BS.sum(-1)
        k_B = torch.minimum(torch.clamp(n_B // c.sparsity, min=2), n_B)
        keep_BHK = (torch.arange(K, device=r_BHS.device) < k_B[:, None, None]) & \
            valid_BS[:, None, :].expand(B, H, S).gather(-1, idx_BHK)
        return idx_BHK, keep_BHK

    def _project(self, x_BTD, idx_BHK, pos_BT):
        """Q, K, V of the selected tokens [B, H, K, C], Q and K rotated by their positions."""
        c = self.config
        B, H, K = idx_BHK.shape
        xs_BHKD = x_BTD.gather(1, idx_BHK.reshape(B, H * K, 1).expand(-1, -1, c.d_model)
                               ).view(B, H, K, c.d_model)
        q, k, v = (torch.einsum("bhkd,hdc->bhkc", xs_BHKD, w)
                   for w in (self.w_q, self.w_k, self.w_v))
        if self.n_rot:
            pos_BHK = pos_BT.gather(1, idx_BHK.reshape(B, H * K)).view(B * H, K)
            q, k = (apply_rope(t.reshape(B * H, 1, K, c.d_head), pos_BHK, n_rot=self.n_rot,
                               base=c.rope_base).view(B, H, K, c.d_head) for t in (q, k))
        return q, k, v

    def _attend(self, q, k, v, allowed):
        """softmax(Q Kᵀ / sqrt(h') + M) V over the selected tokens; ``allowed`` [B, H, Tq, Tk]."""
        return masked_attention(q, k, v, allowed, self.config.attn_impl)

    def forward(self, q_BTD, kv_BSD=None, *, causal=True, cache=None, pos_q=None, pos_k=None,
                valid_k=None):
        """``aux.stats["selected_fraction"]``: the fraction of (token, MoSA head) pairs selected
        (k / T without padding); ``["covered_fraction"]``: the fraction of tokens at least one
        sparse head selected. The dense heads' output is added. Decoding returns no stats."""
        c = self.config
        if kv_BSD is not None or not causal:
            raise ValueError("MoSA is causal self-attention: it takes no kv input (no XL "
                             "memory, no cross-attention) and causal=True")
        check_inputs(q_BTD, None, c.d_model)
        B, T, _ = q_BTD.shape
        if pos_q is None:
            past = 0 if cache is None else len(cache)
            pos_q = torch.arange(past, past + T, device=q_BTD.device).expand(B, T)
        dense_cache = None if cache is None else cache.dense
        dense_BTD = None if self.dense is None else self.dense(
            q_BTD, None, causal=True, cache=dense_cache, pos_q=pos_q, pos_k=pos_q,
            valid_k=valid_k)[0]
        if self.local is not None:
            local_BTD = (self.local(q_BTD, pos_q, valid_k) if cache is None
                         else self.local.decode(q_BTD, pos_q, valid_k, cache))
            dense_BTD = local_BTD if dense_BTD is None else dense_BTD + local_BTD
        r_BHT = self._scores(q_BTD)
        if cache is not None:
            y_BTD = self._decode(q_BTD, r_BHT, pos_q, valid_k, cache)
            return (y_BTD if dense_BTD is None else y_BTD + dense_BTD), Aux()

        idx_BHK, keep_BHK = self._select(r_BHT, valid_k)
        q, k, v = self._project(q_BTD, idx_BHK, pos_q)
        H, K = idx_BHK.shape[1:]
        pos_BHK = pos_q.gather(1, idx_BHK.reshape(B, H * K)).view(B, H, K)
        # M: causal by original position; the diagonal always, so no row is empty
        allowed = pos_BHK[..., None, :] <= pos_BHK[..., :, None]
        if keep_BHK is not None:
            allowed = (allowed & keep_BHK[..., None, :]) | torch.eye(
                K, dtype=torch.bool, device=q_BTD.device)
        gate_BHK = r_BHT.gather(-1, idx_BHK)  # r_s: the router's gradient flows through it
        if keep_BHK is not None:
            gate_BHK = gate_BHK * keep_BHK
        a_BHKC = self._attend(q, k, v, allowed) * gate_BHK[..., None].to(q.dtype)
        ys_BHKD = torch.einsum("bhkc,hcd->bhkd", a_BHKC, self.w_o)
        # Y = scatter(Y_s, I), summed over heads, then the dense and local heads' output added
        # (under autocast the two may differ in dtype; the sum promotes)
        y_BTD = ys_BHKD.new_zeros(B, T, c.d_model).scatter_add(
            1, idx_BHK.reshape(B, H * K, 1).expand(-1, -1, c.d_model),
            ys_BHKD.reshape(B, H * K, c.d_model))
        if dense_BTD is not None:
            y_BTD = y_BTD + dense_BTD
        return y_BTD, self._selection_stats(idx_BHK, keep_BHK, valid_k, T)

    @staticmethod
    def _selection_stats(idx_BHK, keep_BHK, valid_BT, T: int) -> Aux:
        """forward's ``selected_fraction`` and ``covered_fraction`` (valid tokens only)."""
        aux = Aux()
        B, H, K = idx_BHK.shape
        with torch.no_grad():
            n_sel = K * B * H if keep_BHK is None else keep_BHK.sum()
            n_all = B * T * H if valid_BT is None else valid_BT.sum() * H
            aux.stats["selected_fraction"] = torch.as_tensor(n_sel / n_all, dtype=torch.float32)
            # tokens that at least one sparse head selected (the others get only the dense
            # heads' output, or none)
            picked_BT = torch.zeros(B, T, dtype=torch.bool, device=idx_BHK.device).scatter_(
                1, idx_BHK.reshape(B, H * K),
                True if keep_BHK is None else keep_BHK.reshape(B, H * K))
            n_tok = B * T if valid_BT is None else valid_BT.sum()
            aux.stats["covered_fraction"] = (picked_BT.sum() / n_tok).float()
        return aux

    def _decode(self, x_BTD, r_BHT, pos_BT, valid_BT, cache: MoSACache) -> torch.Tensor:
        """Prefix routing (module docstring): token by token, append the token's score, rotated
        key and value, re-run each head's TopK over the prefix, and attend if selected."""
        c = self.config
        B, T, D = x_BTD.shape
        H = c.n_heads
        x_BHTD = x_BTD[:, None].expand(B, H, T, D)
        q, k, v = (torch.einsum("bhtd,hdc->bhtc", x_BHTD, w)
                   for w in (self.w_q, self.w_k, self.w_v))
        if self.n_rot:
            q, k = (apply_rope(t, pos_BT, n_rot=self.n_rot, base=c.rope_base) for t in (q, k))
        valid = (torch.ones(B, T, dtype=torch.bool, device=x_BTD.device) if valid_BT is None
                 else valid_BT.bool())
        outs = []
        for t in range(T):
            cache.append(r_BHT[..., t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                         pos_BT[:, t:t + 1], valid[:, t:t + 1])
            S = len(cache)
            idx_BHK, keep_BHK = self._select(cache.scores, cache.valid)
            chosen_BHK = idx_BHK == S - 1  # is the new token among its head's selection?
            if keep_BHK is not None:
                chosen_BHK &= keep_BHK
            selected_BH = chosen_BHK.any(-1)
            sel_mask_BHS = torch.zeros_like(cache.scores, dtype=torch.bool).scatter(
                -1, idx_BHK, True if keep_BHK is None else keep_BHK)
            sel_mask_BHS[..., S - 1] = True  # its own key (harmless when not selected: gated)
            a_BHC = self._attend(q[:, :, t:t + 1], cache.keys, cache.values,
                                 sel_mask_BHS[:, :, None, :])[:, :, 0]
            gate_BH = r_BHT[..., t] * selected_BH
            outs.append(torch.einsum("bhc,hcd->bd", a_BHC * gate_BH[..., None].to(a_BHC.dtype),
                                     self.w_o))
        return torch.stack(outs, 1)


class LocalHeads(nn.Module):
    """The local heads of MoSA's long-sequence hybrid (module docstring): per head own W_Q, W_K,
    W_V [H_l, D, C] and W_O [H_l, C, D]; a query at position i attends to the keys j <= i with
    j // w >= i // w - 1 (w = ``local_window``), every channel rotated by RoPE."""

    def __init__(self, config: MoSAConfig):
        super().__init__()
        self.config = c = config
        Hl, D, C = c.n_local_heads, c.d_model, c.d_head
        self.w_q = nn.Parameter(torch.empty(Hl, D, C))
        self.w_k = nn.Parameter(torch.empty(Hl, D, C))
        self.w_v = nn.Parameter(torch.empty(Hl, D, C))
        self.w_o = nn.Parameter(torch.empty(Hl, C, D))
        self.n_rot = C - C % 2 if c.pos == "rope" else 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_heads(self.config, (self.w_q, self.w_k, self.w_v), self.w_o)

    def _qkv(self, x_BTD, pos_BT):
        q, k, v = (torch.einsum("btd,hdc->bhtc", x_BTD, w) for w in (self.w_q, self.w_k,
                                                                       self.w_v))
        if self.n_rot:
            q, k = (apply_rope(t, pos_BT, n_rot=self.n_rot, base=self.config.rope_base)
                    for t in (q, k))
        return q, k, v

    def forward(self, x_BTD, pos_BT, valid_BT=None):
        """[B, T, D]: the blocked local attention (w queries of a block against the 2w keys of
        it and the block before), O(T·w) per head. Positions are taken as 0..T-1 (the layer's
        full forward); a padded key is never attended to, a padded query only to itself."""
        c = self.config
        B, T, D = x_BTD.shape
        w = c.local_window
        q, k, v = self._qkv(x_BTD, pos_BT)
        Hl, C = q.shape[1], q.shape[-1]
        nb = -(-T // w)
        pad = nb * w - T
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        qb = q.view(B, Hl, nb, w, C)
        kb, vb = (torch.cat([F.pad(t.view(B, Hl, nb, w, C), (0, 0, 0, 0, 1, 0))[:, :, :-1],
                             t.view(B, Hl, nb, w, C)], 3) for t in (k, v))  # [B, Hl, nb, 2w, C]
        i = torch.arange(w, device=x_BTD.device)
        j = torch.arange(2 * w, device=x_BTD.device)
        blk = torch.arange(nb, device=x_BTD.device)
        key_pos = (blk[:, None] - 1) * w + j  # [nb, 2w]
        q_pos = blk[:, None] * w + i  # [nb, w]
        allowed = ((key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos[:, None, :] >= 0)
                   & (key_pos[:, None, :] < T))  # [nb, w, 2w]
        if valid_BT is not None:
            vk = F.pad(valid_BT.bool(), (w, pad))  # key validity by look-around position
            vk = vk.unfold(1, 2 * w, w)  # [B, nb, 2w]
            allowed = allowed[None] & vk[:, :, None, :]
            allowed = allowed | (key_pos[:, None, :] == q_pos[:, :, None])[None]
            allowed = allowed[:, None]  # [B, 1, nb, w, 2w]
        a = self._attend(qb, kb, vb, allowed).reshape(B, Hl, nb * w, C)[:, :, :T]
        return torch.einsum("bhtc,hcd->btd", a, self.w_o)

    def _attend(self, q, k, v, allowed):
        return masked_attention(q, k, v, allowed, self.config.attn_impl)

    def decode(self, x_BTD, pos_BT, valid_BT, cache: MoSACache):
        """Cached decoding: the new tokens' keys and values appended (the positions and
        validity are appended by the MoSA heads' decoding, which runs after this), then each new
        query attends to the cached keys its window allows."""
        w = self.config.local_window
        q, k, v = self._qkv(x_BTD, pos_BT)
        B, T = x_BTD.shape[:2]
        valid = (torch.ones(B, T, dtype=torch.bool, device=x_BTD.device) if valid_BT is None
                 else valid_BT.bool())
        if cache.local_keys is None:
            cache.local_keys, cache.local_values = k, v
            pos_k, valid_k = pos_BT, valid
        else:
            cache.local_keys = torch.cat([cache.local_keys, k], -2)
            cache.local_values = torch.cat([cache.local_values, v], -2)
            pos_k = torch.cat([cache.positions, pos_BT], -1)
            valid_k = torch.cat([cache.valid, valid], -1)
        pk, pq = pos_k[:, None, :], pos_BT[:, :, None]
        allowed = (pk <= pq) & (torch.div(pk, w, rounding_mode="floor")
                                >= torch.div(pq, w, rounding_mode="floor") - 1)
        allowed = (allowed & valid_k[:, None, :]) | (pk == pq)
        a = self._attend(q, cache.local_keys, cache.local_values, allowed[:, None])
        return torch.einsum("bhtc,hcd->btd", a, self.w_o)
