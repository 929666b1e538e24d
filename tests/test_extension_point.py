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

    def wrap_attention(self, layer_idx, function, projection):
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
    torch.testing.assert_close(outputs[0][1], 3 * outputs[0][0])  # layer 0: the gain (o_proj has no bias)
    assert not torch.equal(outputs[1][1], outputs[1][0])  # layer 1 sees layer 0's change
    outputs.clear()
    plain = model.generate(ids, max_new_tokens=3, do_sample=False)
    calls = {layer: len(seen) for layer, seen in outputs.items()}
    outputs.clear()
    gained = model.generate(ids, max_new_tokens=3, do_sample=False, value_gain=ValueGain(0.0))
    assert {layer: len(seen) for layer, seen in outputs.items()} == calls == {0: 3, 1: 3}  # prefill and 2 steps
    assert all(not seen.any() for layer_outputs in outputs.values() for seen in layer_outputs)  # every layer, step
    assert not torch.equal(gained, plain)
    with pytest.raises(ValueError, match="value_gain layers \\[7\\] are out of range"):
        model(ids, value_gain={"gain": 2.0, "layers": (7,)})


def test_two_mitigations_rewriting_positions_in_one_layer_are_refused(value_gain):
    @dataclass(frozen=True, eq=False)
    class Shifted(Mitigation):
        options_class = ValueGain

        def position_query_key(self, attention, query, key, position_embeddings, residual, attention_mask):
            return query, key

    unregister_mitigation("value_gain")
    register_mitigation(Shifted)
    with pytest.raises(ValueError, match="ms_poe and value_gain both rewrite how positions enter .* layer 1"):
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), value_gain={"gain": 1.0}, ms_poe={"head_order": (0, 1, 2, 3)})


def test_an_unregistered_keyword_is_refused_again():
    with pytest.raises(TypeError, match="unknown keyword arguments \\['value_gain'\\]"):
        tiny_model()(torch.zeros(1, 3, dtype=torch.long), value_gain={"gain": 2.0})
