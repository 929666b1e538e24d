"""Attention Buckets and Parallel Context Windows, checked against references written from the papers' formulas."""

import dataclasses
import math

import pytest
import torch
from conftest import logits, random_ids, tiny_config, tiny_model
from transformers import DynamicCache

from sepformer import (
    AttentionCalibration,
    ParallelContextWindows,
    SepFormerCache,
    SepFormerForCausalLM,
    SepFormerTokenizer,
)


def strong_positions(model):
    """A fresh model has a table of std 0.02 and near-uniform attention, too weak to move anything: make positions
    and attention matter."""
    with torch.no_grad():
        if hasattr(model.model.embed_positions, "weight"):
            model.model.embed_positions.weight.normal_(0, 1)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def cached_logits(model, ids, prefill, **kwargs):
    """Logits of a prefill of `prefill` tokens and then one decoding step per token, concatenated."""
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True, **kwargs).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs).logits)
    return torch.cat(steps, 1)


# ------------------------------------------------------------------------------------------------ Attention Buckets

OWN_READING = {
    "rotary": (dict(rotary_dim=4, rope_theta=500.0), {"bases": [500.0]}),
    "sinusoidal": (dict(positional_map="sinusoidal"), {"bases": [10000]}),
    "learned": (dict(), {"scales": [1.0]}),
}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", sorted(OWN_READING))
def test_one_bucket_with_the_models_own_reading_is_the_base_model_bit_for_bit(kind, attn):
    overrides, buckets = OWN_READING[kind]
    model = strong_positions(tiny_model(**overrides))
    model.set_attn_implementation(attn)
    ids = random_ids(2, 14)
    assert torch.equal(logits(model, ids, attention_buckets=buckets), logits(model, ids))
    plain = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, attention_buckets=buckets), plain)


def model_with(model, **overrides):
    """A copy of `model` (same weights) built from its config with `overrides`."""
    config = tiny_config(**{**model.config.to_diff_dict(), **overrides})
    copy = SepFormerForCausalLM(config).eval()
    copy.load_state_dict(model.state_dict(), strict=False)
    return copy


def sinusoid_by_hand(length, dim, base):
    rows = torch.zeros(length, dim)
    for i in range(length):
        for k in range(0, dim, 2):
            rows[i, k] = math.sin(i / base ** (k / dim))
            rows[i, k + 1] = math.cos(i / base ** (k / dim))
    return rows


def table_read_at(table, positions):
    """Rows of a learned table at fractional positions, linear between neighbours, written out."""
    rows = []
    for position in positions:
        low = math.floor(position)
        weight = position - low
        rows.append(table[low] * (1 - weight) + table[min(low + 1, len(table) - 1)] * weight)
    return torch.stack(rows)


def mixed_by_hand(per_bucket):
    """The reference code's mixing: `w_b = exp(max_v l_b) / Σ_c exp(max_v l_c)`, `Σ_b w_b l_b`, per token."""
    confidences = torch.stack([bucket.max(-1).values for bucket in per_bucket])  # (B, b, seq)
    weights = torch.exp(confidences - confidences.max(0).values) / torch.exp(
        confidences - confidences.max(0).values
    ).sum(0)
    return sum(weight[..., None] * bucket for weight, bucket in zip(weights, per_bucket, strict=True))


def test_rotary_buckets_equal_models_built_with_each_base_mixed_by_confidence():
    model = strong_positions(tiny_model(rotary_dim=4, position_size=0))
    ids = random_ids(2, 16)
    bases = [10000.0, 600.0, 80.0]
    per_bucket = [logits(model_with(model, rope_theta=base), ids) for base in bases]
    assert (per_bucket[2] - per_bucket[0]).abs().max() > 1e-3  # the bases do change the model
    buckets = logits(model, ids, attention_buckets={"bases": bases})
    torch.testing.assert_close(buckets, mixed_by_hand(per_bucket), rtol=1e-5, atol=1e-5)


def test_per_row_rotary_bases_are_read_on_their_own_device():
    """Bases one per row are a tensor on the model's device (a GPU's): SepFormer's rotary makes their frequencies there,
    not on the CPU (the meta device stands in for another device)."""
    rotary = tiny_model(rotary_dim=4).model.rotary_emb.to("meta")
    bases = torch.tensor([100.0, 10000.0], device="meta")[:, None, None]  # (b, 1, 1)
    positions = torch.arange(6, device="meta").expand(2, -1)
    cos, sin = rotary(torch.empty(0, device="meta"), positions, bases)
    assert cos.shape == sin.shape == (2, 6, 4) and cos.device.type == "meta"


