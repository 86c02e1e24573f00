"""The per-layer key/value cache for incremental decoding.

Shape legend: B batch, Hk key/value heads (H for dense attention and SwitchHead, 1 for MoA),
S cached source tokens, C head channels.

What a layer stores is what it can reuse unchanged: keys after RoPE (a key's rotation depends only
on its own position), keys before any Transformer-XL position term (that term depends on the query
too, so it is recomputed from the stored positions), values after SwitchHead's expert mixing (the
V selection depends only on the source token itself). Every entry keeps its absolute integer
position and its validity, so later queries mask and position it exactly as a full forward pass
does; decoding therefore never restarts positions at 0 (the defect the SwitchHead appendix warns
of).

The cache does not detach: decoding normally runs under torch.no_grad().
"""

from __future__ import annotations

import torch
from torch import nn


class KVCacheAttention(nn.Module):
    """The base of the attention layers that decode with a ``KVCache`` (dense, grouped-query,
    SwitchHead, MoA, MoH): ``new_cache`` and ``param_count`` (the config's formula), the rest
    of the attention interface (docs/interfaces.md) their own."""

    def new_cache(self) -> "KVCache":
        return KVCache()

    def param_count(self) -> int:
        return self.config.param_count()


class KVCache:
    """Keys, values, positions and key validity of every source token seen so far.

    Under no_grad (decoding) the entries live in buffers with spare room at the end, grown
    geometrically, so appending a token writes only that token: concatenating instead copies
    the whole cache of every layer at every step, which at a few thousand tokens costs more
    than the attention reading it. With gradients enabled, appends concatenate (a buffer
    written in place would invalidate what autograd saved)."""

    GROWTH = 2.0  # a full buffer is reallocated with this factor times the tokens it must hold

    def __init__(self) -> None:
        self._bufs: tuple[torch.Tensor, ...] | None = None  # keys, values, positions, valid
        self._len = 0
        self._contiguous = True
        self._all_valid = True
        # Constants derived from the layer's weights that decoding reuses from step to step,
        # by name (the attention core keeps its Transformer-XL distance table here).
        self.derived: dict[str, object] = {}

    def _view(self, i: int) -> torch.Tensor | None:
        if self._bufs is None:
            return None
        return self._bufs[i].narrow(self._bufs[i].dim() - 1 - (i < 2), 0, self._len)

    @property
    def keys(self) -> torch.Tensor | None:  # [B, Hk, S, C]
        return self._view(0)

    @property
    def values(self) -> torch.Tensor | None:  # [B, Hk, S, C]
        return self._view(1)

    @property
    def positions(self) -> torch.Tensor | None:  # int64 [B, S]
        return self._view(2)

    @property
    def valid(self) -> torch.Tensor | None:  # bool [B, S]
        return self._view(3)

    @property
    def length(self) -> int:
        """Cached source tokens (a Python int: no host sync)."""
        return self._len

    def __len__(self) -> int:
        return self.length

    @property
    def contiguous(self) -> bool:
        """Whether every cached token sits at its default position (the j-th token appended at
        position j, in every sequence of the batch): attention over the cache is then the
        contiguous case (query i of T at S - T + i), with its fast paths."""
        return self._contiguous

    @property
    def all_valid(self) -> bool:
        """Whether every cached token is known to be valid: no validity was ever appended
        (a Python bool, no host sync; a given validity tensor counts as possibly partial). Masks
        then need not read ``valid``."""
        return self._all_valid

    def append(
        self,
        keys_BHSC: torch.Tensor,
        values_BHSC: torch.Tensor,
        positions_BS: torch.Tensor,
        valid_BS: torch.Tensor | None = None,
        *,
        default_positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add new source tokens; returns everything cached (keys, values, positions, valid).
        ``default_positions``: the caller vouches that ``positions_BS`` are the default ones,
        length .. length + S_new - 1 in every row (kept as ``contiguous``)."""
        B, _, S_new, _ = keys_BHSC.shape
        if values_BHSC.shape[:3] != keys_BHSC.shape[:3]:
            raise ValueError(f"keys {tuple(keys_BHSC.shape)} and values "
                             f"{tuple(values_BHSC.shape)} must agree in batch, heads and length")
        if positions_BS.shape != (B, S_new):
            raise ValueError(f"positions must be [B, S_new] = [{B}, {S_new}], "
                             f"got {tuple(positions_BS.shape)}")
        self._all_valid = self._all_valid and valid_BS is None
        if valid_BS is None:
            valid_BS = torch.ones(B, S_new, dtype=torch.bool, device=keys_BHSC.device)
        new = (keys_BHSC, values_BHSC, positions_BS.to(torch.int64), valid_BS.bool())
        if self._bufs is not None:
            k = self._bufs[0]
            if k.shape[0] != B or k.shape[1] != keys_BHSC.shape[1]:
                raise ValueError(f"the cache holds batch {k.shape[0]} with {k.shape[1]} heads, "
                                 f"got batch {B} with {keys_BHSC.shape[1]} heads; use one cache "
                                 f"per layer and sequence batch (new_cache())")
        self._contiguous = self._contiguous and default_positions
        if self._bufs is None:  # kept as given; the first growth copies it into a buffer
            self._bufs, self._len = new, S_new
            return self.keys, self.values, self.positions, self.valid
        if torch.is_grad_enabled():
            old = [self._view(i) for i in range(4)]
            self._bufs = tuple(
                torch.cat([o, n], o.dim() - 1 - (i < 2)) for i, (o, n) in enumerate(zip(old, new)))
            self._len += S_new
            return self.keys, self.values, self.positions, self.valid
        need = self._len + S_new
        if self._bufs[0].shape[2] < need:
            cap = int(need * self.GROWTH)
            bufs = []
            for i, n in enumerate(new):
                shape = (*n.shape[:2], cap, n.shape[3]) if i < 2 else (B, cap)
                buf = n.new_empty(shape)
                self._view_of(buf, i).copy_(self._view(i))
                bufs.append(buf)
            self._bufs = tuple(bufs)
        for i, n in enumerate(new):
            self._bufs[i].narrow(n.dim() - 1 - (i < 2), self._len, S_new).copy_(n)
        self._len = need
        return self.keys, self.values, self.positions, self.valid

    def _view_of(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf.narrow(buf.dim() - 1 - (i < 2), 0, self._len)

    def reset(self) -> None:
        self._bufs, self._len, self._contiguous, self._all_valid = None, 0, True, True
        self.derived = {}


class SharedKVCache:
    """A read-only view of another layer application's KVCache, for attention that reuses keys
    and values computed elsewhere (Mixture-of-Recursions' recursive KV sharing: every recursion
    step after the first attends to the first step's keys and values).

    It has the part of KVCache's interface the attention core uses. ``append`` stores nothing:
    the new tokens' own keys and values are dropped and the source's are returned, so queries
    attend to the source's entries (with their positions and validity) instead. The source must
    already hold the new tokens (the first step runs before the later ones)."""

    def __init__(self, source: KVCache) -> None:
        self.source = source

    # read through to the source (KVCache's properties)
    keys = property(lambda self: self.source.keys)
    values = property(lambda self: self.source.values)
    positions = property(lambda self: self.source.positions)
    valid = property(lambda self: self.source.valid)
    length = property(lambda self: self.source.length)
    contiguous = property(lambda self: self.source.contiguous)
    all_valid = property(lambda self: self.source.all_valid)
    derived = property(lambda self: self.source.derived)

    def __len__(self) -> int:
        return self.length

    def append(self, keys_BHSC: torch.Tensor, values_BHSC: torch.Tensor,
               positions_BS: torch.Tensor, valid_BS: torch.Tensor | None = None, *,
               default_positions: bool = False,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The source's keys, values, positions and validity; the arguments are not stored."""
        k = self.source.keys
        if k is None:
            raise ValueError("a shared KV cache reads a cache that holds no tokens yet; run the "
                             "layer application that fills it first")
        if k.shape[0] != keys_BHSC.shape[0] or k.shape[1] != keys_BHSC.shape[1]:
            raise ValueError(f"the shared cache holds batch {k.shape[0]} with {k.shape[1]} "
                             f"heads, got batch {keys_BHSC.shape[0]} with "
                             f"{keys_BHSC.shape[1]} heads")
        return k, self.source.values, self.source.positions, self.source.valid
