"""The per-layer key/value cache for incremental decoding.

Shape legend: B batch, Hk key/value heads (H for dense attention and SwitchHead, 1 for MoA),
S cached source tokens, C head channels.

What a layer stores is what it can reuse unchanged: keys after RoPE (a key's rotation depends only
on its own position), keys before any Transformer-XL position term (that term depends on the query
too, so it is recomputed from the stored positions), values after SwitchHead's expert mixing (the
V selection depends only on the source token itself). Every entry keeps its absolute integer
position and its validity, so later queries mask and position it exactly as a full forward pass
does; decoding therefore never restarts positions at 0 (the defect SwitchHead spec §2 warns of).

The cache does not detach: decoding normally runs under torch.no_grad().
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys, values, positions and key validity of every source token seen so far."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, Hk, S, C]
        self.values: torch.Tensor | None = None  # [B, Hk, S, C]
        self.positions: torch.Tensor | None = None  # int64 [B, S]
        self.valid: torch.Tensor | None = None  # bool [B, S]

    @property
    def length(self) -> int:
        """Cached source tokens (a Python int from the shape: no host sync)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def __len__(self) -> int:
        return self.length

    def append(
        self,
        keys_BHSC: torch.Tensor,
        values_BHSC: torch.Tensor,
        positions_BS: torch.Tensor,
        valid_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add new source tokens; returns everything cached (keys, values, positions, valid)."""
        B, _, S_new, _ = keys_BHSC.shape
        if values_BHSC.shape[:3] != keys_BHSC.shape[:3]:
            raise ValueError(f"keys {tuple(keys_BHSC.shape)} and values "
                             f"{tuple(values_BHSC.shape)} must agree in batch, heads and length")
        if positions_BS.shape != (B, S_new):
            raise ValueError(f"positions must be [B, S_new] = [{B}, {S_new}], "
                             f"got {tuple(positions_BS.shape)}")
        if valid_BS is None:
            valid_BS = torch.ones(B, S_new, dtype=torch.bool, device=keys_BHSC.device)
        positions_BS = positions_BS.to(torch.int64)
        if self.keys is None:
            self.keys, self.values = keys_BHSC, values_BHSC
            self.positions, self.valid = positions_BS, valid_BS.bool()
        else:
            if self.keys.shape[0] != B or self.keys.shape[1] != keys_BHSC.shape[1]:
                raise ValueError(f"the cache holds batch {self.keys.shape[0]} with "
                                 f"{self.keys.shape[1]} heads, got batch {B} with "
                                 f"{keys_BHSC.shape[1]} heads; use one cache per layer and "
                                 f"sequence batch (new_cache())")
            self.keys = torch.cat([self.keys, keys_BHSC], -2)
            self.values = torch.cat([self.values, values_BHSC], -2)
            self.positions = torch.cat([self.positions, positions_BS], -1)
            self.valid = torch.cat([self.valid, valid_BS.bool()], -1)
        return self.keys, self.values, self.positions, self.valid

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.valid = None