def test_sinusoidal_map_buckets_read_the_sinusoid_of_each_base():
    model = strong_positions(tiny_model(positional_map="sinusoidal"))
    ids = random_ids(2, 16)
    bases = [10000.0, 50.0]
    per_bucket = []
    for base in bases:  # a learned table holding the sinusoid of this base, written out
        reference = model_with(model, positional_map="learned")
        with torch.no_grad():
            reference.model.embed_positions.weight.copy_(sinusoid_by_hand(64, 8, base))
        per_bucket.append(logits(reference, ids))
    buckets = logits(model, ids, attention_buckets={"bases": bases})
    torch.testing.assert_close(buckets, mixed_by_hand(per_bucket), rtol=1e-5, atol=1e-5)


def test_learned_table_buckets_read_the_table_at_scaled_positions():
    model = strong_positions(tiny_model())
    ids = random_ids(2, 16)
    scales = [1.0, 0.5, 0.75]
    table = model.model.embed_positions.weight.detach()
    per_bucket = []
    for scale in scales:  # a table whose row i is the model's table read at i · scale
        reference = model_with(model)
        with torch.no_grad():
            reference.model.embed_positions.weight[:16] = table_read_at(table, [i * scale for i in range(16)])
        per_bucket.append(logits(reference, ids))
    buckets = logits(model, ids, attention_buckets={"scales": scales})
    torch.testing.assert_close(buckets, mixed_by_hand(per_bucket), rtol=1e-5, atol=1e-5)


BUCKETS = {"bases": [10000.0, 300.0], "scales": [1.0, 0.6]}  # rotary and the learned table, both read per bucket


def test_bucket_cached_decoding_equals_the_full_pass():
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 18)
    full = logits(model, ids, attention_buckets=BUCKETS)
    torch.testing.assert_close(cached_logits(model, ids, 7, attention_buckets=BUCKETS), full, rtol=1e-5, atol=1e-5)


PER_ROW_OPTIONS = {  # options whose spans are per row, for rows each with a copy per bucket
    "attention_calibration": AttentionCalibration(spans=(((1, 5), (5, 9)), ((0, 4), (4, 8))), temperature=0.05),
    "parallel_context_windows": ParallelContextWindows(spans=(((0, 5), (5, 10)), ((0, 4), (4, 9)))),
}


@pytest.mark.parametrize("name", sorted(PER_ROW_OPTIONS))
def test_buckets_beside_per_row_options_equal_each_bucket_run_alone_with_them_mixed(name):
    """Each row's copies carry that row's spans, and calibration's dummy passes (one per row and document) read their
    row's bucket: in a left-padded batch, prefill and decoding equal each bucket alone with the option, mixed."""
    model = strong_positions(tiny_model(rotary_dim=4))
    ids, mask = random_ids(2, 14), torch.ones(2, 14, dtype=torch.long)
    mask[1, :2] = 0
    options = {name: PER_ROW_OPTIONS[name], "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    one = [{key: [values[bucket]] for key, values in BUCKETS.items()} for bucket in range(2)]
    with torch.no_grad():
        per_bucket = [model(ids, attention_mask=mask, attention_buckets=bucket, **options).logits for bucket in one]
        buckets = model(ids, attention_mask=mask, attention_buckets=BUCKETS, **options).logits
    torch.testing.assert_close(buckets, mixed_by_hand(per_bucket), rtol=1e-5, atol=1e-5)
    assert (per_bucket[0] - per_bucket[1]).abs().max() > 1e-3  # the buckets differ
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, **{name: PER_ROW_OPTIONS[name]})
    generated = model.generate(ids, attention_buckets=BUCKETS, **kwargs)
    by_row = []
    for row in range(2):  # alone, unpadded
        alone = {name: dataclasses.replace(PER_ROW_OPTIONS[name], spans=PER_ROW_OPTIONS[name].spans[row : row + 1])}
        prompt = ids[row : row + 1, 2 * row :]
        by_row.append(model.generate(prompt, **{**kwargs, **alone, "attention_mask": None}, attention_buckets=BUCKETS))
    assert torch.equal(generated[:, -4:], torch.cat([tokens[:, -4:] for tokens in by_row]))


