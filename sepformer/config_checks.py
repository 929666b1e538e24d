"""How `SepFormerConfig` checks its fields, torch-free: each field's `@strict` validators run on every assignment
with errors naming the field and the value, `None` sizes derived from other fields, older configs' fields as properties
over the dict fields that now hold them, and the keywords a config would ignore."""

import dataclasses
import difflib
import warnings
from typing import Literal, get_args, get_origin

from huggingface_hub.dataclasses import as_validated_field
from transformers import GenerationConfig

from .mitigation_options import StableMask, plain_number
from .positional_options import (
    EXTRAPOLATION_PARAMETERS,
    MAP_PARAMETERS,
    ConfigTypeError,
    PositionalMapOptions,
    PositionExtrapolation,
)

# Other architectures' names for SepFormer's fields, and keywords SepFormer has no use for: what to do instead.
FOREIGN_KEYWORDS = {
    **dict.fromkeys(["rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"], "use norm_eps"),
    **dict.fromkeys(["n_positions", "max_seq_len"], "use max_position_embeddings"),
    **dict.fromkeys(["n_embd", "d_model"], "use hidden_size"),
    **dict.fromkeys(["n_layer", "num_layers"], "use num_hidden_layers"),
    **dict.fromkeys(["n_head", "num_heads"], "use num_attention_heads"),
    **dict.fromkeys(["hidden_dropout_prob", "resid_pdrop", "embd_pdrop"], "use hidden_dropout"),
    **dict.fromkeys(["attention_probs_dropout_prob", "attn_pdrop"], "use attention_dropout"),
    **dict.fromkeys(["activation_function", "hidden_activation"], "use hidden_act"),
    **dict.fromkeys(["intermediate_size", "n_inner"], "use position_intermediate_size and semantic_intermediate_size"),
    "dropout": "use hidden_dropout and attention_dropout",
    "num_key_value_heads": "SepFormer has no grouped-query attention (every head has its own keys and values)",
    "rope_scaling": "SepFormer's rotary embedding (rotary_dim, rope_theta) has no scaling; positions past the table "
    "use position_extrapolation",
    "rope_parameters": "use rotary_dim and rope_theta (SepFormer's rotary embedding has no scaling types)",
    "head_dim": "set hidden_size and num_attention_heads (head_dim = hidden_size / num_attention_heads)",
    "semantic_size": "set hidden_size and position_size (semantic_size = hidden_size - position_size)",
}

# Keywords that are no field but that transformers itself passes to a config or reads from it (`__post_init__`,
# `from_dict`, `to_dict`, Hub code, quantisation, loading, `AutoTokenizer`).
TRANSFORMERS_KEYWORDS = frozenset(
    "model_type name_or_path num_labels torch_dtype output_attentions attn_implementation experts_implementation "
    "auto_map quantization_config transformers_weights tokenizer_class".split()
)
# Generation parameters given to a config, as transformers treats them: those with a default generation value it drops
# (`PreTrainedConfig.__post_init__`); every other parameter of `GenerationConfig` it keeps on the config, where the
# model's `generation_config` reads it (`GenerationConfig.from_model_config`), also after saving and loading.
DROPPED_GENERATION_KEYWORDS = frozenset(GenerationConfig._get_default_generation_params()) - {"use_cache"}
KEPT_GENERATION_KEYWORDS = (
    frozenset(name for name in vars(GenerationConfig()) if not name.startswith("_")) - DROPPED_GENERATION_KEYWORDS
)
READ_KEYWORDS = TRANSFORMERS_KEYWORDS | KEPT_GENERATION_KEYWORDS  # what transformers reads from a config
# The fields that name a choice and its parameters: the choice's key in their dicts, its dataclass (which parses them),
# the parameters.
OPTION_FIELDS = {
    "position_extrapolation": ("method", PositionExtrapolation, EXTRAPOLATION_PARAMETERS),
    "positional_map": ("map", PositionalMapOptions, MAP_PARAMETERS),
}
# The fields that take an option's dataclass, and its class.
OPTION_CLASSES = {**{field: options for field, (_, options, _) in OPTION_FIELDS.items()}, "stable_mask": StableMask}


class UnreadValueError(ValueError):
    """A value the config's settings would never read: refused, but only warned about in a saved config."""


def checked_on_assignment(derived_sizes: dict, legacy_fields: dict):
    """A class decorator: run a field's `@strict` validators whenever it is set, with errors that name the field and
    the value; make `derived_sizes` (`{name: (meaning, resolve)}`) and `legacy_fields` (`{old field: (field of
    OPTION_FIELDS, parameter)}`) properties."""

    def decorate(cls):
        strict_setattr = cls.__setattr__
        fields = {field.name: field.type for field in dataclasses.fields(cls)}

        def __setattr__(self, name, value):
            if name in fields:
                value = plain_numbers(as_field_value(name, value))
                current = self.__dict__.get(name)
                if name == "positional_map" and isinstance(current, dict) and current["map"] == value:
                    value = current  # the same map again keeps its parameters, as when they were fields of their own
                check_field(cls, name, value, fields[name])
            strict_setattr(self, name, value)

        cls.__setattr__ = __setattr__
        for name, (meaning, resolve) in derived_sizes.items():
            setattr(cls, name, _derived_size(name, meaning, resolve))
        for old, (field, parameter) in legacy_fields.items():
            setattr(cls, old, _legacy_field(old, field, parameter))
        return cls

    return decorate


