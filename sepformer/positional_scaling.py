"""Positional-dimension scaling (arXiv 2406.02536): chosen channels of the attention input times `s`."""

from dataclasses import dataclass

import torch

from .mitigation_base import CallContext, LayerRun, Mitigation
from .mitigation_options import PositionalScaling


@dataclass(frozen=True, eq=False)
class PositionalScalingMitigation(Mitigation):
    """In its layers, every key and the call's last query read the attention input with channels `c` times `s`;
    values and the other queries read it unscaled. Scaled keys go into the cache, and each decoding step (a call of
    one token) scales its own query: a cached generation is, by the method's definition, not the full forward pass
    of the final sequence."""

    options_class = PositionalScaling
    hidden_size: int = 0
    channels: tuple[int, ...] = ()
    factors: torch.Tensor | None = None  # (d_model,): `s` on the chosen channels, 1 elsewhere

    @classmethod
    def resolve(cls, options: PositionalScaling, call: CallContext) -> "PositionalScalingMitigation":
        config = call.model.config
        if options.channels is None and config.position_size == 0:
            raise ValueError(
                "positional_scaling scales the positional block by default, but this model has position_size=0: "
                "give channels=(...) explicitly."
            )
        bad = [channel for channel in options.channels or () if not 0 <= channel < config.hidden_size]
        if bad:
            raise ValueError(
                f"positional_scaling channels {bad} are out of range: channels are 0..{config.hidden_size - 1}."
            )
        channels = options.channels or tuple(range(config.position_size))
        return cls(options, options.layer_set(config.num_hidden_layers), config.hidden_size, channels)

    def start(self, run: LayerRun) -> "PositionalScalingMitigation":
        factors = torch.ones(self.hidden_size, dtype=run.dtype, device=run.device)
        factors[list(self.channels)] = self.options.factor
        return self.replace(factors=factors)

    def query_key_inputs(self, layer_idx, query_input, key_input):
        key_input = key_input * self.factors
        return torch.cat((query_input[:, :-1], key_input[:, -1:]), 1), key_input
