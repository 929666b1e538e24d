"""Reordering documents by relevance: orders, prompts and relevance against references written out by hand."""

import numpy as np
import pytest
import torch
from conftest import random_ids, tiny_gpt2, tiny_llama, tiny_model
from test_attention_calibration import sharp_attention
from transformers import DynamicCache

from sepformer import (
    PositionalScaling,
    ReorderDocuments,
    SepFormerCache,
    add_mitigations,
    document_relevance,
    relevance_order,
    reorder_documents,
    reorder_prompt,
)
from sepformer.positional_search import search_positional_scaling
from sepformer.reordering import SCORING_KEYWORDS

# Two rows of 14 columns, the second padded on the left by 3: three documents each, separators between them.
SPANS = (((1, 4), (5, 8), (9, 12)), ((0, 2), (3, 7), (8, 10)))


def eager_model(**overrides):
    model = sharp_attention(tiny_model(**overrides))
    model.set_attn_implementation("eager")
    return model


def left_padded_batch():
    ids = random_ids(2, 14, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------------- relevance_order


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        # ranks (best first): 3, 1, 2, 4, 0; the ends from the outside in
        ("ends", [3, 2, 0, 4, 1]),
        ("first", [3, 1, 2, 4, 0]),
        ("last", [0, 4, 2, 1, 3]),
    ],
)
def test_relevance_order_of_each_strategy(strategy, expected):
    assert relevance_order([0.1, 0.5, 0.3, 0.9, 0.2], strategy).tolist() == expected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("first", [0, 2, 1, 3]),  # tied documents in their original order
        ("last", [1, 3, 0, 2]),
        ("ends", [0, 1, 3, 2]),  # ranks 0, 2, 1, 3: the earlier of a tie ranks higher
    ],
)
def test_relevance_order_breaks_ties_by_original_index(strategy, expected):
    assert relevance_order(torch.tensor([2.0, 1.0, 2.0, 1.0]), strategy).tolist() == expected


def test_relevance_order_orders_each_row_of_a_batch():
    order = relevance_order([[0.1, 0.5, 0.3, 0.9], [2, 1, 2, 1]])
    assert order.tolist() == [[3, 2, 0, 1], [0, 1, 3, 2]]


# ----------------------------------------------------------------------------------------------------- reorder_prompt


def test_reorder_prompt_moves_the_documents_and_keeps_the_separators_between_them():
    # row 0: documents [1 1] [2 2 2] [3] between 100 ... 101, separators 200 and 201
    # row 1: left-padded by 2, documents [5] [6 6] [7]
    ids = torch.tensor([[100, 1, 1, 200, 2, 2, 2, 201, 3, 101], [0, 0, 100, 5, 200, 6, 6, 201, 7, 101]])
    mask = torch.tensor([[1] * 10, [0, 0] + [1] * 8])
    spans = (((1, 3), (4, 7), (8, 9)), ((1, 2), (3, 5), (6, 7)))
    reordered, new_spans = reorder_prompt(ids, mask, spans, [[2, 0, 1], [1, 2, 0]])
    expected = torch.tensor([[100, 3, 200, 1, 1, 201, 2, 2, 2, 101], [0, 0, 100, 6, 6, 200, 7, 201, 5, 101]])
    assert torch.equal(reordered, expected)
    assert new_spans == (((1, 2), (3, 5), (6, 9)), ((1, 3), (4, 5), (6, 7)))


def test_reorder_prompt_reads_spans_in_the_order_given():
    ids = torch.tensor([[9, 1, 8, 2, 2, 7]])
    reordered, new_spans = reorder_prompt(ids, None, [((3, 5), (1, 2))], [[1, 0]])  # document 0 is [2 2]
    assert reordered.tolist() == [[9, 1, 8, 2, 2, 7]]
    assert new_spans == (((1, 2), (3, 5)),)
    reordered, new_spans = reorder_prompt(ids, None, [((3, 5), (1, 2))], [[0, 1]])
    assert reordered.tolist() == [[9, 2, 2, 8, 1, 7]]
    assert new_spans == (((1, 3), (4, 5)),)


# -------------------------------------------------------------------------------------------------------- relevance