def test_identical_buckets_follow_beams_and_return_sequences_like_the_base_model():
    """Two buckets with the model's own reading mix to exactly the base model's logits (weights 1/2 each), so beam
    search must give the base model's beams: only if every bucket's cache follows the beams' reordering."""
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 10)
    kwargs = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    plain = model.generate(ids, **kwargs)
    same = model.generate(ids, **kwargs, attention_buckets={"bases": [10000.0, 10000.0]})
    assert torch.equal(same, plain)
    differ = model.generate(ids, **kwargs, attention_buckets=BUCKETS)
    assert differ.shape == plain.shape and not torch.equal(differ, plain)
    alone = torch.cat([model.generate(ids[row : row + 1], **kwargs, attention_buckets=BUCKETS) for row in range(2)])
    assert torch.equal(differ, alone)
    assert torch.equal(model.generate(ids, **kwargs, attention_buckets=BUCKETS, use_cache=False), differ)


def test_the_cache_keeps_each_rows_copy_per_bucket_and_batch_operations_move_the_copies_together():
    """Row `r` of the cache is row `r // B` read as bucket `r % B`: its keys are that bucket's alone; beam reordering,
    repeats and selection name the batch's rows, and each row's copies follow it."""
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 6)
    cache = SepFormerCache(config=model.config)
    alone = [SepFormerCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)
        for bucket, bucket_cache in enumerate(alone):
            one = {name: [values[bucket]] for name, values in BUCKETS.items()}
            model(ids, past_key_values=bucket_cache, use_cache=True, attention_buckets=one)
    keys = cache.layers[0].keys.clone()  # (2 rows · 2 buckets, heads, 6, head_dim)
    assert cache.row_copies == 2 and keys.shape[0] == 4
    for bucket, bucket_cache in enumerate(alone):
        torch.testing.assert_close(keys[bucket::2], bucket_cache.layers[0].keys)
    assert not torch.allclose(keys[0::2], keys[1::2])  # bucket 1 keys are rotated with its own base
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].keys, keys[[2, 3, 0, 1]])
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].keys, keys[[2, 3, 2, 3, 0, 1, 0, 1]])
    cache.batch_select_indices(torch.tensor([3]))
    assert torch.equal(cache.layers[0].keys, keys[[0, 1]])
    cache.crop(-6)  # every token: a reset, the copies gone with the prefill's state
    assert cache.row_copies == 1 and cache.get_seq_length() == 0


BATCH_OPERATIONS = {  # the operation, and the rows of the prefill's batch it leaves
    "reorder": (lambda cache: cache.reorder_cache(torch.tensor([1, 0])), [1, 0]),
    "repeat": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1]),
    "select": (lambda cache: cache.batch_select_indices(torch.tensor([1])), [1]),
}


@pytest.mark.parametrize("operation", sorted(BATCH_OPERATIONS))
def test_a_cache_continued_after_a_batch_operation_equals_a_prefill_of_the_batch_it_left(operation):
    """The rows a batch operation leaves read as their buckets at the next steps, whatever the batch's new size."""
    model = strong_positions(tiny_model(rotary_dim=4))
    ids, steps = random_ids(2, 8), random_ids(4, 2, seed=3)
    operate, rows = BATCH_OPERATIONS[operation]
    cache, fresh = SepFormerCache(config=model.config), SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)
        operate(cache)
        model(ids[rows], past_key_values=fresh, use_cache=True, attention_buckets=BUCKETS)
        for step in range(2):
            token = steps[: len(rows), step : step + 1]
            continued = model(token, past_key_values=cache, use_cache=True, attention_buckets=BUCKETS).logits
            expected = model(token, past_key_values=fresh, use_cache=True, attention_buckets=BUCKETS).logits
            torch.testing.assert_close(continued, expected, rtol=1e-5, atol=1e-5)


