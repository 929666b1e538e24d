"""SepFormer configuration, in the style of transformers' `LlamaConfig`: `@strict` dataclass fields, choices as
`Literal`, ranges as `interval` and validated fields, combinations in `validate_architecture`. Torch-free: it imports
the names of the positional maps and extrapolation methods (`positional_options`), not their code.

Every mistake is refused before anything is built or written, by an error that names the field, the value and what
is allowed: a wrong type is a `TypeError` (also `StrictDataclassFieldValidationError`), a wrong value or combination a
`ValueError`, a keyword the config would ignore a `TypeError`, a field its settings never read a `ValueError`; in a
saved config (one with `transformers_version`) the last two warn, so that older `config.json` files still load. A value
is checked whenever it is set (also on assignment); combinations when the config is made, loaded and saved and when a
model is built from it, so that related fields can be assigned one after the other. Special token ids are checked
against the vocabulary only on saving: transformers' workflows set them after the vocabulary.

The derived sizes (`DERIVED_SIZES`) keep what the user gave: `None` (the default) follows the fields it derives from,
also when those are assigned later, and is saved as `null`. Reading one always gives the resolved integer.
"""

import copy
import dataclasses
import difflib
import math
import warnings
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from huggingface_hub.dataclasses import as_validated_field, strict
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import GenerationConfig, PreTrainedConfig
from transformers.utils.type_validators import activation_fn_key, interval

from .mitigation_options import StableMask
from .positional_options import EXTRAPOLATION_PARAMETERS, POSITIONAL_MAP_NAMES, SPLINE_EXTENSIONS, PositionExtrapolation

# Sizes that `None` derives from other fields: how, in one place (also what the messages say).
DERIVED_SIZES = {
    "position_size": ("head_dim", lambda config: config.head_dim),
    "position_table_size": ("max_position_embeddings", lambda config: config.max_position_embeddings),
    "position_intermediate_size": ("4 * position_size", lambda config: 4 * config.position_size),
    "semantic_intermediate_size": ("4 * (hidden_size - position_size)", lambda config: 4 * config.semantic_size),
}

# Fields of older configs that `position_extrapolation` now holds, and the parameter each became.
LEGACY_EXTRAPOLATION_FIELDS = {"fourier_components": "components", "interpolation_length": "length"}

# Keywords of other architectures' configs that SepFormer does not read, and what to do instead.
FOREIGN_KEYWORDS = {
    "intermediate_size": "use position_intermediate_size and semantic_intermediate_size (one MLP per block)",
    "n_inner": "use position_intermediate_size and semantic_intermediate_size (one MLP per block)",
    "rms_norm_eps": "use norm_eps",
    "layer_norm_eps": "use norm_eps",
    "layer_norm_epsilon": "use norm_eps",
    "n_positions": "use max_position_embeddings",
    "n_embd": "use hidden_size",
    "n_layer": "use num_hidden_layers",
    "n_head": "use num_attention_heads",
    "num_key_value_heads": "SepFormer has no grouped-query attention (every head has its own keys and values)",
    "hidden_dropout_prob": "use hidden_dropout",
    "resid_pdrop": "use hidden_dropout",
    "embd_pdrop": "use hidden_dropout",
    "attention_probs_dropout_prob": "use attention_dropout",
    "attn_pdrop": "use attention_dropout",
    "activation_function": "use hidden_act",
    "hidden_activation": "use hidden_act",
    "rope_scaling": "SepFormer's rotary embedding (rotary_dim, rope_theta) has no scaling; positions past the table "
    "use position_extrapolation",
    "rope_parameters": "use rotary_dim and rope_theta (SepFormer's rotary embedding has no scaling types)",
    "head_dim": "set hidden_size and num_attention_heads (head_dim = hidden_size / num_attention_heads)",
    "semantic_size": "set hidden_size and position_size (semantic_size = hidden_size - position_size)",
    "d_model": "use hidden_size",
    "num_heads": "use num_attention_heads",
    "num_layers": "use num_hidden_layers",
    "dropout": "use hidden_dropout and attention_dropout",
    "max_seq_len": "use max_position_embeddings",
}


