"""Every bad input of a call is refused before any work is done, with what was wrong, the value and what is allowed."""

import functools

import pytest
import torch
from conftest import random_ids, tiny_llama, tiny_model
from transformers import GenerationConfig

from sepformer import AttentionCalibration, MSPoE, ParallelContextWindows, SepFormerCache, StableMask, add_mitigations

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def with_id(token: int) -> torch.Tensor:
    ids = IDS.clone()
    ids[1, 5] = token
    return ids


def refused_before_any_work(model, error, message, call):
    """`call()` raises `error` matching `message`, and no decoder layer ran before."""
    layer_calls = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *args: layer_calls.append(1))
    try:
        with pytest.raises(error, match=message):
            call()
    finally:
        handle.remove()
    assert not layer_calls


LABELS = IDS.clone()
TO_INT64 = r"of torch.int64 or torch.int32; got shape \(2, 12\) of "
MASK_VALUES = r"a 2-D padding mask holds only 0 \(padding\) and 1 \(a token\), as bool, int or float"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": IDS[:, :0]}, r"the input has no tokens \(shape \(2, 0\)\)"),
        ({"input_ids": IDS[:0]}, r"the input has no tokens \(shape \(0, 12\)\)"),
        ({"input_ids": IDS[0]}, r"input_ids must be a 2-D tensor .* got shape \(12,\) .* input_ids\[None\]"),
        (
            {"input_ids": IDS[None]},
            r"got shape \(1, 2, 12\) of torch.int64 \(give one row of ids per sequence: input_ids.flatten\(0, -2\)",
        ),
        ({"input_ids": IDS[0, 0]}, r"got shape \(\) .* \(give a batch and a sequence dimension: input_ids.view\(1, 1"),
        (
            {"input_ids": torch.zeros(2, 12, 24)},
            r"got shape \(2, 12, 24\) of torch.float32 \(give token ids; vectors go in inputs_embeds, "
            r"\(batch, sequence, semantic_size=24\)\)",
        ),
        (
            {"input_ids": IDS.to("meta")},
            r"input_ids is on the meta device, which holds shapes but no values: give tensors holding the inputs, "
            r"on the model's device \(cpu\)",
        ),
        ({"input_ids": IDS, "attention_mask": torch.ones(2, 12, device="meta")}, r"attention_mask is on the meta"),
        (
            {"input_ids": IDS, "attention_mask": torch.ones(2, 1, 11, 12, dtype=torch.bool)},
            r"attention_mask has shape \(2, 1, 11, 12\); a 4-D mask must be \(batch or 1, 1 or heads, new tokens, "
            r"past \+ new tokens\) = \(2 or 1, 1 or 4, 12, 12\)",
        ),
        (
            {"input_ids": IDS, "attention_mask": torch.ones(1, 1, 12, 13, dtype=torch.bool)},
            r"attention_mask has shape \(1, 1, 12, 13\); a 4-D mask must be",
        ),
        (
            {"input_ids": IDS, "attention_mask": torch.ones(3, 1, 12, 12, dtype=torch.bool)},
            r"attention_mask has shape \(3, 1, 12, 12\); a 4-D mask must be",
        ),
        ({"input_ids": IDS.float()}, r"input_ids must be a 2-D tensor of token ids .* torch.float32"),
        ({"input_ids": with_id(259)}, r"input_ids contains id 259, outside the vocabulary 0..258"),
        ({"input_ids": with_id(-1)}, r"input_ids contains id -1, outside the vocabulary 0..258"),
        ({"input_ids": IDS, "attention_mask": torch.ones(2, 13)}, r"attention_mask has shape \(2, 13\); .* \(2, 12\)"),
        ({"input_ids": IDS, "attention_mask": torch.ones(2, 1, 12)}, r"attention_mask must be a 2-D padding mask"),
        ({"input_ids": IDS, "position_ids": torch.arange(12)}, r"position_ids has shape \(12,\); .* \(2 or 1, 12\)"),
        ({"input_ids": IDS, "position_ids": torch.arange(11)[None]}, r"position_ids has shape \(1, 11\)"),
        ({"inputs_embeds": torch.zeros(2, 12, 32)}, r"inputs_embeds has shape \(2, 12, 32\).*semantic_size=24"),
        ({"input_ids": IDS, "inputs_embeds": torch.zeros(2, 12, 24)}, "exactly one of input_ids or inputs_embeds"),
        ({"input_ids": IDS.to(torch.uint8)}, TO_INT64 + r"torch.uint8 \(give integer token ids: input_ids.long\(\)\)"),
        ({"input_ids": IDS.bool()}, TO_INT64 + "torch.bool"),
        ({"input_ids": IDS.short()}, TO_INT64 + "torch.int16"),
        (
            {"inputs_embeds": torch.zeros(2, 12, 24, dtype=torch.float64)},
            r"inputs_embeds has dtype torch.float64, but the model's embeddings are torch.float32: give "
            r"inputs_embeds.to\(torch.float32\)",
        ),
        ({"inputs_embeds": torch.zeros(2, 12, 24, dtype=torch.bfloat16)}, r"inputs_embeds has dtype torch.bfloat16"),
        (
            {"input_ids": IDS, "labels": LABELS[:, :5]},
            r"labels must be token ids of torch.int64 shaped like the input \(batch, sequence\) = \(2, 12\); got "
            r"shape \(2, 5\) of torch.int64",
        ),
        ({"input_ids": IDS, "labels": LABELS[0]}, r"labels must be .* = \(2, 12\); got shape \(12,\)"),
        ({"input_ids": IDS, "labels": LABELS.float()}, r"labels must be .*; got shape \(2, 12\) of torch.float32"),
        ({"input_ids": IDS, "labels": LABELS.int()}, r"labels must be .*; got shape \(2, 12\) of torch.int32"),
        ({"inputs_embeds": torch.zeros(2, 12, 24), "labels": LABELS[:1]}, r"labels must be .* got shape \(1, 12\)"),
        (
            {"input_ids": IDS, "labels": with_id(259)},
            r"labels contains 259: a label is a token id 0..258 or ignore_index=-100 \(not scored\)",
        ),
        ({"input_ids": IDS, "labels": with_id(-5)}, r"labels contains -5: a label is a token id 0..258"),
        ({"input_ids": IDS, "labels": with_id(-100), "ignore_index": -1}, r"labels contains -100: .* ignore_index=-1"),
        ({"input_ids": IDS, "labels": LABELS, "shift_labels": with_id(300)}, r"shift_labels contains 300"),
        (
            {"input_ids": IDS, "labels": LABELS, "logits_to_keep": 1},
            r"labels are scored at every position, but logits_to_keep=1 keeps fewer logits",
        ),
        (
            {"input_ids": IDS, "logits_to_keep": -1},
            r"logits_to_keep=-1 is negative: give 0 \(every position\), n > 0 \(the last n positions\) or a tensor",
        ),
        (
            {"input_ids": IDS, "position_ids": torch.full((1, 12), float("nan"))},
            r"position_ids must be integer positions of torch.int64 or torch.int32; got torch.float32",
        ),
        ({"input_ids": IDS, "position_ids": torch.arange(12.0)[None]}, r"position_ids must be integer positions"),
        ({"input_ids": IDS, "position_ids": torch.ones(1, 12, dtype=torch.bool)}, r"got torch.bool"),
        (
            {"input_ids": IDS, "position_ids": torch.arange(12)[None] - 3},
            r"position_ids: position -3 is negative: positions start at 0",
        ),
        ({"input_ids": IDS, "attention_mask": torch.full((2, 12), 2)}, r"attention_mask contains 2: " + MASK_VALUES),
        ({"input_ids": IDS, "attention_mask": torch.full((2, 12), 0.5)}, r"attention_mask contains 0.5: "),
        ({"input_ids": IDS, "attention_mask": -torch.ones(2, 12, dtype=torch.long)}, r"attention_mask contains -1: "),
        ({"input_ids": IDS, "attention_mask": torch.full((2, 12), float("nan"))}, r"attention_mask contains nan: "),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, str) else None,
)
def test_bad_tensors_are_refused(kwargs, message):
    model = tiny_model()
    refused_before_any_work(model, ValueError, message, lambda: model(**kwargs))