def test_a_cropped_cache_continues_every_buckets_cache_from_the_kept_tokens():
    """Assisted decoding crops the tokens it rejected: from every bucket's cache, or the next step reads another
    bucket's tokens at other positions."""
    model = strong_positions(tiny_model(rotary_dim=4))
    ids, rejected = random_ids(2, 14), random_ids(2, 3, seed=1)
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :10], past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)
        model(rejected, past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)
        cache.crop(-3)
        continued = model(ids[:, 10:], past_key_values=cache, use_cache=True, attention_buckets=BUCKETS).logits
    full = logits(model, ids, attention_buckets=BUCKETS)
    torch.testing.assert_close(continued, full[:, 10:], rtol=1e-5, atol=1e-5)


BAD_BUCKETS = [
    ({"bases": []}, "bases=\\(\\) is empty"),
    ({"bases": [10000.0, -1.0]}, "base=-1.0 must be >= 1e-09"),
    ({"bases": [1e-300]}, "base=1e-300 must be >= 1e-09: .* in float32"),  # NaN logits, unrefused
    ({"scales": [0.0]}, "scale=0.0 must be > 0"),
    ({"scales": [1e308]}, "scale=1e\\+308 must be <= 1e\\+09: .* in float32"),  # an error from deep in the maps
    ({"bases": [1e4, float("inf")]}, "base=inf must be a finite number"),
    ({"bases": 10000.0}, "must be a non-empty sequence of positive numbers"),
    ({}, "needs bases=\\[...\\] or scales=\\[...\\]"),
    ({"bases": [1e4, 2e4], "scales": [1.0]}, "2 bases and 1 scales"),
    ({"base": [1e4]}, "unknown keys \\['base'\\]"),
]


@pytest.mark.parametrize(("options", "message"), BAD_BUCKETS, ids=[message[:30] for _, message in BAD_BUCKETS])
def test_bad_bucket_options_are_refused_with_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(rotary_dim=4)(random_ids(1, 8), attention_buckets=options)


@pytest.mark.parametrize("scales", [[2.0], [1.0, 2.0]], ids=["one bucket", "two buckets"])
def test_scales_reaching_past_a_learned_table_are_refused_naming_the_scale_before_any_cache_is_written(scales):
    model = tiny_model(max_position_embeddings=16)
    cache = SepFormerCache(config=model.config)
    message = (
        r"attention_buckets scale 2 reads position 11 at 22, past the learned positional table's 16 rows, "
        r"which position_extrapolation='none' does not extend: give scales <= 1.36364 .* \('clamp', "
    )
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(random_ids(1, 12), past_key_values=cache, use_cache=True, attention_buckets={"scales": scales})
    assert cache.get_seq_length() == 0 and cache.row_copies == 1  # the batch operations name the rows as they are
    with torch.no_grad():  # the refused prefill left nothing that the cache's next generation would be held to
        model(random_ids(1, 8), past_key_values=cache, use_cache=True)
        model(random_ids(1, 1), past_key_values=cache, use_cache=True)
    logits(model, random_ids(1, 12), attention_buckets={"scales": scales}, position_extrapolation="fourier")


def test_the_extreme_buckets_allowed_give_finite_logits():
    model = strong_positions(tiny_model(rotary_dim=4, positional_map="sinusoidal"))
    extreme = {"bases": [1e-9, 10000.0], "scales": [1e9, 1.0]}  # rotary angles up to m · 1e18
    mixed = logits(model, random_ids(2, 12), attention_buckets=extreme)
    assert torch.isfinite(mixed).all()


def test_buckets_that_mean_nothing_for_the_model_are_refused():
    ids = random_ids(1, 8)
    for positional_map in ("learned", "bspline"):
        message = f"mean nothing .* its positional map is '{positional_map}' \\(only the sinusoidal map has a base"
        with pytest.raises(ValueError, match=message):
            tiny_model(positional_map=positional_map)(ids, attention_buckets={"bases": [10000.0]})
    with pytest.raises(ValueError, match="rescale positions, but this model reads none"):
        tiny_model(position_size=0)(ids, attention_buckets={"scales": [1.0, 2.0]})
    model = tiny_model(rotary_dim=4)
    with pytest.raises(ValueError, match="2 buckets mixes .* call it on SepFormerForCausalLM"):
        model.model(ids, attention_buckets={"bases": [1e4, 2e4]})
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(attention_buckets={"bases": [1e4, 2e4]})
    with pytest.raises(ValueError, match="output_attentions and output_hidden_states would be one per bucket"):
        model(ids, attention_buckets={"bases": [1e4, 2e4]}, output_attentions=True)
    with pytest.raises(ValueError, match="ms_poe and attention_buckets cannot be combined"):
        model(ids, attention_buckets={"bases": [1e4]}, ms_poe={"head_order": (0, 1, 2, 3)})
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_buckets={"bases": [1e4, 2e4]})
        with pytest.raises(ValueError, match="needs the same attention_buckets as its prefill"):
            model(ids[:, :1], past_key_values=cache, use_cache=True, attention_buckets={"bases": [1e4, 3e4]})
        with pytest.raises(
            ValueError, match="keeps a copy of every row per attention bucket .* continue it with the same"
        ):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        plain = SepFormerCache(config=model.config)
        model(ids, past_key_values=plain, use_cache=True)
        with pytest.raises(ValueError, match="needs the same attention_buckets as its prefill \\(None\\)"):
            model(ids[:, :1], past_key_values=plain, use_cache=True, attention_buckets={"bases": [1e4, 3e4]})


