"""A mitigation added from outside: an options dataclass and a `Mitigation` with one hook, registered; no model code.
A stateful one keeps what it fixes at prefill on the cache, as a `MitigationState` of its own: no shared file changes.
"""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import random_ids, tiny_llama, tiny_model

from sepformer import SepFormerCache, add_mitigations
from sepformer.cache_sepformer import MitigationState
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


@dataclass(frozen=True)
class TokenSumGain(MitigationOptions):
    """Multiplies each token's attention outputs by `1 + (s mod 5) / 2`, `s` the sum of its row's ids up to it."""

    name: ClassVar[str] = "token_sum_gain"


@dataclass(eq=False)
class TokenSums(MitigationState):
    sums: torch.Tensor  # (b, the call's tokens): each row's sums up to each of them; a decoding step continues the last


@dataclass(frozen=True, eq=False)
class TokenSumGainMitigation(Mitigation):
    options_class = TokenSumGain
    prefill_requirement = "token_sum_gain sums the prompt: it must be on from the prefill."
    cache: object = None
    gains_read: ClassVar[list[torch.Tensor]] = []  # the gains of every decoding step, as the layers read them

    @classmethod
    def fixes_state_at_prefill(cls, options):
        return True

    @classmethod
    def resolve(cls, options, call):
        return cls(options, options.layer_set(call.model.config.num_hidden_layers), call.sepformer_cache)

    def prepare(self, call, others):
        sums = call.input_ids.cumsum(-1)
        if call.continuing:  # from this row's history: the state was reordered, repeated, selected with the rows
            state = self.cache.mitigation_state[self.options.name]
            state.sums = state.sums[:, -1:] + sums
            self.gains_read.append(self.gains())
        else:
            self.cache.mitigation_state[self.options.name] = TokenSums(sums)

    def gains(self) -> torch.Tensor:
        return 1 + self.cache.mitigation_state[self.options.name].sums % 5 / 2

    def wrap_attention(self, layer_idx, function, projection):
        def scaled(*args, **kwargs):
            output, weights = function(*args, **kwargs)  # (b, seq, H, d)
            return output * self.gains()[:, :, None, None].to(output.dtype), weights

        return scaled


@pytest.fixture
def token_sum_gain():
    register_mitigation(TokenSumGainMitigation)
    TokenSumGainMitigation.gains_read.clear()
    yield
    unregister_mitigation("token_sum_gain")


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

        def position_query_key(self, attention, query, key, layer_call):
            return query, key

    unregister_mitigation("value_gain")
    register_mitigation(Shifted)
    with pytest.raises(ValueError, match="ms_poe and value_gain both rewrite how positions enter .* layer 1"):
        tiny_model()(torch.zeros(1, 4, dtype=torch.long), value_gain={"gain": 1.0}, ms_poe={"head_order": (0, 1, 2, 3)})


def test_a_registered_option_given_to_a_decoder_s_base_model_is_refused_as_the_built_in_ones_are(value_gain):
    model = add_mitigations(tiny_llama())
    ids, cache = torch.zeros(1, 4, dtype=torch.long), SepFormerCache(config=model.config)
    with pytest.raises(TypeError, match=r"\['value_gain'\] reached LlamaModel as keywords it ignores"):
        model.model(ids, past_key_values=cache, value_gain={"gain": 2.0})


def test_an_unregistered_keyword_is_refused_again():
    with pytest.raises(TypeError, match="unknown keyword arguments \\['value_gain'\\]"):
        tiny_model()(torch.zeros(1, 3, dtype=torch.long), value_gain={"gain": 2.0})