def attention_reference(model, ids, mask, spans, layers, **kwargs):
    """(b, K): each row run alone, without its padding: the last row's attention, from `outputs.attentions`, averaged
    over heads, layers and each document's columns."""
    rows = []
    for row, row_spans in enumerate(spans):
        tokens = ids[row] if mask is None else ids[row][mask[row].bool()]
        with torch.no_grad():
            attentions = model(tokens[None], output_attentions=True, **kwargs).attentions
        last = torch.stack([attentions[layer][0, :, -1] for layer in layers]).float()  # (L, H, n)
        rows.append([last[:, :, start:end].mean().item() for start, end in row_spans])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("layers", [None, (1,)])
def test_attention_relevance_is_the_last_rows_mean_attention_on_each_document(layers):
    model, (ids, mask) = eager_model(), left_padded_batch()
    got = document_relevance(model, ids, mask, SPANS, by="attention", layers=layers)
    expected = attention_reference(model, ids, mask, SPANS, layers or (0, 1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert got.shape == (2, 3) and got.std(-1).min() > 1e-2  # documents differ: a wrong column would show


@pytest.mark.parametrize(
    ("overrides", "kwargs"), [({}, {}), ({"max_position_embeddings": 12}, {"position_extrapolation": "clamp"})]
)
def test_calibrated_relevance_subtracts_the_dummy_documents_attention_at_each_slot(overrides, kwargs):
    """Also past the positional table: the dummy passes run with the forward keywords of the scoring pass."""
    model, (ids, mask) = eager_model(**overrides), left_padded_batch()
    dummy = (7, 7)
    got = document_relevance(model, ids, mask, SPANS, by="calibrated", dummy_document=dummy, **kwargs)
    attention = attention_reference(model, ids, mask, SPANS, (0, 1), **kwargs)
    for row, row_spans in enumerate(SPANS):
        tokens = ids[row][mask[row].bool()]
        for k, (start, end) in enumerate(row_spans):
            spliced = torch.cat((tokens[:start], torch.tensor(dummy), tokens[end:]))[None]
            bias = attention_reference(model, spliced, None, [[(start, start + len(dummy))]], (0, 1), **kwargs)
            torch.testing.assert_close(got[row, k], attention[row, k] - bias[0, 0], rtol=1e-4, atol=1e-7)


def test_position_free_relevance_is_the_attention_with_the_positional_block_of_query_and_keys_zeroed():
    """Layer 0 reads the embeddings, the same in both passes: its last row with the positional block of the last
    query's and every key's input zeroed is the position-free attention there."""
    model, (ids, mask) = eager_model(), left_padded_batch()
    d_pos, attention = model.config.position_size, model.model.layers[0].self_attn

    def zero_positions(last_only):
        def hook(module, args):
            (hidden,) = args
            hidden = hidden.clone()
            hidden[:, -1 if last_only else slice(None), :d_pos] = 0
            return (hidden,)

        return hook

    handles = [
        attention.q_proj.register_forward_pre_hook(zero_positions(last_only=True)),
        attention.k_proj.register_forward_pre_hook(zero_positions(last_only=False)),
    ]
    try:
        expected = attention_reference(model, ids, mask, SPANS, (0,))
    finally:
        for handle in handles:
            handle.remove()
    got = document_relevance(model, ids, mask, SPANS, by="position_free", layers=(0,))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    plain = document_relevance(model, ids, mask, SPANS, by="attention", layers=(0,))
    assert (got - plain).abs().max() > 1e-4


def test_position_free_relevance_zeroes_the_positional_block_in_every_layer_not_only_those_it_reads():
    model, (ids, mask) = eager_model(), left_padded_batch()
    every_layer = PositionalScaling(factor=0.0, layers=(0, 1))
    expected = attention_reference(model, ids, mask, SPANS, (1,), positional_scaling=every_layer)
    got = document_relevance(model, ids, mask, SPANS, by="position_free", layers=(1,))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    last_layer_only = PositionalScaling(factor=0.0, layers=(1,))
    last_layer_only = attention_reference(model, ids, mask, SPANS, (1,), positional_scaling=last_layer_only)
    assert (got - last_layer_only).abs().max() > 1e-4  # the layers before it change what it reads


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama, lambda attn: eager_model()])
@pytest.mark.parametrize("by", ["attention", "calibrated"])
def test_a_left_padded_row_gets_the_scores_and_the_order_it_gets_alone(make, by):
    """GPT-2 reads absolute positions: a left-padded row (and its dummy passes) must be run at its own positions."""
    model, (ids, mask) = make("eager"), left_padded_batch()
    fields = {"by": by, "rounds": 2, **({"dummy_document": (5, 6)} if by == "calibrated" else {})}
    alone = [(ids[:1], SPANS[:1]), (ids[1:, 3:], SPANS[1:])]  # row 1 without its 3 columns of padding
    scores = document_relevance(model, ids, mask, SPANS, by, dummy_document=fields.get("dummy_document"))
    expected = [
        document_relevance(model, row, None, spans, by, dummy_document=fields.get("dummy_document"))
        for row, spans in alone
    ]
    torch.testing.assert_close(scores, torch.cat(expected), rtol=1e-5, atol=1e-7)
    order = reorder_documents(model, ids, mask, {"spans": SPANS, **fields})[2]
    expected = [reorder_documents(model, row, None, {"spans": spans, **fields})[2] for row, spans in alone]
    assert torch.equal(order, torch.cat(expected))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_attention_and_calibrated_relevance_on_hugging_face_models(make):
    model, (ids, mask) = make("eager"), left_padded_batch()
    got = document_relevance(model, ids, mask, SPANS, by="attention")
    torch.testing.assert_close(got, attention_reference(model, ids, mask, SPANS, (0, 1)), rtol=1e-5, atol=1e-7)
    calibrated = document_relevance(model, ids, mask, SPANS, by="calibrated", dummy_document=(5,))
    assert calibrated.shape == (2, 3) and not torch.allclose(calibrated, got)
    with pytest.raises(ValueError, match=r"by='position_free' zeroes SepFormer's positional block; this is a"):
        document_relevance(model, ids, mask, SPANS, by="position_free")
    sdpa = make("sdpa")
    sdpa.load_state_dict(model.state_dict())
    torch.testing.assert_close(document_relevance(sdpa, ids, mask, SPANS, by="attention"), got, rtol=1e-5, atol=1e-7)
    assert sdpa.config._attn_implementation == "sdpa"  # scored in eager attention, then back to its own


