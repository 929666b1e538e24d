"""Positional maps past the training length: each method against its formula, caching, decoding."""

import math

import pytest
import torch
from conftest import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from sepformer import (
    EXTRAPOLATION_METHODS,
    PositionExtrapolation,
    SepFormerCache,
    SepFormerConfig,
    SepFormerForCausalLM,
)
from sepformer.positional_maps import compress_positions, fourier_rows, sinusoid

L = 16
METHODS = [m for m in EXTRAPOLATION_METHODS if m != "none"]


def model_with_table(seed=0, **overrides):
    """A tiny model with an `L = 16` table whose rows are smooth plus noise, like a trained table."""
    model = tiny_model(seed=seed, max_position_embeddings=L, **overrides)
    with torch.no_grad():
        i = torch.arange(L, dtype=torch.float32)[:, None]
        k = torch.arange(model.config.position_size, dtype=torch.float32)[None, :]
        model.model.embed_positions.weight.copy_(torch.sin(0.3 * i * (k + 1) / 4) + 0.05 * torch.randn(L, k.shape[1]))
    return model


def rows(model, positions, method, **params):
    table = model.model.embed_positions
    with torch.no_grad():
        return table(torch.tensor([positions]), PositionExtrapolation(method=method, **params))[0]


def test_clamp_repeats_the_last_row():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    torch.testing.assert_close(rows(model, [15, 16, 40], "clamp"), weight[[15, 15, 15]])


def test_clamp_reads_a_position_far_past_the_table_without_making_the_rows_up_to_it():
    """Rows up to position 10^9 would take 34 GB: clamp reads the last row wherever the position is."""
    model = model_with_table()
    ids = torch.zeros(1, 3, dtype=torch.long)
    far = model(ids, position_ids=torch.tensor([[0, 10**9, 10**9 + 1]]), position_extrapolation="clamp").logits
    near = model(ids, position_ids=torch.tensor([[0, L - 1, L - 1]]), position_extrapolation="clamp").logits
    torch.testing.assert_close(far, near, atol=0, rtol=0)
    table = model.model.embed_positions  # fractional positions (MS-PoE's m / r) too
    far_rows = table(torch.tensor([[L - 1.5, 1e9 + 0.5]]), PositionExtrapolation("clamp"))
    weight = table.weight.detach()
    torch.testing.assert_close(far_rows[0], torch.stack(((weight[L - 2] + weight[L - 1]) / 2, weight[L - 1])))


@pytest.mark.parametrize("method", ["sinusoidal", "fourier"])
def test_a_method_reads_a_position_far_past_the_table_at_that_position_without_making_the_rows_up_to_it(method):
    """Rows up to position 10^9 would take 34 GB: far past the table the method's rows are made at the positions
    read, integer and fractional, and the table's rows read as they are."""
    table = model_with_table().model.embed_positions
    weight, extrapolation = table.weight.detach(), PositionExtrapolation(method)
    if method == "sinusoidal":
        formula = lambda positions: weight.std() * sinusoid(positions, weight.shape[1])  # noqa: E731
    else:
        formula = lambda positions: fourier_rows(weight, positions, extrapolation.components)  # noqa: E731
    far = torch.tensor([L - 1, 10**9, 10**9 + 1, 2**40])
    got = table(far[None], extrapolation)[0].detach()
    torch.testing.assert_close(got, torch.cat((weight[L - 1 :], formula(far[1:]))))
    halves = table(torch.tensor([[L - 1.5, 1e9 + 0.5]], dtype=torch.float64), extrapolation)[0].detach()
    expected_far = (formula(torch.tensor([10**9])) + formula(torch.tensor([10**9 + 1]))) / 2
    torch.testing.assert_close(halves, torch.cat(((weight[L - 2 : L - 1] + weight[L - 1 :]) / 2, expected_far)))
    for no_positions in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0)):  # integer and fractional: no rows
        assert table(no_positions, extrapolation).shape == (1, 0, weight.shape[1])