def test_a_registered_mitigation_keeps_its_rows_state_on_the_cache_under_beam_search(token_sum_gain):
    """Beam search reorders the beams, whose histories differ: each beam's sums must follow it. Without a cache each
    call is a prefill that sums the whole sequence anew: the reference. Each returned sequence is its row's alone."""
    model = tiny_model()
    ids = random_ids(2, 10)
    kwargs = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    gained = model.generate(ids, **kwargs, token_sum_gain={})
    steps = TokenSumGainMitigation.gains_read
    assert len(steps) == 5 and all(gains.shape == (6, 1) for gains in steps)  # 2 rows · 3 beams, one read per step
    assert any(len(gains[:3].unique()) > 1 for gains in steps)  # the beams of a row differ: a reorder shows
    assert not torch.equal(gained, model.generate(ids, **kwargs))
    assert torch.equal(gained, model.generate(ids, **kwargs, token_sum_gain={}, use_cache=False))
    for row in range(2):
        alone = model.generate(ids[row : row + 1], **kwargs, token_sum_gain={})
        assert torch.equal(gained[2 * row : 2 * row + 2], alone)
    with pytest.raises(ValueError, match="token_sum_gain sums the prompt: it must be on from the prefill"):
        model(ids[:, :1], past_key_values=model(ids, use_cache=True).past_key_values, token_sum_gain={})


def test_a_registered_default_applies_to_calls_without_the_keyword_and_false_switches_it_off(value_gain):
    @dataclass(frozen=True, eq=False)
    class SilencedByDefault(ValueGainMitigation):
        @classmethod
        def default_options(cls, config):
            return {"gain": 0.0}

    model, ids = tiny_model(), random_ids(1, 6)
    with torch.no_grad():
        plain, silenced = model(ids).logits, model(ids, value_gain={"gain": 0.0}).logits
        unregister_mitigation("value_gain")
        register_mitigation(SilencedByDefault)
        assert not torch.equal(plain, silenced)
        assert torch.equal(model(ids).logits, silenced)
        assert torch.equal(model(ids, value_gain=False).logits, plain)


def test_a_mitigation_s_replace_is_dataclasses_replace():
    """`Mitigation.replace` (what `start` returns at every step) skips `__init__` only where that changes nothing: a
    field derived in `__post_init__` is derived again, a class with slots is copied, and a field `__init__` does not
    take, or no field at all, is refused as `dataclasses.replace` refuses it."""
    import dataclasses

    @dataclass(frozen=True, eq=False)
    class Derived(Mitigation):
        scale: float = 1.0
        double: float = dataclasses.field(init=False, default=0.0)

        def __post_init__(self):
            object.__setattr__(self, "double", 2 * self.scale)

    @dataclass(frozen=True, eq=False, slots=True)
    class Slotted(Mitigation):
        scale: float = 1.0

    @dataclass(frozen=True, eq=False)
    class Plain(Mitigation):
        scale: float = 1.0
        fixed: float = dataclasses.field(init=False, default=0.0)

    options = MitigationOptions()
    assert Derived(options, frozenset()).replace(scale=3.0).double == 6.0
    assert Slotted(options, frozenset()).replace(scale=3.0).scale == 3.0
    plain = Plain(options, frozenset({1}))
    started = plain.replace(scale=3.0)
    assert (type(started), started.scale, started.layers, plain.scale) == (Plain, 3.0, frozenset({1}), 1.0)
    with pytest.raises(ValueError, match="init=False"):
        plain.replace(fixed=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'scael'"):
        plain.replace(scael=3.0)


def test_a_plan_s_layers_keep_their_own_hooks_shared_where_alike_and_after_starting():
    """Each layer's hooks hold the mitigations acting in it, in the plan's order; layers with the same mitigations
    share one `LayerHooks`, and a started plan keeps both, each mitigation replaced by its started self."""
    from sepformer.mitigation_base import MitigationPlan

    @dataclass(frozen=True, eq=False)
    class Counted(Mitigation):
        runs: int = 0

        def wrap_attention(self, layer_idx, function, projection):
            return function

        def start(self, run):
            return self.replace(runs=self.runs + 1)

    first, second = Counted(MitigationOptions(), frozenset({0, 2, 3})), Counted(MitigationOptions(), frozenset({1, 3}))
    plan = MitigationPlan.of((first, second), 5)
    for runs in range(3):  # as resolved, then started twice (a started plan starts again)
        if runs:
            plan = plan.start(None)
        first, second = plan.mitigations
        assert (first.runs, second.runs) == (runs, runs)
        assert [hooks.attention_wrappers for hooks in plan.layers] == [
            (first,),
            (second,),
            (first,),
            (first, second),
            (),
        ]
        assert plan.layers[0] is plan.layers[2] and len({id(hooks) for hooks in plan.layers}) == 4