def test_a_model_running_sdpa_is_scored_in_eager_attention_and_keeps_sdpa():
    model, (ids, mask) = eager_model(), left_padded_batch()
    options = {"spans": SPANS, "by": "attention", "rounds": 2}
    expected = reorder_documents(model, ids, mask, options)[0]
    model.set_attn_implementation("sdpa")
    assert torch.equal(reorder_documents(model, ids, mask, options)[0], expected)
    assert model.config._attn_implementation == "sdpa"
    greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    by_hand = model.generate(input_ids=expected, attention_mask=mask, **greedy)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, reorder_documents=options, **greedy), by_hand)

    def fail(*args):
        raise RuntimeError("a scoring pass failed")

    model.model.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a scoring pass failed"):
        reorder_documents(model, ids, mask, options)
    assert model.config._attn_implementation == "sdpa"  # restored after the error too


def test_rounds_score_and_sort_the_reordered_prompt_then_place_by_the_strategy():
    model, (ids, mask) = eager_model(), left_padded_batch()
    got_ids, got_spans, got_order = reorder_documents(model, ids, mask, {"spans": SPANS, "rounds": 3})
    prompt, spans, order = ids, SPANS, torch.arange(3).expand(2, 3)
    for strategy in ("last", "last", "ends"):
        step = relevance_order(document_relevance(model, prompt, mask, spans), strategy)
        prompt, spans = reorder_prompt(prompt, mask, spans, step)
        order = order.gather(1, step)
    assert torch.equal(got_ids, prompt) and got_spans == spans and torch.equal(got_order, order)
    assert torch.equal(reorder_prompt(ids, mask, SPANS, order)[0], prompt)  # the composed order, in one move


