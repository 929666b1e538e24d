"""What a user passes to `forward`/`generate` to switch a position-bias mitigation on: one frozen dataclass each.

Plain Python, no torch: the config validates its `stable_mask` field with these classes. Each field is checked when
the dataclass is made, so a bad value fails at the call, with the field, the value and what is allowed. Every option
takes its dataclass, the dict of its fields (`{"gamma": 0.05}`), or `None` (off).
"""

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

INT64_MAX = 2**63 - 1
MIN_TEMPERATURE = 1e-38
TEMPERATURE_BOUND = ": calibration's float32 logits (Attn(doc) - bias) / t, |Attn(doc) - bias| <= 1, overflow below it"
# A bucket's float32 angles m · scale / min(base, 1) stay finite (<= 2**63 · 1e18 < 3.4e38) for every int64 position m.
MIN_BUCKET_BASE, MAX_BUCKET_SCALE = 1e-9, 1e9
BUCKET_BOUNDS = (
    f": a bucket turns position m by up to m · scale / min(base, 1) radians, in float32, finite for every int64 m with "
    f"bases >= {MIN_BUCKET_BASE:g} and scales <= {MAX_BUCKET_SCALE:g}"
)


def plain_number(value) -> int | float | None:
    """`value` as a plain Python `int` or `float` if it is a real number of any numeric type (Python's, NumPy's, a
    `Fraction`, a 0-d array or tensor), else `None` (bools of any kind, strings, sequences, complex numbers): what an
    option or a config field keeps is plain, so a config saves as JSON."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # NumPy scalars, 0-d arrays and tensors
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def plain_integer(value) -> int | None:
    """`value` as a plain Python `int` if it is an integer of any integer type (`plain_number`), else `None`."""
    number = plain_number(value)
    return number if isinstance(number, int) else None


def is_sequence(value) -> bool:
    return not isinstance(value, str) and plain_number(value) is None and hasattr(value, "__iter__")


def as_int_tuple(name: str, field: str, value, empty: bool = True) -> tuple[int, ...] | None:
    """`value` (`None` or a sequence of integers, not empty unless `empty`) as a tuple of plain ints."""
    if value is None:
        return None
    if not is_sequence(value):
        raise ValueError(f"{name} {field}={value!r} must be a sequence of integers.")
    items = tuple(value)  # a generator is read once, here
    integers = tuple(plain_integer(item) for item in items)
    if None in integers:
        raise ValueError(f"{name} {field}={items!r} must be a sequence of integers.")
    if not (integers or empty):
        raise ValueError(f"{name} {field}=() is empty: give at least one.")
    return integers


def check_number(
    name: str,
    field: str,
    value,
    low: float | None = None,
    strict: bool = True,
    high: float | None = None,
    why: str = "",
) -> int | float:
    """`value` as a plain number (`plain_number`): finite, above `low` (or equal, unless `strict`) and at most `high`;
    `why` ends the error."""
    number = plain_number(value)
    if number is None or not math.isfinite(number):
        is_bool = str(getattr(value, "dtype", type(value).__name__)).endswith("bool")  # Python's, NumPy's, torch's
        bool_note = " (a bool is not a number here)" if is_bool else ""
        raise ValueError(f"{name} {field}={value!r} must be a finite number{bool_note}.")
    if low is not None and (number <= low if strict else number < low):
        raise ValueError(f"{name} {field}={value!r} must be {'>' if strict else '>='} {low}{why}.")
    if high is not None and number > high:
        raise ValueError(f"{name} {field}={value!r} must be <= {high:g}{why}.")
    return number


def as_positive_numbers(name: str, field: str, value, **bounds) -> tuple[float, ...] | None:
    """A non-empty sequence of finite numbers > 0 (within `bounds`, as `check_number` takes them), as a tuple of
    floats, or `None`."""
    if value is None:
        return None
    if not is_sequence(value):
        raise ValueError(f"{name} {field}={value!r} must be a non-empty sequence of positive numbers.")
    items = tuple(value)
    if not items:
        raise ValueError(f"{name} {field}=() is empty: give one number per bucket.")
    return tuple(float(check_number(name, field[:-1], item, **{"low": 0.0, **bounds})) for item in items)


def as_spans(name: str, field: str, spans) -> tuple[tuple[tuple[int, int], ...], ...]:
    """`name`'s `field`: per batch row, non-overlapping `(start, end)` integer spans, the same number (>= 1) in every
    row."""
    try:
        rows = tuple(tuple(tuple(span) for span in row) for row in spans)
    except TypeError:
        rows = None
    if rows is None or not all(len(span) == 2 for row in rows for span in row):
        try:  # one row's spans, given without the batch's list: a hint
            pairs = tuple(tuple(plain_integer(bound) for bound in pair) for pair in spans)
        except TypeError:
            pairs = ()
        one_row = pairs and all(len(pair) == 2 and None not in pair for pair in pairs)
        hint = f": for a batch of one row, {field}=[{pairs!r}]" if one_row else ""
        raise ValueError(f"{name} {field}={spans!r} must be, per batch row, a sequence of (start, end){hint}.")
    for row_index, row in enumerate(rows):
        for span in row:
            if None in (plain_integer(bound) for bound in span):
                raise ValueError(
                    f"{name} span {span!r} of row {row_index} must be two integers (token indices), not "
                    f"{', '.join(type(bound).__name__ for bound in span)}."
                )
    rows = tuple(tuple((plain_integer(start), plain_integer(end)) for start, end in row) for row in rows)
    if not rows or len({len(row) for row in rows}) != 1 or len(rows[0]) == 0:
        raise ValueError(
            f"{name} {field} must give every batch row the same number (>= 1) of documents; got "
            f"{[len(row) for row in rows]}."
        )
    for row_index, row in enumerate(rows):
        ordered = sorted(row)
        for start, end in ordered:
            if not 0 <= start < end:
                raise ValueError(
                    f"{name} span ({start}, {end}) of row {row_index} is empty or negative: a span is (start, end) "
                    "with 0 <= start < end."
                )
        for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False):
            if start < end:
                raise ValueError(f"{name} {field} of row {row_index} overlap: {ordered}.")
    return rows


FieldCheck = Callable[[str, str, object], object]  # (option's name, field, value) -> the value as kept


def checked(check: FieldCheck, default=dataclasses.MISSING, **metadata):
    """A field of an option dataclass whose value `check` refuses (a `ValueError` naming the option, the field, the
    value and what is allowed) or keeps as plain Python values, when the dataclass is made (`check_fields`);
    `metadata`: what else the field's users read."""
    return dataclasses.field(default=default, metadata={"check": check, **metadata})


