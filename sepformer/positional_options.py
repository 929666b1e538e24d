"""The positional options a config names, without torch: the positional maps and extrapolation methods by name, each
method's parameters, and `PositionExtrapolation`. `positional_maps` registers their implementations under these names
(`POSITIONAL_MAPS`, `EXTRAPOLATIONS`); a new method is its entry here and its function there."""

from dataclasses import dataclass

from .mitigation_options import plain_integer

POSITIONAL_MAP_NAMES = ("learned", "sinusoidal", "bspline")
SPLINE_EXTENSIONS = ("clamp", "linear")

# Each extrapolation method and the parameters it reads, with their defaults. `none` refuses positions past the table;
# `interpolate` compresses positions into it; the others make rows past it (`positional_maps.EXTRAPOLATIONS`).
EXTRAPOLATION_PARAMETERS = {
    "none": {},
    "clamp": {},
    "sinusoidal": {},
    "fourier": {"components": 16},  # K: Fourier coefficients kept per dimension
    "interpolate": {"length": None},  # the length compressed for; None: the current call's
}
EXTRAPOLATION_METHODS = tuple(EXTRAPOLATION_PARAMETERS)


def _methods() -> str:
    return ", ".join(map(repr, EXTRAPOLATION_METHODS))


@dataclass(frozen=True)
class PositionExtrapolation:
    """How a learned table answers positions past its last row: a method of `EXTRAPOLATION_PARAMETERS` and the
    parameters it reads.

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
        if self.method not in EXTRAPOLATION_PARAMETERS:
            raise ValueError(f"position_extrapolation method {self.method!r} is unknown: choose one of {_methods()}.")
        components, length = plain_integer(self.components), plain_integer(self.length)
        if components is None or components < 1:
            raise ValueError(f"fourier components={self.components!r} must be a positive integer.")
        if self.length is not None and (length is None or length < 1):
            raise ValueError(f"interpolate length={self.length!r} must be None or a positive integer.")
        object.__setattr__(self, "components", components)  # plain integers: a config saves them as JSON
        object.__setattr__(self, "length", length)
        unread = [
            f"{name}={getattr(self, name)!r}"
            for method, parameters in EXTRAPOLATION_PARAMETERS.items()
            for name, default in parameters.items()
            if getattr(self, name) != default and self.method != method
        ]
        if unread:
            readers = ", ".join(
                f"{name} by {method!r}"
                for method, parameters in EXTRAPOLATION_PARAMETERS.items()
                for name in parameters
            )
            raise ValueError(
                f"position_extrapolation {', '.join(unread)} is read only by its method ({readers}; it would be "
                f"ignored), not by {self.method!r}: drop it or use that method."
            )

    @classmethod
    def parse(cls, value) -> "PositionExtrapolation":
        """A method name, a dict `{"method": ..., <its parameters>}`, or an instance."""
        keys = ("method", *(name for parameters in EXTRAPOLATION_PARAMETERS.values() for name in parameters))
        if all(hasattr(value, name) for name in keys):
            # duck-typed: an instance from another copy of this module (installed package vs. Hub custom code)
            return cls(**{name: getattr(value, name) for name in keys})
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, dict):
            unknown = set(value) - set(keys)
            if unknown:
                raise ValueError(
                    f"position_extrapolation got unknown keys {sorted(unknown)}: allowed are "
                    f"{', '.join(map(repr, keys))}."
                )
            return cls(**value)
        raise ValueError(
            f"position_extrapolation must be a method name, a dict or a PositionExtrapolation; got {value!r}."
        )

    def as_config_value(self) -> str | dict:
        """The method's name, or a dict of it and the parameters it reads that are not at their defaults."""
        parameters = {
            name: getattr(self, name)
            for name, default in EXTRAPOLATION_PARAMETERS[self.method].items()
            if getattr(self, name) != default
        }
        return {"method": self.method, **parameters} if parameters else self.method