@pytest.mark.parametrize("strategy", ["first", "last"])
def test_the_order_of_two_rounds_places_the_second_rounds_order_on_the_first_rounds_prompt(strategy):
    """Place `j` holds the original document `first[second[j]]`: the second round orders the first round's places.
    (With these scores the two orders do not commute, so composing them the other way round shows.)"""
    model, (ids, mask) = eager_model(), left_padded_batch()
    first_ids, first_spans, first = reorder_documents(model, ids, mask, {"spans": SPANS, "strategy": "last"})
    _, _, second = reorder_documents(model, first_ids, mask, {"spans": first_spans, "strategy": strategy})
    expected = torch.tensor([[a[j] for j in b] for a, b in zip(first.tolist(), second.tolist(), strict=True)])
    other_way = torch.tensor([[b[j] for j in a] for a, b in zip(first.tolist(), second.tolist(), strict=True)])
    assert not torch.equal(expected, other_way)
    got_ids, _, got = reorder_documents(model, ids, mask, {"spans": SPANS, "strategy": strategy, "rounds": 2})
    assert torch.equal(got, expected)
    assert torch.equal(reorder_prompt(ids, mask, SPANS, got)[0], got_ids)


# --------------------------------------------------------------------------------------------------------- generate


def generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, **kwargs)


BEAMS = [{}, {"num_beams": 3, "num_return_sequences": 2}]


@pytest.mark.parametrize("beams", BEAMS)
def test_generate_with_given_scores_is_generate_on_the_prompt_reordered_by_hand(beams):
    model, (ids, mask) = eager_model(), left_padded_batch()
    scores = [[0.2, 0.9, 0.5], [0.1, 0.3, 0.7]]  # "ends": row 0 -> documents [1, 0, 2], row 1 -> [2, 0, 1]
    by_hand = ids.clone()
    by_hand[0, 1:12] = torch.cat((ids[0, 5:8], ids[0, 4:5], ids[0, 1:4], ids[0, 8:9], ids[0, 9:12]))
    row = ids[1]  # left-padded by 3: document k's columns are its span + 3
    by_hand[1, 3:] = torch.cat((row[11:13], row[5:6], row[3:5], row[10:11], row[6:10], row[13:]))
    got = generate(model, ids, mask, reorder_documents={"spans": SPANS, "by": scores}, **beams)
    assert torch.equal(got, generate(model, by_hand, mask, **beams))
    assert torch.equal(got[:: len(got) // 2, :14], by_hand)  # the sequences begin with the reordered prompt


@pytest.mark.parametrize("beams", BEAMS)
def test_generate_with_relevance_from_the_model_is_generate_on_the_reordered_prompt(beams):
    model, (ids, mask) = eager_model(), left_padded_batch()
    option = ReorderDocuments(spans=SPANS, by="position_free", strategy="first", rounds=2)
    reordered, _, order = reorder_documents(model, ids, mask, option)
    assert not torch.equal(order, torch.arange(3).expand(2, 3))
    got = generate(model, ids, mask, reorder_documents=option, **beams)
    assert torch.equal(got, generate(model, reordered, mask, **beams))


def test_generate_without_attention_mask_reorders_within_the_padding_it_infers():
    """`generate` infers the padding of a prompt given without `attention_mask` from `pad_token_id`: the spans count
    from the first real token of that padding, and the padding stays where it is."""
    model, (ids, mask) = eager_model(), left_padded_batch()
    ids[ids == model.config.pad_token_id] = 5  # pad_token_id only in the padding
    ids[1, :3] = model.config.pad_token_id
    option = {"spans": SPANS, "by": SCORES}
    got = model.generate(ids, max_new_tokens=3, do_sample=False, reorder_documents=option)
    assert torch.equal(got[1, :3], ids[1, :3])
    assert torch.equal(
        got, model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, reorder_documents=option)
    )


def mitigated_llama():
    """A Hugging Face decoder given `generate(reorder_documents=...)` by `add_mitigations`, with SepFormer's pad id."""
    model = add_mitigations(tiny_llama("eager"))
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    return model


GENERATORS = {"SepFormer": (eager_model, SepFormerCache), "mitigated Llama": (mitigated_llama, DynamicCache)}


@pytest.mark.parametrize("make", [make for make, _ in GENERATORS.values()], ids=list(GENERATORS))
def test_generate_without_attention_mask_infers_no_padding_where_pad_token_id_is_an_eos(make):
    """transformers infers no padding when `pad_token_id` is an `eos_token_id`: spans count from column 0."""
    model, (ids, _) = make(), left_padded_batch()
    pad = model.config.pad_token_id
    ids[ids == pad] = 5
    ids[:, 0] = pad  # would read as one column of left padding
    option = {"spans": SPANS, "by": SCORES}
    got = model.generate(
        ids, max_new_tokens=3, do_sample=False, eos_token_id=pad, pad_token_id=pad, reorder_documents=option
    )
    assert torch.equal(got[:, :14], reorder_documents(model, ids, None, option)[0])


# ------------------------------------------------------------------------------------------------------ bad options

SCORES = [[0.2, 0.9, 0.5], [0.1, 0.3, 0.7]]
REFUSED = [
    ({"strategy": "middle"}, r"strategy='middle' is not one of \['ends', 'last', 'first'\]"),
    ({"strategy": np.array("ends")}, r"strategy=array\('ends', dtype='<U4'\) is not one of"),
    ({"by": "relevance"}, r"by='relevance' is not one of \['attention', 'calibrated', 'position_free'\]"),
    ({"by": [[0.2, 0.9]] * 2}, r"one score per document: shape \(2, 3\) for these spans; got \[2, 2\]"),
    ({"by": torch.ones(3)}, r"one score per document: shape \(2, 3\) for these spans; got not a \(rows, documents\)"),
    ({"by": [[0.2, float("nan"), 0.5]] * 2}, r"reorder_documents by score=nan must be a finite number"),
    ({"rounds": 0}, r"rounds=0 must be an integer >= 1"),
    ({"by": SCORES, "rounds": 2}, r"rounds=2 is read only by relevance from the model .* leave it at 1"),
    ({"by": SCORES, "layers": (1,)}, r"layers=\(1,\) is read only by relevance from the model .* leave it at None"),
    ({"dummy_document": (5,)}, r"dummy_document is only read by by='calibrated' .*; got by='attention'"),
    ({"layers": (0, 5)}, r"reorder_documents layers \[5\] are out of range: this model has layers 0..1"),
    ({"spans": (((1, 4), (5, 8), (9, 20)), SPANS[1])}, r"span \(9, 20\) of row 0 is out of range: .* has 14 tokens"),
    ({"spans": (((1, 6), (5, 8), (9, 12)), SPANS[1])}, r"reorder_documents spans of row 0 overlap"),
    ({"spans": (SPANS[0], SPANS[1][:2])}, r"the same number \(>= 1\) of documents; got \[3, 2\]"),
    ({"spans": SPANS[:1]}, r"reorder_documents has spans for 1 rows; the batch has 2 rows"),
    ({"sharpness": 2}, r"reorder_documents got unknown keys \['sharpness'\]"),
]


@pytest.mark.parametrize(("fields", "message"), REFUSED)
def test_bad_options_are_refused_before_any_forward(fields, message):
    model, (ids, mask) = eager_model(), left_padded_batch()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, reorder_documents={"spans": SPANS, **fields})
    assert not calls