class ConfigTypeError(StrictDataclassFieldValidationError, TypeError):
    """A config field set to a value of the wrong type: a `TypeError`, and the error `@strict` dataclasses raise."""

    def __init__(self, message: str):
        Exception.__init__(self, message)


def _check_fields_on_every_assignment(cls):
    """Run each field's `@strict` validators with messages that name the field: a wrong type is a `ConfigTypeError`, a
    string outside a `Literal` or a wrong value a `ValueError`. Make the derived sizes properties over stored values."""
    strict_setattr = cls.__setattr__
    field_types = {field.name: field.type for field in dataclasses.fields(cls)}

    def __setattr__(self, name, value):
        if name in field_types:
            _check_field(cls, name, value, field_types[name])
        strict_setattr(self, name, value)

    cls.__setattr__ = __setattr__
    for name in DERIVED_SIZES:
        setattr(cls, name, _derived_size(name))
    return cls


def _check_field(cls, name, value, annotation) -> None:
    type_check, *value_checks = cls.__validators__[name]  # `@strict` puts the type's check first
    try:
        type_check(value)
    except (TypeError, ValueError):
        if get_origin(annotation) is Literal and isinstance(value, str):
            raise ValueError(
                f"{name}={value!r} is not allowed: choose one of {', '.join(map(repr, get_args(annotation)))}."
            ) from None
        raise ConfigTypeError(_type_message(name, value, annotation)) from None
    for check in value_checks:
        try:
            check(value)
        except ValueError as error:
            reason = str(error)
            raise ValueError(f"{name}={value!r} is not allowed: {reason[:1].lower()}{reason[1:]}") from None


def _derived_size(name: str) -> property:
    meaning, resolve = DERIVED_SIZES[name]

    def get(self):
        value = self.__dict__.get(name)
        return resolve(self) if value is None else value

    def set_(self, value):
        self.__dict__[name] = value

    return property(get, set_, doc=f"`{name}`; `None` (stored and saved as such) reads as {meaning}.")


def _allowed(condition, allowed: str):
    """A validated field whose value must satisfy `condition`; `allowed` says what is (the field and value are added)."""

    def check(value):
        if not condition(value):
            raise ValueError(allowed)

    return as_validated_field(check)


def _size_or_derived(name: str, minimum: int = 1):
    """A size that `None` derives; `minimum` 0 for the positional MLP, whose width is 0 in a `position_size=0` model
    (configs saved before the sizes were derived store it; whether it must be positive is `validate_architecture`'s)."""
    allowed = f"it must be a positive integer, or None for {DERIVED_SIZES[name][0]}."
    return _allowed(lambda value: value is None or value >= minimum, allowed)(default=None)


def _stable_mask(value):
    if value is None:
        return
    try:
        StableMask.parse(value)  # raises ValueError on unknown keys or bad values
    except TypeError as error:  # a required field missing: the dataclass's own message
        fields = ", ".join(repr(field.name) for field in dataclasses.fields(StableMask))
        raise ValueError(f"it must be a dict of StableMask's fields ({fields}), with at least 'gamma' ({error}).") from None


positive = interval(min=1)
finite_positive = interval(min=0, max=math.inf, exclude_min=True, exclude_max=True)
probability = interval(min=0, max=1, exclude_max=True)
token_id = _allowed(lambda value: value != [], "it must be None, a token id or a non-empty list of token ids.")


