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