@pytest.mark.parametrize(
    ("model_overrides", "fields", "kwargs", "message"),
    [
        ({}, {}, {"attention_calibration": {"spans": SPANS}}, r"and attention_calibration cannot be combined: its"),
        ({}, {}, {"parallel_context_windows": {"spans": SPANS}}, r"and parallel_context_windows cannot be combined"),
        ({"rotary_dim": 4}, {}, {}, r"by='position_free' needs .* position_size=8, rotary_dim=4"),
        (
            {"pad_token_id": None, "eos_token_id": None},
            {"by": "calibrated"},
            {},
            r"reorder_documents's default dummy document repeats pad_token_id \(or eos_token_id",
        ),
        ({}, {"by": "calibrated", "dummy_document": (300,)}, {}, r"dummy_document has ids \[300\] outside the vocab"),
    ],
)
def test_what_the_model_or_the_call_lacks_is_refused_before_any_forward(model_overrides, fields, kwargs, message):
    attn = model_overrides.pop("attn", "eager")
    model, (ids, mask) = eager_model(**model_overrides), left_padded_batch()
    model.set_attn_implementation(attn)
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, reorder_documents={"spans": SPANS, "by": "position_free", **fields}, **kwargs)
    assert not calls


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        ("SepFormer", {"ms_poe": {"layers": (9,)}}, r"ms_poe layers \[9\] are out of range"),
        ("SepFormer", {"attention_buckets": {"bases": (1e4, 2e4)}}, r"bases=\[10000.0, 20000.0\] mean nothing"),
        ("mitigated Llama", {"ms_poe": {"layers": (9,)}}, r"ms_poe layers \[9\] are out of range"),
        ("mitigated Llama", {"positional_scaling": {"factor": 0.0}}, r"positional_scaling on LlamaForCausalLM needs"),
    ],
)
def test_what_the_generation_options_lack_is_refused_before_the_scoring_passes(make, kwargs, message):
    """The options generation runs with are resolved against the model before reordering's forwards, as their prefill
    would resolve them."""
    model, (ids, mask) = GENERATORS[make][0](), left_padded_batch()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, reorder_documents={"spans": SPANS, "by": "calibrated"}, **kwargs)
    assert not calls