def test_a_method_assigned_to_a_live_config_is_checked_at_the_next_call():
    """The config's own method is checked as a call's is: an assignment skips the checks of the config's
    construction."""
    model = tiny_model(max_position_embeddings=L, positional_map="sinusoidal")
    model.config.position_extrapolation = "fourier"
    with pytest.raises(ValueError, match="position_extrapolation='fourier' needs a learned positional table"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model = model_with_table()
    model.config.position_extrapolation = {"method": "interpolate", "length": 10}
    with pytest.raises(ValueError, match="interpolate length=10 must exceed the table's 16 rows"):
        model(torch.zeros(1, 12, dtype=torch.long))


def test_sinusoidal_is_the_std_matched_sinusoid():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    got = rows(model, list(range(12, 40)), "sinusoidal")
    torch.testing.assert_close(got[:4], weight[12:16])  # inside the table: the table
    d = weight.shape[1]
    expected = torch.zeros(24, d)
    angle = torch.arange(16, 40, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    expected[:, 0::2], expected[:, 1::2] = angle.sin(), angle.cos()
    torch.testing.assert_close(got[4:], weight.std() * expected)  # documented discontinuity at L


def test_fourier_with_every_coefficient_reproduces_the_table_and_is_periodic():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    every = L // 2 + 1
    torch.testing.assert_close(fourier_rows(weight, torch.arange(L), every), weight, rtol=1e-4, atol=1e-5)
    # past L, the series continues with period L: p(L + i) = p(i) (the documented discontinuity at L-1 -> L)
    torch.testing.assert_close(
        rows(model, list(range(L, 3 * L)), "fourier", components=every), weight.repeat(2, 1), rtol=1e-4, atol=1e-5
    )


def test_fourier_top_k_equals_the_formula_with_the_largest_coefficients():
    model = model_with_table()
    weight = model.model.embed_positions.weight.detach().double()
    K, i = 3, torch.arange(L, 2 * L, dtype=torch.float64)
    expected = torch.zeros(L, weight.shape[1], dtype=torch.float64)
    for dim in range(weight.shape[1]):
        spectrum = torch.fft.fft(weight[:, dim])  # full DFT: the conjugate twins carry the other half
        half = spectrum[: L // 2 + 1]
        for k in half.abs().topk(K).indices.tolist():
            scale = 1 / L if k in (0, L // 2) else 2 / L
            expected[:, dim] += scale * (half[k] * torch.exp(2j * math.pi * k * i / L)).real
    torch.testing.assert_close(
        rows(model, list(range(L, 2 * L)), "fourier", components=K).double(), expected, rtol=1e-4, atol=1e-5
    )


def test_fourier_with_few_components_is_smoother_than_the_table():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    smooth = fourier_rows(weight, torch.arange(L), 2)
    assert smooth.diff(dim=0).abs().mean() < weight.diff(dim=0).abs().mean()


def test_interpolate_is_the_identity_up_to_L_and_compresses_longer_sequences():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    torch.testing.assert_close(rows(model, list(range(L)), "interpolate"), weight)
    n = 4 * L
    got = rows(model, list(range(n)), "interpolate")
    position = torch.arange(n) * (L - 1) / (n - 1)
    low = position.floor().long()
    high = (low + 1).clamp(max=L - 1)
    expected = weight[low] + (position - low)[:, None] * (weight[high] - weight[low])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got[[0, -1]], weight[[0, -1]])  # the ends map to the ends


def test_none_names_the_position_the_table_rows_and_the_methods():
    model = model_with_table()
    with pytest.raises(ValueError, match=r"position 20 is past .* 16 rows .*'clamp', 'sinusoidal', 'fourier'"):
        model(torch.zeros(1, 21, dtype=torch.long))


def test_negative_positions_are_refused():
    model = model_with_table()
    with pytest.raises(ValueError, match="position -1 is negative"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[-1, 0, 1]]))


def test_continuity_at_L_of_clamp_and_interpolate():
    """`clamp` and `interpolate` are continuous at L; `sinusoidal` and `fourier` start another curve there, which the
    exact-formula tests above pin down (std-matched sinusoid; the periodic series, `p(L) = p(0)` with every term)."""
    model = model_with_table()
    weight = model.model.embed_positions.weight
    assert torch.equal(rows(model, [L], "clamp")[0], weight[L - 1])
    compressed = rows(model, list(range(2 * L)), "interpolate")
    assert compressed.diff(dim=0).norm(dim=-1).max() <= weight.diff(dim=0).norm(dim=-1).max() + 1e-6


def test_fractional_positions_interpolate_inside_the_table():
    model = model_with_table()
    weight = model.model.embed_positions.weight
    table = model.model.embed_positions
    with torch.no_grad():
        got = table(torch.tensor([[0.0, 2.5, 7.25, 15.0]]), PositionExtrapolation())[0]
    expected = torch.stack([weight[0], (weight[2] + weight[3]) / 2, 0.75 * weight[7] + 0.25 * weight[8], weight[15]])
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------------- through the model and the cache


def decode_step_by_step(model, ids, prefill, **kwargs):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True, **kwargs).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs).logits)
    return torch.cat(steps, 1)