def check_fields(options, name: str) -> None:
    """Each field of the dataclass instance `options` that `checked` declares, in field order: refused under `name`, or
    kept as its check returns it."""
    for spec in dataclasses.fields(options):
        if "check" in spec.metadata:
            object.__setattr__(options, spec.name, spec.metadata["check"](name, spec.name, getattr(options, spec.name)))


def with_bounds(check: FieldCheck, **bounds) -> FieldCheck:
    """`check` with these keywords: a closure rather than a `functools.partial`, which torch.compile does not trace
    (options are made inside compiled forwards, from the config)."""
    return lambda name, field, value: check(name, field, value, **bounds)


def integer(low: int) -> FieldCheck:
    """An integer >= `low`."""

    def check(name: str, field: str, value) -> int:
        number = plain_integer(value)
        if number is None or number < low:
            raise ValueError(f"{name} {field}={value!r} must be an integer >= {low}.")
        return number

    return check


def one_of(choices: tuple[str, ...]) -> FieldCheck:
    """One of the names `choices`, kept as a plain `str` (a NumPy string, or an array of one, is not a name)."""

    def check(name: str, field: str, value) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} {field}={value!r} is not one of {list(choices)}.")
        return str(value)

    return check


def from_fields(cls: type, value, name: str, renamed: dict[str, str] | None = None):
    """`value` as the dataclass `cls` (checked when made): one already; its namesake from another copy of this package
    (the installed one and a Hub checkpoint's custom code are two copies), by its fields; or a dict of its fields
    (`renamed`: older names of fields, still read), an unknown key refused under `name`. `None` for anything else."""
    if isinstance(value, cls):
        return value
    fields = cls.__match_args__  # the dataclass's fields; `dataclasses.fields(cls)` does not trace (torch.compile)
    if type(value).__name__ == cls.__name__ and all(hasattr(value, field) for field in fields):
        return cls(**{field: getattr(value, field) for field in fields})
    if not isinstance(value, dict):
        return None
    renamed = {old: new for old, new in (renamed or {}).items() if old in value}
    if both := [(old, new) for old, new in renamed.items() if new in value]:
        raise ValueError(f"{name} got both {both[0][0]!r} and {both[0][1]!r}, the older name of the same field.")
    value = {renamed.get(key, key): item for key, item in value.items()}
    unknown = set(value) - set(fields)
    if unknown:
        unknown = sorted(unknown, key=repr)  # keys of any type
        raise ValueError(f"{name} got unknown keys {unknown}: allowed are {', '.join(map(repr, fields))}.")
    return cls(**value)


