"""Every mitigation option through the model (`sepformer/mitigations.py`: the registry, the per-call plan, the
compatibility rules): cached = full, left padding, right padding refused where it matters, bad options and refused
pairs, bfloat16, state fixed at prefill."""

import dataclasses

import pytest
import torch
from conftest import SPANS, logits, random_ids, strong_positions, tiny_model
from huggingface_hub.errors import StrictDataclassFieldValidationError

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    SepFormerCache,
    SepFormerConfig,
    SepFormerTokenizer,
    StableMask,
)
from sepformer.mitigation_options import REFUSED_TOGETHER, SAME_LAYERS_ONLY

OPTIONS = {
    "stable_mask": {"stable_mask": StableMask(gamma=0.2, columns=40)},
    "ms_poe": {"ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1))},
    "ms_poe_fixed": {"ms_poe": MSPoE(layers=(1,), head_order=(2, 0, 3, 1))},
    "calibration": {"attention_calibration": AttentionCalibration(spans=(SPANS,), temperature=1e-2, layers=(0, 1))},
    "calibration_positional": {
        "attention_calibration": AttentionCalibration(
            spans=(SPANS,), temperature=1e-2, layers=(0, 1), bias_estimate="positional"
        )
    },
    "scaling": {"positional_scaling": PositionalScaling(factor=-1.0, layers=(0, 1))},
}


@pytest.mark.parametrize("name", ["stable_mask", "ms_poe_fixed"])
def test_cached_decoding_equals_the_full_pass(name):
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 20)
    full = logits(model, ids, **OPTIONS[name])
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :8], past_key_values=cache, use_cache=True, **OPTIONS[name]).logits]
        for t in range(8, 20):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **OPTIONS[name]).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_left_padded_batch_generates_what_each_prompt_generates_alone(name, attn):
    model = strong_positions(tiny_model(rotary_dim=4))
    model.set_attn_implementation(attn)
    tokenizer = SepFormerTokenizer(padding_side="left")
    prompts = ["def f(x): return", "import os, sys", "a longer prompt, with more bytes"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id, **OPTIONS[name])
    calibration = OPTIONS[name].get("attention_calibration")
    if calibration is not None:
        kwargs["attention_calibration"] = dataclasses.replace(calibration, spans=(SPANS,) * 3)
    together = model.generate(**batch, **kwargs)[:, batch.input_ids.shape[1] :]
    options = {key: value for key, value in kwargs.items() if key in OPTIONS[name]}
    changed = logits(model, batch.input_ids, attention_mask=batch.attention_mask, **options)[:, -1]
    assert (changed - logits(model, batch.input_ids, attention_mask=batch.attention_mask)[:, -1]).abs().max() > 1e-5
    for row, prompt in enumerate(prompts):
        if calibration is not None:
            kwargs["attention_calibration"] = calibration
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), **kwargs)
        assert torch.equal(together[row], alone[0, -8:]), prompt