@pytest.mark.parametrize("method", METHODS)
def test_cached_decoding_past_L_equals_the_full_forward(method):
    model = model_with_table()
    ids = torch.randint(0, 256, (2, 3 * L), generator=torch.Generator().manual_seed(0))
    extrapolation = {"method": method, "length": 3 * L} if method == "interpolate" else method
    with torch.no_grad():
        full = model(ids, position_extrapolation=extrapolation).logits
    torch.testing.assert_close(
        decode_step_by_step(model, ids, 10, position_extrapolation=extrapolation), full, rtol=1e-5, atol=1e-5
    )


def test_interpolate_without_a_length_refuses_cached_decoding_past_L():
    model = model_with_table()
    ids = torch.randint(0, 256, (1, 2 * L))
    with pytest.raises(ValueError, match=r"'interpolate' needs the final sequence length"):
        decode_step_by_step(model, ids, 10, position_extrapolation="interpolate")


def test_interpolate_without_a_length_continues_a_cache_up_to_the_whole_table():
    """A continued call fixes the length at the table's `position_table_size` rows, not at `L`: a table trained past
    `L` (random offsets) decodes past `L` without compressing anything, as the full forward pass does."""
    model = tiny_model(max_position_embeddings=L, position_table_size=4 * L, random_position_offsets=True)
    ids = torch.randint(0, 256, (2, 3 * L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids, position_extrapolation="interpolate").logits
    torch.testing.assert_close(
        decode_step_by_step(model, ids, 6, position_extrapolation="interpolate"), full, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("method", METHODS)
def test_cached_generation_past_L_equals_uncached(method):
    model = model_with_table()
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    extrapolation = {"method": method, "length": 6 + 2 * L} if method == "interpolate" else method
    kwargs = dict(max_new_tokens=2 * L, do_sample=False, pad_token_id=256, position_extrapolation=extrapolation)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_per_call_override_reaches_every_decoding_step(monkeypatch):
    model = model_with_table()
    table = model.model.embed_positions
    seen = []
    original = type(table).forward

    def recording_forward(self, ids, extrapolation, store=None):
        seen.append(extrapolation.method)
        return original(self, ids, extrapolation, store)

    monkeypatch.setattr(type(table), "forward", recording_forward)
    model.generate(
        torch.zeros(1, 4, dtype=torch.long),
        max_new_tokens=2 * L,
        do_sample=False,
        pad_token_id=256,
        position_extrapolation="clamp",
    )
    assert seen == ["clamp"] * (2 * L)


def test_config_default_and_per_call_override():
    model = model_with_table(position_extrapolation="clamp")
    ids = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model(ids, position_extrapolation="clamp").logits)
        assert not torch.allclose(model(ids).logits, model(ids, position_extrapolation="sinusoidal").logits)


def test_rows_past_the_table_are_kept_on_the_generation_only():
    """A generation's cache keeps the rows past the table for its steps, made once per capacity `L · 2^m`; a call
    without one makes them anew, from the weights as they are."""
    model = model_with_table()
    table = model.model.embed_positions
    fourier = PositionExtrapolation(method="fourier", components=4)
    store = {}
    with torch.no_grad():
        first = table.rows_past_table(3 * L, fourier, store)
        assert table.rows_past_table(2 * L + 5, fourier, store) is first  # the same capacity: kept
        assert first.shape[0] == 3 * L  # rows L .. 4L-1: capacity rounded up to L * 2^m
        assert table.rows_past_table(3 * L, fourier, None) is not first
        table.weight.data.mul_(2.0)  # no version counter moves
        torch.testing.assert_close(
            table.rows_past_table(3 * L, fourier, None), fourier_rows(table.weight, torch.arange(L, 4 * L), 4)
        )
        cache = SepFormerCache(config=model.config)
        model.generate(
            torch.randint(0, 256, (1, L - 2)),
            max_new_tokens=L,
            do_sample=False,
            past_key_values=cache,
            position_extrapolation="fourier",
        )
    assert cache.derived[("rows past the table", PositionExtrapolation(method="fourier"))].shape[0] == L  # 2L - L


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_rows_past_L_equal_the_row_alone(method):
    """Each row extrapolates for its own positions: a short row is not compressed for the longest one."""
    model = model_with_table()
    long_ids, short_ids = torch.randint(0, 256, (1, 3 * L)), torch.randint(0, 256, (1, L + 4))
    pad = 3 * L - short_ids.shape[1]
    batch = torch.cat([long_ids, torch.cat([torch.full((1, pad), 256), short_ids], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = model(batch, attention_mask=mask, position_extrapolation=method).logits
        alone = model(short_ids, position_extrapolation=method).logits
    torch.testing.assert_close(together[1, pad:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["clamp", "sinusoidal", "fourier", "interpolate"])
def test_compiled_forward_past_L_equals_eager(method):
    model = model_with_table()
    extrapolation = {"method": method, "length": 3 * L} if method == "interpolate" else method
    ids = torch.randint(0, 256, (2, 3 * L))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(ids, position_extrapolation=extrapolation).logits,
            model(ids, position_extrapolation=extrapolation).logits,
            rtol=1e-4,
            atol=1e-5,
        )


def test_training_past_L_sends_gradients_to_the_table():
    model = model_with_table(position_extrapolation="fourier")
    model.train()
    ids = torch.randint(0, 256, (1, 2 * L))
    model(ids, labels=ids).loss.backward()
    grad = model.model.embed_positions.weight.grad
    assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("method", METHODS)
def test_method_survives_save_and_reload(tmp_folder, method):
    read = {"fourier": {"components": 5}, "interpolate": {"length": 3 * L}}.get(method, {})
    value = {"method": method, **read} if read else method
    model = model_with_table(position_extrapolation=value)
    model.save_pretrained(tmp_folder)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_folder).eval()
    assert reloaded.config.position_extrapolation == value
    assert reloaded.config.default_extrapolation() == model.config.default_extrapolation()
    ids = torch.randint(0, 256, (1, 2 * L))  # shorter than interpolation_length: a dropped length would show
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_random_position_offsets_train_the_whole_table():
    model = tiny_model(max_position_embeddings=L, position_table_size=4 * L, random_position_offsets=True)
    model.train()
    touched = torch.zeros(4 * L, dtype=torch.bool)
    for _ in range(60):
        model.zero_grad()
        ids = torch.randint(0, 256, (8, L))
        model(ids, labels=ids).loss.backward()
        touched |= model.model.embed_positions.weight.grad.abs().sum(-1) > 0
    # the last row is only ever a sequence's last position, whose output has no next token to predict
    assert touched[:-1].all()
    model.eval()  # at inference positions start at 0 and the table covers 4L without extrapolating
    ids = torch.randint(0, 256, (2, L))
    with torch.no_grad():
        assert model(torch.randint(0, 256, (1, 4 * L))).logits.shape == (1, 4 * L, 259)
        assert torch.equal(model(ids).logits, model(ids).logits)  # no random offset outside training


def test_random_position_offsets_refuse_a_sequence_longer_than_the_table():
    model = tiny_model(max_position_embeddings=L, position_table_size=2 * L, random_position_offsets=True).train()
    ids = torch.randint(0, 256, (1, 2 * L + 1))
    with pytest.raises(ValueError, match=r"reaches position 32, past the table of position_table_size=32"):
        model(ids, position_extrapolation="clamp")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"position_extrapolation": "linear"}, "method 'linear' is unknown"),
        ({"position_extrapolation": "fourier", "fourier_components": 0}, "components=0"),
        ({"interpolation_length": -3}, "length=-3"),
        ({"position_extrapolation": "clamp", "positional_map": "sinusoidal"}, "needs a learned positional table"),
        ({"position_extrapolation": "clamp", "position_size": 0}, "needs a learned positional table"),
        ({"position_table_size": 8}, "position_table_size=8 must be >= max_position_embeddings=16"),
        ({"random_position_offsets": True}, "random_position_offsets=True needs"),
        ({"position_table_size": 32}, "position_table_size=32 > max_position_embeddings=16 needs random_position_"),
        ({"position_extrapolation": "interpolate", "interpolation_length": 16}, "interpolate length=16 must exceed"),
        ({"interpolation_length": 48}, r"interpolation_length=48 is read only with 'interpolate' .*has position_ext"),
        (
            {"position_extrapolation": "clamp", "fourier_components": 8},
            r"fourier_components=8 is read only with 'fourier' \(it would be ignored\); this config has position_"
            r"extrapolation='clamp'",
        ),
        ({"position_extrapolation": "sinusoidal", "position_size": 7}, None),  # odd d_pos: a sine ends the row
    ],
)
def test_invalid_extrapolation_config(overrides, message):
    if message is None:
        model = tiny_model(max_position_embeddings=L, **overrides)
        assert model(torch.zeros(1, 2 * L, dtype=torch.long)).logits.shape == (1, 2 * L, 259)
        return
    with pytest.raises(ValueError, match=message):
        tiny_model(max_position_embeddings=L, **overrides)