def test_buckets_train_with_labels_on_the_mixed_logits():
    model = strong_positions(tiny_model(rotary_dim=4)).train()
    ids = random_ids(2, 12)
    output = model(ids, labels=ids, attention_buckets=BUCKETS)
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(output.loss, expected)
    output.loss.backward()
    assert model.model.embed_positions.weight.grad.abs().sum() > 0
    labels = torch.where(torch.arange(12) < 6, 7, ids)  # the loss's own keywords reach it: 7 marks what is not scored
    output = model(ids, labels=labels, ignore_index=7, attention_buckets=BUCKETS)
    expected = torch.nn.functional.cross_entropy(
        output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=7
    )
    torch.testing.assert_close(output.loss, expected)


# -------------------------------------------------------------------------------------- Parallel Context Windows


def pcw_by_hand(spans, length):
    """PCW's positions and attention mask for one row of `length` tokens, written from the paper with loops.

    Tokens before the first window are shared by every window (the reference shares <bos>); window `k`'s tokens get
    positions `s_1, s_1 + 1, ...`; the tokens after the windows continue from `s_1 + max |W_k|` and see everything.
    """
    first, last = spans[0][0], spans[-1][1]
    longest = max(end - start for start, end in spans)
    window = [None] * length
    positions = list(range(length))
    for k, (start, end) in enumerate(spans):
        for i in range(start, end):
            window[i], positions[i] = k, first + (i - start)
    for i in range(last, length):
        positions[i] = first + longest + (i - last)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(i + 1):
            allowed[i, j] = window[i] is None or window[j] is None or window[i] == window[j]
    return torch.tensor(positions), allowed


def reference_logits(model, ids, spans):
    positions, allowed = pcw_by_hand(spans, ids.shape[1])
    mask = torch.zeros(1, 1, *allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return logits(model, ids, position_ids=positions[None], attention_mask=mask)


WINDOWS = ((2, 6), (6, 13), (13, 16))  # a 2-token prefix, windows of 4, 7 and 3 tokens, then the task


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("overrides", [dict(), dict(rotary_dim=4), dict(positional_map="sinusoidal")])
def test_windows_equal_positions_and_mask_written_from_the_paper(overrides, attn):
    model = strong_positions(tiny_model(**overrides))
    model.set_attn_implementation(attn)
    ids = random_ids(1, 20)
    windows = logits(model, ids, parallel_context_windows={"spans": [WINDOWS]})
    torch.testing.assert_close(windows, reference_logits(model, ids, WINDOWS), rtol=1e-5, atol=1e-5)
    assert (windows - logits(model, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("span", [(0, 20), (2, 20), (1, 14)])
def test_one_window_is_the_base_model_bit_for_bit(span, attn):
    model = strong_positions(tiny_model(rotary_dim=4))
    model.set_attn_implementation(attn)
    ids = random_ids(2, 20)
    assert torch.equal(logits(model, ids, parallel_context_windows={"spans": [[span]] * 2}), logits(model, ids))
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=2, num_return_sequences=2)
    plain = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, **kwargs, parallel_context_windows={"spans": [[span]] * 2}), plain)


def test_window_cached_decoding_continues_with_task_positions_as_the_full_pass():
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 22)
    options = {"parallel_context_windows": {"spans": [WINDOWS, ((0, 9), (9, 12), (12, 16))]}}
    full = logits(model, ids, **options)
    torch.testing.assert_close(cached_logits(model, ids, 17, **options), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[:1], reference_logits(model, ids[:1], WINDOWS), rtol=1e-5, atol=1e-5)


