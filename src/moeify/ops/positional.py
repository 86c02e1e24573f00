"""Positional maths for attention: rotary embeddings (RoPE) and Transformer-XL relative positions.

Shape legend
    B batch          H heads (1 broadcasts over the query heads)       T query (destination) tokens
    S source tokens  C head channels (d_head)      D sinusoid width (d_model)
    F sinusoid frequencies, ceil(D / 2)            R relative distances in a contiguous table

Positions are integers. Angles are formed in float64 and only their sines and cosines are cast to
the working dtype, so large absolute positions (long decoding) lose no precision in the angle.
On a device without float64 (Apple's MPS) the angles are formed on the CPU and their sines and
cosines moved to the device (``angle_device``); everywhere else on the tensors' own device.

RoPE (SwitchHead appendix): only the first ``rope_dims(d_head, 0.5)`` channels of each head are
rotated, base 10000, rotate-half convention (channel i pairs with channel i + n/2).

Transformer-XL (Dai et al. 2019, §3.3; SwitchHead appendix): the position logit of query i and key j
is q_i · P(p_i - p_j), with P(r) = W_pos · emb(r) the projected sinusoidal embedding of the
distance, emb(r) = [sin(r ω_f) for f < F ; cos(r ω_f) for f < D - F], ω_f = 10000^(-2f / D).
Two evaluations of the same quantity:
    ``xl_logits_contiguous``  default positions (query i at S - T + i, key j at j): one projected
                              table of distances and the classic XL diagonal shift (``rel_shift``).
                              Also decoding, while every cached token sits at its default
                              position; ``XLPositionTableCache`` keeps the table between steps.
    ``xl_logits_at``          explicit integer positions (Mixture-of-Depths, decoding after
                              tokens at explicit positions):
                              the angle-difference identity sin((p_i - p_j)ω) = sin p_iω cos p_jω
                              - cos p_iω sin p_jω (and the cos one) turns the logit into one
                              product of a query-side and a key-side factor. It needs no table of
                              distances, hence no host sync to size one, and never builds a
                              [T, S, D] tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from moeify.ops.amp import amp_backward, amp_forward
from moeify.ops.memo import stamp

ROPE_BASE = 10000.0
SINUSOID_BASE = 10000.0


# ----------------------------------------------------------------------------------------------
# RoPE


def rope_dims(d_head: int, fraction: float = 0.5) -> int:
    """Channels rotated per head: int(fraction * d_head), rounded down to an even number because
    rotate-half pairs channel i with channel i + n/2 (the authors' code would fail on an odd count,
    e.g. d_head = 42)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the RoPE rotate fraction must lie in [0, 1], got {fraction}")
    n = int(fraction * d_head)
    return n - (n % 2)


def _positions_2d(pos: torch.Tensor) -> torch.Tensor:
    return pos if pos.dim() == 2 else pos.unsqueeze(0)


def angle_device(device) -> torch.device | None:
    """Where float64 angles of tensors on ``device`` are formed: that device, or the CPU for
    one without float64 (MPS)."""
    if device is not None and torch.device(device).type == "mps":
        return torch.device("cpu")
    return device


def rope_inv_freq(n_rot: int, base: float = ROPE_BASE, device=None) -> torch.Tensor:
    """float64 [n_rot / 2]: base^(-2f / n_rot), the RoPE frequencies of the rotated channels
    (on ``angle_device(device)``)."""
    exps = torch.arange(0, n_rot, 2, dtype=torch.float64, device=angle_device(device)) / n_rot
    return base ** -exps


# ----------------------------------------------------------------------------------------------
# Scaled RoPE (context extension), as transformers' modeling_rope_utils defines each rope_type

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


