"""SepFormer configuration, in the style of transformers' `LlamaConfig`: `@strict` dataclass fields, choices as
`Literal`, ranges as `interval`, combinations in `validate_architecture`. Torch-free: positional maps and extrapolation
methods are known here by name, with their parameters (`positional_options`); `positional_maps` holds their code.
When each value and combination is checked, and what a saved config only warns about: docs/design.md, "Configuration
fields".
"""

import copy
import dataclasses
import math
from typing import Literal

from huggingface_hub.dataclasses import as_validated_field, strict
from transformers import PreTrainedConfig
from transformers.utils.type_validators import activation_fn_key, interval

from .config_checks import (
    ConfigTypeError,
    UnreadValueError,
    allowed,
    as_field_value,
    check_field,
    checked_on_assignment,
    derived_or,
    ignored_keywords,
    refuse_unless_saved,
    require,
)
from .mitigation_options import StableMask
from .positional_options import PositionalMapOptions, PositionExtrapolation

# Sizes that `None` derives from other fields (also when those are assigned later), in one place. `None` is stored and
# saved as such; reading the field gives the resolved integer.
DERIVED_SIZES = {
    "position_size": ("head_dim", lambda config: config.head_dim),
    "position_table_size": ("max_position_embeddings", lambda config: config.max_position_embeddings),
    "position_intermediate_size": ("4 * position_size", lambda config: 4 * config.position_size),
    "semantic_intermediate_size": ("4 * (hidden_size - position_size)", lambda config: 4 * config.semantic_size),
}

# Fields of older configs that a dict field now holds, with the parameter each became: still read and set.
LEGACY_FIELDS = {
    "fourier_components": ("position_extrapolation", "components"),
    "interpolation_length": ("position_extrapolation", "length"),
    "spline_control_points": ("positional_map", "control_points"),
    "spline_degree": ("positional_map", "degree"),
    "spline_extension": ("positional_map", "extension"),
}


def refuse_both(old: str, value, values: dict) -> None:
    """An older field and a dict or dataclass in `values` (the config's or `from_pretrained`'s keywords) that both set
    it."""
    field, parameter = LEGACY_FIELDS[old]
    given = as_field_value(field, values.get(field))
    if isinstance(given, dict) and parameter in given:
        raise ValueError(f"{old}={value!r} and {field}={given!r} both set {parameter}.")


def _stable_mask(value):
    if value is not None:
        try:
            StableMask.parse(value)  # a ValueError on unknown keys or bad values
        except TypeError as error:  # a required field missing: the dataclass's own message
            fields = ", ".join(repr(field.name) for field in dataclasses.fields(StableMask))
            raise ValueError(f"it must be a dict of StableMask's fields ({fields}), with 'gamma' ({error}).") from None


positive = interval(min=1)
finite_positive = interval(min=0, max=math.inf, exclude_min=True, exclude_max=True)
probability = interval(min=0, max=1, exclude_max=True)
token_id = allowed(lambda value: value != [], "it must be None, a token id or a non-empty list of token ids.")


