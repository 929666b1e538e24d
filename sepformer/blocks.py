"""SepFormer's block-diagonal modules: one module per subspace of `[x_pos ‖ x_sem]`, nothing crosses between them."""

import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN

from .kept import cached_constant


class BlockDiagonal(nn.Module):
    """`[x_pos ‖ x_sem] -> [position(x_pos) ‖ semantic(x_sem)]`: one module per subspace, nothing crosses.

    With `d_pos = 0` there is no positional block: `position` is `None` and the input is all semantic.
    """

    def __init__(self, position: nn.Module | None, semantic: nn.Module, position_size: int):
        super().__init__()
        self.position = position
        self.semantic = semantic
        self.position_size = position_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return self.semantic(x)
        # (..., d) -> (rows, d): a linear layer on 2D rows is one matmul call, on more dimensions a matmul and two
        # reshapes, and decoding steps go by call count.
        return self.each_block(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def __format__(self, spec: str) -> str:
        """The module with which modules an adapter targets instead: PEFT names a target it cannot adapt with
        `f"{target}"`, and the blocks, not this container, are the linear layers."""
        blocks = " and ".join(f"`<name>.{name}`" for name, block in self.named_children() if block is not None)
        return format(
            f"{self!r} [a SepFormer block-diagonal module: adapters target its blocks, {blocks} (e.g. "
            "`v_proj.position` and `v_proj.semantic`; in an MLP its `up_proj` and `down_proj`); "
            "sepformer.LORA_TARGET_MODULES lists every projection]",
            spec,
        )

    def each_block(self, x: torch.Tensor) -> torch.Tensor:
        widths = (self.position_size, x.shape[-1] - self.position_size)
        return blockwise(x, (self.position, self.semantic), widths)


def blockwise(x: torch.Tensor, functions, widths: tuple[int, ...]) -> torch.Tensor:
    """`[f_1(x_1) ‖ f_2(x_2) ‖ ...]` over blocks of the last dimension of the given widths.

    One split rather than slices: its backward is one cat, where each slice's backward fills a zero tensor of the full
    width and they are summed."""
    blocks = x.split_with_sizes(widths, -1)
    return torch.cat([function(block) for function, block in zip(functions, blocks, strict=True)], -1)


def block_diagonal(
    config, make: Callable[[int], nn.Module], kind: type[BlockDiagonal] = BlockDiagonal
) -> BlockDiagonal:
    """`make(width)` builds the module of one subspace; the positional one is skipped when `d_pos = 0`."""
    position = make(config.position_size) if config.position_size > 0 else None
    return kind(position, make(config.semantic_size), config.position_size)


def block_norm(config) -> "BlockNorm":
    """A `BlockNorm` of the config's `norm_type`, one RMSNorm or LayerNorm per block."""
    norm = nn.RMSNorm if config.norm_type == "rmsnorm" else nn.LayerNorm
    return block_diagonal(config, lambda width: norm(width, eps=config.norm_eps), BlockNorm)


@cached_constant(maxsize=8)
def block_statistics(position_size: int, semantic_size: int, eps: float, device: torch.device):
    """float32 constants of an RMS `BlockNorm`: the `(d, 2)` block-averaging matrix, `eps` per block, the `(2, d)` 0/1
    indicator."""
    indicator = torch.block_diag(torch.ones(1, position_size), torch.ones(1, semantic_size)).to(device)
    averaging = (indicator / indicator.sum(-1, keepdim=True)).t().contiguous()
    return averaging, torch.full((2,), eps, device=device), indicator


class BlockNorm(BlockDiagonal):
    """Each block normalised on its own (its own RMSNorm or LayerNorm, `position` and `semantic`).

    LayerNorms run as `BlockDiagonal`'s blocks do: torch's layer norm is one fused kernel per block. RMSNorms run in
    one pass over the rows, seven aten calls where the two torch RMSNorms with their split and cat are fourteen (six
    each on CPU): each block's mean square (plus `eps`) is one matmul with the block-averaging matrix, and comes back
    to the block's coordinates, times the block's weight, through one `(2, d)` matrix. Statistics in float32, as the
    torch norms compute them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return self.semantic(x)
        if not isinstance(self.semantic, nn.RMSNorm):  # layer norms work on any shape: no reshapes
            return self.each_block(x)
        if torch.is_autocast_enabled(x.device.type):  # the matmuls below would run in half precision
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x)
        rows = x.reshape(-1, x.shape[-1])  # (rows, d): 2D matmuls, no reshapes around each
        return self.normed_rows(x.shape[-1] - self.position_size, x.device)(rows).view(x.shape)

    def normed_rows(self, semantic_size: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """The RMS norm of rows (rows, d), its float32 constants made now (the decoding steps make it once): the
        `block_statistics` and the `(2, d)` weights, row j block j's weight on its coordinates and 0 elsewhere."""
        averaging, eps, indicator = block_statistics(self.position_size, semantic_size, self.semantic.eps, device)
        weights = indicator * torch.cat((self.position.weight, self.semantic.weight)).float()
        return functools.partial(rms_normed_rows, averaging=averaging, eps=eps, weights=weights)


def rms_normed_rows(rows: torch.Tensor, averaging: torch.Tensor, eps: torch.Tensor, weights: torch.Tensor):
    """Rows (rows, d), each block RMS-normed in float32 and times its weights, back in their dtype."""
    h = rows.float()
    inverse_rms = torch.addmm(eps, h * h, averaging).rsqrt_()  # (rows, 2): one per block
    return (h * (inverse_rms @ weights)).to(rows.dtype)


class SepFormerMLP(nn.Module):
    def __init__(self, config, width: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(width, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, width, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))