def as_field_value(name: str, value):
    """An option's dataclass given to the field that holds it (`OPTION_CLASSES`), as the field keeps it: the dict of
    every parameter it reads, at their defaults too (a dataclass sets them all, as such a dict does), which the config
    saves as JSON. Another field's dataclass is left to be refused."""
    if not isinstance(value, OPTION_CLASSES.get(name, ())):
        return value
    if name not in OPTION_FIELDS:  # stable_mask
        return dataclasses.asdict(value)
    key, _, parameters = OPTION_FIELDS[name]
    return {
        key: getattr(value, key),
        **{parameter: getattr(value, parameter) for parameter in parameters[getattr(value, key)]},
    }


def plain_numbers(value):
    """`value` with each number in it (also in a dict or a list) a plain `int` or `float` (`plain_number`): fields take
    NumPy and torch numbers as Python's, and the config saves them as JSON."""
    if isinstance(value, dict):
        return {key: plain_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_numbers(item) for item in value]
    number = plain_number(value)
    return value if number is None else number


def check_field(cls, name, value, annotation) -> None:
    type_check, *value_checks = cls.__validators__[name]  # `@strict` puts the type's check first
    try:
        type_check(value)
    except (TypeError, ValueError) as error:
        if get_origin(annotation) is Literal and isinstance(value, str):
            allowed = ", ".join(map(repr, get_args(annotation)))
            raise ValueError(f"{name}={value!r} is not allowed: choose one of {allowed}.") from None
        raise ConfigTypeError(f"{name}={value!r} is not allowed: {error}") from None
    for check in value_checks:
        try:
            check(value)
        except (TypeError, ValueError) as error:  # a `ConfigTypeError` of a dict field's parameter stays one
            reason, error_type = str(error), ConfigTypeError if isinstance(error, TypeError) else ValueError
            raise error_type(f"{name}={value!r} is not allowed: {reason[:1].lower()}{reason[1:]}") from None


def _derived_size(name: str, meaning: str, resolve) -> property:
    def get(self):
        value = self.__dict__.get(name)
        return resolve(self) if value is None else value

    def set_(self, value):
        self.__dict__[name] = value

    return property(get, set_, doc=f"`{name}`; `None` (stored and saved as such) reads as {meaning}.")


def _legacy_field(old: str, field: str, parameter: str) -> property:
    """An older config's field, now a parameter in `field`'s dict: what `lm_eval --model_args` and
    `from_pretrained(..., interpolation_length=2048)` set, after the field. At its default a field the choice does not
    read is what every older config saved; another value is refused."""
    key, options_class, parameters = OPTION_FIELDS[field]
    parse = options_class.parse
    reader, default = next((name, names[parameter]) for name, names in parameters.items() if parameter in names)

    def get(self):
        return getattr(parse(getattr(self, field)), parameter, default)

    def set_(self, value):
        options = parse(getattr(self, field))
        if parameter in parameters[getattr(options, key)]:
            setattr(self, field, dataclasses.replace(options, **{parameter: value}).as_config_value())
        elif value != default:
            raise UnreadValueError(
                f"{old}={value!r} is read only with {reader!r} (it would be ignored); this config has "
                f"{field}={getattr(self, field)!r}. Set that first, or leave {old} out."
            )

    return property(get, set_, doc=f"`{field}`'s `{parameter}` (a field of older configs).")


def allowed(condition, allowed: str):
    """A validated field whose value must satisfy `condition`; `allowed` says what is (field and value are added)."""

    def check(value):
        if not condition(value):
            raise ValueError(allowed)

    return as_validated_field(check)


def derived_or(minimum: int, meaning: str):
    return allowed(
        lambda value: value is None or value >= minimum,
        f"it must be a positive integer, or None for {meaning}.",
    )(default=None)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def refuse_unless_saved(error: Exception, saved: bool) -> None:
    """Raise `error`; for a `saved` config (it carries `transformers_version`) warn with its message instead, so that a
    `config.json` saved before SepFormer checked this, or written by a tool, still loads."""
    if not saved:
        raise error
    warnings.warn(f"{error} (A saved config: it loads all the same.)", stacklevel=3)


def _ignored_keyword(key: str, value, fields: list[str]) -> str | None:
    """Why SepFormer would ignore the keyword `key`, or `None` for those transformers reads. `None` sets nothing
    (tools copy `rope_scaling=None` from other configs); extra special tokens are checked against the vocabulary."""
    if value is None or key.startswith("_") or key.endswith("_token_id") or key in READ_KEYWORDS:
        return None
    if key in DROPPED_GENERATION_KEYWORDS:
        return (
            f"{key}={value!r}, a generation parameter: transformers does not keep it on the config (only a model "
            "loaded from a folder without generation_config.json reads it, from config.json); set it on "
            "model.generation_config or pass it to generate()."
        )
    if key in FOREIGN_KEYWORDS:
        return f"{key}={value!r}, which SepFormer does not read (it would be ignored): {FOREIGN_KEYWORDS[key]}."
    close = difflib.get_close_matches(key, fields, n=3)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "the class docstring lists the fields."
    return f"an unknown keyword {key}={value!r} (it would be ignored): {hint}"


def ignored_keywords(kwargs: dict, fields: list[str]) -> str:
    """What is wrong with each keyword of `kwargs` that SepFormer would ignore ("" if none)."""
    return " ".join(problem for key, value in kwargs.items() if (problem := _ignored_keyword(key, value, fields)))
