"""The positional options a config names, without torch: each positional map and extrapolation method by name, with
the parameters it reads, their defaults and what they allow. `positional_maps` registers their implementations under
these names (`POSITIONAL_MAPS`, `EXTRAPOLATIONS`): a new map is its dataclass here and its module there, a new method
its name in `EXTRAPOLATION_METHODS` (its parameters in `PositionExtrapolation`) and its function there."""

from dataclasses import dataclass, fields
from typing import ClassVar

from huggingface_hub.errors import StrictDataclassFieldValidationError

from .mitigation_options import check_fields, checked, from_fields, plain_integer


class ConfigTypeError(StrictDataclassFieldValidationError, TypeError):
    """A field set to a value of the wrong type: a `TypeError`, and the error `@strict` dataclasses raise."""

    def __init__(self, message: str):
        Exception.__init__(self, message)


def parameter(default, *, minimum: int = 1, choices: tuple = (), reader: str | None = None, wrong_type=ValueError):
    """A parameter, its default and what it allows (a `checked` field): one of `choices`, else an integer >= `minimum`
    (or None where that is the default), kept as a plain integer, which a config saves as JSON. `reader`: the
    extrapolation method that reads it, which its errors name; `wrong_type`: the error for a value of the wrong
    type."""

    def check(name: str, field: str, value):
        if value is None and default is None:
            return None
        number = None if choices else plain_integer(value)
        is_wrong_type = not isinstance(value, str) if choices else number is None
        if is_wrong_type or (value not in choices if choices else number < minimum):
            allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            allowed = f"one of {', '.join(map(repr, choices))}" if choices else allowed
            allowed = f"None or {allowed}" if default is None else allowed
            allowed += f", not {type(value).__name__}" if is_wrong_type else ""
            error = wrong_type if is_wrong_type else ValueError
            raise error(f"{reader or name} {field}={value!r} must be {allowed}.")
        return value if choices else number

    return checked(check, default, reader=reader, minimum=minimum, choices=choices)


def map_parameter(default, **rules):
    """A positional map's `parameter`: only ever a config's field, so a value of the wrong type is its `TypeError`."""
    return parameter(default, wrong_type=ConfigTypeError, **rules)


def parameter_defaults(options: type, reader: str | None = None) -> dict:
    """The parameters of the class `options` that `reader` reads (a map: all of its own), with their defaults."""
    return {option.name: option.default for option in fields(options) if option.metadata.get("reader", "") == reader}


def config_value(key: str, options, defaults: dict) -> str | dict:
    """The name `options` has under `key`, or a dict of it and the parameters not at their `defaults`."""
    changed = {name: getattr(options, name) for name, default in defaults.items() if getattr(options, name) != default}
    return {key: getattr(options, key), **changed} if changed else getattr(options, key)


@dataclass(frozen=True)
class PositionalMapOptions:
    """A positional map and its parameters, as `positional_map` names them (in the manner of transformers'
    `rope_parameters`): the map's name, or a dict `{"map": name, <its parameters>}`. Each map is a subclass registered
    in `POSITIONAL_MAP_OPTIONS`, its parameters declared with `map_parameter`, its checks against the config in
    `check`."""

    map: ClassVar[str]

    def __post_init__(self):
        check_fields(self, self.map)

    @classmethod
    def parse(cls, value) -> "PositionalMapOptions":
        name = value.get("map") if isinstance(value, dict) else value
        if not isinstance(name, str) or name not in POSITIONAL_MAP_OPTIONS:
            names = ", ".join(map(repr, POSITIONAL_MAP_OPTIONS))
            raise ValueError(f"choose one of {names}, or a dict {{'map': name, <its parameters>}}.")
        parameters = {key: item for key, item in value.items() if key != "map"} if isinstance(value, dict) else {}
        unknown = sorted(set(parameters) - set(MAP_PARAMETERS[name]))
        if unknown:
            known = ", ".join(MAP_PARAMETERS[name]) or "none"
            raise ValueError(f"the {name} map reads no {unknown} (its parameters: {known}).")
        return POSITIONAL_MAP_OPTIONS[name](**parameters)

    def check(self, config) -> None:
        """A `ValueError` if the map cannot work with the config's other fields."""

    def as_config_value(self) -> str | dict:
        return config_value("map", self, MAP_PARAMETERS[self.map])


