"""Positional scaling (`sepformer/positional_scaling.py`): factor 1 = the base model bit for bit; scaled keys in the
cache."""

import torch
from conftest import logits, random_ids, strong_positions, tiny_model

from sepformer import PositionalScaling, SepFormerCache


def test_positional_scaling_with_factor_one_is_the_base_model_bit_for_bit():
    model = tiny_model(num_hidden_layers=3, rotary_dim=4)
    ids = random_ids(2, 12)
    options = (
        PositionalScaling(1.0),
        PositionalScaling(1.0, channels=(0, 9, 31), layers=(0, 1, 2)),
        PositionalScaling(1.0, layers=(0, 1, 2), skip_first=2, last_recompute_tokens=5),
    )
    for option in options:
        assert torch.equal(logits(model, ids, positional_scaling=option), logits(model, ids))
    greedy = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, **greedy, positional_scaling=options[2]), model.generate(ids, **greedy))


def test_positional_scaling_writes_scaled_keys_into_the_cache():
    model = strong_positions(tiny_model(num_hidden_layers=3))
    ids = random_ids(2, 10)
    inputs = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kw: inputs.__setitem__(m.layer_idx, args[0]), with_kwargs=True
        )
        for layer in model.model.layers
    ]
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, positional_scaling=PositionalScaling(-0.5))  # layer 1 only
        base_cache = SepFormerCache(config=model.config)
        model(ids, past_key_values=base_cache, use_cache=True)
        scaled_input = inputs[1].clone()
        scaled_input[..., :8] *= -0.5
        expected = model.model.layers[1].self_attn.k_proj(scaled_input).view(2, 10, 4, 8).transpose(1, 2)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(cache.layers[1].keys, expected)
    assert torch.equal(cache.layers[0].keys, base_cache.layers[0].keys)  # layer 0 is not scaled (default layers)
    assert torch.equal(cache.layers[0].values, base_cache.layers[0].values)