# Options refused together, and why; `reorder_documents` is `generate`'s. SAME_LAYERS_ONLY: refused in shared layers.
REFUSED_TOGETHER = {
    ("stable_mask", "attention_calibration"): (
        "calibration redistributes a softmax row that sums to 1, and StableMask's rows do not"
    ),
    ("ms_poe", "positional_scaling"): "both rewrite the positional part of the queries and keys",
    ("stable_mask", "attention_buckets"): (
        "StableMask's sink logits are defined at integer positions, and a bucket may read positions m · scale"
    ),
    ("ms_poe", "attention_buckets"): "MS-PoE reads positions with the model's own base, not the bucket's",
    ("ms_poe", "parallel_context_windows"): "MS-PoE rescales the tokens' own positions, which the windows rewrite",
    ("attention_calibration", "parallel_context_windows"): (
        "calibration measures each document's positional bias at its slot of one sequence, and the windows give "
        "every document the first slots (their positions restart)"
    ),
    **{
        ("reorder_documents", name): "its spans would describe the documents where they were before reordering: "
        "reorder first (sepformer.reorder_documents returns the prompt and the documents' new spans), then generate "
        f"with {name} on the new spans"
        for name in ("attention_calibration", "parallel_context_windows")
    },
}
SAME_LAYERS_ONLY = {("ms_poe", "positional_scaling")}


def check_combination(layers: dict) -> None:
    """`layers`: the layers (a set) of each option of the call, by keyword; other keywords are not read."""
    for (first, second), why in REFUSED_TOGETHER.items():
        if first not in layers or second not in layers:
            continue
        if (first, second) not in SAME_LAYERS_ONLY:
            raise ValueError(f"{first} and {second} cannot be combined: {why}.")
        shared = layers[first] & layers[second]
        if shared:
            raise ValueError(f"{first} and {second} {why} of layers {sorted(shared)}: give them disjoint `layers`.")


