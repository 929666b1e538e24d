"""Every registered positional map (rows, cached decoding, saving, refused values), the B-spline map against Cox–de
Boor written out here, and randomized positions in training."""

import json
import math
import re
from dataclasses import fields

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from sepformer import MSPoE, PositionExtrapolation, SepFormerCache, SepFormerConfig, SepFormerForCausalLM
from sepformer.positional_maps import (
    EXTRAPOLATIONS,
    POSITIONAL_MAPS,
    bspline_basis,
    bspline_knots,
    capacity_for,
    check_registries,
    randomized_positions,
)
from sepformer.positional_options import EXTRAPOLATION_METHODS, POSITIONAL_MAP_OPTIONS, BSplineMap

L = 16
D_POS = 8  # tiny_model: hidden_size 32, 4 heads


def reference_knots(n, k, end):
    """Clamped uniform knots: k + 1 at each end, n - k equal segments in between."""
    return [0.0] * (k + 1) + [end * j / (n - k) for j in range(1, n - k)] + [end] * (k + 1)


def cox_de_boor(i, k, t, knots):
    """`N_{i,k}(t)` by the recursion, spans half-open except the last non-empty one, which also holds the end."""
    if k == 0:
        if knots[i] <= t < knots[i + 1]:
            return 1.0
        return 1.0 if t == knots[-1] and knots[i] < knots[i + 1] == knots[-1] else 0.0
    value = 0.0
    if knots[i + k] > knots[i]:
        value += (t - knots[i]) / (knots[i + k] - knots[i]) * cox_de_boor(i, k - 1, t, knots)
    if knots[i + k + 1] > knots[i + 1]:
        value += (knots[i + k + 1] - t) / (knots[i + k + 1] - knots[i + 1]) * cox_de_boor(i + 1, k - 1, t, knots)
    return value


def reference_rows(control_points, k, positions, end, extension):
    """`p(t) = Σ_i N_{i,k}(t) c_i` on `[0, end]`; past it the last control point (`clamp`) or the tangent at the end,
    taken here as a one-sided finite difference (`linear`)."""
    c = control_points.double()
    n = c.shape[0]
    knots = reference_knots(n, k, end)

    def p(t):
        return sum(cox_de_boor(i, k, t, knots) * c[i] for i in range(n))

    rows = []
    for t in positions:
        if t <= end:
            rows.append(p(t))
        elif extension == "clamp":
            rows.append(c[-1])
        else:
            step = 1e-6
            rows.append(p(end) + (t - end) * (p(end) - p(end - step)) / step)
    return torch.stack(rows)


def map_model(options, **overrides):
    """A tiny model with the map `options`, its weights large enough to matter, read past `L` by `sinusoidal` if it is
    a table that needs an extrapolation method."""
    config = tiny_config(max_position_embeddings=L, positional_map=options.as_config_value(), **overrides)
    if config.has_positional_table:
        config.position_extrapolation = "sinusoidal"
    torch.manual_seed(0)
    model = SepFormerForCausalLM(config).eval()
    with torch.no_grad():
        for weight in model.model.embed_positions.parameters():
            weight.normal_(0, 1)
    return model


def spline_model(**parameters):
    return map_model(BSplineMap(**{"control_points": 6, **parameters}))


def map_rows(model, positions):
    with torch.no_grad():
        return model.model.embed_positions(positions, model.config.default_extrapolation())


def other_allowed(option):
    """A value the declaration of a map's parameter allows besides its default."""
    rules = option.metadata
    if rules["choices"]:
        return next(choice for choice in rules["choices"] if choice != option.default)
    return option.default - 1 if option.default > rules["minimum"] else option.default + 1


def refused(option):
    """Values the declaration of a map's parameter refuses, each with its error: a `TypeError` for a wrong type."""
    rules = option.metadata
    if rules["choices"]:
        return [(f"not {option.default}", ValueError), (1, TypeError)]
    return [(rules["minimum"] - 1, ValueError), (rules["minimum"] + 0.5, TypeError), (True, TypeError)]