@dataclass(frozen=True)
class LearnedMap(PositionalMapOptions):
    """A table of `position_table_size` learned rows, past which `position_extrapolation` answers (the default)."""

    map: ClassVar[str] = "learned"


@dataclass(frozen=True)
class SinusoidalMap(PositionalMapOptions):
    """The fixed sinusoid of "Attention Is All You Need" over the `position_size` dimensions."""

    map: ClassVar[str] = "sinusoidal"

    def check(self, config) -> None:
        if config.position_size % 2:
            raise ValueError(
                f"position_size={config.position_size} is odd: the sinusoidal map needs sine/cosine pairs."
            )


@dataclass(frozen=True)
class BSplineMap(PositionalMapOptions):
    """`control_points` learned control points (`n`, meant to be `≪ T`) on a B-spline of `degree` `k` over the
    positions `[0, T-1]`, `T` the `position_table_size`. Past `T-1`, `extension`: `clamp` keeps the last control
    point, `linear` continues the end's tangent."""

    map: ClassVar[str] = "bspline"
    control_points: int = map_parameter(16, minimum=2)
    degree: int = map_parameter(3)
    extension: str = map_parameter("clamp", choices=("clamp", "linear"))

    def check(self, config) -> None:
        n, k, T = self.control_points, self.degree, config.position_table_size
        if k >= n:
            raise ValueError(
                f"bspline degree={k} needs more control points than that: control_points={n} must be > degree (a "
                "B-spline of degree k has k + 1 control points per segment)."
            )
        if n > T:
            raise ValueError(f"bspline control_points={n} is more than the position_table_size={T} positions it spans.")


POSITIONAL_MAP_OPTIONS = {options.map: options for options in (LearnedMap, SinusoidalMap, BSplineMap)}
MAP_PARAMETERS = {name: parameter_defaults(options) for name, options in POSITIONAL_MAP_OPTIONS.items()}
# `none` refuses positions past the table; `interpolate` compresses positions into it; the others make rows past it
# (`positional_maps.EXTRAPOLATIONS`).
EXTRAPOLATION_METHODS = ("none", "clamp", "sinusoidal", "fourier", "interpolate")
LEARNED_TABLE_METHODS = ("none", "interpolate")


@dataclass(frozen=True)
class PositionExtrapolation:
    """How a learned table answers positions past its last row: a method of `EXTRAPOLATION_METHODS` and the
    parameters it reads.

    Args:
        method: one of `EXTRAPOLATION_METHODS`.
        components: `K`, Fourier coefficients kept per dimension (`fourier`).
        length: `interpolate` only: the sequence length the positions are compressed for. `None` compresses for the
            length of the current call, which is what a full forward pass needs; cached decoding past `L` needs a
            fixed `length` (the final length), or the cached keys would have been computed with another scale.
    """

    method: str = "none"
    components: int = parameter(16, reader="fourier")
    length: int | None = parameter(None, reader="interpolate")

    def __post_init__(self):
        if self.method not in EXTRAPOLATION_METHODS:
            methods = ", ".join(map(repr, EXTRAPOLATION_METHODS))
            raise ValueError(f"position_extrapolation method {self.method!r} is unknown: choose one of {methods}.")
        check_fields(self, "position_extrapolation")
        for option in fields(self)[1:]:
            if getattr(self, option.name) != option.default and option.metadata["reader"] != self.method:
                raise ValueError(
                    f"position_extrapolation {option.name}={getattr(self, option.name)!r} is read only by "
                    f"{option.metadata['reader']!r} (it would be ignored), not by {self.method!r}: drop it or use "
                    "that method."
                )

    @classmethod
    def parse(cls, value) -> "PositionExtrapolation":
        """A method name, a dict `{"method": ..., <its parameters>}`, or an instance."""
        parsed = from_fields(cls, {"method": value} if isinstance(value, str) else value, "position_extrapolation")
        if parsed is None:
            raise ValueError(
                f"position_extrapolation must be a method name, a dict or a PositionExtrapolation; got {value!r}."
            )
        return parsed

    def as_config_value(self) -> str | dict:
        return config_value("method", self, EXTRAPOLATION_PARAMETERS[self.method])


EXTRAPOLATION_PARAMETERS = {
    method: parameter_defaults(PositionExtrapolation, method) for method in EXTRAPOLATION_METHODS
}
