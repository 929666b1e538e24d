"""transformers' fast path for generation: a static cache and a `fullgraph` compiled forward for the decoding steps
(the prefill runs eagerly), equal to eager greedy decoding. The `eager` backend traces the same graph as inductor, so a
graph break or a data-dependent branch fails here as it would there, without inductor's minutes of code generation."""

import pytest
import torch
from conftest import random_ids, tiny_llama, tiny_model
from transformers import CompileConfig

from sepformer import add_mitigations

PAST_L = dict(max_position_embeddings=16)  # 10 prompt tokens and 12 new ones reach past L
FIXED_HEADS = {"ms_poe": {"layers": [0, 1], "head_order": [3, 2, 1, 0]}}
VARIANTS = {  # (config, options of generate)
    "learned table": (dict(), {}),
    "rotary": (dict(rotary_dim=4), {}),
    "learned table, fourier past L": (dict(PAST_L, position_extrapolation="fourier"), {}),
    "B-spline map past L": (dict(PAST_L, positional_map={"map": "bspline", "control_points": 6}), {}),
    "interpolate past L": (PAST_L, {"position_extrapolation": {"method": "interpolate", "length": 22}}),
    "MS-PoE head_order, fourier past L": (dict(PAST_L, position_extrapolation="fourier"), FIXED_HEADS),
    "MS-PoE head_order, rotary": (dict(rotary_dim=4), FIXED_HEADS),
    "StableMask": (dict(), {"stable_mask": {"gamma": 0.5}}),
}


def compiled_generation_equals_eager_greedy(model, options: dict) -> None:
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, **options)
    eager = model.generate(ids, **kwargs)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(compiled, eager)
    assert model._compiled_call is not None  # the decoding steps did run compiled


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_cache_compiled_generation_equals_eager_greedy(variant):
    config, options = VARIANTS[variant]
    compiled_generation_equals_eager_greedy(tiny_model(**config), options)


@pytest.mark.parametrize("options", [{}, {"stable_mask": {"gamma": 0.5}}], ids=["no option", "StableMask"])
def test_a_mitigated_decoders_static_cache_compiled_generation_equals_eager_greedy(options):
    """The decoding steps of a decoder given `add_mitigations` tell a continued static cache as SepFormer's do (its
    length is a tensor a compiled graph cannot branch on); the options that keep state on the cache refuse it."""
    compiled_generation_equals_eager_greedy(add_mitigations(tiny_llama()), options)


SPANS = [[[1, 4], [4, 8]]] * 2
COMPILED_OPTIONS = {  # (config, options as a user passes them: dicts)
    "fourier": (PAST_L, {"position_extrapolation": {"method": "fourier", "components": 4}}),
    "interpolate without length": (PAST_L, {"position_extrapolation": "interpolate"}),
    "stable_mask": ({}, {"stable_mask": {"gamma": 0.5}}),
    "ms_poe ranked at prefill": ({}, {"ms_poe": {"layers": [0, 1]}}),
    "ms_poe head_order, fourier past L": (dict(PAST_L, position_extrapolation="fourier"), FIXED_HEADS),
    "ms_poe head_order, interpolate": (
        PAST_L,
        {**FIXED_HEADS, "position_extrapolation": {"method": "interpolate", "length": 30}},
    ),
    "positional_scaling": ({}, {"positional_scaling": {"layers": [1], "factor": 0.5}}),
    "attention_calibration": ({}, {"attention_calibration": {"spans": SPANS}}),
    "attention_calibration positional": ({}, {"attention_calibration": dict(spans=SPANS, bias_estimate="positional")}),
    "parallel_context_windows": ({}, {"parallel_context_windows": {"spans": SPANS}}),
    "attention_buckets, one scale": ({}, {"attention_buckets": {"scales": [0.5]}}),
    "attention_buckets, fourier past L": (
        dict(PAST_L, position_extrapolation="fourier"),
        {"attention_buckets": {"scales": [1.5, 0.5]}},
    ),
    "attention_buckets, rotary bases": (dict(rotary_dim=4), {"attention_buckets": {"bases": [100.0, 10000.0]}}),
}


def test_ms_poe_on_a_decoder_refuses_a_static_cache_compiled_by_name():
    """Its decoding steps turn the keys a static cache holds by how many it has seen, a tensor a graph cannot branch
    on; the eager steps on a static cache are the eager greedy tokens."""
    model, ids = add_mitigations(tiny_llama()), random_ids(2, 10)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, ms_poe={"head_order": [3, 2, 1, 0]})
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True
    with pytest.raises(Exception, match="ms_poe turns the keys a static cache.*which torch.compile cannot trace"):
        model.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))


# The options that read the padding mask, compiled on a left-padded batch too: a traced call reads no value of the
# mask (the prefill's checks of spans and padding are read eagerly only), and builds the dummy passes by positions.
READ_PADDING = (
    "ms_poe ranked at prefill",
    "positional_scaling",
    "attention_calibration",
    "attention_calibration positional",
    "parallel_context_windows",
)