@_check_fields_on_every_assignment
@strict
class SepFormerConfig(PreTrainedConfig):
    r"""
    Configuration of a SepFormer: a decoder-only causal LM whose hidden state is `[p(i) ‖ s(token)]`, with the
    positional block in coordinates `[0, position_size)` and the semantic block in the rest.

    Args:
        vocab_size: tokens in the vocabulary (259 = 256 bytes + pad, bos, eos for `SepFormerTokenizer`).
        hidden_size: `d_model = d_pos + d_sem`.
        position_size: `d_pos`, the width of the positional block. `None` means `head_dim` (and follows
            `hidden_size`/`num_attention_heads` when they are assigned later); `0` is a model with no positional
            information at all (NoPE). Must be smaller than `hidden_size`.
        num_hidden_layers, num_attention_heads: depth and heads; `head_dim = hidden_size / num_attention_heads`.
        position_intermediate_size, semantic_intermediate_size: hidden widths of the two MLPs. `None` means
            4x the block's width (following later changes of the block's width).
        hidden_act: activation of both MLPs (any name of `transformers.activations.ACT2FN`).
        max_position_embeddings: `L`, the training length (rows of the learned positional table).
        positional_map: `"learned"` (a table of `L` rows), `"sinusoidal"` (fixed, over `d_pos` dimensions) or
            `"bspline"` (`p(t) = Σ_i N_{i,k}(t) c_i`, learned control points, knots over `[0, position_table_size-1]`).
        position_extrapolation: how a learned table answers positions past its rows: a method of
            `EXTRAPOLATION_PARAMETERS` by name (`"none"`: an error, `"clamp"`, `"sinusoidal"`, `"fourier"`,
            `"interpolate"`) or a dict of it and its parameters (`{"method": "fourier", "components": 16}`,
            `{"method": "interpolate", "length": 2048}`). Overridable per call. The fields `fourier_components` and
            `interpolation_length` of older configs still load, folded into it.
        position_table_size: `M`, the positions a map is trained on: rows of the learned table, the end of the
            B-spline's knots, the range of randomized positions. `None` means `max_position_embeddings` (following
            later assignments of it). Larger than `L` it needs `random_position_offsets` or `randomized_positions`.
        random_position_offsets: in training, shift each sequence's positions by a random offset so that every row
            of a `position_table_size > max_position_embeddings` table is trained (learned table only).
        randomized_positions: in training, give each sequence a sorted random subset of distinct positions from
            `[0, position_table_size)` (Ruoss et al. 2023); at inference positions are `0..n-1`. Any map.
        randomized_range: `"fixed"` draws every sequence's positions from `[0, position_table_size)`;
            `"per_sequence"` first draws each sequence's own range `[0, M')`, `M'` uniform between its length and
            `position_table_size`, so that gaps run from none (the positions of inference) to the widest.
        spline_control_points: `n`, the B-spline's learned control points (`positional_map="bspline"`).
        spline_degree: `k`, the B-spline's degree (3: cubic).
        spline_extension: the B-spline past its last knot: `"clamp"` (the last control point) or `"linear"` (the
            end's tangent continued).
        norm_type: `"rmsnorm"` or `"layernorm"`; each subspace is normalised on its own.
        norm_eps: epsilon of the norms.
        lm_head_input: which block the LM head reads, `"semantic"` or `"all"`.
        rotary_dim: rotary embedding on the first `rotary_dim` dimensions of every query/key head; `0` is off.
        rope_theta: rotary base.
        attention_dropout, hidden_dropout: dropout on attention probabilities and on the residual branches and
            embeddings.
        attention_bias, mlp_bias: biases of the attention projections and of the MLPs.
        initializer_range: std of the normal initialisation.
        stable_mask: StableMask's fields as a dict (`{"gamma": 0.05}`), on in training and inference; `None` is off.
            A call's `stable_mask=` overrides it.
        fuse_decoding_projections: decoding steps run each layer on weights laid out for them and kept on the KV
            cache (`FusedProjections`: q/k/v and o as two dense matmuls, on a CPU the MLPs' weights stored
            `(in, out)`; up to 1.09x the layer's weights more memory while the cache lives at `d_pos = d / 4`).
            `False` keeps the modules.
        pad_token_id, bos_token_id, eos_token_id: ids inside the vocabulary (`0 <= id < vocab_size`) or `None`;
            `eos_token_id` may be a list of ids, and -1 for "never stop". Checked when the config is saved, so that
            they can be set after `vocab_size`.
    """

    model_type = "sepformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = positive(default=259)
    hidden_size: int = positive(default=256)
    position_size: int | None = _allowed(
        lambda value: value is None or value >= 0,
        "it must be None (head_dim), 0 (a model without positions) or a positive integer smaller than hidden_size.",
    )(default=None)
    num_hidden_layers: int = positive(default=4)
    num_attention_heads: int = positive(default=4)
    position_intermediate_size: int | None = _size_or_derived("position_intermediate_size", minimum=0)
    semantic_intermediate_size: int | None = _size_or_derived("semantic_intermediate_size")
    hidden_act: str = activation_fn_key(default="gelu_pytorch_tanh")
    max_position_embeddings: int = positive(default=512)
    positional_map: Literal[POSITIONAL_MAP_NAMES] = "learned"
    position_extrapolation: str | dict = as_validated_field(PositionExtrapolation.parse)(default="none")
    position_table_size: int | None = _size_or_derived("position_table_size")
    random_position_offsets: bool = False
    randomized_positions: bool = False
    randomized_range: Literal["fixed", "per_sequence"] = "fixed"
    spline_control_points: int = interval(min=2)(default=16)
    spline_degree: int = positive(default=3)
    spline_extension: Literal[SPLINE_EXTENSIONS] = "clamp"
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float | int = finite_positive(default=1e-6)
    lm_head_input: Literal["semantic", "all"] = "semantic"
    tie_word_embeddings: bool = False
    rotary_dim: int = _allowed(
        lambda value: value >= 0 and value % 2 == 0,
        "it must be 0 (off) or an even number <= head_dim (the rotated dimensions of each head come in pairs).",
    )(default=0)
    rope_theta: float | int = finite_positive(default=10000.0)
    attention_dropout: float | int = probability(default=0.0)
    hidden_dropout: float | int = probability(default=0.0)
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float | int = interval(min=0, max=math.inf, exclude_max=True)(default=0.02)
    stable_mask: dict | None = as_validated_field(_stable_mask)(default=None)
    fuse_decoding_projections: bool = True
    use_cache: bool = True
    pad_token_id: int | None = token_id(default=256)
    bos_token_id: int | None = token_id(default=257)
    eos_token_id: int | list[int] | None = token_id(default=258)

    def __post_init__(self, **kwargs):
        # Fields were checked one by one as they were set; the keywords that are no field come here.
        saved = self.transformers_version is not None
        self._fold_legacy_extrapolation(kwargs, saved)
        _check_ignored_keywords(kwargs, saved)
        super().__post_init__(**kwargs)
        # `@strict` runs the `validate_*` methods too, but wraps their errors; calling it here raises the plain
        # `ValueError` (from the constructor, `from_pretrained` and the Auto classes alike).
        self.validate_architecture()

    def _fold_legacy_extrapolation(self, kwargs: dict, saved: bool) -> None:
        """`fourier_components` / `interpolation_length` (older configs' fields, or keywords) into
        `position_extrapolation`. At its default a field the method does not read is what every older config saved."""
        extrapolation = PositionExtrapolation.parse(self.position_extrapolation)
        reads = EXTRAPOLATION_PARAMETERS[extrapolation.method]
        folded = {}
        for old, parameter in LEGACY_EXTRAPOLATION_FIELDS.items():
            if old not in kwargs:
                continue
            value = kwargs.pop(old)
            if parameter in reads:
                if isinstance(self.position_extrapolation, dict) and parameter in self.position_extrapolation:
                    raise ValueError(
                        f"{old}={value!r} and position_extrapolation={self.position_extrapolation!r} both set "
                        f"{parameter}: give it once, in position_extrapolation."
                    )
                folded[parameter] = value
            elif value != PositionExtrapolation.__dataclass_fields__[parameter].default:
                reader = next(method for method, names in EXTRAPOLATION_PARAMETERS.items() if parameter in names)
                message = (
                    f"{old}={value!r} is read only with {reader!r} (it would be ignored); this config has "
                    f"position_extrapolation={self.position_extrapolation!r}. Set that, or leave {old} out."
                )
                _refuse(ValueError(message), saved)
        if folded:
            self.position_extrapolation = dataclasses.replace(extrapolation, **folded).as_config_value()

    def check_combinations(self) -> None:
        """Every check that involves more than one field (`validate_architecture`, `check_token_ids`), raising the
        plain `ValueError`. `save_pretrained` needs a config that passes (the model's constructor, its architecture)."""
        self.validate_architecture()
        self.check_token_ids()

    def with_sizes_fixed(self) -> "SepFormerConfig":
        """This config if its derived sizes are all set, else a copy with each set to its value now: a model's config
        describes the model's weights, so its sizes no longer follow later assignments."""
        if all(self.__dict__.get(name) is not None for name in DERIVED_SIZES):
            return self
        fixed = copy.deepcopy(self)
        for name in DERIVED_SIZES:
            fixed.__dict__[name] = getattr(self, name)
        return fixed

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        # Before anything is written (the folder, Hub code files): assignments are not checked together.
        self.check_combinations()
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def semantic_size(self) -> int:
        return self.hidden_size - self.position_size

    def validate_architecture(self):
        """Every invalid value or combination, with the field, the value and what is allowed."""
        field_types = {field.name: field.type for field in dataclasses.fields(self)}
        for name, annotation in field_types.items():  # also values that reached `__dict__` without an assignment
            _check_field(type(self), name, self.__dict__.get(name), annotation)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: head_dim = hidden_size / num_attention_heads must be an integer."
            )
        if not 0 <= self.position_size < self.hidden_size:
            raise ValueError(
                f"position_size={self.position_size} is not allowed: it must satisfy 0 <= position_size < "
                f"hidden_size={self.hidden_size} (0 is a model without positions; position_size = hidden_size "
                "would leave no semantic dimensions)."
            )
        if self.position_size > 0 and self.position_intermediate_size < 1:
            raise ValueError(
                f"position_intermediate_size={self.position_intermediate_size} is not allowed: it must be a positive "
                "integer, or None for 4 * position_size."
            )
        if self.position_size == 0 and self.__dict__.get("position_intermediate_size") not in (None, 0):  # 0: as saved before it was derived
            raise ValueError(
                f"position_intermediate_size={self.position_intermediate_size} is not used: position_size=0 has no "
                "positional block and no positional MLP; leave it None."
            )
        if self.semantic_intermediate_size < 1:  # derived from a semantic block of width 0 or less
            raise ValueError(f"semantic_intermediate_size={self.semantic_intermediate_size} must be a positive integer.")
        if self.positional_map == "sinusoidal" and self.position_size % 2 == 1:
            raise ValueError(
                f"position_size={self.position_size} is odd, but positional_map='sinusoidal' needs an even "
                "position_size (sine/cosine pairs)."
            )
        if self.rotary_dim == 0 and self.rope_theta != 10000.0:
            message = (
                f"rope_theta={self.rope_theta!r} is read only with rotary_dim > 0 (it would be ignored); this config "
                "has rotary_dim=0. Set that, or leave rope_theta at its default 10000.0."
            )
            _refuse(ValueError(message), saved=self.transformers_version is not None)
        self.check_extrapolation(self.default_extrapolation())  # raises on an unknown method or bad values
        has_table = self.has_positional_table
        if self.position_table_size < self.max_position_embeddings:
            raise ValueError(
                f"position_table_size={self.position_table_size} must be >= max_position_embeddings="
                f"{self.max_position_embeddings}."
            )
        if self.position_table_size > self.max_position_embeddings and not (
            self.random_position_offsets or self.randomized_positions
        ):
            raise ValueError(
                f"position_table_size={self.position_table_size} > max_position_embeddings="
                f"{self.max_position_embeddings} needs random_position_offsets=True or randomized_positions=True: "
                "otherwise the positions past max_position_embeddings are never trained."
            )
        if self.random_position_offsets and self.randomized_positions:
            raise ValueError(
                "random_position_offsets=True and randomized_positions=True are two ways of choosing the training "
                "positions: choose one."
            )
        if self.randomized_positions and not (
            self.position_size > 0 and self.position_table_size > self.max_position_embeddings
        ):
            raise ValueError(
                "randomized_positions=True needs a positional map (position_size > 0) and a range of positions "
                f"position_table_size > max_position_embeddings={self.max_position_embeddings} to draw from; got "
                f"position_size={self.position_size}, position_table_size={self.position_table_size}."
            )
        if self.randomized_range != "fixed" and not self.randomized_positions:
            raise ValueError(
                f"randomized_range={self.randomized_range!r} is read only with randomized_positions=True (it would be "
                "ignored): set randomized_positions=True or leave randomized_range='fixed'."
            )
        spline_fields = {"spline_control_points": 16, "spline_degree": 3, "spline_extension": "clamp"}
        changed = [
            f"{name}={getattr(self, name)!r}"
            for name, default in spline_fields.items()
            if getattr(self, name) != default
        ]
        if changed and self.positional_map != "bspline":
            raise ValueError(
                f"{', '.join(changed)} shape the B-spline map only (it would be ignored): set positional_map='bspline' "
                f"or leave them at their defaults; positional_map is {self.positional_map!r}."
            )
        if self.spline_degree >= self.spline_control_points:
            raise ValueError(
                f"spline_degree={self.spline_degree} needs more control points than that: spline_control_points="
                f"{self.spline_control_points} must be > spline_degree (a B-spline of degree k has k + 1 control "
                "points per segment)."
            )
        if self.positional_map == "bspline" and self.position_table_size < 2:
            raise ValueError(
                f"positional_map='bspline' spreads its knots over [0, position_table_size - 1]: position_table_size="
                f"{self.position_table_size} must be >= 2."
            )
        if self.positional_map == "bspline" and self.spline_control_points > self.position_table_size:
            raise ValueError(
                f"spline_control_points={self.spline_control_points} is more than the position_table_size="
                f"{self.position_table_size} positions it spans: use at most that many."
            )
        if self.random_position_offsets and not (has_table and self.position_table_size > self.max_position_embeddings):
            raise ValueError(
                "random_position_offsets=True needs a learned table (positional_map='learned', position_size > 0) "
                f"with position_table_size > max_position_embeddings={self.max_position_embeddings}; got "
                f"positional_map={self.positional_map!r}, position_size={self.position_size}, "
                f"position_table_size={self.position_table_size}."
            )
        if self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} is not allowed: it must be 0 (off) or an even number <= "
                f"head_dim={self.head_dim}."
            )
        # with position_size=0 the whole vector is the semantic block: the head reads the same either way
        if self.tie_word_embeddings and self.lm_head_input != "semantic" and self.position_size > 0:
            raise ValueError(
                f"tie_word_embeddings=True needs lm_head_input='semantic' (the token embedding has width "
                f"semantic_size={self.semantic_size}); got lm_head_input={self.lm_head_input!r}."
            )

    def validate_token_ids(self):
        """Not checked when the config is made (`@strict` runs every `validate_*` then), where transformers would warn:
        its workflows set the ids after the vocabulary. `check_token_ids` refuses them where they are used."""

    def check_token_ids(self):
        """Special token ids inside the vocabulary, or `eos_token_id` -1 ("never stop", as in transformers): an error
        when the config is saved (an id past the embedding would fail deep inside torch when generation pads or
        starts with it)."""
        for name in self.__dict__:
            if not name.endswith("_token_id"):
                continue
            value = getattr(self, name)
            ids = value if isinstance(value, list) else [value]
            never_stop = [-1] if name == "eos_token_id" else []
            bad = [i for i in ids if isinstance(i, int) and not 0 <= i < self.vocab_size and i not in never_stop]
            if bad:
                also = ", or -1 for never stopping" if never_stop else ""
                raise ValueError(
                    f"{name}={value!r} is outside the vocabulary: token ids are 0..{self.vocab_size - 1} "
                    f"(vocab_size={self.vocab_size}){also}; use None for no such token."
                )

    @property
    def has_positional_table(self) -> bool:
        return self.positional_map == "learned" and self.position_size > 0

    def check_extrapolation(self, extrapolation: PositionExtrapolation) -> None:
        """An extrapolation method (the config's or a call's) is for a learned table, and `interpolate`'s length
        must be past it."""
        if extrapolation.method != "none" and not self.has_positional_table:
            raise ValueError(
                f"position_extrapolation={extrapolation.method!r} needs a learned positional table (it applies to a "
                f"learned positional table only); this model has positional_map={self.positional_map!r}, "
                f"position_size={self.position_size} (a sinusoid is defined at every position, a B-spline has its "
                "spline_extension, position_size=0 has no positions): use 'none'."
            )
        if extrapolation.length is not None and extrapolation.length <= self.position_table_size:
            raise ValueError(
                f"interpolate length={extrapolation.length} must exceed the table's {self.position_table_size} rows: "
                "up to the table's length 'interpolate' is the identity."
            )

    def default_extrapolation(self) -> PositionExtrapolation:
        return PositionExtrapolation.parse(self.position_extrapolation)



