"""A mitigation added from outside: an options dataclass and a `Mitigation` with one hook, registered; no model code."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import tiny_model

from sepformer.mitigation_base import Mitigation
from sepformer.mitigation_options import MitigationOptions
from sepformer.mitigations import register_mitigation, unregister_mitigation


@dataclass(frozen=True)
class ValueGain(MitigationOptions):
    """Multiplies every attention output of its layers by `gain`."""

    gain: float
    layers: tuple[int, ...] | None = None
    name: ClassVar[str] = "value_gain"


@dataclass(frozen=True, eq=False)
class ValueGainMitigation(Mitigation):
    options_class = ValueGain

    def wrap_attention(self, layer_idx, function):
        def scaled(*args, **kwargs):
            output, weights = function(*args, **kwargs)
            return output * self.options.gain, weights

        return scaled


@pytest.fixture
def value_gain():
    register_mitigation(ValueGainMitigation)
    yield
    unregister_mitigation("value_gain")


def test_a_registered_mitigation_reaches_forward_generate_and_every_layer(value_gain):
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(
            lambda module, args, out: outputs.setdefault(module.layer_idx, []).append(out[0])
        )
    with torch.no_grad():
        model(ids)
        model(ids, value_gain={"gain": 3.0, "layers": (0,)})
    torch.testing.assert_close(outputs[0][1], 3 * outputs[0][0])  # layer 0: the gain, applied before o_proj's bias
    assert not torch.equal(outputs[1][1], outputs[1][0])  # layer 1 sees layer 0's change
    neutral = model.generate(ids, max_new_tokens=3, do_sample=False, value_gain=ValueGain(1.0))
    assert torch.equal(neutral, model.generate(ids, max_new_tokens=3, do_sample=False))
    with pytest.raises(ValueError, match="value_gain layers \\[7\\] are out of range"):
        model(ids, value_gain={"gain": 2.0, "layers": (7,)})


def test_an_unregistered_keyword_is_refused_again():
    with pytest.raises(TypeError, match="unknown keyword arguments \\['value_gain'\\]"):
        tiny_model()(torch.zeros(1, 3, dtype=torch.long), value_gain={"gain": 2.0})
