"""transformers' fast path for generation: a static cache and a `fullgraph` compiled forward for the decoding steps
(the prefill runs eagerly), equal to eager greedy decoding. The `eager` backend traces the same graph as inductor, so a
graph break or a data-dependent branch fails here as it would there, without inductor's minutes of code generation."""

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import CompileConfig

VARIANTS = {
    "learned table": dict(),
    "rotary": dict(rotary_dim=4),
    "learned table, fourier past L": dict(max_position_embeddings=16, position_extrapolation="fourier"),
    "B-spline map past L": dict(max_position_embeddings=16, positional_map="bspline", spline_control_points=6),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_cache_compiled_generation_equals_eager_greedy(variant):
    torch._dynamo.reset()
    model = tiny_model(**VARIANTS[variant])
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **kwargs)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert torch.equal(compiled, eager)
    assert model._compiled_call is not None  # the decoding steps did run compiled


@pytest.mark.parametrize(
    "options",
    [{"positional_scaling": {"layers": [1], "factor": 0.5}}, {"ms_poe": {"layers": [0, 1]}},
     {"attention_calibration": {"spans": [[[1, 4], [4, 8]]] * 2}}],
    ids=["positional_scaling", "ms_poe", "attention_calibration"],
)
def test_a_compiled_forward_with_its_own_cache_is_a_prefill(options):
    """A compiled call without a cache (one is made for it when `use_cache` is on) starts a generation: the options
    that act at prefill give the eager logits."""
    torch._dynamo.reset()
    model = tiny_model()
    ids = random_ids(2, 10)
    with torch.no_grad():
        eager = model(ids, **options).logits
        compiled = torch.compile(model, backend="eager")(ids, **options).logits
    assert torch.equal(compiled, eager)


def test_compiled_training_draws_random_position_offsets():
    torch._dynamo.reset()
    model = tiny_model(max_position_embeddings=16, position_table_size=64, random_position_offsets=True).train()
    table = model.model.embed_positions
    drawn = []
    original = type(table).training_positions
    table.training_positions = lambda *args: drawn.append(1) or original(table, *args)
    ids = random_ids(4, 16)
    torch.compile(model, backend="eager")(ids, labels=ids).loss.backward()
    assert drawn == [1]