# ----------------------------------------------------------------------------------- types and unknown keywords


def _describe_type(annotation) -> str:
    if annotation is bool:
        return "True or False"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if annotation is dict:
        return "a dict"
    if annotation is type(None):
        return "None"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list and args:
        return f"a list of {_describe_type(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (dict, list):
        return f"a {origin.__name__}"
    if origin in (Union, UnionType):
        if {float, int} <= set(args):  # `float | int`: any real number
            args = tuple(arg for arg in args if arg is not int)
        parts = [_describe_type(arg) for arg in args]
        return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"
    return f"a {annotation.__name__}" if isinstance(annotation, type) else f"of type {annotation}"


def _type_message(name: str, value, annotation) -> str:
    message = f"{name}={value!r} is not allowed: it must be {_describe_type(annotation)}, not {type(value).__name__}."
    if name == "stable_mask":
        message += " Pass StableMask's fields as a dict, e.g. {'gamma': 0.05} (dataclasses.asdict of a StableMask)."
    return message


# transformers drops these from a config's keywords (they belong to `generation_config`)
_GENERATION_KEYWORDS = frozenset(GenerationConfig._get_default_generation_params()) - {"use_cache"}

# Keywords that are no field but that transformers itself passes to a config, or reads from it: consumed by
# `PreTrainedConfig.__post_init__` and `from_dict`, written by `to_dict`, Hub code (`auto_map`), quantisation and
# loading (`transformers_weights`), read by `AutoTokenizer` (`tokenizer_class`).
TRANSFORMERS_KEYWORDS = frozenset(
    "model_type name_or_path num_labels torch_dtype output_attentions attn_implementation experts_implementation "
    "auto_map quantization_config transformers_weights tokenizer_class".split()
)