class MitigationOptions:
    """Base of the option dataclasses: `parse` accepts an instance (also one from another copy of this module: the
    installed package and the Hub custom code are two copies), a dict of the fields, or `None` (off)."""

    name: ClassVar[str]  # the keyword of `forward` and `generate`
    renamed: ClassVar[dict[str, str]] = {}  # old field name -> new, still read from dicts (saved configs)

    def __post_init__(self):
        check_fields(self, self.name)
        self.check_across_fields()

    def check_across_fields(self) -> None:
        """The rules across fields (and what a field becomes given the others), once each field passed its own check
        (`checked`), in the order of the fields."""

    @classmethod
    def parse(cls, value):
        parsed = None if value is None else from_fields(cls, value, cls.name, cls.renamed)
        if value is not None and parsed is None:
            raise ValueError(f"{cls.name} must be a {cls.__name__}, a dict of its fields or None; got {value!r}.")
        return parsed

    def default_layers(self, num_layers: int) -> range:
        """The layers the option acts in when it is given no `layers`: its paper's choice."""
        return range(num_layers)

    def layer_set(self, num_layers: int) -> frozenset[int]:
        """The layers it acts in, checked against the model's."""
        layers = getattr(self, "layers", None)
        if layers is None:
            return frozenset(self.default_layers(num_layers))
        if len(layers) == 0 or len(set(layers)) != len(layers):
            raise ValueError(f"{self.name} layers={layers!r} must be a non-empty tuple of distinct layer indices.")
        bad = [layer for layer in layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"{self.name} layers {bad} are out of range: this model has layers 0..{num_layers - 1}.")
        return frozenset(layers)

    def repeat_rows(self, repeats: int) -> "MitigationOptions":
        """The options for a batch whose rows are each repeated `repeats` times (beam search, several return
        sequences): only options with per-row data change."""
        return self


class SpanOptions(MitigationOptions):
    """Options with a `spans` field: per batch row, `(start, end)` token spans."""

    spans: tuple[tuple[tuple[int, int], ...], ...]

    def repeat_rows(self, repeats: int) -> "SpanOptions":
        return dataclasses.replace(self, spans=tuple(row for row in self.spans for _ in range(repeats)))


def as_column_count(name: str, field: str, value) -> int | None:
    columns = plain_integer(value)
    if value is not None and (columns is None or not 1 <= columns <= INT64_MAX):
        raise ValueError(
            f"{name} {field}={value!r} must be None or a positive integer, at most 2**63 - 1 (positions are int64)."
        )
    return columns


@dataclass(frozen=True)
class StableMask(MitigationOptions):
    """StableMask (arXiv 2402.04779): `softmax(A ⊙ C + P) ⊙ C` with pseudo-scores `P_ij = -γ(j-1)` for `j > i`.

    Computed in its exact sink form: one extra logit `τ_t = log Σ_{j=t+1..N} e^{-γ(j-1)}` per query row `t` (the
    1-indexed absolute position) with a zero value vector, so no `n × n` matrix is built.

    Args:
        gamma: `γ > 0`, the decay of the pseudo-scores; large `γ` is the base model.
        columns: `N`, the last column the pseudo-scores run to; `None` is the model's `max_position_embeddings`.
            Rows at `t >= N` get no sink. Any size: `τ` is computed at the positions a call reads, not tabulated.
    """

    gamma: float = checked(with_bounds(check_number, low=0.0))
    columns: int | None = checked(as_column_count, default=None)
    name: ClassVar[str] = "stable_mask"
    renamed: ClassVar[dict[str, str]] = {"length": "columns"}