PROMPTS = ["def f(x): return", "import os, sys", "a longer prompt, with more bytes"]
PROMPT_WINDOWS = (((1, 5), (5, 9)), ((0, 7), (7, 12)), ((2, 10), (10, 20)))


def options_of_rows(name, rows):
    """The option `name` for a batch of the prompts `rows` (windows are given per row)."""
    if name == "attention_buckets":
        return {name: BUCKETS}
    return {name: {"spans": [PROMPT_WINDOWS[row] for row in rows]}}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["attention_buckets", "parallel_context_windows"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(name, attn):
    model = strong_positions(tiny_model(rotary_dim=4))
    model.set_attn_implementation(attn)
    tokenizer = SepFormerTokenizer(padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id, num_beams=2)
    together = model.generate(**batch, **kwargs, **options_of_rows(name, range(len(PROMPTS))))
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), **kwargs, **options_of_rows(name, [row]))
        assert torch.equal(together[row, -8:], alone[0, -8:]), prompt


BAD_WINDOWS = [
    ({"spans": [((0, 4), (5, 8))]}, "leave tokens 4..4 between two windows"),
    ({"spans": [((0, 4), (3, 8))]}, "overlap"),
    ({"spans": [((0, 4), (4, 30))]}, "span \\(4, 30\\) of row 0 is out of range: the prompt of that row has 12"),
    ({"spans": [((3, 3),)]}, "empty or negative"),
    ({"spans": [((0, 3),), ((0, 3),)]}, "spans for 2 rows; the batch has 1"),
    ({"spans": [((0, 3.5),)]}, "must be two integers"),
    ({"spans": []}, "the same number \\(>= 1\\)"),
    ({"window": [((0, 3),)]}, "unknown keys \\['window'\\]"),
]


@pytest.mark.parametrize(("options", "message"), BAD_WINDOWS, ids=[message[:30] for _, message in BAD_WINDOWS])
def test_bad_windows_are_refused_with_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(random_ids(1, 12), parallel_context_windows=options)


def test_windows_refuse_a_4d_mask_calibration_and_a_cache_started_without_them():
    model = tiny_model()
    ids = random_ids(1, 12)
    windows = ParallelContextWindows(spans=(((0, 4), (4, 8)),))
    with pytest.raises(ValueError, match="needs the 2D padding mask"):
        model(ids, attention_mask=torch.zeros(1, 1, 12, 12), parallel_context_windows=windows)
    with pytest.raises(ValueError, match="attention_calibration and parallel_context_windows cannot be combined"):
        model(ids, parallel_context_windows=windows, attention_calibration=AttentionCalibration(spans=(((0, 4),),)))
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="parallel_context_windows encodes the windows at prefill"):
            model(ids[:, :1], past_key_values=cache, use_cache=True, parallel_context_windows=windows)


def test_windows_refuse_other_position_ids_and_a_cache_cropped_back_into_a_window():
    """Windows are placed from the positions counted from each row's first token (the mask and the positions read
    must agree), and a continuing call's tokens are task tokens after them: both refused as on Hugging Face decoders.
    The windows a cache must hold count each row's padding."""
    model = strong_positions(tiny_model(position_size=0, rotary_dim=8))  # relative positions: a shift alone is no-op
    ids = random_ids(2, 20)
    one_row = ParallelContextWindows(spans=(((0, 10), (10, 18)),))
    with pytest.raises(ValueError, match=r"places its windows and the task .* position_ids are others \(\[7, 8"):
        model(ids[:1], position_ids=torch.arange(7, 27)[None], parallel_context_windows=one_row)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :3] = 0  # row 1: 17 real tokens, its windows end at its 16th: 19 columns
    windows = ParallelContextWindows(spans=(((0, 10), (10, 18)), ((0, 8), (8, 16))))

    def continued(crop: int):
        cache = SepFormerCache(config=model.config)
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, parallel_context_windows=windows)
        cache.crop(crop)
        step_mask = torch.cat((mask[:, : cache.get_seq_length()], torch.ones(2, 1, dtype=torch.long)), 1)
        step = dict(attention_mask=step_mask, past_key_values=cache, use_cache=True, parallel_context_windows=windows)
        return model(ids[:, :1], **step).logits

    with torch.no_grad():
        continued(-1)  # 19 tokens: every row's windows held
        with pytest.raises(
            ValueError, match="the cache holds 18 tokens, short of the 19 that hold every row's windows"
        ):
            continued(-2)