def test_negative_positions_are_refused_without_a_positional_map():
    # rotary alone reads any position: only the check refuses it
    model = tiny_model(position_size=0, rotary_dim=4)
    refused_before_any_work(
        model, ValueError, "position -1 is negative", lambda: model(IDS, position_ids=torch.arange(12)[None] - 1)
    )


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("input_ids", IDS.numpy(), "ndarray"),
        ("input_ids", IDS.tolist(), "list"),
        ("inputs_embeds", torch.zeros(2, 12, 24).numpy(), "ndarray"),
        ("attention_mask", [[1] * 12] * 2, "list"),
        ("position_ids", list(range(12)), "list"),
    ],
)
def test_inputs_that_are_no_tensors_are_type_errors(name, value, kind):
    model = tiny_model()
    message = rf"{name} must be a torch tensor; got a {kind}. Convert it first, e.g. torch.tensor\(ids\)\[None\]"
    inputs = {"input_ids": IDS, name: value} if name not in ("input_ids", "inputs_embeds") else {name: value}
    refused_before_any_work(model, TypeError, message, lambda: model(**inputs))
    with pytest.raises(TypeError, match=r"labels must be a torch tensor of token ids; got a list"):
        model(IDS, labels=IDS.tolist())


def test_valid_labels_masks_and_positions_of_every_allowed_kind_still_run():
    model = tiny_model()
    with torch.no_grad():
        expected = model(IDS, labels=LABELS)
        ignored = LABELS.clone()
        ignored[:, :3] = -1
        assert torch.isfinite(model(IDS, labels=ignored, ignore_index=-1).loss)
        for mask in (torch.ones(2, 12, dtype=torch.bool), torch.ones(2, 12), torch.ones(2, 12, dtype=torch.int32)):
            torch.testing.assert_close(model(IDS, attention_mask=mask, labels=LABELS).loss, expected.loss)
        positions = torch.arange(12, dtype=torch.int32)[None]
        torch.testing.assert_close(model(IDS.int(), position_ids=positions).logits, expected.logits)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts each operation's inputs
            model(inputs_embeds=model.model.embed_tokens(IDS).bfloat16())