@pytest.mark.parametrize(
    "value, message",
    [
        ("linear", "method 'linear' is unknown"),
        ({"method": "fourier", "k": 3}, r"unknown keys \['k'\]"),
        ({"method": "fourier", "components": -1}, "components=-1"),
        (3, "must be a method name, a dict or a PositionExtrapolation"),
        ({"method": "interpolate", "length": 10}, "interpolate length=10 must exceed the table's 16 rows"),
        (
            {"method": "clamp", "length": 100},
            r"length=100 is read only by 'interpolate' \(it would be ignored\), not by 'clamp'",
        ),
        ({"method": "interpolate", "components": 8}, r"components=8 is read only by 'fourier' .* not by 'interpolate'"),
    ],
)
def test_invalid_per_call_extrapolation(value, message):
    with pytest.raises(ValueError, match=message):
        model_with_table()(torch.zeros(1, 4, dtype=torch.long), position_extrapolation=value)


@pytest.mark.parametrize("overrides", [{"positional_map": "sinusoidal"}, {"position_size": 0}])
def test_per_call_method_without_a_learned_table_is_refused(overrides):
    model = tiny_model(max_position_embeddings=L, **overrides)
    with pytest.raises(ValueError, match="needs a learned positional table"):
        model(torch.zeros(1, 4, dtype=torch.long), position_extrapolation="fourier")
    with pytest.raises(ValueError, match="must be a method name"):
        model(torch.zeros(1, 4, dtype=torch.long), position_extrapolation=3)


