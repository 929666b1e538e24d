"""Positional maps `p(i)`, the only part of a SepFormer that depends on position, and their extrapolation.

Each map takes `position_ids` of shape (batch or 1, seq), integer or fractional, and returns rows of shape
(batch or 1, seq, d_pos). Past the `L` rows of a learned table, rows come from an extrapolation method:

| method        | `p(i)` for `i >= L`                                                                      |
|---------------|------------------------------------------------------------------------------------------|
| `none`        | a `ValueError` naming the position, `L` and the methods                                  |
| `clamp`       | `p(L-1)`                                                                                 |
| `sinusoidal`  | `σ · PE(i)`, `σ` the std of the table (discontinuous at `L`: a different map)            |
| `fourier`     | the inverse DFT of the table's top-K coefficients per dimension, periodic with period L  |
| `interpolate` | positions compressed into `[0, L-1]`: `i · (L-1)/(n-1)` for a sequence of `n > L` tokens  |
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

EXTRAPOLATION_METHODS = ("none", "clamp", "sinusoidal", "fourier", "interpolate")


@dataclass(frozen=True)
class PositionExtrapolation:
    """How a learned table answers positions past its last row.

    Args:
        method: one of `EXTRAPOLATION_METHODS`.
        components: `K`, Fourier coefficients kept per dimension (`fourier`).
        length: `interpolate` only: the sequence length the positions are compressed for. `None` compresses for the
            length of the current call, which is what a full forward pass needs; cached decoding past `L` needs a
            fixed `length` (the final length), or the cached keys would have been computed with another scale.
    """

    method: str = "none"
    components: int = 16
    length: int | None = None

    def __post_init__(self):
        if self.method not in EXTRAPOLATION_METHODS:
            raise ValueError(
                f"position_extrapolation method {self.method!r} is unknown: choose one of "
                f"{', '.join(map(repr, EXTRAPOLATION_METHODS))}."
            )
        if not isinstance(self.components, int) or self.components < 1:
            raise ValueError(f"fourier components={self.components!r} must be a positive integer.")
        if self.length is not None and (not isinstance(self.length, int) or self.length < 1):
            raise ValueError(f"interpolate length={self.length!r} must be None or a positive integer.")

    @classmethod
    def parse(cls, value) -> "PositionExtrapolation":
        """A method name, a dict `{"method": ..., "components": ..., "length": ...}`, or an instance."""
        if all(hasattr(value, name) for name in ("method", "components", "length")):
            # duck-typed: an instance from another copy of this module (installed package vs. Hub custom code)
            return cls(method=value.method, components=value.components, length=value.length)
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            unknown = set(value) - {"method", "components", "length"}
            if unknown:
                raise ValueError(
                    f"position_extrapolation got unknown keys {sorted(unknown)}: allowed are 'method', "
                    "'components', 'length'."
                )
            return cls(**value)
        raise ValueError(
            f"position_extrapolation must be a method name, a dict or a PositionExtrapolation; got {value!r}."
        )


SINUSOID_BASE = 10000.0  # the sinusoidal map's base, as in "Attention Is All You Need"


def sinusoid(positions: torch.Tensor, dim: int, base: float = SINUSOID_BASE) -> torch.Tensor:
    """`PE(i)_{2k} = sin(i / base^{2k/dim})`, `PE(i)_{2k+1} = cos(i / base^{2k/dim})`; fractional `positions` too.

    An odd `dim` ends with a sine.
    """
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    angles = positions.float()[..., None] * base**-exponents  # (..., ceil(dim / 2))
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]  # (..., dim), interleaved


def fourier_rows(table: torch.Tensor, positions: torch.Tensor, components: int) -> torch.Tensor:
    """`p(i) = Σ_k w_k Re[p̂_k e^{2πjki/L}]` over each dimension's `components` largest coefficients.

    `w_k = 2/L`, except `1/L` for the constant term and (even `L`) the Nyquist term, which have no conjugate twin:
    with every coefficient kept, the rows at `0..L-1` are the table itself.
    """
    length = table.shape[0]
    spectrum = torch.fft.rfft(table.float(), dim=0)  # (L // 2 + 1, d)
    frequencies = spectrum.shape[0]
    if components < frequencies:
        keep = spectrum.abs().topk(components, dim=0).indices  # (K, d)
        spectrum = torch.zeros_like(spectrum).scatter(0, keep, spectrum.gather(0, keep))
    weights = torch.full((frequencies,), 2.0 / length, device=table.device)
    weights[0] = 1.0 / length
    if length % 2 == 0:
        weights[-1] = 1.0 / length
    k = torch.arange(frequencies, device=table.device, dtype=torch.float64)
    phase = 2 * math.pi * positions.double()[:, None] * k / length  # (n, L // 2 + 1)
    basis_real, basis_imag = phase.cos().float() * weights, phase.sin().float() * weights
    return (basis_real @ spectrum.real - basis_imag @ spectrum.imag).to(table.dtype)  # (n, d)


def interpolation_scale(length: int, needed):
    """`(L-1)/(n-1)`: positions of a sequence of `n > L` tokens compressed into a table of `L` rows."""
    return (length - 1) / (needed - 1)


def interpolate_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows at fractional `positions` in `[0, len(table) - 1]`, linear between neighbouring rows."""
    low = positions.floor().long().clamp(0, table.shape[0] - 1)
    high = (low + 1).clamp(max=table.shape[0] - 1)
    weight = (positions - low).unsqueeze(-1).to(table.dtype)
    return torch.lerp(table[low], table[high], weight)