def left_padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def assert_compiles_as_eagerly(model, options: dict, padded: bool) -> None:
    ids, mask = left_padded_ids() if padded else (random_ids(2, 12), None)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, **options).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids, attention_mask=mask, **options).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("variant", "padded"), [(variant, False) for variant in COMPILED_OPTIONS] + [(name, True) for name in READ_PADDING]
)
def test_every_option_given_as_a_dict_runs_under_fullgraph_compile_as_eagerly(variant, padded):
    """Options are parsed inside the traced call: parsing traces, and the positions they read (fractional ones past
    the table among them) take no data-dependent branch."""
    config, options = COMPILED_OPTIONS[variant]
    assert_compiles_as_eagerly(tiny_model(**config), options, padded)


@pytest.mark.parametrize(
    "options",
    [
        {"positional_scaling": {"layers": [1], "factor": 0.5}},
        {"ms_poe": {"layers": [0, 1]}},
        {"attention_calibration": {"spans": [[[1, 4], [4, 8]]] * 2}},
    ],
    ids=["positional_scaling", "ms_poe", "attention_calibration"],
)
def test_a_compiled_forward_with_its_own_cache_is_a_prefill(options):
    """A compiled call without a cache (one is made for it when `use_cache` is on) starts a generation: the options
    that act at prefill give the eager logits."""
    model = tiny_model()
    ids = random_ids(2, 10)
    with torch.no_grad():
        eager = model(ids, **options).logits
        compiled = torch.compile(model, backend="eager")(ids, **options).logits
    assert torch.equal(compiled, eager)


def test_compiled_training_draws_random_position_offsets():
    model = tiny_model(max_position_embeddings=16, position_table_size=64, random_position_offsets=True).train()
    table = model.model.embed_positions
    drawn = []
    original = type(table).training_positions
    table.training_positions = lambda *args: drawn.append(1) or original(table, *args)
    ids = random_ids(4, 16)
    torch.compile(model, backend="eager")(ids, labels=ids).loss.backward()
    assert drawn == [1]


TRACED_ON_DECODERS = {  # the options as a user passes them
    "stable_mask": {"stable_mask": {"gamma": 0.5}},
    "ms_poe ranked at prefill": {"ms_poe": {"layers": [0, 1]}},
    "ms_poe head_order": {"ms_poe": {"head_order": [3, 2, 1, 0]}},
    "attention_calibration": {"attention_calibration": {"spans": SPANS}},
    "parallel_context_windows": {"parallel_context_windows": {"spans": SPANS}},
    "attention_buckets, scales": {"attention_buckets": {"scales": [1.0, 0.5]}},
}


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "left padding"])
@pytest.mark.parametrize("variant", list(TRACED_ON_DECODERS))
def test_a_mitigated_decoder_runs_the_options_under_fullgraph_compile_as_eagerly(variant, padded):
    assert_compiles_as_eagerly(add_mitigations(tiny_llama()), TRACED_ON_DECODERS[variant], padded)


# What a trace cannot do: hooks a decoder's projections get for the call, a rotary of a decoder's class built at another
# base, dummy passes of their own length re-padded by each row's padding: (the model, its options, left padding).
UNTRACED = {
    "positional_scaling": (
        lambda: add_mitigations(tiny_llama()),
        {"positional_scaling": {"layers": [1], "factor": 0.5, "channels": [0, 1]}},
        False,
    ),
    "attention_buckets bases": (
        lambda: add_mitigations(tiny_llama()),
        {"attention_buckets": {"bases": [100.0]}},
        False,
    ),
    "attention_calibration's dummy_document": (
        tiny_model,
        {"attention_calibration": {"spans": SPANS, "dummy_document": [5, 6]}},
        True,
    ),
}


@pytest.mark.parametrize("variant", list(UNTRACED))
def test_what_a_trace_cannot_do_is_refused_under_fullgraph_and_runs_eagerly_without(variant):
    make_model, options, padded = UNTRACED[variant]
    model = make_model()
    ids, mask = left_padded_ids() if padded else (random_ids(2, 12), None)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, **options).logits
        with pytest.raises(Exception, match=f"{variant.split()[0]}.*which torch.compile cannot trace"):
            torch.compile(model, fullgraph=True, backend="eager")(ids, attention_mask=mask, **options)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")(ids, attention_mask=mask, **options).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"attention_calibration": {"spans": SPANS}},
        {"ms_poe": {}},
        {"positional_scaling": {"layers": [1], "factor": 0.5, "channels": [0, 1]}},
        {"attention_buckets": {"bases": [100.0, 10000.0]}},
    ],
    ids=["attention_calibration", "ms_poe", "positional_scaling", "attention_buckets bases"],
)
def test_generate_on_a_decoders_compiled_forward_gives_the_eager_tokens(options):
    """`model.forward = torch.compile(model.forward)`, the usual recipe, on a left-padded batch: the options read
    nothing of the instance's `forward` (a compiled wrapper, whose signature a trace cannot read), and what a trace
    cannot do breaks the graph and runs eagerly."""
    model = add_mitigations(tiny_llama())
    ids, mask = left_padded_ids()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, **options)
    eager = model.generate(ids, **kwargs)
    model.forward = torch.compile(model.forward, backend="eager")
    assert torch.equal(model.generate(ids, **kwargs), eager)