def _check_ignored_keywords(kwargs: dict, saved: bool) -> None:
    """Keywords that are no field and that nothing reads: a misspelt field, another architecture's name for one, a
    generation parameter (which transformers drops), any other. A `TypeError` naming each; in a `saved` config a
    warning, and transformers keeps the key as an attribute (`set_config_for_less_flaky_test` sets `layer_norm_eps`
    on configs, which transformers' tests then save and load)."""
    problems = [_ignored_keyword(key, value) for key, value in kwargs.items()]
    problems = [problem for problem in problems if problem is not None]
    if problems:
        _refuse(TypeError(f"SepFormerConfig got {' '.join(problems)}"), saved)


def _refuse(error: Exception, saved: bool) -> None:
    """Raise `error`; for a `saved` config (it carries `transformers_version`) warn with its message instead, so that a
    `config.json` saved before SepFormer checked this, or written by a tool, still loads."""
    if not saved:
        raise error
    warnings.warn(f"{error} (A saved config: it loads all the same.)", stacklevel=2)


def _ignored_keyword(key: str, value) -> str | None:
    """Why SepFormer would ignore the keyword `key`, or `None` for those transformers reads."""
    if value is None or key.startswith("_") or key.endswith("_token_id") or key in TRANSFORMERS_KEYWORDS:
        # `None` sets nothing (tools copy `rope_scaling=None`, `max_length=None` from other configs); private keys of
        # transformers; extra special tokens (checked against the vocabulary)
        return None
    if key in _GENERATION_KEYWORDS:
        return (
            f"{key}={value!r}, a generation parameter: transformers does not keep it on the config (only a model "
            "loaded from a folder without generation_config.json reads it, from config.json); set it on "
            "model.generation_config or pass it to generate()."
        )
    if key in FOREIGN_KEYWORDS:
        return f"{key}={value!r}, which SepFormer does not read (it would be ignored): {FOREIGN_KEYWORDS[key]}."
    close = difflib.get_close_matches(key, [field.name for field in dataclasses.fields(SepFormerConfig)], n=3)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "the class docstring lists the fields."
    return f"an unknown keyword {key}={value!r} (it would be ignored): {hint}"


__all__ = ["ConfigTypeError", "SepFormerConfig"]