def position_range(positions: torch.Tensor) -> tuple[int | float, int | float]:
    """(lowest, highest) position as Python numbers, from one reduction; a negative position is an error."""
    low, high = (value.item() for value in torch.aminmax(positions))
    if low < 0:
        raise ValueError(f"position {low} is negative: positions start at 0.")
    return low, high


class LearnedPositions(nn.Embedding):
    """A table of learned rows (the default map), extended past its end by a `PositionExtrapolation`."""

    def __init__(self, config):
        super().__init__(config.position_table_size, config.position_size)
        self.random_offsets = config.random_position_offsets
        self._cache = None  # (key, rows past the table) of the last extension made without autograd

    def training_positions(self, position_ids: torch.LongTensor, batch: int) -> torch.LongTensor:
        """With `random_position_offsets`, half the rows shifted by a random offset so that every row of the table
        gets trained. The other half keep their positions: inference starts at 0, and with uniform offsets alone row
        0 would be trained by one sequence in `position_table_size - seq` only."""
        if not self.random_offsets:
            return position_ids
        room = self.num_embeddings - int(position_ids.max())  # offsets in [0, room)
        if room < 1:
            raise ValueError(
                f"random_position_offsets: a training sequence reaches position {int(position_ids.max())}, past the "
                f"table of position_table_size={self.num_embeddings} rows; train on shorter sequences."
            )
        offsets = torch.randint(0, room, (batch, 1), device=position_ids.device)
        keep = torch.rand(batch, 1, device=position_ids.device) < 0.5
        return position_ids + offsets.masked_fill(keep, 0)  # (b, seq)

    def forward(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        if position_ids.is_floating_point():
            return self.fractional(position_ids, extrapolation)
        if torch.compiler.is_compiling():
            return self.traceable(position_ids, extrapolation)
        if position_ids.numel() == 0:
            return super().forward(position_ids)
        low, high = position_range(position_ids)
        if extrapolation.method == "interpolate":
            return self.interpolated(position_ids, extrapolation)
        length = self.num_embeddings
        if high < length:
            return super().forward(position_ids)
        rows = self.rows_past_table(high + 1, extrapolation)  # rows L, L+1, ...
        if low >= length:  # every position past the table (cached decoding past L): no copy of the table
            return nn.functional.embedding(position_ids - length, rows)
        return nn.functional.embedding(position_ids, torch.cat((self.weight, rows)))  # (capacity, d_pos) table

    def interpolated(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """Position interpolation, per row: a row of `n > L` positions is compressed by `(L-1)/(n-1)`."""
        return interpolate_rows(self.weight, self.table_coordinates(position_ids, extrapolation))

    def table_coordinates(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """Where in the table each position is read: itself, except under `interpolate` past the table (compressed).

        MS-PoE rescales these coordinates, so that `p(m / r)` and `p(m)` are read on the same scale.
        """
        if extrapolation.method != "interpolate":
            return position_ids
        length = self.num_embeddings
        row_needed = position_ids.amax(-1, keepdim=True) + 1  # (b or 1, 1): each row's own length
        if extrapolation.length is not None:
            if int(row_needed.max()) > extrapolation.length:
                raise ValueError(
                    f"position {int(row_needed.max()) - 1} is past position_extrapolation 'interpolate' "
                    f"length={extrapolation.length}. Past the table (L={length}), cached decoding with 'interpolate' "
                    "needs the final sequence length: position_extrapolation={'method': 'interpolate', 'length': N}."
                )
            row_needed = torch.full_like(row_needed, extrapolation.length)
        scale = torch.where(row_needed > length, interpolation_scale(length, row_needed.clamp(min=2)), 1.0)
        return position_ids * scale  # identity for rows of at most L positions

    def fractional(self, positions: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """Rows at fractional positions (MS-PoE's `p(i / r)`): linear interpolation between rows."""
        _, high = position_range(positions)
        needed = math.ceil(high) + 1
        if needed <= self.num_embeddings:
            return interpolate_rows(self.weight, positions)
        return interpolate_rows(torch.cat((self.weight, self.rows_past_table(needed, extrapolation))), positions)

    def rows_past_table(self, needed: int, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """Extrapolated rows `L, L+1, ...`, at least up to row `needed - 1`.

        Rows depend on the position only, so they are computed for a capacity rounded up to `L · 2^m` and reused by
        every call and decoding step that fits, until the table's weights change (their version counter moves with
        every in-place update: optimiser steps, loading; writes through `.data` bypass it: call `clear_cache()`).
        Under autograd they are rebuilt, once per call.
        """
        length, method = self.num_embeddings, extrapolation.method
        if method in ("none", "interpolate"):
            raise ValueError(
                f"position {needed - 1} is past the learned positional table of L={length} rows and "
                f"position_extrapolation={method!r}"
                + (" (which compresses integer positions only)" if method == "interpolate" else "")
                + f". Choose an extrapolation method: {', '.join(repr(m) for m in EXTRAPOLATION_METHODS[1:4])}"
                + (", 'interpolate'" if method == "none" else "")
                + ", in the config or per call (`model(..., position_extrapolation='fourier')`)."
            )
        capacity = length * 2 ** math.ceil(math.log2(needed / length))
        key = (extrapolation, capacity, self.weight._version, self.weight.data_ptr(), self.weight.dtype)
        cacheable = not (torch.is_grad_enabled() and self.weight.requires_grad)
        if cacheable and self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        rows = self.method_rows(torch.arange(length, capacity, device=self.weight.device), extrapolation)
        if cacheable:
            self._cache = (key, rows)
        return rows

    def clear_cache(self) -> None:
        self._cache = None

    def method_rows(self, positions: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """`p(i)` of `clamp`, `sinusoidal` or `fourier` at 1-D `positions` (all assumed `>= L`): (n, d_pos)."""
        weight = self.weight
        with torch.autocast(weight.device.type, enabled=False):  # a cached extension must not carry autocast's dtype
            if extrapolation.method == "clamp":
                return weight[-1:].expand(positions.shape[0], -1)
            if extrapolation.method == "sinusoidal":
                return (weight.float().std() * sinusoid(positions, self.embedding_dim)).to(weight.dtype)
            return fourier_rows(weight, positions, extrapolation.components)

    def traceable(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """The same rows without data-dependent branches (under `torch.compile`): every method is evaluated at every
        position and selected where the position is past the table. `none` indexes the table as it is."""
        length, method = self.num_embeddings, extrapolation.method
        if method == "interpolate":
            if extrapolation.length is None or extrapolation.length <= length:
                return super().forward(position_ids)
            return interpolate_rows(self.weight, position_ids * interpolation_scale(length, extrapolation.length))
        if method == "none":
            return super().forward(position_ids)
        inside = super().forward(position_ids.clamp(max=length - 1))
        past = self.method_rows(position_ids.flatten(), extrapolation).view(*position_ids.shape, -1)
        return torch.where((position_ids >= length).unsqueeze(-1), past, inside)


class SinusoidalPositions(nn.Module):
    """The fixed sinusoid of "Attention Is All You Need" over `d_pos` dimensions, defined at every position."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.position_size

    def training_positions(self, position_ids: torch.LongTensor, batch: int) -> torch.LongTensor:
        return position_ids

    def forward(
        self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation, base: float = SINUSOID_BASE
    ) -> torch.Tensor:
        """`base`: another base than the map's own (Attention Buckets)."""
        return sinusoid(position_ids, self.dim, base)

    def table_coordinates(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        return position_ids  # defined everywhere: nothing is compressed

    def extra_repr(self):
        return f"dim={self.dim}"


POSITIONAL_MAP_CLASSES = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}


def positions_from_mask(padding_mask: torch.Tensor) -> torch.LongTensor:
    """(b, n) each slot's position counted from its row's first real token (left padding gets negative values)."""
    return padding_mask.long().cumsum(-1) - 1


def apply_partial_rotary(q, k, cos, sin):
    """Rotate the first `cos.shape[-1]` dimensions of each head of `q` and `k` (b, heads, seq, head_dim).

    `cos`/`sin`: (b, seq, rotary_dim), shared by the heads, or (b, heads, seq, rotary_dim), one angle per head (MS-PoE).
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rotary_dim = cos.shape[-1]

    def rotate(x):
        rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
        return torch.cat((rotated, x[..., rotary_dim:]), -1)

    return rotate(q), rotate(k)


def call_extrapolation(config, value, continuing: bool) -> PositionExtrapolation:
    """The call's `position_extrapolation` (the config's when `None`), checked against the model."""
    if value is None:
        extrapolation = config.default_extrapolation()
    else:
        extrapolation = PositionExtrapolation.parse(value)
        config.check_extrapolation(extrapolation)
    if extrapolation.method == "interpolate" and extrapolation.length is None and continuing:
        # The cached keys were made with the scale of an earlier length: only positions inside the table, where
        # the scale is 1, can continue them exactly.
        extrapolation = dataclasses.replace(extrapolation, length=config.position_table_size)
    return extrapolation
