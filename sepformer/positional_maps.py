"""Positional maps `p(i)`, the only part of a SepFormer that depends on position, and their extrapolation.

Three maps: a learned table (`LearnedPositions`), the fixed sinusoid (`SinusoidalPositions`) and a B-spline with learned
control points (`BSplinePositions`). Each map takes `position_ids` of shape (batch or 1, seq), integer or fractional,
and returns rows of shape (batch or 1, seq, d_pos). Past the `L` rows of a learned table, rows come from an
extrapolation method (`none`, `clamp`, `sinusoidal`, `fourier`, `interpolate`): docs/design.md, section 3, gives each
formula.
"""

import dataclasses
import math

import torch
from torch import nn

from .kept import kept_in
from .positional_options import (
    EXTRAPOLATION_METHODS,
    LEARNED_TABLE_METHODS,
    POSITIONAL_MAP_OPTIONS,
    PositionExtrapolation,
)

SINUSOID_BASE = 10000.0  # the sinusoidal map's base, as in "Attention Is All You Need"


def sinusoid(positions: torch.Tensor, dim: int, base: float | torch.Tensor = SINUSOID_BASE) -> torch.Tensor:
    """`PE(i)_{2k} = sin(i / base^{2k/dim})`, `PE(i)_{2k+1} = cos(i / base^{2k/dim})`; fractional `positions` too,
    and `base` one float or (b, 1, 1) one per row of `positions` (b, seq).

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
    weights[[0, -1] if length % 2 == 0 else [0]] = 1.0 / length
    k = torch.arange(frequencies, device=table.device, dtype=torch.float64)
    phase = 2 * math.pi * positions.double()[:, None] * k / length  # (n, L // 2 + 1)
    basis_real, basis_imag = phase.cos().float() * weights, phase.sin().float() * weights
    return (basis_real @ spectrum.real - basis_imag @ spectrum.imag).to(table.dtype)  # (n, d)


def compress_positions(positions: torch.Tensor, length: int, needed) -> torch.Tensor:
    """`i · (L-1)/(n-1)`: positions of a sequence of `n > L` tokens compressed into a table of `L` rows.

    Computed from the integer product `i · (L-1)`: its integer quotient by `n-1` plus the remainder's fraction, so the
    last position lands exactly on row `L-1` and no other rounds past it. Multiplying by a rounded scale can overshoot
    it (float32 `19 · (15/19)` is `15.000001`), and so can dividing the product in float32 once it is past `2^24`
    (`L = 2048` at `8L`); a reader that takes the ceiling then asks for a row past the table.
    """
    scaled = positions * (length - 1)
    whole = torch.div(scaled, needed - 1, rounding_mode="floor")
    return whole + (scaled - whole * (needed - 1)) / (needed - 1)


def interpolate_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows at fractional `positions` in `[0, len(table) - 1]`, linear between neighbouring rows."""
    low = positions.floor().long().clamp(0, table.shape[0] - 1)
    high = (low + 1).clamp(max=table.shape[0] - 1)
    weight = (positions - low).unsqueeze(-1).to(table.dtype)
    return torch.lerp(table[low], table[high], weight)


# The methods that make rows past a learned table: `(table, positions >= L, extrapolation) -> (n, d_pos)` rows, each
# registered under its name in `positional_options.EXTRAPOLATION_METHODS` (docs/design.md, section 3, the formulas).
EXTRAPOLATIONS = {
    "clamp": lambda table, positions, extrapolation: table[-1:].expand(positions.shape[0], -1),
    "sinusoidal": lambda table, positions, extrapolation: (
        table.float().std() * sinusoid(positions, table.shape[1])
    ).to(table.dtype),
    "fourier": lambda table, positions, extrapolation: fourier_rows(table, positions, extrapolation.components),
}