# ``scaling`` below is any object with the fields of moeify.layers.attention_core.RopeScaling
# (kind, factor, original_context, low_freq_factor, high_freq_factor, beta_fast, beta_slow,
# attention_factor, mscale, mscale_all_dim, truncate), which documents each kind:
#     linear   position interpolation (Chen et al. 2023, arXiv:2306.15595, §2.2)
#     dynamic  dynamic NTK, from the longest position of the call
#     yarn     YaRN (Peng et al. 2023, arXiv:2309.00071, Eq. 17-18 and 21-22)
#     llama3   Llama 3.1's wavelength-banded interpolation


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (arXiv:2309.00071, Eq. 22)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: Any) -> float:
    """The factor on cos and sin: YaRN's temperature, 1 for every other kind."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def scaled_rope_inv_freq(n_rot: int, base: float, scaling: Any, *,
                         device=None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [n_rot / 2]: the RoPE frequencies under ``scaling`` (None: ``rope_inv_freq``).
    ``dynamic`` reads the longest position of ``pos`` (a tensor op, no host sync)."""
    inv_F = rope_inv_freq(n_rot, base, device)
    if scaling is None or n_rot == 0:
        return inv_F
    s, orig = scaling.factor, scaling.original_context
    if scaling.kind == "linear":
        return inv_F / s
    if scaling.kind == "dynamic":
        if pos is None:
            return inv_F
        seq = (pos.max().to(inv_F.device, torch.float64) + 1).clamp(min=orig)
        scaled_base = base * (s * seq / orig - (s - 1)) ** (n_rot / (n_rot - 2))
        exps = torch.arange(0, n_rot, 2, dtype=torch.float64, device=inv_F.device) / n_rot
        return scaled_base ** -exps
    if scaling.kind == "llama3":
        low_wavelen = orig / scaling.low_freq_factor
        high_wavelen = orig / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_F
        out = torch.where(wavelen > low_wavelen, inv_F / s, inv_F)
        smooth = (orig / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * out / s + smooth * out
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, out)
    # yarn: dimension i interpolates (/ s) below the correction range, extrapolates above it
    # (Eq. 17-18: the range of dims that turn beta_fast .. beta_slow times over the context).
    def correction_dim(rotations: float) -> float:
        return n_rot * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_rot - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = ((torch.arange(n_rot // 2, dtype=torch.float64, device=inv_F.device) - low)
            / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_F / s * (1 - extrapolate) + inv_F * extrapolate


def _rotate_into(out, x, cos, sin, half: int, n_rot: int) -> torch.Tensor:
    """out = x rotated by the angles (cos, sin): x * cos + rotate_half(x) * sin on the first
    n_rot channels, with rotate_half(x) = [-x2 ; x1]; the rest copied. Written in place into
    the slices of ``out`` (four multiply-adds and a copy, no concatenation)."""
    x1, x2 = x[..., :half], x[..., half:n_rot]
    o1, o2 = out[..., :half], out[..., half:n_rot]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    if n_rot < x.shape[-1]:
        out[..., n_rot:].copy_(x[..., n_rot:])
    return out


class _Rope(torch.autograd.Function):
    """The rotation as one Function: its backward is the rotation by the opposite angles (the
    transpose of a rotation), computed the same way, where autograd would differentiate the
    multiplies, the subtraction and the concatenation one by one."""

    @staticmethod
    @amp_forward
    def forward(ctx, x, cos, sin, half, n_rot):
        ctx.save_for_backward(cos, sin)
        ctx.dims = (half, n_rot)
        return _rotate_into(torch.empty_like(x), x, cos, sin, half, n_rot)

    @staticmethod
    @amp_backward
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half, n_rot = ctx.dims
        return _rotate_into(torch.empty_like(grad), grad, cos, -sin, half, n_rot), \
            None, None, None, None


def apply_rope(x_BHTC: torch.Tensor, pos_BT: torch.Tensor, *, n_rot: int,
               base: float = ROPE_BASE, scaling: Any = None) -> torch.Tensor:
    """Rotate the first ``n_rot`` channels of every head by the angles of the token positions.
    ``pos_BT`` is [B, T] or [T] (integers); any head count broadcasts. ``scaling``: the
    frequencies of ``scaled_rope_inv_freq`` and, for YaRN, cos and sin times its attention
    factor (the rotated channels only, as transformers applies it)."""
    if n_rot == 0:
        return x_BHTC
    half = n_rot // 2
    inv_F = scaled_rope_inv_freq(n_rot, base, scaling, device=x_BHTC.device, pos=pos_BT)
    ang_BTF = _positions_2d(pos_BT).to(inv_F.device, torch.float64)[..., None] * inv_F
    cos_BTF, sin_BTF = ang_BTF.cos(), ang_BTF.sin()
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        cos_BTF, sin_BTF = cos_BTF * factor, sin_BTF * factor
    cos_B1TF = cos_BTF.to(x_BHTC.device, x_BHTC.dtype)[:, None]
    sin_B1TF = sin_BTF.to(x_BHTC.device, x_BHTC.dtype)[:, None]
    if torch.compiler.is_compiling():
        # The Function writes into slices with out= (no concatenation), which torch.compile
        # cannot trace; the compiler fuses the plain expression into one kernel anyway.
        x1, x2 = x_BHTC[..., :half], x_BHTC[..., half:n_rot]
        return torch.cat([x1 * cos_B1TF - x2 * sin_B1TF, x2 * cos_B1TF + x1 * sin_B1TF,
                          x_BHTC[..., n_rot:]], -1)
    return _Rope.apply(x_BHTC, cos_B1TF, sin_B1TF, half, n_rot)


# ----------------------------------------------------------------------------------------------
# Sinusoidal embeddings and Transformer-XL position logits


def sinusoid_inv_freq(d_model: int, device=None) -> torch.Tensor:
    """float64 [ceil(D / 2)]: 10000^(-2f / D) (on ``angle_device(device)``)."""
    f = torch.arange(0, (d_model + 1) // 2, dtype=torch.float64, device=angle_device(device))
    return SINUSOID_BASE ** (-2.0 * f / d_model)


def sinusoidal_embedding(pos_N: torch.Tensor, d_model: int, dtype=torch.float32) -> torch.Tensor:
    """[N, D]: [sin(p ω) ; cos(p ω)] for integer (or real) positions or distances p; for odd D the
    last cosine is dropped."""
    inv_F = sinusoid_inv_freq(d_model, pos_N.device)
    ang_NF = pos_N.to(inv_F.device, torch.float64)[:, None] * inv_F
    return torch.cat([ang_NF.sin(), ang_NF.cos()], -1)[:, :d_model].to(pos_N.device, dtype)


def rel_shift(x_BHTR: torch.Tensor, S: int) -> torch.Tensor:
    """The Transformer-XL diagonal shift. Column m of ``x`` holds distance S - 1 - m (so R >= S
    columns cover distances S-1 down to S-R); the result holds, for query i and key j, the column
    of distance (S - T + i) - j, i.e. out[..., i, j] = x[..., i, j + T - 1 - i]. Entries whose
    distance is not in the table (keys after the query when R = S) are finite garbage for the
    mask to remove."""
    *lead, T, R = x_BHTR.shape
    assert R >= S, "the distance table must have at least S columns"
    padded = F.pad(x_BHTR, (1, 0)).reshape(*lead, R + 1, T)
    return padded[..., 1:, :].reshape(*lead, T, R)[..., :S]


def _projected_distances(w_pos_DHC: torch.Tensor, dist_R: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """P(r) = W_pos · emb(r) for each distance of ``dist_R``: [H or 1, R, C]."""
    emb_RD = sinusoidal_embedding(dist_R, w_pos_DHC.shape[0], dtype)
    return torch.einsum("rd,dhc->hrc", emb_RD, w_pos_DHC.to(dtype))


def xl_position_table(w_pos_DHC: torch.Tensor, S: int, T: int, *, causal: bool,
                      dtype: torch.dtype) -> torch.Tensor:
    """P(r) = W_pos · emb(r) for the distances S-1 down to 0 (causal: a query never looks
    forward) or down to 1 - T (cross-attention): [H or 1, R, C], row m holding S - 1 - m."""
    lowest = 0 if causal else 1 - T
    dist_R = torch.arange(S - 1, lowest - 1, -1, device=w_pos_DHC.device)
    return _projected_distances(w_pos_DHC, dist_R, dtype)


class XLPositionTableCache:
    """The causal ``xl_position_table`` of a decoding layer, kept from call to call.

    P depends only on the weights and the distances, yet a cache of S tokens needs S rows of
    it at every decoding step: recomputed, that is S·D·H·C multiply-adds per layer and token,
    ten times the attention itself at the 47M shapes. Kept here, the table grows only by the
    rows of new distances (to ``GROWTH`` times the length asked for, so growing is amortised),
    stored from the largest distance down so that the S rows a call needs are its last S, a
    view. It is rebuilt whenever the weights change (``moeify.ops.memo.stamp``: another tensor,
    or an in-place update), and only serves calls without gradients (decoding).
    """

    GROWTH = 1.25

    def __init__(self) -> None:
        self._rows_HRC: torch.Tensor | None = None  # row m: distance R - 1 - m
        self._key: tuple | None = None

    def table(self, w_pos_DHC: torch.Tensor, S: int, dtype: torch.dtype) -> torch.Tensor:
        """[H or 1, S, C]: P of the distances S - 1 down to 0, equal to
        ``xl_position_table(w_pos_DHC, S, T, causal=True, dtype=dtype)``."""
        key = stamp(w_pos_DHC)
        if key is None:
            return xl_position_table(w_pos_DHC, S, 1, causal=True, dtype=dtype)
        key = (key, dtype)
        if key != self._key:
            self._rows_HRC, self._key = None, key
        have = 0 if self._rows_HRC is None else self._rows_HRC.shape[1]
        if have < S:
            cap = max(S, int(have * self.GROWTH))
            dist = torch.arange(cap - 1, have - 1, -1, device=w_pos_DHC.device)
            new = _projected_distances(w_pos_DHC, dist, dtype)
            self._rows_HRC = new if self._rows_HRC is None else torch.cat([new, self._rows_HRC], 1)
        return self._rows_HRC[:, self._rows_HRC.shape[1] - S:]


def xl_logits_contiguous(qp_BHTC: torch.Tensor, w_pos_DHC: torch.Tensor, S: int, *,
                         causal: bool) -> torch.Tensor:
    """q · P(p_i - p_j) for default positions (query i at S - T + i, key j at j): [B, H, T, S].
    ``w_pos_DHC`` is the position projection d_model -> (H or 1) x d_head. A causal mask only
    needs distances >= 0; cross-attention needs down to 1 - T."""
    T = qp_BHTC.shape[-2]
    p_HRC = xl_position_table(w_pos_DHC, S, T, causal=causal, dtype=qp_BHTC.dtype)
    return rel_shift(qp_BHTC @ p_HRC.transpose(-1, -2), S)


def xl_logits_at(qp_BHTC: torch.Tensor, w_pos_DHC: torch.Tensor, pos_q_BT: torch.Tensor,
                 pos_k_BS: torch.Tensor) -> torch.Tensor:
    """q · P(p_i - p_j) for explicit integer positions: [B, H, T, S] (see the module docstring)."""
    D, F_ = w_pos_DHC.shape[0], (w_pos_DHC.shape[0] + 1) // 2
    dt = qp_BHTC.dtype
    # Project each query back onto the sinusoid basis: c = q · W_pos_h, split into the coefficients
    # of the sines (a) and of the cosines (b).
    c_BHTD = qp_BHTC @ w_pos_DHC.permute(1, 2, 0)
    a, b = c_BHTD[..., :F_], c_BHTD[..., F_:]
    if D % 2:
        b = F.pad(b, (0, 1))
    inv_F = sinusoid_inv_freq(D, qp_BHTC.device)
    ang_q = _positions_2d(pos_q_BT).to(inv_F.device, torch.float64)[..., None] * inv_F
    dev = qp_BHTC.device
    sin_q, cos_q = ang_q.sin().to(dev, dt)[:, None], ang_q.cos().to(dev, dt)[:, None]
    q_fac = torch.cat([a * sin_q + b * cos_q, b * sin_q - a * cos_q], -1)
    k_fac = _key_factors(_positions_2d(pos_k_BS), D, inv_F, dt)[:, None]
    return q_fac @ k_fac.transpose(-1, -2)


# Integer key positions below this take their factors from a table (``_key_factors``).
KEY_TABLE_MAX = 1 << 15
_key_tables: dict = {}  # (D, device, dtype) -> [n, 2F] factors of positions 0 .. n - 1
# (a cache of constants: the same table whoever asks)


def _key_factors(pos_BS: torch.Tensor, D: int, inv_F: torch.Tensor, dt) -> torch.Tensor:
    """[B, S, 2F]: [cos(p ω) ; sin(p ω)] of every key position, in ``dt`` (angles in float64).
    Decoding asks for the same positions at every step and layer, and the trigonometry costs
    more than the attention: on CPU, integer positions in [0, KEY_TABLE_MAX) are looked up in a
    table of exactly these values (computed the same way, so the results are identical), grown
    by doubling; anything else is computed directly (no host sync on accelerators)."""
    def direct(p):
        ang = p.to(inv_F.device, torch.float64)[..., None] * inv_F
        return torch.cat([ang.cos(), ang.sin()], -1).to(p.device, dt)

    if pos_BS.device.type != "cpu" or pos_BS.is_floating_point() or pos_BS.numel() == 0:
        return direct(pos_BS)
    lo, hi = int(pos_BS.min()), int(pos_BS.max())
    if lo < 0 or hi >= KEY_TABLE_MAX:
        return direct(pos_BS)
    key = (D, pos_BS.device, dt)
    table = _key_tables.get(key)
    if table is None or table.shape[0] <= hi:
        n = max(1024, 1 << hi.bit_length())
        table = _key_tables[key] = direct(torch.arange(n, device=pos_BS.device))
    return table.index_select(0, pos_BS.reshape(-1)).view(*pos_BS.shape, -1)


def default_positions(B: int, T: int, S_new: int, past: int,
                      device) -> tuple[torch.Tensor, torch.Tensor]:
    """The interface's default positions: new source token j at past + j, query i at
    past + S_new - T + i (the queries are the last T source tokens).
    Returns int64 [B, T] and [B, S_new]."""
    pos_k = torch.arange(past, past + S_new, device=device)
    pos_q = torch.arange(past + S_new - T, past + S_new, device=device)
    return pos_q.expand(B, T), pos_k.expand(B, S_new)


__all__ = [
    "ROPE_BASE", "ROPE_TYPES", "rope_dims", "rope_inv_freq",
    "scaled_rope_inv_freq", "rope_attention_factor", "apply_rope", "sinusoid_inv_freq",
    "sinusoidal_embedding", "rel_shift", "xl_position_table", "XLPositionTableCache",
    "xl_logits_contiguous",
    "xl_logits_at",
    "default_positions",
]