@checked_on_assignment(DERIVED_SIZES, LEGACY_FIELDS)
@strict
class SepFormerConfig(PreTrainedConfig):
    r"""
    Configuration of a SepFormer: a decoder-only causal LM whose hidden state is `[p(i) ‖ s(token)]`, the positional
    block in coordinates `[0, position_size)` and the semantic block in the rest. `docs/design.md` explains each
    field; in short:

    - sizes: `vocab_size` (259: `SepFormerTokenizer`'s bytes and three specials), `hidden_size = d_pos + d_sem`,
      `position_size` (`d_pos`; `None`: `head_dim`; `0`: no positions at all), `num_hidden_layers`,
      `num_attention_heads`, `position_intermediate_size` and `semantic_intermediate_size` (the two MLPs; `None`: 4x
      their block), `hidden_act` (any name of `ACT2FN`).
    - positions: `max_position_embeddings` (`L`, the training length), `positional_map` (`"learned"`, `"sinusoidal"`,
      `"bspline"`, `{"map": "bspline", "control_points": 8}` or a map's dataclass), `position_extrapolation` (how a
      learned table answers positions past its rows: a method, `{"method": "fourier", "components": 16}` or a
      `PositionExtrapolation`; overridable per call; older configs' `fourier_components`, `interpolation_length` and
      `spline_*` fields read and set the parameters), `position_table_size` (`M >= L` positions a map is trained on;
      `None`: `L`; larger needs one of the next two), `random_position_offsets` (random shifts in training, learned
      table), `randomized_positions` and `randomized_range` (sorted random positions from `[0, M)` in training,
      `"fixed"` or `"per_sequence"` ranges), `rotary_dim` and `rope_theta` (rotary on the first `rotary_dim` dimensions
      of every head; 0 is off).
    - the rest: `norm_type` (`"rmsnorm"` or `"layernorm"`, one norm per block), `norm_eps`, `lm_head_input`
      (`"semantic"` or `"all"`), dropouts, biases, `initializer_range`, `stable_mask` (a `StableMask` or its fields as
      a dict, on in training and inference), `fuse_decoding_projections` (decoding steps on weights laid out for them,
      kept on the KV cache), and token ids inside the vocabulary (`eos_token_id` may be a list, and -1 for "never
      stop").
    """

    model_type = "sepformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = positive(default=259)
    hidden_size: int = positive(default=256)
    position_size: int | None = allowed(
        lambda value: value is None or value >= 0,
        "it must be None (head_dim), 0 (a model without positions) or a positive integer smaller than hidden_size.",
    )(default=None)
    num_hidden_layers: int = positive(default=4)
    num_attention_heads: int = positive(default=4)
    # 0 allowed: configs of `position_size=0` models saved before the sizes were derived store it
    position_intermediate_size: int | None = derived_or(0, DERIVED_SIZES["position_intermediate_size"][0])
    semantic_intermediate_size: int | None = derived_or(1, DERIVED_SIZES["semantic_intermediate_size"][0])
    hidden_act: str = activation_fn_key(default="gelu_pytorch_tanh")
    max_position_embeddings: int = positive(default=512)
    positional_map: str | dict = as_validated_field(PositionalMapOptions.parse)(default="learned")
    position_extrapolation: str | dict = as_validated_field(PositionExtrapolation.parse)(default="none")
    position_table_size: int | None = derived_or(1, DERIVED_SIZES["position_table_size"][0])
    random_position_offsets: bool = False
    randomized_positions: bool = False
    randomized_range: Literal["fixed", "per_sequence"] = "fixed"
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float | int = finite_positive(default=1e-6)
    lm_head_input: Literal["semantic", "all"] = "semantic"
    tie_word_embeddings: bool = False
    rotary_dim: int = allowed(
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
        for old in LEGACY_FIELDS:
            if old in kwargs:
                value = kwargs.pop(old)
                refuse_both(old, value, self.__dict__)
                try:
                    setattr(self, old, value)
                except UnreadValueError as error:
                    refuse_unless_saved(error, saved)
        ignored = ignored_keywords(kwargs, [field.name for field in dataclasses.fields(self)] + list(LEGACY_FIELDS))
        if ignored:
            refuse_unless_saved(TypeError(f"SepFormerConfig got {ignored}"), saved)
        super().__post_init__(**kwargs)
        # `@strict` runs the `validate_*` methods too, but wraps their errors: here they are the plain `ValueError`.
        self.validate_architecture()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers sets `from_pretrained`'s keywords on the loaded config one by one, in the caller's order: an
        older field (`interpolation_length=4096`) is set after the field that holds it (`position_extrapolation`), which
        would otherwise replace the parameter it sets."""
        for old in LEGACY_FIELDS:
            if old in kwargs:
                refuse_both(old, kwargs[old], kwargs)
                kwargs[old] = kwargs.pop(old)  # last
        return super().from_dict(config_dict, **kwargs)

    def check_combinations(self) -> None:
        """Every check that involves more than one field; `save_pretrained` and a model's constructor need a pass."""
        self.validate_architecture()
        # special token ids inside the vocabulary, or `eos_token_id` -1 ("never stop", as in transformers)
        for name in [name for name in self.__dict__ if name.endswith("_token_id")]:
            value = getattr(self, name)
            never_stop = [-1] if name == "eos_token_id" else []
            ids = value if isinstance(value, list) else [value]
            bad = [i for i in ids if isinstance(i, int) and not 0 <= i < self.vocab_size and i not in never_stop]
            require(
                not bad,
                f"{name}={value!r} is outside the vocabulary: token ids are 0..{self.vocab_size - 1} "
                f"(vocab_size={self.vocab_size}){', or -1 for never stopping' if never_stop else ''}; use None "
                "for no such token.",
            )

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
        self.check_combinations()  # before anything is written: assignments are not checked together
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def semantic_size(self) -> int:
        return self.hidden_size - self.position_size

    @property
    def has_positional_table(self) -> bool:
        return self.map_options().map == "learned" and self.position_size > 0

    def default_extrapolation(self) -> PositionExtrapolation:
        return PositionExtrapolation.parse(self.position_extrapolation)

    def map_options(self) -> PositionalMapOptions:
        return PositionalMapOptions.parse(self.positional_map)

    def validate_architecture(self):
        """Every invalid value or combination, with the fields, their values and what is allowed."""
        for field in dataclasses.fields(self):  # also values that reached `__dict__` without an assignment
            check_field(type(self), field.name, self.__dict__.get(field.name), field.type)
        self.check_sizes()
        self.check_rotary()
        self.map_options().check(self)
        self.check_extrapolation(self.default_extrapolation())
        self.check_training_positions()

    def check_sizes(self) -> None:
        d_pos = self.position_size
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}: "
            "head_dim = hidden_size / num_attention_heads must be an integer.",
        )
        require(
            0 <= d_pos < self.hidden_size,
            f"position_size={d_pos} is not allowed: it must satisfy 0 <= position_size < hidden_size="
            f"{self.hidden_size} (0 is a model without positions; hidden_size would leave no semantic block).",
        )
        require(
            d_pos == 0 or self.position_intermediate_size >= 1,
            f"position_intermediate_size={self.position_intermediate_size} is not allowed: it must be a positive "
            "integer, or None for 4 * position_size.",
        )
        require(
            d_pos > 0 or self.__dict__.get("position_intermediate_size") in (None, 0),
            f"position_intermediate_size={self.position_intermediate_size} is not used: position_size=0 has no "
            "positional block and no positional MLP; leave it None.",
        )
        # with position_size=0 the whole vector is the semantic block: the head reads the same either way
        require(
            not self.tie_word_embeddings or self.lm_head_input == "semantic" or d_pos == 0,
            "tie_word_embeddings=True needs lm_head_input='semantic' (the token embedding has width "
            f"semantic_size={self.semantic_size}); got lm_head_input={self.lm_head_input!r}.",
        )

    def check_rotary(self) -> None:
        require(
            self.rotary_dim <= self.head_dim,
            f"rotary_dim={self.rotary_dim} is not allowed: it must be 0 (off) or an even number <= "
            f"head_dim={self.head_dim}.",
        )
        if self.rotary_dim == 0 and self.rope_theta != 10000.0:
            message = (
                f"rope_theta={self.rope_theta!r} is read only with rotary_dim > 0 (it would be ignored); this "
                "config has rotary_dim=0. Set that, or leave rope_theta at its default 10000.0."
            )
            refuse_unless_saved(ValueError(message), self.transformers_version is not None)

    def check_training_positions(self) -> None:
        """`position_table_size` and the ways of training the positions up to it."""
        L, M, d_pos = self.max_position_embeddings, self.position_table_size, self.position_size
        require(M >= L, f"position_table_size={M} must be >= max_position_embeddings={L}.")
        require(
            M == L or self.random_position_offsets or self.randomized_positions,
            f"position_table_size={M} > max_position_embeddings={L} needs random_position_offsets=True or "
            "randomized_positions=True: otherwise the positions past max_position_embeddings are never trained.",
        )
        require(
            not (self.random_position_offsets and self.randomized_positions),
            "random_position_offsets=True and randomized_positions=True are two ways of choosing the training "
            "positions: choose one.",
        )
        require(
            not self.randomized_positions or (d_pos > 0 and M > L),
            "randomized_positions=True needs a positional map (position_size > 0) and a range of positions "
            f"position_table_size > max_position_embeddings={L} to draw from; got position_size={d_pos}, "
            f"position_table_size={M}.",
        )
        require(
            self.randomized_range == "fixed" or self.randomized_positions,
            f"randomized_range={self.randomized_range!r} is read only with randomized_positions=True (it would be "
            "ignored): set randomized_positions=True or leave randomized_range='fixed'.",
        )
        require(
            not self.random_position_offsets or (self.has_positional_table and M > L),
            "random_position_offsets=True needs a learned table (positional_map='learned', position_size > 0) with "
            f"position_table_size > max_position_embeddings={L}; got positional_map={self.positional_map!r}, "
            f"position_size={d_pos}, position_table_size={M}.",
        )

    def validate_token_ids(self):
        """Not when the config is made (`@strict` runs every `validate_*` then, and transformers would only warn):
        `check_combinations` refuses them on saving."""

    def check_extrapolation(self, extrapolation: PositionExtrapolation) -> None:
        """An extrapolation method (the config's or a call's) is for a learned table, and `interpolate`'s length
        must be past it."""
        require(
            extrapolation.method == "none" or self.has_positional_table,
            f"position_extrapolation={extrapolation.method!r} needs a learned positional table; this model has "
            f"positional_map={self.positional_map!r}, position_size={self.position_size} (the other maps are defined "
            "at every position, position_size=0 has no positions): use 'none'.",
        )
        length, rows = extrapolation.length, self.position_table_size
        require(
            length is None or length > rows,
            f"interpolate length={length} must exceed the table's {rows} rows: up to the table's length "
            "'interpolate' is the identity.",
        )


__all__ = ["ConfigTypeError", "SepFormerConfig"]
