"""SepFormer's rotary embedding: the first `rotary_dim` dimensions of each head, in the rotate-half layout."""

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half


class SepFormerRotaryEmbedding(nn.Module):
    """cos/sin of rotary embedding for the first `rotary_dim` dimensions of each head, computed once per forward."""

    def __init__(self, config):
        super().__init__()
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, base: float | None = None) -> torch.Tensor:
        base = self.rope_theta if base is None else base
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, base: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`base`: another rotary base than the config's `rope_theta` (Attention Buckets)."""
        inv_freq = self.inv_freq if base is None else self.compute_inv_freq(base)
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # (b, seq, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, seq, rotary_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_partial_rotary(q, k, cos, sin):
    """Rotate the first `cos.shape[-1]` dimensions of each head of `q` and `k` (b, heads, seq, head_dim).

    `cos`/`sin`: (b, seq, rotary_dim), shared by the heads, or (b, heads, seq, rotary_dim), one angle per head (MS-PoE).
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return rotate_partial(q, cos, sin), rotate_partial(k, cos, sin)


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dimensions of each head of `x` (b, heads, n, head_dim) by the angles of `cos`
    and `sin` (b, heads or 1, n, rotary_dim), in rotary's rotate-half layout."""
    rotary_dim = cos.shape[-1]
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
    return torch.cat((rotated, x[..., rotary_dim:]), -1)