@pytest.mark.parametrize("given", ["labels", "shift_labels"])
def test_labels_that_score_no_token_warn_that_the_loss_is_nan(given):
    """Llama returns a NaN loss without a word. A warning, not an error: `Trainer` evaluates batches whose labels may
    all be ignored; with `num_items_in_batch` (its training steps) the loss is 0 and nothing is said."""
    from transformers.testing_utils import CaptureLogger

    from sepformer import input_checks

    model = tiny_model()
    labels = torch.full_like(IDS, -100)
    labels[:, 0] = 3  # the first label is never scored: the loss shifts the labels
    ignored = {"labels": labels}
    if given == "shift_labels":
        ignored = {"labels": LABELS, "shift_labels": torch.full_like(IDS, -100)}
    with CaptureLogger(input_checks.logger) as captured, torch.no_grad():
        assert model(IDS, **ignored).loss.isnan()
    assert "Every scored label is ignore_index=-100 (the loss scores labels[:, 1:], or shift_labels): no token " in (
        captured.out
    )
    with CaptureLogger(input_checks.logger) as captured, torch.no_grad():
        assert model(IDS, **ignored, num_items_in_batch=torch.tensor(8)).loss == 0
        model(IDS, labels=LABELS)
    assert captured.out == ""


def test_a_4d_mask_of_the_right_shape_runs():
    model = tiny_model()
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    with torch.no_grad():
        expected = model(IDS).logits
        for mask in (causal.expand(2, 1, 12, 12), causal.expand(1, 4, 12, 12)):
            torch.testing.assert_close(model(IDS, attention_mask=mask).logits, expected)
        cache = model(IDS[:, :11], use_cache=True).past_key_values
        step = model(IDS[:, 11:], attention_mask=causal[11:].expand(2, 1, 1, 12), past_key_values=cache).logits
    torch.testing.assert_close(step, expected[:, 11:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (
            IDS[:1, :1],
            r"the input's batch is 1, but past_key_values holds 2 rows: a call continuing a cache gives "
            r"every cached row its new tokens \(keep some rows with past_key_values.batch_select_indices",
        ),
        (torch.tensor([[5], [300]]), r"input_ids contains id 300, outside the vocabulary 0..258"),
        (torch.tensor([[-2], [5]]), r"input_ids contains id -2, outside the vocabulary 0..258"),
    ],
)
def test_a_bad_decoding_step_is_refused_before_any_work(step, message):
    """A decoding step's ids are not read before it runs (that would wait for the device): the embedding's refusal is
    named."""
    model = tiny_model()
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
        refused_before_any_work(model, ValueError, message, lambda: model(step, past_key_values=cache))
    assert cache.get_seq_length() == 12