@pytest.mark.parametrize("make", list(GENERATORS))
def test_several_buckets_generate_on_the_reordered_prompt(make):
    """Checked before the scoring passes as the copies of the rows resolve them, then run on the copies."""
    model, (ids, mask) = GENERATORS[make][0](), left_padded_batch()
    option, buckets = {"spans": SPANS, "by": SCORES}, {"attention_buckets": {"scales": (1.0, 0.5)}}
    reordered = reorder_documents(model, ids, mask, option)[0]
    assert torch.equal(
        generate(model, ids, mask, reorder_documents=option, **buckets), generate(model, reordered, mask, **buckets)
    )


@pytest.mark.parametrize("make", list(GENERATORS))
def test_a_cache_the_generation_options_cannot_keep_their_state_on_is_refused_before_the_scoring_passes(make):
    model, (ids, mask) = GENERATORS[make][0](), left_padded_batch()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=r"ms_poe keeps what it fixes at prefill on the cache, so it needs a cache"):
        generate(model, ids, mask, reorder_documents={"spans": SPANS}, ms_poe={}, past_key_values=DynamicCache())
    assert not calls


def test_a_right_padded_prompt_and_a_prompt_without_ids_are_refused():
    model, (ids, mask) = eager_model(), left_padded_batch()
    with pytest.raises(ValueError, match=r"rows \[1\] end in padding there .* pad on the left"):
        reorder_documents(model, ids, mask.flip(-1), {"spans": SPANS})
    embeds = model.model.embed_tokens(ids)
    with pytest.raises(
        ValueError, match=r"reorder_documents moves the prompt's token ids: give the prompt as input_ids"
    ):
        model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=2, reorder_documents={"spans": SPANS})


def test_bad_orders_and_scores_are_refused():
    ids, mask = left_padded_batch()
    with pytest.raises(ValueError, match=r"order of row 1 is \[0, 0, 2\]: it must be a permutation of 0..2"):
        reorder_prompt(ids, mask, SPANS, [[0, 1, 2], [0, 0, 2]])
    with pytest.raises(ValueError, match=r"order must be integer indices of shape \(rows, documents\) = \(2, 3\)"):
        reorder_prompt(ids, mask, SPANS, [0, 1, 2])
    with pytest.raises(ValueError, match=r"relevance scores must be finite"):
        relevance_order([1.0, float("inf")])
    with pytest.raises(ValueError, match=r"shape \(K,\) or \(b, K\) with K >= 1 documents; got shape \(0,\)"):
        relevance_order([])
    with pytest.raises(ValueError, match=r"strategy='best' is not one of"):
        relevance_order([1.0], "best")
    with pytest.raises(ValueError, match=r"strategy=array\('last', dtype='<U4'\) is not one of"):
        relevance_order([1.0], np.array("last"))  # a name, not an array holding one


