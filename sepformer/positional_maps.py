"""Positional maps `p(i)`: the only part of a SepFormer that depends on position.

Each map takes `position_ids` of shape (batch or 1, seq) and returns rows of shape (batch or 1, seq, d_pos).
"""

import torch
from torch import nn


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """`PE(i)_{2k} = sin(i / 10000^{2k/dim})`, `PE(i)_{2k+1} = cos(i / 10000^{2k/dim})`; `positions` may be fractional."""
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    angles = positions.float()[..., None] * 10000.0**-exponents  # (..., dim / 2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., dim), sin/cos interleaved


class LearnedPositions(nn.Embedding):
    """A table of `max_position_embeddings` learned rows (the seed's choice)."""

    def __init__(self, config):
        super().__init__(config.max_position_embeddings, config.position_size)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            _check_in_table(position_ids, self.num_embeddings)
        return super().forward(position_ids)


class SinusoidalPositions(nn.Module):
    """The fixed sinusoid of "Attention Is All You Need" over `d_pos` dimensions, defined at every position."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.position_size

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return sinusoid(position_ids, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


POSITIONAL_MAP_CLASSES = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}


def _check_in_table(position_ids: torch.Tensor, length: int) -> None:
    if position_ids.numel() == 0:
        return
    low, high = position_ids.min().item(), position_ids.max().item()
    if low < 0 or high >= length:
        bad = low if low < 0 else high
        raise ValueError(
            f"position {bad} is outside the learned positional table: positions must lie in [0, "
            f"max_position_embeddings={length}). Shorten the input or use a model with a longer "
            "max_position_embeddings."
        )