# Rows past a learned table made and kept for a generation: at most 64 MB in float32. A position far past the table
# (34 GB of rows up to position 10^9 at `d_pos = 8`) reads the method's rows at the call's positions only.
MAX_ROWS_VALUES = 2**24


def position_range(positions: torch.Tensor) -> tuple[int | float, int | float]:
    """(lowest, highest) position as Python numbers, from one reduction; a negative position is an error."""
    low, high = (value.item() for value in torch.aminmax(positions))
    if low < 0:
        raise ValueError(f"position {low} is negative: positions start at 0.")
    return low, high


def capacity_for(needed: int, length: int) -> int:
    """`length · 2^m`, the smallest such at least `needed`: rows made for it serve every shorter call."""
    return length * 2 ** max(0, math.ceil(math.log2(needed / length)))


class PositionalMap:
    """What every positional map is: an `nn.Module` built from the config, registered in `POSITIONAL_MAPS` under a
    name of `positional_options.POSITIONAL_MAP_OPTIONS` (which holds its parameters), with

    - `forward(position_ids, extrapolation, store=None) -> (b or 1, seq, d_pos)`: `p(i)` at integer or fractional
      positions; `extrapolation` is the call's `PositionExtrapolation` (a map defined everywhere ignores it), `store`
      where a generation keeps rows it made from the weights (`derived_store`), or `None`. A map whose reading has a
      base also takes `base=` (Attention Buckets read the sinusoid with other bases);
    - `table_coordinates(position_ids, extrapolation)`: where those positions read the map (`interpolate` compresses);
    - the training positions below: the positions themselves, shifted by random offsets (a learned table only), or
      randomized positions (Ruoss et al. 2023). At inference positions are always `0..n-1`."""

    def table_coordinates(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        return position_ids  # a map defined everywhere: nothing is compressed

    def setup_training_positions(self, config) -> None:
        self.random_offsets = config.random_position_offsets
        self.randomized = config.randomized_positions
        self.per_sequence_range = config.randomized_range == "per_sequence"
        self.position_range = config.position_table_size  # M: training positions lie in [0, M)

    def training_positions(self, position_ids: torch.Tensor, batch: int) -> torch.Tensor:
        if not (self.random_offsets or self.randomized):
            return position_ids
        highest = int(position_ids.max().ceil())  # fractional positions (attention buckets') read the next one too
        if highest >= self.position_range:
            option = "random_position_offsets" if self.random_offsets else "randomized_positions"
            raise ValueError(
                f"{option}: a training sequence reaches position {highest}, past the table of "
                f"position_table_size={self.position_range} rows; train on shorter sequences."
            )
        if self.random_offsets:
            # Half the rows shifted by a random offset, so that every row of the table gets trained; the other half
            # keep theirs: inference starts at 0, and with uniform offsets alone row 0 would be trained by one
            # sequence in `position_table_size - seq` only.
            offsets = torch.randint(0, self.position_range - highest, (batch, 1), device=position_ids.device)
            keep = torch.rand(batch, 1, device=position_ids.device) < 0.5
            return position_ids + offsets.masked_fill(keep, 0)  # (b, seq)
        return randomized_positions(
            position_ids.expand(batch, -1), highest + 1, self.position_range, self.per_sequence_range
        )


def randomized_positions(
    position_ids: torch.Tensor, needed: int, position_range: int, per_sequence_range: bool = False
) -> torch.Tensor:
    """Randomized positions (Ruoss et al., arXiv 2305.16843): each row's `i`-th position becomes the `i`-th smallest
    of `needed` distinct positions drawn uniformly from `[0, position_range)`, or with `per_sequence_range` from the
    row's own `[0, M')`, `M'` uniform in `[needed, position_range]` (why: docs/design.md, "Randomized positions");
    padding slots (position 0) read the row's first one. A fractional position (an attention bucket's `m · s`) reads
    linearly between the draws of the integers around it."""
    batch = position_ids.shape[0]
    scores = torch.rand(batch, position_range, device=position_ids.device)
    if per_sequence_range:
        row_range = torch.randint(needed, position_range + 1, (batch, 1), device=position_ids.device)  # M'
        scores = scores.masked_fill(torch.arange(position_range, device=position_ids.device) >= row_range, -1.0)
    chosen = scores.topk(needed, dim=-1).indices.sort(dim=-1).values  # (b, needed): a sorted uniform subset
    if not position_ids.is_floating_point():
        return chosen.gather(-1, position_ids)  # (b, seq)
    below = position_ids.floor().long()
    low, high = chosen.gather(-1, below), chosen.gather(-1, (below + 1).clamp(max=needed - 1))
    return low + (position_ids - below) * (high - low)  # (b, seq)


class LearnedPositions(nn.Embedding, PositionalMap):
    """A table of learned rows (the default map), extended past its end by a `PositionExtrapolation`."""

    def __init__(self, config):
        super().__init__(config.position_table_size, config.position_size)
        self.setup_training_positions(config)

    def forward(
        self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation, store: dict | None = None
    ) -> torch.Tensor:
        """`store`: where the generation keeps rows past the table between its steps (`derived_store`), or `None`.
        Fractional positions (MS-PoE's `p(i / r)`) read linearly between rows."""
        if torch.compiler.is_compiling():
            return self.traceable(position_ids, extrapolation)
        fractional = position_ids.is_floating_point()
        if position_ids.numel() == 0:
            return super().forward(position_ids.long())
        low, high = position_range(position_ids)
        if extrapolation.method == "interpolate" and not fractional:
            return interpolate_rows(self.weight, self.table_coordinates(position_ids, extrapolation))

        def read(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return interpolate_rows(table, positions) if fractional else nn.functional.embedding(positions, table)

        length, needed = self.num_embeddings, math.ceil(high) + 1
        if needed > length and extrapolation.method == "clamp":  # the last row past the table: no rows to make
            position_ids = position_ids.clamp(max=length - 1)
        elif needed > length:
            past_rows = capacity_for(needed, length) - length  # what `rows_past_table` would make and keep
            if extrapolation.method in EXTRAPOLATIONS and past_rows * self.embedding_dim > MAX_ROWS_VALUES:
                return self.traceable(position_ids, extrapolation)  # far past the table: the rows at these positions
            rows = self.rows_past_table(needed, extrapolation, store)  # rows L, L+1, ...
            if low >= length and not fractional:  # every position past the table (cached decoding past L): no copy
                return nn.functional.embedding(position_ids - length, rows)
            return read(torch.cat((self.weight, rows)), position_ids)  # (capacity, d_pos) table
        return read(self.weight, position_ids)

    def table_coordinates(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """Where in the table each position is read: itself, except under `interpolate` past the table (compressed).

        MS-PoE rescales these coordinates, so that `p(m / r)` and `p(m)` are read on the same scale.
        """
        if extrapolation.method != "interpolate":
            return position_ids
        length = self.num_embeddings
        row_needed = position_ids.amax(-1, keepdim=True) + 1  # (b or 1, 1): each row's own length
        if extrapolation.length is not None:
            if not torch.compiler.is_compiling() and int(row_needed.max()) > extrapolation.length:
                raise ValueError(
                    f"position {int(row_needed.max()) - 1} is past position_extrapolation 'interpolate' "
                    f"length={extrapolation.length}. Past the table ({length} rows), cached decoding with "
                    "'interpolate' needs the final sequence length: position_extrapolation={'method': 'interpolate', "
                    "'length': N}."
                )
            row_needed = torch.full_like(row_needed, extrapolation.length)
        compressed = compress_positions(position_ids, length, row_needed.clamp(min=2))
        return torch.where(row_needed > length, compressed, position_ids)  # identity for rows of at most L positions

    def rows_past_table(self, needed: int, extrapolation: PositionExtrapolation, store: dict | None) -> torch.Tensor:
        """Extrapolated rows `L, L+1, ...`, at least up to row `needed - 1`.

        Computed for a capacity rounded up to `L · 2^m`, so that with a `store` the decoding steps of a generation
        make them once per doubling of the length rather than at every step.
        """
        length, method = self.num_embeddings, extrapolation.method
        if method not in EXTRAPOLATIONS:
            choices = [name for name in (*EXTRAPOLATIONS, "interpolate") if name != method]
            raise ValueError(
                f"position {needed - 1} is past the learned positional table of {length} rows "
                f"(position_table_size) and position_extrapolation={method!r}"
                + (" (which compresses integer positions only)" if method == "interpolate" else "")
                + f". Choose an extrapolation method: {', '.join(map(repr, choices))}"
                + ", in the config or per call (`model(..., position_extrapolation='fourier')`)."
            )

        def make(count: int) -> torch.Tensor:
            return self.method_rows(torch.arange(length, length + count, device=self.weight.device), extrapolation)

        return kept_in(store, ("rows past the table", extrapolation), make, rows=capacity_for(needed, length) - length)

    def method_rows(self, positions: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """`p(i)` of a method of `EXTRAPOLATIONS` at 1-D `positions` (all assumed `>= L`): (n, d_pos)."""
        with torch.autocast(self.weight.device.type, enabled=False):  # a cached extension must not carry autocast's
            return EXTRAPOLATIONS[extrapolation.method](self.weight, positions, extrapolation)  # dtype

    def traceable(self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation) -> torch.Tensor:
        """The same rows without data-dependent branches (under `torch.compile`, and far past the table): every method
        is evaluated at every position and selected where the position is past the table; fractional positions lie
        between the rows at their floor and the next. `none` indexes the table as it is; `interpolate` compresses each
        row as eagerly."""
        length, method = self.num_embeddings, extrapolation.method
        fractional = position_ids.is_floating_point()  # table coordinates already (MS-PoE's `p(m / r)`)
        if fractional and method not in EXTRAPOLATIONS:  # `none`, `interpolate`: between the table's rows
            return interpolate_rows(self.weight, position_ids)
        if method == "interpolate":
            return interpolate_rows(self.weight, self.table_coordinates(position_ids, extrapolation))
        if method not in EXTRAPOLATIONS:  # `none`
            return super().forward(position_ids)
        if fractional:
            low = position_ids.floor()
            weight = (position_ids - low).unsqueeze(-1).to(self.weight.dtype)
            low = low.long()
            return torch.lerp(self.traceable(low, extrapolation), self.traceable(low + 1, extrapolation), weight)
        inside = super().forward(position_ids.clamp(max=length - 1))
        past = self.method_rows(position_ids.flatten(), extrapolation).view(*position_ids.shape, -1)
        return torch.where((position_ids >= length).unsqueeze(-1), past, inside)


class SinusoidalPositions(nn.Module, PositionalMap):
    """The fixed sinusoid of "Attention Is All You Need" over `d_pos` dimensions, defined at every position."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.position_size
        self.setup_training_positions(config)

    def forward(
        self,
        position_ids: torch.Tensor,
        extrapolation: PositionExtrapolation,
        store: dict | None = None,
        base: float | torch.Tensor = SINUSOID_BASE,
    ) -> torch.Tensor:
        """`base`: another base than the map's own, or (b, 1, 1) one per row (Attention Buckets). Made from no weight:
        nothing to `store`."""
        return sinusoid(position_ids, self.dim, base)

    def extra_repr(self):
        return f"dim={self.dim}"


def bspline_knots(control_points: int, degree: int, end: float) -> torch.Tensor:
    """The clamped uniform knot vector over `[0, end]`: `degree + 1` knots at each end, `control_points - degree`
    equal segments between them (float64, `control_points + degree + 1` knots)."""
    breakpoints = torch.linspace(0.0, end, control_points - degree + 1, dtype=torch.float64)
    return torch.cat((breakpoints[:1].repeat(degree), breakpoints, breakpoints[-1:].repeat(degree)))


def bspline_basis(positions: torch.Tensor, knots: torch.Tensor, degree: int, extension: str) -> torch.Tensor:
    """`N_{i,k}(t)` for every control point `i` at real `positions` (...): (..., n), float64, by Cox–de Boor.

    On `[0, end]` (the knots' span) the rows sum to 1. Past `end`, `clamp` keeps the end's basis (`p(t) = c_{n-1}`)
    and `linear` continues along the end's tangent: `p(end) + (t - end) p'(end)`, `p'(end) = k (c_{n-1} - c_{n-2}) / h`
    for the last segment's length `h` (the clamped knots make only the last two control points reach the end).
    """
    end = knots[-1]
    inside = positions.double().clamp(max=end)[..., None]  # (..., 1)
    # degree 0: indicators of the half-open spans [t_i, t_{i+1}); `end` itself belongs to the last non-empty one
    basis = ((knots[:-1] <= inside) & (inside < knots[1:])).double()  # (..., n + k)
    last_span = len(knots) - degree - 2
    basis[..., last_span] = torch.where(inside[..., 0] == end, 1.0, basis[..., last_span])
    for d in range(1, degree + 1):
        width = basis.shape[-1] - 1  # functions of degree d
        left, right = knots[:width], knots[d + 1 : d + 1 + width]  # t_i, t_{i+d+1}
        rise = span_ratio(inside - left, knots[d : d + width] - left)  # (t - t_i) / (t_{i+d} - t_i)
        fall = span_ratio(right - inside, right - knots[1 : 1 + width])  # (t_{i+d+1} - t) / (t_{i+d+1} - t_{i+1})
        basis = rise * basis[..., :-1] + fall * basis[..., 1:]  # (..., n + k - d)
    if extension == "linear":
        slope = degree / (end - knots[-degree - 2])  # k / h
        beyond = (positions.double() - end).clamp(min=0)[..., None] * slope  # (..., 1)
        basis = torch.cat((basis[..., :-2], basis[..., -2:-1] - beyond, basis[..., -1:] + beyond), -1)
    return basis


def span_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`numerator / denominator`, 0 where the span is empty (repeated knots: Cox–de Boor's `0/0 = 0`)."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=torch.finfo(torch.float64).tiny), 0.0)


class BSplinePositions(nn.Module, PositionalMap):
    """`p(t) = Σ_i N_{i,k}(t) c_i`: `n` learned control points `c_i` (`control_points`, `n ≪ L`) and the B-spline
    basis of degree `k` (`degree`) on clamped uniform knots over `[0, T-1]`, `T` the `position_table_size` (`L`, or
    the range of randomized positions). Defined at every real position; past `T-1` as `extension` says
    (`positional_options.BSplineMap`).

    Integer positions read rows computed for `0 .. T·2^m - 1`, once per generation where there is a `store`, as the
    learned table's extension is. Fractional positions (MS-PoE) evaluate the basis at the position itself.
    """

    def __init__(self, config):
        super().__init__()
        options = config.map_options()
        self.degree, self.extension, self.length = options.degree, options.extension, config.position_table_size
        self.control_points = nn.Parameter(torch.empty(options.control_points, config.position_size))
        self.setup_training_positions(config)
        self._knots = None  # float64 knots on the control points' device

    def knots(self) -> torch.Tensor:
        device = self.control_points.device
        if self._knots is None or self._knots.device != device:
            self._knots = bspline_knots(self.control_points.shape[0], self.degree, float(self.length - 1)).to(device)
        return self._knots

    def forward(
        self, position_ids: torch.Tensor, extrapolation: PositionExtrapolation, store: dict | None = None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling() or position_ids.numel() == 0:
            return self.rows_at(position_ids)
        _, high = position_range(position_ids)  # refuses a negative position
        if position_ids.is_floating_point():
            return self.rows_at(position_ids)
        rows = kept_in(
            store,
            "spline rows",
            lambda count: self.rows_at(torch.arange(count, device=position_ids.device)),
            rows=capacity_for(high + 1, self.length),
        )
        return nn.functional.embedding(position_ids, rows)  # (b or 1, seq, d_pos)

    def rows_at(self, positions: torch.Tensor) -> torch.Tensor:
        """`Σ_i N_i(t) c_i` at real `positions` (...): (..., d_pos). Summed control point by control point, in the
        same order for every position: a position's row is the same bit for bit whatever else the call reads (MS-PoE's
        identity compares the rows at `m / 1` with those at `m`)."""
        weight = self.control_points
        with torch.autocast(weight.device.type, enabled=False):
            basis = bspline_basis(positions, self.knots(), self.degree, self.extension).to(weight.dtype)
            rows = basis[..., :1] * weight[0]
            for i in range(1, weight.shape[0]):
                rows = rows + basis[..., i : i + 1] * weight[i]
            return rows

    def extra_repr(self):
        return (
            f"control_points={tuple(self.control_points.shape)}, degree={self.degree}, knots=[0, "
            f"{self.length - 1}], extension={self.extension!r}"
        )


POSITIONAL_MAPS = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions, "bspline": BSplinePositions}


def check_registries(
    methods=EXTRAPOLATION_METHODS,
    extrapolations=EXTRAPOLATIONS,
    map_names=tuple(POSITIONAL_MAP_OPTIONS),
    maps=POSITIONAL_MAPS,
) -> None:
    """The names the config knows (`positional_options`) and the implementations here agree: a method or map named in
    one registry only would be accepted by the config and fail in the model, or never be reachable."""
    for kind, named, implemented, where in (
        ("extrapolation method", set(methods) - set(LEARNED_TABLE_METHODS), set(extrapolations), "EXTRAPOLATIONS"),
        ("positional map", set(map_names), set(maps), "POSITIONAL_MAPS"),
    ):
        unimplemented, unnamed = sorted(named - implemented), sorted(implemented - named)
        if unimplemented or unnamed:
            raise ValueError(
                f"the {kind} registries disagree: {unimplemented or 'none'} named in positional_options without an "
                f"implementation in positional_maps.{where}, {unnamed or 'none'} implemented there without a name in "
                "positional_options. Register each under the same name in both."
            )


check_registries()


def call_extrapolation(config, value, continuing: bool) -> PositionExtrapolation:
    """The call's `position_extrapolation` (the config's when `None`), checked against the model: the config's too,
    which an assignment to a live config may have changed without the checks of its construction."""
    extrapolation = config.default_extrapolation() if value is None else PositionExtrapolation.parse(value)
    config.check_extrapolation(extrapolation)
    if extrapolation.method == "interpolate" and extrapolation.length is None and continuing:
        # The cached keys were made with the scale of an earlier length: only positions inside the table, where
        # the scale is 1, can continue them exactly.
        extrapolation = dataclasses.replace(extrapolation, length=config.position_table_size)
    return extrapolation


def check_position_readable(model, last: int, position_extrapolation, continuing: bool) -> None:
    """Refuse position `last` where the learned table of `model` (a `SepFormerForCausalLM`) cannot read it under the
    call's `position_extrapolation` (`call_extrapolation`), with the error reading it would raise; the other maps are
    defined at every position."""
    extrapolation = call_extrapolation(model.config, position_extrapolation, continuing)
    table = model.model.embed_positions
    if not isinstance(table, LearnedPositions):
        return
    if extrapolation.method == "none" and last >= table.num_embeddings:
        table(torch.tensor([[last]], device=table.weight.device), extrapolation)  # raises before reading a row
    if extrapolation.method == "interpolate":
        table.table_coordinates(torch.tensor([[last]]), extrapolation)