def test_a_legacy_tuple_cache_is_refused_with_its_conversion():
    model = tiny_model()
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
        legacy = tuple((layer.keys, layer.values) for layer in cache.layers)
        step = torch.tensor([[5], [6]])
        message = (
            r"past_key_values must be a Cache; got a tuple .* "
            r"SepFormerCache\(past_key_values, config=model.config\)"
        )
        refused_before_any_work(model, TypeError, message, lambda: model(step, past_key_values=legacy))
        converted = SepFormerCache(legacy, config=model.config)  # as the message says
        torch.testing.assert_close(
            model(step, past_key_values=converted).logits, model(step, past_key_values=cache).logits
        )


@pytest.mark.parametrize(
    ("ids", "message"),
    [(IDS[:, :0], "the input has no tokens"), (IDS[0], "input_ids must be a 2-D tensor")],
)
def test_generate_refuses_bad_prompts(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_model().generate(ids, max_new_tokens=2)


def test_generate_refuses_bad_prompts_and_masks_before_any_step():
    model = tiny_model()
    twos = torch.full((2, 12), 2)
    for call, message in [
        (lambda: model.generate(IDS.tolist(), max_new_tokens=2), "input_ids must be a torch tensor; got a list"),
        (lambda: model.generate(input_ids=IDS.to(torch.uint8), max_new_tokens=2), TO_INT64 + "torch.uint8"),
        (lambda: model.generate(IDS, attention_mask=twos, max_new_tokens=2), "attention_mask contains 2: "),
    ]:
        refused_before_any_work(model, (TypeError, ValueError), message, call)


PAST_THE_TABLE = (
    r"position {} is past the learned positional table of 16 rows \(position_table_size\) and "
    r"position_extrapolation='none'"
)


@pytest.mark.parametrize(
    "length",
    [
        {"max_new_tokens": 6},
        {"max_length": 18},
        {"generation_config": GenerationConfig(max_new_tokens=6)},
        {"generation_config": GenerationConfig(max_new_tokens=2), "max_new_tokens": 6},  # keywords come first
    ],
    ids=["max_new_tokens", "max_length", "generation_config", "keyword-over-config"],
)
def test_generating_past_the_table_is_refused_before_the_first_step(length):
    # a 12-token prompt and 6 new tokens: the model is fed positions up to 16 (the last new token is returned only)
    model = tiny_model(max_position_embeddings=16)
    message = PAST_THE_TABLE.format(16)
    refused_before_any_work(model, ValueError, message, lambda: model.generate(IDS, do_sample=False, **length))
    model.generation_config.max_new_tokens = 6  # the model's own generation config, read last
    refused_before_any_work(model, ValueError, message, lambda: model.generate(IDS, do_sample=False))
    refused_before_any_work(
        model,
        ValueError,
        message,
        lambda: model.generate(IDS, GenerationConfig(do_sample=False)),  # positional
    )


def test_the_last_position_counts_a_rows_real_tokens_and_the_extrapolation_of_the_call():
    model = tiny_model(max_position_embeddings=16)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, :2] = 0  # every row left-padded by 2: 10 real tokens, 7 new are fed up to position 15, the table's last row
    assert model.generate(IDS, attention_mask=mask, max_new_tokens=7, do_sample=False).shape == (2, 19)
    refused_before_any_work(
        model,
        ValueError,
        PAST_THE_TABLE.format(16),
        lambda: model.generate(IDS, attention_mask=mask, max_new_tokens=8, do_sample=False),
    )
    assert model.generate(IDS, max_new_tokens=6, do_sample=False, position_extrapolation="clamp").shape == (2, 18)
    # a cached `interpolate` keeps the table's scale once decoding starts: it needs the final length
    refused_before_any_work(
        model,
        ValueError,
        r"position 16 is past position_extrapolation 'interpolate' length=16",
        lambda: model.generate(IDS, max_new_tokens=6, do_sample=False, position_extrapolation="interpolate"),
    )
    interpolated = {"method": "interpolate", "length": 17}
    assert model.generate(IDS, max_new_tokens=6, do_sample=False, position_extrapolation=interpolated).shape == (2, 18)
    uncached = model.generate(
        IDS, max_new_tokens=6, do_sample=False, position_extrapolation="interpolate", use_cache=False
    )  # every step compresses the whole sequence anew
    assert uncached.shape == (2, 18)