@pytest.mark.parametrize(
    ("twos", "spans", "message"),
    [
        (True, SPANS, r"attention_mask contains 2: a 2-D padding mask holds only 0 \(padding\) and 1"),
        (True, (((1, 4), (5, 8), (9, 20)), SPANS[1]), r"attention_mask contains 2: a 2-D padding mask holds only 0"),
        (False, (SPANS[0], ((0, 2), (3, 7), (8, 11))), r"span \(8, 11\) of row 1 holds the prompt's last token \(10,"),
    ],
)
def test_reorder_prompt_refuses_a_mask_of_other_values_and_a_span_holding_the_question(twos, spans, message):
    """A mask of 2s would count each row twice as long (spans past the row cut short, silently); the prompt's last
    token is the question, which a document holding it would take along."""
    model, (ids, mask) = eager_model(), left_padded_batch()
    mask = mask * 2 if twos else mask
    with pytest.raises(ValueError, match=message):
        reorder_prompt(ids, mask, spans, [[2, 1, 0]] * 2)
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        document_relevance(model, ids, mask, spans)
    assert not calls


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"positional_scaling": {"factor": 0.5}}, r"by='position_free' sets positional_scaling itself .* got"),
        ({"attention_calibration": {"spans": SPANS}}, r"reorder_documents and attention_calibration cannot be"),
    ],
)
def test_forward_keywords_the_scoring_would_override_or_misread_are_refused_before_any_forward(keywords, message):
    model, (ids, mask) = eager_model(), left_padded_batch()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        document_relevance(model, ids, mask, SPANS, by="position_free", **keywords)
    with pytest.raises(ValueError, match=message):
        reorder_documents(model, ids, mask, {"spans": SPANS, "by": "position_free"}, **keywords)
    assert not calls


@pytest.mark.parametrize("keyword", SCORING_KEYWORDS)
def test_the_scoring_passes_own_keywords_are_refused_by_name_before_any_forward(keyword):
    model, (ids, mask) = eager_model(), left_padded_batch()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    message = rf"reorder_documents sets \['{keyword}'\] of its scoring passes itself .*: drop them"
    with pytest.raises(TypeError, match=message):
        document_relevance(model, ids, mask, SPANS, **{keyword: True})
    with pytest.raises(TypeError, match=message):
        reorder_documents(model, ids, mask, {"spans": SPANS}, **{keyword: True})
    assert not calls


def test_a_dummy_document_taking_the_dummy_passes_past_the_positions_the_model_reads_is_refused_before_any_forward():
    """GPT-2 has 64 positions: dummy passes of 71 tokens would fail after the first scoring pass, with or without
    add_mitigations. SepFormer reads past its table with a position_extrapolation."""
    long = {"spans": SPANS, "by": "calibrated", "dummy_document": (5,) * 60}
    gpt2, sepformer, (ids, mask) = tiny_gpt2("eager"), eager_model(max_position_embeddings=16), left_padded_batch()
    mitigated_gpt2 = add_mitigations(tiny_gpt2("eager"))
    calls = []
    for model in (gpt2, mitigated_gpt2, sepformer):
        model.register_forward_pre_hook(lambda *args: calls.append(1))
    for model in (gpt2, mitigated_gpt2):
        with pytest.raises(ValueError, match=r"dummy_document of 60 tokens makes dummy passes of 71 tokens, past max"):
            reorder_documents(model, ids, mask, long)
    long["dummy_document"] = (5,) * 8
    with pytest.raises(
        ValueError,
        match=r"of 8 tokens makes dummy passes of 19 tokens, position 18 is past the learn"
        r".*'fourier'\)`\): give a shorter dummy_document\.$",
    ):
        reorder_documents(sepformer, ids, mask, long)
    assert not calls
    reorder_documents(sepformer, ids, mask, long, position_extrapolation="clamp")
    assert calls


@pytest.mark.parametrize("make", list(GENERATORS))
def test_generate_refuses_a_cache_that_already_holds_the_prompt_before_any_forward(make):
    """transformers' prefix-cache recipe: the cache holds the prompt in its old order."""
    (make, cache_class), (ids, mask) = GENERATORS[make], left_padded_batch()
    model = make()
    with torch.no_grad():
        cache = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True).past_key_values
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    option = {"spans": SPANS, "by": SCORES}
    with pytest.raises(ValueError, match=r"past_key_values already holds 8 tokens of the prompt in its old order"):
        generate(model, ids, mask, reorder_documents=option, past_key_values=cache)
    with pytest.raises(ValueError, match=r"past_key_values already holds a tuple of the prompt in its old order"):
        generate(model, ids, mask, reorder_documents=option, past_key_values=((ids, ids),))
    assert not calls
    empty = cache_class(config=model.config)
    assert torch.equal(
        generate(model, ids, mask, reorder_documents=option, past_key_values=empty),
        generate(model, ids, mask, reorder_documents=option),
    )