@dataclass(frozen=True)
class MSPoE(MitigationOptions):
    """MS-PoE (arXiv 2403.04797): head `h` sees positions `m / r_h`, ratios linear from `r_min` to `r_max`.

    Args:
        r_min, r_max: `1 <= r_min <= r_max`; the most position-aware head gets `r_min`.
        layers: layer indices; `None` is every layer but the first `min(2, num_layers // 2)` (the paper leaves the
            first two alone; a two-layer model keeps its first).
        head_order: heads from most to least position-aware (`head_order[0]` gets `r_min`). `None` ranks the heads of
            each layer and batch row at prefill by the position-awareness score `S_P` of the last query's attention
            row; the ranking is kept for every later decoding step.
    """

    r_min: float = checked(with_bounds(check_number, low=1.0, strict=False), default=1.2)
    r_max: float = checked(with_bounds(check_number, low=1.0, strict=False), default=1.8)
    layers: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    head_order: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    name: ClassVar[str] = "ms_poe"

    def check_across_fields(self) -> None:
        if self.r_max < self.r_min:
            raise ValueError(f"ms_poe r_max={self.r_max} must be >= r_min={self.r_min}.")

    def default_layers(self, num_layers: int) -> range:
        return range(min(2, num_layers // 2), num_layers)


@dataclass(frozen=True)
class AttentionCalibration(SpanOptions):
    """Attention calibration, "Found in the Middle" (arXiv 2406.16008).

    Args:
        spans: per batch row, the documents' `(start, end)` token spans (end exclusive, integers), counted like
            positions: from the row's first real token, so the same spans serve a row alone and left-padded in a
            batch. Every row has the same number of documents; spans do not overlap and lie inside the prompt.
            `generate` repeats each row's spans for its beams and return sequences.
        temperature: `t` of `α = softmax(rel / t)` over documents (paper: 5e-5); at least 1e-38, for finite float32
            logits.
        layers: layer indices; `None` is the last half of the layers (the paper's choice).
        dummy_document: token ids of the dummy document that measures `bias(k)` when it replaces document `k`;
            `None` is `pad_token_id` repeated to document `k`'s length (a document with no content), or where the
            config has no pad token (Llama 3, Mistral), its `eos_token_id`.
        bias_estimate: how `bias(k)` is measured. `"dummy_passes"` (the paper's): one extra forward pass per
            document, the dummy document in its place. `"positional"` (SepFormer only): no extra pass; in each
            layer, the attention document `k` would get if every one of its tokens kept its positional coordinates
            and took the documents' mean semantic coordinates, all other keys as they are. An approximation (how close
            it comes: docs/design.md): check it against the dummy passes on your task before relying on it.
    """

    spans: tuple[tuple[tuple[int, int], ...], ...] = checked(as_spans)
    temperature: float = checked(
        with_bounds(check_number, low=MIN_TEMPERATURE, strict=False, why=TEMPERATURE_BOUND), default=5e-5
    )
    layers: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    dummy_document: tuple[int, ...] | None = checked(with_bounds(as_int_tuple, empty=False), default=None)
    bias_estimate: str = checked(one_of(("dummy_passes", "positional")), default="dummy_passes")
    name: ClassVar[str] = "attention_calibration"

    def check_across_fields(self) -> None:
        if self.bias_estimate == "positional" and self.dummy_document is not None:
            raise ValueError(
                "attention_calibration dummy_document is only read by bias_estimate='dummy_passes'; "
                "bias_estimate='positional' runs no dummy document."
            )

    def default_layers(self, num_layers: int) -> range:
        return range(num_layers // 2, num_layers)


@dataclass(frozen=True)
class PositionalScaling(MitigationOptions):
    """Positional-dimension scaling (arXiv 2406.02536): chosen channels of the attention input times `s`.

    At prefill the last `last_recompute_tokens` rows are recomputed with scaled queries and keys (the scaled keys go
    into the cache); each decoding step reads the scaled input: by definition, not the full pass of the final sequence.

    Args:
        factor: `s` (paper's grid: 0.5, 0, -0.5, -1; default 0, as the authors' code); 1 is the base model. The
            attention scores carry `s²`: `|s|` is at most the square root of the model dtype's largest value.
        channels: hidden-state channels; `None` is SepFormer's positional block `[0, d_pos)`, known by construction.
        layers: layer indices; `None` is the middle layers (all but the first and the last when there are >= 3).
        skip_first: tokens at positions `< skip_first` (counted from each row's first real token) are never scaled.
        last_recompute_tokens: how many of the prompt's last rows are recomputed with scaled queries and keys.
    """

    factor: float = checked(check_number, default=0.0)
    channels: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    layers: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    skip_first: int = checked(integer(0), default=0)
    last_recompute_tokens: int = checked(integer(1), default=1)
    name: ClassVar[str] = "positional_scaling"

    def check_across_fields(self) -> None:
        if self.channels is not None and (len(self.channels) == 0 or len(set(self.channels)) != len(self.channels)):
            raise ValueError(f"positional_scaling channels={self.channels!r} must be distinct and non-empty.")

    def default_layers(self, num_layers: int) -> range:
        return range(1, num_layers - 1) if num_layers >= 3 else range(num_layers)


@dataclass(frozen=True)
class AttentionBuckets(MitigationOptions):
    """Attention Buckets (arXiv 2312.04455): `B` copies of the input, each reading positions its own way, with its own
    KV cache; the next-token logits are mixed by confidence, `Σ_b softmax_b(max_v logits_b) · logits_b`.

    Bucket `b` reads positions with `bases[b]` and/or `scales[b]` (give one or both, one value per bucket):

    Args:
        bases: the base of the model's base-parametrised position reading: rotary's `θ` when rotary is on, otherwise
            the sinusoidal positional map's base (10000 is the model's own). A learned table has no base: use `scales`.
        scales: bucket `b` reads the positional map and rotary at positions `m · scales[b]` (1 is the model's own).

    Bases are at least 1e-9 and scales at most 1e9, which keeps every bucket's float32 angles finite.
    """

    bases: tuple[float, ...] | None = checked(
        with_bounds(as_positive_numbers, low=MIN_BUCKET_BASE, strict=False, why=BUCKET_BOUNDS), default=None
    )
    scales: tuple[float, ...] | None = checked(
        with_bounds(as_positive_numbers, high=MAX_BUCKET_SCALE, why=BUCKET_BOUNDS), default=None
    )
    name: ClassVar[str] = "attention_buckets"

    def check_across_fields(self) -> None:
        if self.bases is None and self.scales is None:
            raise ValueError("attention_buckets needs bases=[...] or scales=[...] (one value per bucket).")
        if self.bases is not None and self.scales is not None and len(self.bases) != len(self.scales):
            raise ValueError(
                f"attention_buckets has {len(self.bases)} bases and {len(self.scales)} scales: give one of each per "
                "bucket."
            )

    @property
    def num_buckets(self) -> int:
        return len(self.bases if self.bases is not None else self.scales)


@dataclass(frozen=True)
class BucketRows(AttentionBuckets):
    """Several buckets as the rows of one batch, which the causal LM runs for them: of `rows` rows (b · B), row `r` a
    copy of batch row `r // B` reading positions as bucket `r % B`. A batch made from them with each row repeated in
    place (the dummy passes of calibration) keeps each copy's bucket. Equal to the same buckets over another number of
    rows."""

    rows: int = dataclasses.field(default=1, compare=False)


@dataclass(frozen=True)
class ParallelContextWindows(SpanOptions):
    """Parallel Context Windows (arXiv 2212.10947): each window attends only within itself (and to the tokens before
    the first window), its positions restart where the first window starts; the tokens after the last window (the
    task, and every generated token) take positions from the longest window on and attend to everything.

    Args:
        spans: per batch row, the windows' `(start, end)` token spans (end exclusive), counted from the row's first
            real token like `attention_calibration`'s; in every row the same number of windows, which follow one
            another without gaps (the windows cover the context from the first window's start to the last's end).
    """

    spans: tuple[tuple[tuple[int, int], ...], ...] = checked(
        lambda name, field, value: tuple(tuple(sorted(row)) for row in as_spans(name, field, value))
    )
    name: ClassVar[str] = "parallel_context_windows"

    def check_across_fields(self) -> None:
        for row_index, row in enumerate(self.spans):
            for (_, end), (start, _) in zip(row, row[1:], strict=False):
                if start != end:
                    raise ValueError(
                        f"parallel_context_windows spans of row {row_index} leave tokens {end}..{start - 1} between "
                        f"two windows ({list(row)}): windows follow one another without gaps (put separators inside "
                        "a window)."
                    )


__all__ = [
    "AttentionBuckets",
    "AttentionCalibration",
    "MSPoE",
    "MitigationOptions",
    "ParallelContextWindows",
    "PositionalScaling",
    "StableMask",
]