def test_an_extrapolation_from_another_copy_of_the_module_is_accepted():
    """Hub custom code and the installed package each have their own `PositionExtrapolation` class: a namesake with
    the same fields is read by its fields; another kind of object with those attributes is not one."""
    from types import SimpleNamespace

    foreign = type("PositionExtrapolation", (SimpleNamespace,), {})(method="clamp", components=16, length=None)
    with pytest.raises(ValueError, match="position_extrapolation must be a method name"):
        PositionExtrapolation.parse(SimpleNamespace(method="clamp", components=16, length=None))
    model = model_with_table()
    ids = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        assert torch.equal(
            model(ids, position_extrapolation=foreign).logits, model(ids, position_extrapolation="clamp").logits
        )


def test_sinusoidal_map_runs_past_L_as_is():
    model = tiny_model(max_position_embeddings=L, positional_map="sinusoidal")
    with torch.no_grad():
        out = model(torch.zeros(1, 3 * L, dtype=torch.long), output_hidden_states=True)
    angle = torch.arange(3 * L, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, 8, 2) / 8)
    expected = torch.stack((angle.sin(), angle.cos()), -1).flatten(1)  # PE_2k = sin, PE_2k+1 = cos, interleaved
    torch.testing.assert_close(out.hidden_states[0][0, :, :8], expected)