def test_relevance_from_a_model_in_train_mode_is_refused_before_any_forward():
    """Dropout would score the documents anew at every call, as search_positional_scaling refuses it too."""
    model, (ids, mask) = eager_model(attention_dropout=0.5), left_padded_batch()
    model.train()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    message = r"by='attention' scores the documents with the model, whose dropout is on in train mode: put the model"
    with pytest.raises(ValueError, match=message):
        document_relevance(model, ids, mask, SPANS)
    with pytest.raises(ValueError, match=message):
        reorder_documents(model, ids, mask, {"spans": SPANS})
    with pytest.raises(ValueError, match=message):
        generate(model, ids, mask, reorder_documents={"spans": SPANS})
    assert not calls
    reorder_documents(model, ids, mask, {"spans": SPANS, "by": SCORES})  # given scores run no model


def test_generate_scores_with_its_position_extrapolation():
    """A prompt past the positional table: the scoring passes read it as the generation does."""
    model, (ids, mask) = eager_model(max_position_embeddings=12), left_padded_batch()
    option = {"spans": SPANS, "by": "position_free", "strategy": "last"}
    reordered, _, _ = reorder_documents(model, ids, mask, option, position_extrapolation="clamp")
    got = generate(model, ids, mask, reorder_documents=option, position_extrapolation="clamp")
    assert torch.equal(got, generate(model, reordered, mask, position_extrapolation="clamp"))


@pytest.mark.parametrize("call", ["document_relevance", "reorder_documents"])
def test_forward_keywords_with_given_scores_are_refused_not_ignored(call):
    """Given scores run no forward: a forward keyword would be silently ignored."""
    model, (ids, mask) = eager_model(), left_padded_batch()
    with pytest.raises(TypeError, match=r"position_extrapolation.*would be ignored"):
        if call == "document_relevance":
            document_relevance(model, ids, mask, SPANS, by=SCORES, position_extrapolation="clamp")
        else:
            reorder_documents(model, ids, mask, {"spans": SPANS, "by": SCORES}, position_extrapolation="clamp")


def test_generate_with_given_scores_and_a_forward_keyword_reorders_and_generates_with_it():
    model, (ids, mask) = eager_model(), left_padded_batch()
    option = {"spans": SPANS, "by": SCORES}
    got = generate(model, ids, mask, reorder_documents=option, position_extrapolation="clamp")
    reordered = reorder_documents(model, ids, mask, option)[0]
    assert torch.equal(got, generate(model, reordered, mask, position_extrapolation="clamp"))


def test_rounds_of_any_integer_type_are_a_plain_int():
    assert ReorderDocuments(spans=SPANS, rounds=np.int64(2)).rounds == 2
    assert type(ReorderDocuments(spans=SPANS, rounds=torch.tensor(3)).rounds) is int
    with pytest.raises(ValueError, match="rounds=True must be an integer"):
        ReorderDocuments(spans=SPANS, rounds=True)


def test_a_sepformer_of_another_copy_of_the_package_is_scored_and_searched_as_one():
    """A Hub checkpoint's custom code is another copy of this package, whose SepFormer may have no
    `decoder_positions`: its config says what it is, and it is read as the installed package's SepFormer."""
    model, (ids, mask) = eager_model(), left_padded_batch()

    class OtherCopy(type(model)):
        decoder_positions = None  # a copy older than the attribute

    other = OtherCopy(model.config).eval()
    other.load_state_dict(model.state_dict())
    for by in ("position_free", "attention"):
        expected = document_relevance(model, ids, mask, SPANS, by=by, layers=(0,))
        torch.testing.assert_close(document_relevance(other, ids, mask, SPANS, by=by, layers=(0,)), expected)
    batches = [{"input_ids": ids[:1], "labels": ids[:1], "gold_position": torch.tensor([1])}]
    searched = [search_positional_scaling(m, batches, factors=(0.5,)).option for m in (model, other)]
    assert searched[0] == searched[1]
    rotary = eager_model(rotary_dim=4)  # positions in the rotary too: refused alike
    other = OtherCopy(rotary.config).eval()
    for refused in (rotary, other):
        with pytest.raises(ValueError, match=r"by='position_free' needs positions only in the positional block"):
            document_relevance(refused, ids, mask, SPANS, by="position_free")