# every registered map at its defaults and, if it has parameters, with each at another allowed value
MAPS = [options() for options in POSITIONAL_MAP_OPTIONS.values()]
MAPS += [options(**{o.name: other_allowed(o) for o in fields(options)}) for options in POSITIONAL_MAP_OPTIONS.values()]
MAPS = list(dict.fromkeys(MAPS))  # maps without parameters once
MAP_IDS = [json.dumps(options.as_config_value()) for options in MAPS]


POSITIONS = [0.0, 0.5, 1.0, 2.9, 3.0, 7.25, 11.0, 14.999, 15.0]


@pytest.mark.parametrize("n, k", [(6, 3), (5, 1), (8, 2), (4, 3), (7, 4)])
def test_basis_equals_cox_de_boor(n, k):
    knots = bspline_knots(n, k, float(L - 1))
    torch.testing.assert_close(knots, torch.tensor(reference_knots(n, k, L - 1.0), dtype=torch.float64))
    got = bspline_basis(torch.tensor(POSITIONS, dtype=torch.float64), knots, k, "clamp")
    knot_list = reference_knots(n, k, L - 1.0)
    expected = torch.tensor(
        [[cox_de_boor(i, k, t, knot_list) for i in range(n)] for t in POSITIONS], dtype=torch.float64
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("extension", ["clamp", "linear"])
@pytest.mark.parametrize("n, k", [(6, 3), (16, 3), (5, 1)])
def test_partition_of_unity(n, k, extension):
    knots = bspline_knots(n, k, float(L - 1))
    inside = bspline_basis(torch.linspace(0, L - 1, 1001), knots, k, extension)
    assert (inside >= 0).all()
    torch.testing.assert_close(inside.sum(-1), torch.ones(1001, dtype=torch.float64), rtol=0, atol=1e-12)
    # past the last knot the rows stay affine combinations of the control points (clamp: the last one alone)
    beyond = bspline_basis(torch.tensor([16.0, 40.0, 1000.0]), knots, k, extension)
    torch.testing.assert_close(beyond.sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-9)
    if extension == "clamp":
        assert torch.equal(beyond, torch.nn.functional.one_hot(torch.tensor([n - 1] * 3), n).double())


@pytest.mark.parametrize("extension", ["clamp", "linear"])
def test_rows_at_integer_and_fractional_positions_equal_the_reference(extension):
    model = spline_model(extension=extension)
    control_points = model.model.embed_positions.control_points.detach()
    integers = list(range(3 * L))  # past the last knot (15) as well
    with torch.no_grad():
        hidden = model(torch.zeros(1, 3 * L, dtype=torch.long), output_hidden_states=True).hidden_states[0]
    expected = reference_rows(control_points, 3, integers, L - 1.0, extension).float()
    torch.testing.assert_close(hidden[0, :, :D_POS], expected, rtol=1e-4, atol=1e-4)
    fractional = [0.25, 7.5, 14.75, 15.5, 20.125]
    torch.testing.assert_close(
        map_rows(model, torch.tensor([fractional]))[0],
        reference_rows(control_points, 3, fractional, L - 1.0, extension).float(),
        rtol=1e-4,
        atol=1e-4,
    )


def learned_row_L(table, method):
    """Row `L` of a learned table past its end, from the methods' formulas: `σ · PE(L)` (`σ` the std of the table,
    `PE_{2k} = sin`, `PE_{2k+1} = cos` of `L / 10000^{2k/d}`), or, with every Fourier term kept, `p(L) = p(0)`."""
    if method == "fourier":
        return table[0]
    d = table.shape[1]
    angles = [L / 10000 ** (2 * (j // 2) / d) for j in range(d)]
    pe = [math.sin(angle) if j % 2 == 0 else math.cos(angle) for j, angle in enumerate(angles)]
    return table.std() * torch.tensor(pe, dtype=table.dtype)


@pytest.mark.parametrize("method", ["sinusoidal", "fourier"])
def test_fractional_positions_between_the_last_row_and_the_first_extrapolated_one_interpolate_them(method):
    """MS-PoE reads `p(m / r)` at fractional positions: between `L-1` and `L` a row is read between the table's last
    row and the extrapolated row `L` (the position's ceiling is a row past the table), linearly."""
    model = tiny_model(max_position_embeddings=L)
    table = model.model.embed_positions.weight.detach().double()
    positions = [3.25, L - 1.0, L - 0.75, L - 0.5, L - 0.25]
    row_L = learned_row_L(table, method)
    expected = [torch.lerp(table[3], table[4], 0.25), table[L - 1]]
    expected += [torch.lerp(table[L - 1], row_L, 1 - (L - t)) for t in positions[2:]]
    with torch.no_grad():
        rows = model.model.embed_positions(torch.tensor([positions]), PositionExtrapolation(method))[0]
    torch.testing.assert_close(rows.double(), torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_ends_are_the_end_control_points():
    model = spline_model()
    control_points = model.model.embed_positions.control_points
    rows = map_rows(model, torch.tensor([[0, L - 1, 4 * L]]))[0]
    torch.testing.assert_close(rows, control_points[[0, -1, -1]], rtol=1e-6, atol=1e-6)


def decode_step_by_step(model, ids, prefill):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(steps, 1)


@pytest.mark.parametrize("options", MAPS, ids=MAP_IDS)
def test_every_map_reads_rows_at_integer_and_fractional_positions(options):
    model = map_model(options)
    positions = torch.arange(3 * L)[None]
    rows = map_rows(model, positions)
    assert rows.shape == (1, 3 * L, D_POS) and rows.isfinite().all()
    assert torch.equal(map_rows(model, positions[:, 20:23]), rows[:, 20:23])  # whatever else the call reads
    torch.testing.assert_close(map_rows(model, positions.float()), rows)  # whole fractional positions: the rows
    inside, at = positions[:, : L - 1].float(), rows[:, : L - 1]
    torch.testing.assert_close(map_rows(model, inside + 1e-3), at, rtol=0, atol=1e-2)  # continuous
    assert not torch.allclose(map_rows(model, inside + 0.5), at, rtol=0, atol=1e-3)  # but not constant between


@pytest.mark.parametrize("options", MAPS, ids=MAP_IDS)
def test_every_map_decodes_past_L_with_a_cache_as_the_full_forward(options):
    model = map_model(options)
    ids = torch.randint(0, 256, (2, 3 * L), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
    torch.testing.assert_close(decode_step_by_step(model, ids, 10), full, rtol=1e-5, atol=1e-5)
    kwargs = dict(max_new_tokens=2 * L, do_sample=False, pad_token_id=256)
    prompt = ids[:, :6]
    cached, uncached = (model.generate(prompt, use_cache=use_cache, **kwargs) for use_cache in (True, False))
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("options", MAPS, ids=MAP_IDS)
def test_every_map_survives_save_and_reload(options, tmp_folder):
    model = map_model(options)
    model.save_pretrained(tmp_folder)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_folder).eval()
    assert reloaded.config.map_options() == options
    ids = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("options", POSITIONAL_MAP_OPTIONS.values(), ids=list(POSITIONAL_MAP_OPTIONS))
def test_every_map_refuses_the_values_its_parameters_do_not_allow_when_set(options):
    config = SepFormerConfig()
    for name, value, error in [(option.name, *value) for option in fields(options) for value in refused(option)]:
        given = {"map": options.map, name: value}
        message = rf"positional_map=.* is not allowed: {options.map} {name}={re.escape(repr(value))} must be"
        with pytest.raises(error, match=message):
            SepFormerConfig(positional_map=given)
        with pytest.raises(error, match=message):
            config.positional_map = given
    with pytest.raises(ValueError, match=rf"the {options.map} map reads no \['bogus'\] \(its parameters: "):
        SepFormerConfig(positional_map={"map": options.map, "bogus": 1})


def test_the_older_spline_fields_give_the_same_model_in_a_saved_config_and_as_keywords(tmp_path):
    model = spline_model(control_points=5, degree=2, extension="linear")
    model.save_pretrained(tmp_path)
    path, older = tmp_path / "config.json", dict(spline_control_points=5, spline_degree=2, spline_extension="linear")
    path.write_text(json.dumps({**json.loads(path.read_text()), "positional_map": "bspline", **older}))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.positional_map == {"map": "bspline", "control_points": 5, "degree": 2, "extension": "linear"}
    assert not set(older) & set(reloaded.config.to_dict())
    ids = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert SepFormerConfig(positional_map="bspline", **older).positional_map == reloaded.config.positional_map
    assert SepFormerConfig(positional_map={"map": "bspline", "degree": 2}).spline_degree == 2


def test_the_map_named_again_keeps_its_parameters_and_another_name_gets_its_defaults(tmp_path):
    """As when the spline's parameters were fields of their own: re-stating the map's name changes nothing."""
    model = spline_model(control_points=5, degree=2, extension="linear")
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, positional_map="bspline").eval()
    ids = torch.randint(0, 256, (1, 2 * L))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    config = SepFormerConfig(positional_map={"map": "bspline", "degree": 2})
    config.positional_map = "bspline"
    assert config.positional_map == {"map": "bspline", "degree": 2}
    config.positional_map = "learned"
    config.positional_map = "bspline"
    assert config.positional_map == "bspline"
    config = SepFormerConfig(position_extrapolation={"method": "fourier", "components": 8})
    config.position_extrapolation = "fourier"  # a method named alone has its defaults, as before the maps had options
    assert config.position_extrapolation == "fourier"


def test_rows_are_kept_on_the_generation_only():
    model = spline_model()
    spline = model.model.embed_positions
    positions = torch.arange(3 * L)[None]
    store = {}
    with torch.no_grad():
        first = spline(positions, None, store)
        (rows,) = store.values()
        capacity = capacity_for(3 * L, spline.length)  # T · 2^m covering 3L
        assert rows.shape[0] == capacity
        torch.testing.assert_close(rows, spline.rows_at(torch.arange(capacity)))
        assert torch.equal(spline(positions[:, :5], None, store), first[:, :5])
        assert len(store) == 1 and next(iter(store.values())) is rows  # the same capacity: kept
        spline.control_points.data.mul_(2.0)
        torch.testing.assert_close(spline(positions, None), spline.rows_at(positions))  # no store: the weights now


def test_ms_poe_identity_is_the_base_model_bit_for_bit():
    model = spline_model()
    ids = torch.randint(0, 256, (2, 2 * L + 3))
    identity = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=(0, 1, 2, 3))
    with torch.no_grad():
        assert torch.equal(model(ids, ms_poe=identity).logits, model(ids).logits)


def test_compiled_forward_past_L_equals_eager():
    model = spline_model(extension="linear")
    ids = torch.randint(0, 256, (2, 3 * L))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------- randomized positions


def test_randomized_positions_are_sorted_distinct_subsets_that_reach_every_position():
    M = 8 * L
    reached = torch.zeros(M, dtype=torch.bool)
    for _ in range(50):
        drawn = randomized_positions(torch.arange(L).expand(4, -1), L, M)
        assert drawn.shape == (4, L)
        assert (drawn.diff(dim=-1) > 0).all() and drawn.min() >= 0 and drawn.max() < M
        reached[drawn.flatten()] = True
    assert reached.all()


def test_a_fractional_position_reads_linearly_between_the_draws_around_it():
    """An attention bucket's `m · s` in training: the draws of the integers, then each fraction between them."""
    positions = torch.arange(L).expand(4, -1)
    torch.manual_seed(0)
    drawn = randomized_positions(positions, L, 8 * L)
    fractions = torch.tensor([0.0, 0.25, 0.5])[torch.arange(L - 1) % 3]
    torch.manual_seed(0)
    between = randomized_positions((torch.arange(L - 1) + fractions).expand(4, -1), L, 8 * L)  # the same draws
    expected = drawn[:, :-1] + fractions * (drawn[:, 1:] - drawn[:, :-1])
    assert between.is_floating_point() and torch.equal(between, expected)
    torch.manual_seed(0)
    assert torch.equal(randomized_positions(positions.float(), L, 8 * L), drawn.float())


@pytest.mark.parametrize("positional_map", POSITIONAL_MAP_OPTIONS)
def test_attention_buckets_train_on_randomized_positions(positional_map):
    """The scaled positions are fractional where the draws are integer rows: each reads between two draws."""
    model = tiny_model(
        max_position_embeddings=L, position_table_size=8 * L, randomized_positions=True, positional_map=positional_map
    ).train()
    ids = torch.randint(0, 256, (2, L))
    for scales in ((0.5,), (1.0, 0.7)):
        loss = model(ids, labels=ids, attention_buckets={"scales": scales}).loss
        loss.backward()
        assert loss.isfinite()


def test_a_range_per_sequence_gives_gaps_from_none_to_the_widest():
    """Fixed range: 16 positions from [0, 128) nearly always reach past 64. Per sequence: the range M' is uniform in
    [16, 128], so about half the rows stay below 64, and some are contiguous (M' = 16: the positions of inference)."""
    M, n = 8 * L, L
    fixed = randomized_positions(torch.arange(n).expand(4000, -1), n, M)
    varied = randomized_positions(torch.arange(n).expand(4000, -1), n, M, per_sequence_range=True)
    assert (varied.diff(dim=-1) > 0).all() and varied.min() >= 0 and varied.max() < M
    assert (fixed.amax(-1) < M // 2).float().mean() < 0.01
    assert 0.3 < (varied.amax(-1) < M // 2).float().mean() < 0.6
    assert (varied.amax(-1) == n - 1).any() and torch.equal(torch.unique(varied), torch.arange(M))


@pytest.mark.parametrize("positional_map", [name for name in POSITIONAL_MAP_OPTIONS if name != "sinusoidal"])
def test_randomized_positions_train_every_row_up_to_M(positional_map):
    """Every output scored (each position has a target, as with L + 1-token blocks): every row of an 8L table, and
    every control point of a spline over [0, 8L), gets a gradient (the sinusoid has nothing to learn)."""
    model = tiny_model(
        max_position_embeddings=L, position_table_size=8 * L, randomized_positions=True, positional_map=positional_map
    ).train()
    parameter = next(model.model.embed_positions.parameters())
    reached = torch.zeros(parameter.shape[0], dtype=torch.bool)
    for _ in range(30):
        model.zero_grad()
        blocks = torch.randint(0, 256, (8, L + 1))
        model(blocks[:, :-1], labels=blocks[:, :-1], shift_labels=blocks[:, 1:].contiguous()).loss.backward()
        reached |= parameter.grad.abs().sum(-1) > 0
    assert reached.all()


@pytest.mark.parametrize("positional_map", POSITIONAL_MAP_OPTIONS)
def test_randomized_positions_only_in_training_and_inference_reads_0_to_n(positional_map):
    model = tiny_model(
        max_position_embeddings=L, position_table_size=8 * L, randomized_positions=True, positional_map=positional_map
    )
    ids = torch.randint(0, 256, (3, L))
    with torch.no_grad():
        evaluated = model(ids).logits
        assert torch.equal(evaluated, model(ids, position_ids=torch.arange(L)[None]).logits)
        assert model(torch.randint(0, 256, (1, 8 * L))).logits.shape == (1, 8 * L, 259)  # 8L: no extrapolation
        model.train()
        assert not torch.allclose(model(ids).logits, evaluated)  # training reads other positions


def test_randomized_positions_refuse_a_sequence_longer_than_the_range():
    model = tiny_model(max_position_embeddings=L, position_table_size=2 * L, randomized_positions=True).train()
    with pytest.raises(ValueError, match=r"randomized_positions: a training sequence reaches position 32, past"):
        model(torch.randint(0, 256, (1, 2 * L + 1)), position_extrapolation="clamp")


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"positional_map": {"map": "bspline", "control_points": 4, "degree": 4}}, ValueError, "control_points=4 must"),
        ({"spline_degree": 2}, ValueError, r"spline_degree=2 is read only with 'bspline' \(it would be ignored\)"),
        ({"positional_map": "bspline", "spline_degree": 0}, ValueError, "bspline degree=0 must be a positive integer"),
        ({"positional_map": "bspline", "spline_control_points": 1}, ValueError, "control_points=1 must be an integer"),
        (
            {"positional_map": "bspline", "spline_extension": "cubic"},
            ValueError,
            r"bspline extension='cubic' must be one of 'clamp', 'linear'\.",
        ),
        ({"positional_map": "bspline", "spline_degree": 2.5}, TypeError, "degree=2.5 must be a positive .*, not float"),
        ({"positional_map": "bspline", "spline_control_points": "8"}, TypeError, "control_points='8' .*, not str"),
        ({"positional_map": "bspline", "spline_control_points": True}, TypeError, "control_points=True .*, not bool"),
        ({"positional_map": {"map": "bspline", "degree": 2.5}}, TypeError, "degree=2.5 must be .*, not float"),
        ({"positional_map": "bspline", "max_position_embeddings": 8}, ValueError, "control_points=16 is more than the"),
        ({"positional_map": "bspline", "position_extrapolation": "clamp"}, ValueError, "defined at every position"),
        ({"positional_map": "sinusoidal", "position_size": 7}, ValueError, "position_size=7 is odd"),
        ({"randomized_positions": True}, ValueError, "randomized_positions=True needs a positional map"),
        (
            {"randomized_positions": True, "position_size": 0, "position_table_size": 32},
            ValueError,
            "randomized_positions=True needs a positional map",
        ),
        (
            {"randomized_positions": True, "random_position_offsets": True, "position_table_size": 32},
            ValueError,
            "choose one",
        ),
        ({"position_table_size": 32, "positional_map": "sinusoidal"}, ValueError, "or randomized_positions=True"),
        ({"randomized_range": "per_sequence"}, ValueError, "randomized_range='per_sequence' is read only with"),
        ({"randomized_range": "adaptive"}, ValueError, "randomized_range='adaptive' is not allowed: choose one of"),
    ],
)
def test_invalid_spline_and_randomized_configs(overrides, error, message):
    values = dict(max_position_embeddings=L)
    values.update(overrides)
    with pytest.raises(error, match=message):
        tiny_model(**values)


def test_a_call_continuing_a_cache_in_training_mode_reads_plain_positions():
    """Randomized positions are drawn for a whole sequence: a cached step is not given a fresh random position."""
    # unfused: a training-mode step runs the layers' modules, which the fused weights match to ~1e-7, not bit for bit
    model = tiny_model(
        max_position_embeddings=L, position_table_size=8 * L, randomized_positions=True, fuse_decoding_projections=False
    )
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    steps = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        cache = SepFormerCache(config=model.config)
        with torch.no_grad():
            model.eval()(ids[:, :8], past_key_values=cache, use_cache=True)
            getattr(model, mode)()
            steps[mode] = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(steps["train"], steps["eval"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("registry", "entry", "message"),
    [
        ("methods", ("bogus",), r"extrapolation method registries disagree: \['bogus'\] named in positional_opti"),
        ("extrapolations", {"bogus": None}, r"\['bogus'\] implemented there without a name in positional_options"),
        ("map_names", ("bogus",), r"positional map registries disagree: \['bogus'\] named in positional_options"),
        ("maps", {"bogus": None}, r"positional map registries disagree: none named .* \['bogus'\] implemented"),
    ],
)
def test_the_registries_of_names_and_implementations_are_checked_to_agree(registry, entry, message):
    registries = dict(
        methods=EXTRAPOLATION_METHODS,
        extrapolations=EXTRAPOLATIONS,
        map_names=tuple(POSITIONAL_MAP_OPTIONS),
        maps=POSITIONAL_MAPS,
    )
    check_registries(**registries)  # as at import
    current = registries[registry]
    registries[registry] = (*current, *entry) if isinstance(current, tuple) else {**current, **entry}
    with pytest.raises(ValueError, match=message):
        check_registries(**registries)


def test_integer_parameters_are_kept_as_plain_integers():
    """NumPy and torch integers are taken as integers and kept as Python's (a config saves them as JSON)."""
    spline = BSplineMap(control_points=np.int64(8), degree=torch.tensor(2))
    assert (type(spline.control_points), type(spline.degree)) == (int, int)
    fourier = PositionExtrapolation("fourier", components=np.int32(4))
    assert type(fourier.components) is int