def test_the_last_position_is_the_longest_rows():
    """Rows padded unevenly: the longest row reaches the last position, not the shortest."""
    model = tiny_model(max_position_embeddings=16)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # row 0: 12 real tokens, 6 new are fed up to position 16; row 1: 8 real tokens up to 12
    refused_before_any_work(
        model,
        ValueError,
        PAST_THE_TABLE.format(16),
        lambda: model.generate(IDS, attention_mask=mask, max_new_tokens=6, do_sample=False),
    )
    refused_before_any_work(
        model,
        ValueError,
        r"position 16 is past position_extrapolation 'interpolate' length=16",
        lambda: model.generate(IDS, attention_mask=mask, max_new_tokens=6, position_extrapolation="interpolate"),
    )
    assert model.generate(IDS, attention_mask=mask, max_new_tokens=5, do_sample=False).shape == (2, 17)


def test_a_generation_one_token_past_the_table_runs_as_its_steps_do():
    """The last new token is returned, never fed: a generation of `L + 1` tokens reads positions up to `L - 1` only,
    and gives the tokens of a cached loop feeding each one."""
    model = tiny_model(max_position_embeddings=16)
    ids = IDS[:1]
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)  # 17 tokens, positions 0..15 fed
    tokens, cache = ids, SepFormerCache(config=model.config)
    with torch.no_grad():
        for _ in range(5):
            fed = tokens if cache.get_seq_length() == 0 else tokens[:, -1:]
            logits = model(fed, past_key_values=cache, use_cache=True).logits
            tokens = torch.cat((tokens, logits[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize(
    "options",
    [{"parallel_context_windows": {"spans": [[(0, 6), (6, 10)]]}}, {"attention_buckets": {"scales": [0.5, 0.8]}}],
    ids=["windows", "bucket scales"],
)
def test_options_that_move_the_positions_read_are_checked_by_the_steps_on_those_positions(options):
    """Windows and bucket scales < 1 read the task's positions earlier than their tokens: a generation past the table
    by its tokens runs where its forward reads inside the table, and is refused at the step reading past it."""
    model = tiny_model(max_position_embeddings=16)
    ids = IDS[:1]  # 12 tokens: the windows move the task's positions back by 4, the scales to at most 0.8 m
    assert model.generate(ids, max_new_tokens=8, do_sample=False, **options).shape == (1, 20)
    assert model(torch.cat((ids, ids[:, :7]), 1), **options).logits.shape[1] == 19  # the same positions, unfed
    with pytest.raises(ValueError, match="past the learned positional table"):
        model.generate(ids, max_new_tokens=40, do_sample=False, **options)


def test_buckets_that_move_no_position_are_checked_before_the_first_step():
    model = tiny_model(max_position_embeddings=16, rotary_dim=4)
    for buckets in ({"bases": [1e4, 2e4]}, {"scales": [1.0, 1.0]}):
        call = functools.partial(model.generate, IDS, max_new_tokens=8, do_sample=False, attention_buckets=buckets)
        refused_before_any_work(model, ValueError, PAST_THE_TABLE.format(18), call)


def test_an_unknown_keyword_is_refused_not_ignored():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['stablemask'\].*'stable_mask'"):
        model(IDS, stablemask={"gamma": 0.1})
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['extrapolation'\]"):
        model.model(IDS, extrapolation="clamp")
    with pytest.raises(ValueError, match="stablemask"):  # generate checks its keywords itself
        model.generate(IDS, max_new_tokens=1, stablemask={"gamma": 0.1})


def test_fractional_document_spans_are_refused_not_truncated():
    with pytest.raises(ValueError, match=r"span \(0, 3.5\) of row 0 must be two integers .* int, float"):
        AttentionCalibration(spans=[[(0, 3.5)]])
    with pytest.raises(ValueError, match="must be, per batch row, a sequence of \\(start, end\\)"):
        AttentionCalibration(spans=[[(0, 3, 5)]])


@pytest.mark.parametrize("option", [AttentionCalibration, ParallelContextWindows])
def test_one_rows_spans_given_without_their_batch_row_are_refused_with_the_nesting_to_give(option):
    """A batch of one is the usual call, and its spans are easily given unnested: the refusal shows the nesting."""
    with pytest.raises(
        ValueError,
        match=r"spans=\(\(0, 3\), \(3, 6\)\) must be, per batch row, .*: for a batch of one "
        r"row, spans=\[\(\(0, 3\), \(3, 6\)\)\]\.$",
    ):
        option(spans=((0, 3), (3, 6)))
    with pytest.raises(ValueError, match=r"spans=5 must be, per batch row, a sequence of \(start, end\)\.$"):
        option(spans=5)


def test_dummy_document_ids_outside_the_vocabulary_are_refused():
    option = AttentionCalibration(spans=[[(0, 3)]] * 2, dummy_document=(5, 300))
    with pytest.raises(ValueError, match=r"dummy_document has ids \[300\] outside the vocabulary 0..258"):
        tiny_model()(IDS, attention_calibration=option)


def test_a_default_dummy_document_of_a_pad_token_outside_the_vocabulary_is_refused():
    llama = add_mitigations(tiny_llama())
    llama.config.pad_token_id = llama.config.vocab_size + 5
    option = AttentionCalibration(spans=[[(0, 3)]])
    vocab = llama.config.vocab_size
    bad = rf"which is not in the vocabulary 0\.\.{vocab - 1} \(pad_token_id={vocab + 5},"
    with pytest.raises(ValueError, match=bad):
        llama(IDS[:1], attention_calibration=option)


def test_a_configured_stable_mask_can_be_switched_off_for_one_call():
    masked = tiny_model(stable_mask={"gamma": 0.5})
    plain = tiny_model()
    with torch.no_grad():
        off = masked(IDS, stable_mask=False).logits
        assert torch.equal(off, plain(IDS).logits)
        assert not torch.allclose(masked(IDS).logits, off)
        assert torch.equal(masked(IDS).logits, masked(IDS, stable_mask=StableMask(0.5)).logits)
    generated = masked.generate(IDS, max_new_tokens=3, do_sample=False, stable_mask=False)
    assert torch.equal(generated, plain.generate(IDS, max_new_tokens=3, do_sample=False))


def test_flex_attention_refuses_what_needs_the_attention_row_and_runs_a_fixed_order():
    model = tiny_model()
    model.set_attn_implementation("flex_attention")
    spans = AttentionCalibration(spans=[[(0, 3)]] * 2)
    with pytest.raises(ValueError, match="ms_poe ranks the heads .* flex_attention's block mask"):
        model(IDS, ms_poe=MSPoE())
    with pytest.raises(ValueError, match="attention_calibration rewrites .* flex_attention's block mask"):
        model(IDS, attention_calibration=spans)
    fixed = MSPoE(head_order=(0, 1, 2, 3), layers=(1,))
    with torch.no_grad():
        flex = model(IDS, ms_poe=fixed).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(flex, model(IDS, ms_poe=fixed).logits, rtol=1e-5, atol=1e-5)


def test_spans_of_numpy_or_torch_integers_are_integers():
    import numpy as np

    assert AttentionCalibration(spans=np.array([[[0, 3], [3, 6]]])).spans == (((0, 3), (3, 6)),)
    assert MSPoE(layers=torch.tensor([1])).layers == (1,)
    with pytest.raises(ValueError, match="must be two integers"):
        AttentionCalibration(spans=[[(0, np.bool_(True))]])


def test_a_stable_mask_saved_with_its_old_field_name_still_loads():
    assert StableMask.parse({"gamma": 0.1, "length": 40}) == StableMask(0.1, columns=40)
    assert tiny_model(stable_mask={"gamma": 0.1, "length": 40}).config.stable_mask == {"gamma": 0.1, "length": 40}


def test_a_resolved_plan_and_options_together_are_refused():
    from sepformer.mitigation_base import MitigationPlan

    model = tiny_model()
    with pytest.raises(ValueError, match=r"give either mitigation_plan or the options \['stable_mask'\], not both"):
        model.model(IDS, mitigation_plan=MitigationPlan.of((), 2), stable_mask={"gamma": 0.1})


def test_generate_refuses_padding_outside_the_vocabulary_before_any_step():
    """A config may hold such an id until it is saved; `generate` would feed it to a step after a row ends and fail
    inside the embedding. With transformers' "never stop" (`eos_token_id=-1`) no row ends: nothing is fed."""
    model = tiny_model(pad_token_id=1000)
    with pytest.raises(ValueError, match="pad_token_id=1000 is outside the vocabulary 0..258"):
        model.generate(random_ids(2, 6), max_new_tokens=4, do_sample=False)
    model.generate(random_ids(2, 6), max_new_tokens=4, do_sample=False, pad_token_id=3)  # a valid id given to the call
    model.generate(random_ids(2, 6), max_new_tokens=4, do_sample=False, pad_token_id=-1, eos_token_id=-1)


@pytest.mark.parametrize("kind", ["sepformer", "llama"])
def test_a_chunked_prefill_is_refused_with_options_that_read_the_whole_prompt(kind):
    """`prefill_chunk_size` feeds the prompt in several calls: options that read its last token or its documents'
    spans at prefill are refused before any work; the others give the tokens of the prompt fed whole."""
    model = tiny_model() if kind == "sepformer" else add_mitigations(tiny_llama())
    spans = [[(0, 6), (6, 10)]] * 2
    chunked = dict(max_new_tokens=3, do_sample=False, prefill_chunk_size=5)
    reading_the_prompt = {
        "ms_poe": {},
        "positional_scaling": {"channels": [0]},
        "attention_calibration": {"spans": spans},
        "parallel_context_windows": {"spans": spans},
    }
    for name, fields in reading_the_prompt.items():
        message = rf"{name} reads the whole prompt at prefill .* prefill_chunk_size=5 feeds the prompt of 12 tokens"
        refused_before_any_work(
            model, ValueError, message, functools.partial(model.generate, IDS, **chunked, **{name: fields})
        )
    heads = model.config.num_attention_heads
    for options in (
        {"stable_mask": {"gamma": 0.5}},
        {"ms_poe": {"head_order": list(range(heads))[::-1]}},  # fixed ranks: no prefill row read
        {"attention_buckets": {"scales": [0.5, 1.0]}},
    ):
        settings = dict(output_logits=True, return_dict_in_generate=True, **options)
        fed_whole = model.generate(IDS, max_new_tokens=3, do_sample=False, **settings)
        in_chunks = model.generate(IDS, **chunked, **settings)
        assert torch.equal(in_chunks.sequences, fed_whole.sequences)
        torch.testing.assert_close(torch.stack(in_chunks.logits), torch.stack(fed_whole.logits), rtol=1e-5, atol=1e-5)
    assert model.generate(IDS, **{**chunked, "prefill_chunk_size": 12}, ms_poe={}).shape == (2, 15)  # one chunk
    # continuing a prefilled cache, every chunk is a continuation, as the tokens fed whole are
    continued = []
    for chunk in (None, 2):
        cache = SepFormerCache(config=model.config)
        with torch.no_grad():
            model(IDS[:, :9], past_key_values=cache, use_cache=True, ms_poe={})
        continued.append(
            model.generate(IDS, **{**chunked, "prefill_chunk_size": chunk}, past_key_values=cache, ms_poe={})
        )
    assert torch.equal(*continued)


@pytest.mark.parametrize("options", [{}, {"ms_poe": {}}])
@pytest.mark.parametrize("kind", ["sepformer", "llama"])
def test_a_chunked_prefill_of_a_prompt_given_as_embeddings_is_refused_before_any_work(kind, options):
    """transformers' chunked prefill splits the prompt's token ids and feeds embeddings with positions for none of
    their tokens (a plain Llama fails on it inside the rotary): refused by name, with options or without."""
    model = tiny_model() if kind == "sepformer" else add_mitigations(tiny_llama())
    embeds = model.get_input_embeddings()(IDS).detach()
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, **options)
    for chunk in (5, 100):
        message = rf"prefill_chunk_size={chunk}: generate's chunked prefill splits the prompt's token ids"
        refused_before_any_work(
            model,
            ValueError,
            message,
            functools.partial(model.generate, inputs_embeds=embeds, prefill_chunk_size=chunk, **settings),
        )
    assert model.generate(inputs_embeds=embeds, **settings).shape == (2, 3)


def test_the_last_position_of_a_prompt_given_as_embeddings_is_checked_before_the_first_step():
    model = tiny_model(max_position_embeddings=16)
    embeds = model.model.embed_tokens(IDS)
    call = functools.partial(model.generate, inputs_embeds=embeds, max_new_tokens=10, do_sample=False)
    refused_before_any_work(model, ValueError, PAST_THE_TABLE.format(20), call)
    assert model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False).shape == (2, 5)


def test_one_new_token_under_interpolate_feeds_only_the_prompt_at_prefill():
    """With one new token no decoding step runs: the prompt is compressed for its own length at prefill, as the
    forward of the same prompt is, and needs no `interpolate` length."""
    model = tiny_model(max_position_embeddings=8)
    generated = model.generate(IDS, max_new_tokens=1, do_sample=False, position_extrapolation="interpolate")
    with torch.no_grad():
        expected = model(IDS, position_extrapolation="interpolate").logits[:, -1].argmax(-1)
    assert torch.equal(generated[:, -1], expected)
    refused_before_any_work(
        model,
        ValueError,
        r"position 12 is past position_extrapolation 'interpolate' length=8",
        lambda: model.generate(IDS, max_new_tokens=2, do_sample=False, position_extrapolation="interpolate"),
    )