def test_a_cache_prefilled_with_windows_or_buckets_cannot_be_continued_without_them():
    model = tiny_model(rotary_dim=4)
    ids = random_ids(1, 12)
    windows = ParallelContextWindows(spans=(((0, 4), (4, 8)),))
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, parallel_context_windows=windows)
        with pytest.raises(ValueError, match="this cache was prefilled with parallel_context_windows="):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        model(ids[:, :1], past_key_values=cache, use_cache=True, parallel_context_windows=windows)  # the same: fine

    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)
        for other in (None, {"bases": [BUCKETS["bases"][0]]}):  # no buckets, or bucket 0 alone
            with pytest.raises(ValueError, match="a copy of every row per attention bucket from its prefill"):
                model(ids[:, :1], past_key_values=cache, use_cache=True, attention_buckets=other)
        model(ids[:, :1], past_key_values=cache, use_cache=True, attention_buckets=BUCKETS)  # the same: fine


@pytest.mark.parametrize(
    "keyword, options, other",
    [
        ("attention_buckets", {"scales": [0.5]}, {"scales": [0.9]}),
        ("attention_buckets", {"bases": [2e4]}, {"bases": [3e4]}),
        ("positional_scaling", {"factor": -0.5}, {"factor": 0.5}),
    ],
)
def test_a_cache_made_with_one_reading_of_positions_is_continued_with_the_same(keyword, options, other):
    """One bucket's cached keys were read at its positions, positional scaling's were scaled: a continued call with
    the option off, or with other options, would attend to keys of another model. Refused; the same options go on."""
    model = tiny_model(rotary_dim=4)
    ids = random_ids(1, 12)
    with torch.no_grad():
        cache = SepFormerCache(config=model.config)
        model(ids[:, :9], past_key_values=cache, use_cache=True, **{keyword: options})
        with pytest.raises(ValueError, match=f"this cache was prefilled with {keyword}="):
            model(ids[:, 9:10], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=f"{keyword} fixed state at prefill .* needs the options of its prefill"):
            model(ids[:, 9:10], past_key_values=cache, use_cache=True, **{keyword: other})
        model(ids[:, 9:10], past_key_values=cache, use_cache=True, **{keyword: options})  # the same: fine

        plain = SepFormerCache(config=model.config)
        model(ids[:, :9], past_key_values=plain, use_cache=True)
        with pytest.raises(ValueError, match=f"{keyword} .* must be on from the first \\(prefill\\) call"):
            model(ids[:, 9:10], past_key_values=plain, use_cache=True, **{keyword: options})
        with pytest.raises(ValueError, match=f"{keyword} keeps what it fixes at prefill on the cache"):
            model(ids[:, :9], past_key_values=DynamicCache(), use_cache=True, **{keyword: options})


def test_an_assistant_model_is_refused_where_the_windows_reach_the_prompts_last_token():
    """transformers crops the assistant's cache before the prompt's last token and feeds it again, as a task token
    where it lay in a window; windows that end before it draft and generate what plain decoding generates."""
    model, assistant = tiny_model(), tiny_model(seed=1)
    prompt = random_ids(1, 12)
    greedy = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    with pytest.raises(ValueError, match=r"the windows of rows \[0\] end at the prompt's last token, which"):
        model.generate(prompt, assistant_model=assistant, parallel_context_windows={"spans": [[(0, 6), (6, 12)]]})
    for spans, message in [
        ([[(0, 6), (6, 13)]], r"span \(6, 13\) of row 0 is out of range"),
        ([[(0, 6)]] * 2, "2 rows"),
    ]:
        with pytest.raises(ValueError, match=message):  # the prefill's refusals, not this one
            model.generate(prompt, assistant_model=assistant, parallel_context_windows={"spans": spans}, **greedy)
    windows = {"parallel_context_windows": {"spans": [[(0, 5), (5, 10)]]}}
    assisted = model.generate(prompt, assistant_model=assistant, **windows, **greedy)
    assert torch.equal(assisted, model.generate(prompt, **windows, **greedy))
