"""SepFormer's rotary embedding: the first `rotary_dim` dimensions of each head, in the rotate-half layout.

Dimension `i` and `i + rotary_dim / 2` of a head turn together by one angle. The tables carry the sine signed for that
layout (minus on the first half): a turn is then `x · cos + roll(x) · sin`, one `roll` where rotate-half takes two
slices, a negation and a concatenation, with the same values.
"""

import torch
from torch import nn


class SepFormerRotaryEmbedding(nn.Module):
    """cos and signed sin of the rotary embedding of the first `rotary_dim` dimensions of each head, computed once per
    forward: tables for `rotate_partial`, not for transformers' `apply_rotary_pos_emb` (whose sine is not signed)."""

    def __init__(self, config):
        super().__init__()
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, base: float | torch.Tensor | None = None) -> torch.Tensor:
        """(rotary_dim / 2), or (b, 1, rotary_dim / 2) for `base` (b, 1, 1): one base per row, on its device."""
        base = self.rope_theta if base is None else base
        device = base.device if isinstance(base, torch.Tensor) else None
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=device) / self.rotary_dim))

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, base: float | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`base`: another rotary base than the config's `rope_theta`, or (b, 1, 1) one per row (Attention Buckets)."""
        inv_freq = self.inv_freq if base is None else self.compute_inv_freq(base)
        return rotary_cos_sin(position_ids, inv_freq.to(x.device), x.dtype)


def rotary_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`cos ‖ signed sin` (..., 2 · rotary_dim) of the rotary angles `positions · inv_freq`, as `rotate_partial` reads
    them once split in two (`rotary_cos_sin`): `positions` (...) any real positions (MS-PoE's `m / r`, or the turn
    `m / r - m`), `inv_freq` (rotary_dim / 2), or (b, 1, rotary_dim / 2) one table per row of `positions` (b, seq).
    The sine is signed for the rotate-half layout: rotate-half's `(-x₂, x₁)` with its minus moved onto the sine."""
    angles = positions.float()[..., None] * inv_freq.float()  # (..., rotary_dim / 2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos, -sin, sin), -1).to(dtype)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin (..., rotary_dim), the two halves of `rotary_table`."""
    return rotary_table(positions, inv_freq, dtype).chunk(2, -1)


def apply_partial_rotary(q, k, cos, sin):
    """`rotate_partial` of `q` and `k` (b, heads, seq, head_dim); `cos`/`sin` (b, seq, rotary_dim), shared by the
    heads, or (b, heads, seq, rotary_dim), one angle per head (MS-PoE)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return rotate_partial(q, cos, sin), rotate_partial(k, cos, sin)


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dimensions of each head of `x` (..., b, heads, n, head_dim) by the angles of
    `cos` and the signed `sin` (`rotary_cos_sin`) (b, heads or 1, n, rotary_dim), in rotary's rotate-half layout."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:  # the whole head turns: no slices, no copy of an empty rest
        return x * cos + x.roll(rotary_dim // 2, -1) * sin
    turned = x[..., :rotary_dim]
    return torch.cat((turned * cos + turned.roll(rotary_dim // 2, -1) * sin, x[..., rotary_dim:]), -1)