ACT_ON_LAST_ROWS = {"ms_poe", "calibration", "calibration_positional", "scaling"}  # ranked MS-PoE, not a fixed order


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_right_padded_prompt_is_refused_by_what_acts_on_its_last_token(name):
    """Positional scaling, calibration and ranked MS-PoE act on the prefill's last column, a pad in a row padded on
    the right (the tokenizer's default): the short row's last real token came out 0.6 to 8.6 off the row alone. They
    refuse it; the others give each right-padded row what it gives alone."""
    model = strong_positions(tiny_model(rotary_dim=4))
    tokenizer = SepFormerTokenizer()
    assert tokenizer.padding_side == "right"
    prompts = ["def f(x): return", "a longer prompt, with more bytes"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    options = dict(OPTIONS[name])
    if "attention_calibration" in options:
        options["attention_calibration"] = dataclasses.replace(options["attention_calibration"], spans=(SPANS,) * 2)
    if name in ACT_ON_LAST_ROWS:
        refused = r"acts on each row's last prompt token, .* rows \[0\] end in padding .* padding_side='left'"
        with pytest.raises(ValueError, match=refused):
            model(**batch, **options)
        with pytest.raises(ValueError, match=refused):
            model.generate(**batch, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id, **options)
        left = SepFormerTokenizer(padding_side="left")(prompts, return_tensors="pt", padding=True)
        logits(model, left.input_ids, attention_mask=left.attention_mask, **options)  # left padding runs
        return
    together = logits(model, batch.input_ids, attention_mask=batch.attention_mask, **options)
    for row, prompt in enumerate(prompts):
        alone = logits(model, tokenizer([prompt], return_tensors="pt").input_ids, **options)[0]
        torch.testing.assert_close(together[row, : len(alone)], alone, rtol=1e-5, atol=1e-5)


BAD = [
    ({"stable_mask": {"gamma": -1}}, "gamma=-1 must be > 0"),
    ({"stable_mask": {"gamma": 0.1, "columns": 0}}, "columns=0 must be None or a positive integer"),
    ({"stable_mask": {"gamma": 0.1, "columns": 2**63}}, "columns=9223372036854775808 must be .* at most 2\\*\\*63 - 1"),
    ({"stable_mask": {"gama": 0.1}}, "unknown keys \\['gama'\\]"),
    ({"stable_mask": 0.1}, "must be a StableMask, a dict"),
    ({"ms_poe": {"r_min": 0.5}}, "r_min=0.5 must be >= 1.0"),
    ({"ms_poe": {"r_min": 2.0, "r_max": 1.5}}, "r_max=1.5 must be >= r_min=2.0"),
    ({"ms_poe": {"layers": (5,)}}, "layers \\[5\\] are out of range: this model has layers 0..1"),
    ({"ms_poe": {"head_order": (0, 1, 2)}}, "must be a permutation of the 4 heads"),
    ({"ms_poe": {"layers": (1,)}, "positional_scaling": {"factor": 0.0, "layers": (1,)}}, "disjoint `layers`"),
    ({"positional_scaling": {"factor": float("nan")}}, "factor=nan must be a finite number"),
    ({"positional_scaling": {"factor": 1e30}}, "factor=1e\\+30 overflows this model's torch.float32: .* 1.845e\\+19"),
    ({"positional_scaling": {"factor": 0.5, "channels": (32,)}}, "channels \\[32\\] are out of range"),
    ({"positional_scaling": {"skip_first": -1}}, "skip_first=-1 must be an integer >= 0"),
    ({"positional_scaling": {"last_recompute_tokens": 0}}, "last_recompute_tokens=0 must be an integer >= 1"),
    ({"positional_scaling": {"last_recompute_tokens": 1.5}}, "last_recompute_tokens=1.5 must be an integer"),
    ({"positional_scaling": {"channels": ()}}, "must be distinct and non-empty"),
    ({"positional_scaling": {"dims": (0,)}}, "unknown keys \\['dims'\\]"),
    ({"attention_calibration": {"spans": (((0, 4), (3, 6)),)}}, "overlap"),
    ({"attention_calibration": {"spans": (((0, 4), (4, 60)),)}}, "out of range: the prompt of that row has 12"),
    ({"attention_calibration": {"spans": (((3, 3),),)}}, "empty or negative"),
    ({"attention_calibration": {"spans": (((0, 3),), ((0, 3),))}}, "spans for 2 rows; the batch has 1"),
    ({"attention_calibration": {"spans": (((0, 3),), ((0, 3), (3, 5)))}}, "the same number"),
    ({"attention_calibration": {"spans": (SPANS,), "temperature": 0}}, "temperature=0 must be >= 1e-38: .* float32"),
    ({"attention_calibration": {"spans": (SPANS,), "temperature": 1e-300}}, "temperature=1e-300 must be >= 1e-38"),
    ({"attention_calibration": {"spans": (SPANS,), "bias_estimate": "mean"}}, "bias_estimate='mean' is not one of"),
    (
        {"attention_calibration": {"spans": (SPANS,), "bias_estimate": "positional", "dummy_document": (5,)}},
        "dummy_document is only read by bias_estimate='dummy_passes'",
    ),
    ({"attention_calibration": {"spans": (SPANS,)}, "stable_mask": {"gamma": 0.1}}, "cannot be combined"),
    ({"stable_mask": {"gamma": 1.0, "columns": 6, "length": 5}}, "got both 'length' and 'columns', the older name"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[message[:30] for _, message in BAD])
def test_invalid_options_are_refused_with_a_clear_error(kwargs, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        model(random_ids(1, 12), **kwargs)


def test_the_extreme_values_allowed_give_finite_logits_and_a_half_precision_model_allows_smaller_factors():
    """NaN logits came back without an error for calibration's temperature=1e-300 and positional scaling's
    factor=1e30; the bounds that refuse them still let the extremes they allow run finite."""
    model = strong_positions(tiny_model())
    ids = random_ids(1, 12)
    coldest = AttentionCalibration(spans=(SPANS,), temperature=1e-38)
    assert torch.isfinite(logits(model, ids, attention_calibration=coldest)).all()
    assert torch.isfinite(logits(model, ids, positional_scaling=PositionalScaling(-1e4))).all()
    half = model.to(torch.float16)
    with pytest.raises(ValueError, match="factor=300 overflows this model's torch.float16: .* at most 255.9"):
        half(ids, positional_scaling=PositionalScaling(300))
    assert torch.isfinite(logits(half, ids, positional_scaling=PositionalScaling(-2.0))).all()


# Written out by hand: a pair dropped from REFUSED_TOGETHER, or one whose name a typo changed, fails below.
REFUSED_PAIRS = {
    ("stable_mask", "attention_calibration"),
    ("ms_poe", "positional_scaling"),  # in the same layers only
    ("stable_mask", "attention_buckets"),
    ("ms_poe", "attention_buckets"),
    ("ms_poe", "parallel_context_windows"),
    ("attention_calibration", "parallel_context_windows"),
    ("reorder_documents", "attention_calibration"),  # generate's: tests/test_reordering.py
    ("reorder_documents", "parallel_context_windows"),
}
IN_THE_SAME_LAYERS_ONLY = {("ms_poe", "positional_scaling")}
VALID_ALONE = {  # on a 12-token prompt, in layers 0 and 1
    "stable_mask": StableMask(0.1),
    "ms_poe": MSPoE(layers=(0, 1)),
    "attention_calibration": AttentionCalibration(spans=(SPANS,), layers=(0, 1)),
    "positional_scaling": PositionalScaling(0.5, layers=(0, 1)),
    "attention_buckets": AttentionBuckets(scales=[0.5]),
    "parallel_context_windows": ParallelContextWindows(spans=(((0, 4), (4, 8)),)),
}


def test_the_refused_pairs_in_the_code_are_the_ones_written_out():
    assert set(REFUSED_TOGETHER) == REFUSED_PAIRS
    assert SAME_LAYERS_ONLY == IN_THE_SAME_LAYERS_ONLY


@pytest.mark.parametrize(
    "pair",
    sorted(pair for pair in REFUSED_PAIRS | set(REFUSED_TOGETHER) if "reorder_documents" not in pair),
    ids="+".join,
)
def test_every_refused_pair_is_refused_and_each_of_it_runs_alone(pair):
    model = tiny_model()
    ids = random_ids(1, 12)
    for name in pair:
        logits(model, ids, **{name: VALID_ALONE[name]})
    first, second = pair
    same_layers = pair in IN_THE_SAME_LAYERS_ONLY
    refused = r".* of layers \[0, 1\]: give them disjoint" if same_layers else "cannot be combined"
    with pytest.raises(ValueError, match=f"{first} and {second} {refused}"):
        model(ids, **{name: VALID_ALONE[name] for name in pair})
    if same_layers:
        disjoint = {first: dataclasses.replace(VALID_ALONE[first], layers=(0,))}
        logits(model, ids, **disjoint, **{second: dataclasses.replace(VALID_ALONE[second], layers=(1,))})


def test_options_that_need_something_the_model_lacks_are_refused():
    nope = tiny_model(position_size=0)
    ids = random_ids(1, 12)
    with pytest.raises(ValueError, match="ms_poe rescales positions, but this model has none"):
        nope(ids, ms_poe=MSPoE())
    with pytest.raises(ValueError, match="give channels=\\(...\\) explicitly"):
        nope(ids, positional_scaling=PositionalScaling(0.0))
    flex = tiny_model()
    flex.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="stable_mask runs on the 'eager' and 'sdpa'"):
        flex(ids, stable_mask=StableMask(0.1))
    with pytest.raises(StrictDataclassFieldValidationError, match="stable_mask"):
        SepFormerConfig(stable_mask=0.1)
    with pytest.raises(ValueError, match="gamma=0 must be > 0"):
        SepFormerConfig(stable_mask={"gamma": 0})
    no_pad = tiny_model(pad_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match=r"repeats pad_token_id \(or eos_token_id where .*\), which is not in"):
        no_pad(ids, attention_calibration=AttentionCalibration(spans=(SPANS,)))
    no_positions = tiny_model(position_size=0)
    with pytest.raises(ValueError, match="bias_estimate='positional' reads the positional block, .* position_size=0"):
        no_positions(ids, attention_calibration=AttentionCalibration(spans=(SPANS,), bias_estimate="positional"))
    no_pad(ids, attention_calibration=AttentionCalibration(spans=(SPANS,), bias_estimate="positional"))  # no dummy


@pytest.mark.parametrize("positional_map", ["learned", "sinusoidal"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_generates_in_bfloat16(name, positional_map):
    model = tiny_model(rotary_dim=4, positional_map=positional_map).to(torch.bfloat16)
    kwargs = dict(OPTIONS[name])
    if "attention_calibration" in kwargs:
        kwargs["attention_calibration"] = dataclasses.replace(kwargs["attention_calibration"], spans=(SPANS,) * 3)
    out = model.generate(random_ids(3, 12), max_new_tokens=3, do_sample=False, **kwargs)
    assert out.shape == (3, 15)


def test_state_fixed_at_prefill_refuses_other_options_and_static_caches():
    model = tiny_model()
    ids = random_ids(1, 12)
    cache = SepFormerCache(config=model.config)
    option = AttentionCalibration(spans=(SPANS,))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_calibration=option)
        with pytest.raises(ValueError, match="continuing a cache needs the options of its prefill"):
            model(
                ids[:, :1],
                past_key_values=cache,
                use_cache=True,
                attention_calibration=AttentionCalibration(spans=(((0, 4), (4, 8)),)),
            )
    with pytest.raises(ValueError, match="needs a cache that grows with the tokens"):
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            cache_implementation="static",
            attention_calibration=option,
        )


def test_layers_and_channels_accept_any_sequence_of_integers():
    assert MSPoE(layers=(layer for layer in (2, 3))).layers == (2, 3)
    assert PositionalScaling(0.5, channels=range(3)).channels == (0, 1, 2)
    with pytest.raises(ValueError, match="must be a sequence of integers"):
        MSPoE(layers=2)