@pytest.mark.parametrize("n", [20, 24, 28, 29, 39])
def test_ms_poe_identity_under_interpolate_is_the_base_model_at_every_length(n):
    """At these lengths float32 `(n-1) · (15/(n-1))` is `15.000001`: the last position must still land on row 15."""
    from sepformer import MSPoE

    model = model_with_table()
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n))
    identity = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=(0, 1, 2, 3))
    for extrapolation in ("interpolate", {"method": "interpolate", "length": n}):
        with torch.no_grad():
            base = model(ids, position_extrapolation=extrapolation).logits
            assert torch.equal(model(ids, position_extrapolation=extrapolation, ms_poe=identity).logits, base)
    table = model.model.embed_positions
    coordinates = table.table_coordinates(torch.arange(n)[None], PositionExtrapolation("interpolate"))
    assert coordinates[0, -1].item() == L - 1


def test_interpolate_puts_the_last_position_on_the_last_row_past_float32_s_exact_integers():
    """At `L = 2048` and `8L` tokens the product `i · (L-1)` is past `2^24`: divided in float32 it lands the last
    position off row `L-1` (past it for 270 of 400 lengths from 16384), and MS-PoE's reader then asks for row `L`."""
    for rows in (2048, 4096):
        lengths = torch.arange(8 * rows, 8 * rows + 400)[:, None]
        last = compress_positions(lengths - 1, rows, lengths)
        assert (last == rows - 1).all()
        positions = torch.randint(0, 8 * rows, (1, 4096), generator=torch.Generator().manual_seed(rows))
        compressed = compress_positions(positions, rows, lengths)
        exact = positions.double() * (rows - 1) / (lengths.double() - 1)
        assert (compressed <= rows - 1).all()
        torch.testing.assert_close(compressed.double(), exact, rtol=2e-7, atol=0)
    model = SepFormerForCausalLM(
        SepFormerConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, max_position_embeddings=2048)
    ).eval()
    with torch.no_grad():  # a last position that float32 put at 2047.0001: MS-PoE at ratio 1 reads rows 2047 and 2048
        model(
            torch.tensor([[65]]),
            position_ids=torch.tensor([[16394]]),
            position_extrapolation={"method": "interpolate", "length": 16395},
            ms_poe={"r_min": 1.0, "r_max": 1.5},
        )


def test_the_fields_of_older_configs_fold_into_position_extrapolation():
    config = SepFormerConfig(position_extrapolation="fourier", fourier_components=5, interpolation_length=None)
    assert config.position_extrapolation == {"method": "fourier", "components": 5}
    assert "fourier_components" not in config.to_dict()
    with pytest.raises(ValueError, match=r"interpolation_length=64 and position_extrapolation=.* both set length"):
        SepFormerConfig(position_extrapolation={"method": "interpolate", "length": 1024}, interpolation_length=64)


@pytest.mark.parametrize("order", ["old field first", "method first"])
def test_from_pretrained_sets_an_older_field_after_the_method_whatever_the_keywords_order(tmp_path, order):
    """transformers sets `from_pretrained`'s keywords one by one in the caller's order: the method set after the older
    field would drop its parameter without a word."""
    SepFormerConfig(position_extrapolation={"method": "interpolate", "length": 2048}).save_pretrained(tmp_path)
    keywords = {"interpolation_length": 4096, "position_extrapolation": "interpolate"}
    if order == "method first":
        keywords = dict(reversed(keywords.items()))
    for load in (SepFormerConfig.from_pretrained, AutoConfig.from_pretrained):
        assert load(tmp_path, **keywords).position_extrapolation == {"method": "interpolate", "length": 4096}
    with pytest.raises(ValueError, match=r"interpolation_length=64 and position_extrapolation=.* both set length"):
        SepFormerConfig.from_pretrained(
            tmp_path, interpolation_length=64, position_extrapolation={"method": "interpolate", "length": 1024}
        )


def test_the_config_imports_no_torch_code_of_the_package():
    import ast
    import pathlib

    package, seen, todo = pathlib.Path("sepformer"), set(), ["configuration_sepformer"]
    while todo:
        name = todo.pop()
        seen.add(name)
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.split(".")[0] == "torch" for alias in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "torch", name
                if node.level == 1 and node.module not in seen:
                    todo.append(node.module)
    assert "positional_options" in seen and "positional_maps" not in seen
