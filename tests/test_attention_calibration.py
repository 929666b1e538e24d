"""Attention calibration (`sepformer/attention_calibration.py`): the calibrated row against the paper's formula,
`bias(k)` against a dummy pass done by hand, the positional estimate against a pass whose `k_proj` input is swapped."""

import re

import pytest
import torch
from conftest import SPANS, random_ids, strong_positions, tiny_llama, tiny_model
from test_any_decoder import left_padded

import sepformer
from sepformer import AttentionCalibration, MSPoE, PositionalScaling, SepFormerCache
from sepformer.attention_calibration import bias_from_positions
from sepformer.mitigations import KeyDocuments, calibrate_row


def test_calibrated_row_keeps_the_row_and_the_document_total():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 3, 12, generator=generator).softmax(-1)
    documents = torch.zeros(2, 12, 3)
    documents[:, 1:4, 0], documents[:, 4:6, 1], documents[:, 8:11, 2] = 1, 1, 1
    bias = torch.rand(2, 3, 3, generator=generator) * 0.1
    calibrated = calibrate_row(probs, KeyDocuments.of(documents), bias, temperature=0.05)
    torch.testing.assert_close(calibrated.sum(-1), torch.ones(2, 3))
    outside = documents.sum(-1)[:, None].expand_as(probs) == 0
    assert torch.equal(calibrated[outside], probs[outside])
    mass = lambda p: torch.einsum("bhk,bkd->bhd", p, documents)  # noqa: E731
    torch.testing.assert_close(mass(calibrated).sum(-1), mass(probs).sum(-1))
    # α_k ∝ exp(rel_k / t): each document's mean attention becomes proportional to α_k
    means = mass(calibrated) / documents.sum(1)[:, None]
    rel = mass(probs) / documents.sum(1)[:, None] - bias
    torch.testing.assert_close(means / means.sum(-1, keepdim=True), (rel / 0.05).softmax(-1))
    # t -> ∞: every document's mean is equal
    flat = calibrate_row(probs, KeyDocuments.of(documents), bias, temperature=1e9)
    flat_means = mass(flat) / documents.sum(1)[:, None]
    torch.testing.assert_close(flat_means, flat_means[..., :1].expand_as(flat_means))


def test_a_row_with_generated_keys_is_calibrated_in_place_as_anew():
    """A decoding step's row: the prompt keys' entries re-weighted, the generated keys' (past the documents' P) kept;
    in place only when asked (the layers' own row, without autograd)."""
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(2, 3, 15, generator=generator).softmax(-1)
    documents = torch.zeros(2, 12, 3)
    documents[:, 1:4, 0], documents[:, 4:6, 1], documents[:, 8:11, 2] = 1, 1, 1
    bias = torch.rand(2, 3, 3, generator=generator) * 0.1
    row = probs.clone()
    anew = calibrate_row(row, KeyDocuments.of(documents), bias, temperature=0.05)
    assert torch.equal(row, probs)
    in_place = calibrate_row(row, KeyDocuments.of(documents), bias, temperature=0.05, in_place=True)
    assert in_place is row and torch.equal(in_place, anew)
    assert torch.equal(in_place[..., 12:], probs[..., 12:]) and not torch.equal(in_place[..., :12], probs[..., :12])


@pytest.mark.parametrize("temperature", [5e-5, 1e-8, 1e-12])
def test_calibrated_row_keeps_float32_precision_at_small_temperatures(temperature):
    """Documents of 2, 8 and 20 keys whose relevances tie (a uniform row, one bias): the paper's formula written in
    float64 gives every key its attention back; the float32 row must match it to float32 precision, however small the
    temperature (a form that adds log |doc| to rel / t loses the sizes to rounding there: 0.76 off at t = 1e-8)."""
    documents = torch.zeros(1, 30, 3)
    documents[:, :2, 0], documents[:, 2:10, 1], documents[:, 10:, 2] = 1, 1, 1
    probs = torch.full((1, 2, 30), 1 / 30)
    bias = torch.full((1, 2, 3), 1 / 30 - 0.3)
    wide = probs.double()
    mass = torch.bmm(wide, documents.double())
    sizes = documents.double().sum(1)[:, None]
    alpha = ((mass / sizes - bias.double()) / temperature).softmax(-1)
    factor = alpha * mass.sum(-1, keepdim=True) / (alpha * sizes).sum(-1, keepdim=True) / (mass / sizes)
    expected = wide * torch.bmm(factor, documents.double().mT)
    calibrated = calibrate_row(probs, KeyDocuments.of(documents), bias, temperature)
    torch.testing.assert_close(calibrated.double(), expected, rtol=1e-6, atol=1e-7)


def test_a_document_the_row_does_not_attend_keeps_its_zeros_and_the_gradients_finite():
    """A document whose keys the row cannot attend (masked: slid out of a window) has no mass: it gets factor 0, and a
    gradient through the row is finite (the division by its zero mean must not reach the backward pass, where
    0 · inf is NaN)."""
    generator = torch.Generator().manual_seed(0)
    documents = torch.zeros(1, 12, 3)
    documents[:, 1:4, 0], documents[:, 4:6, 1], documents[:, 8:11, 2] = 1, 1, 1
    logits = torch.randn(1, 2, 12, generator=generator, requires_grad=True)
    probs = logits.masked_fill(documents[..., 1].bool()[:, None], float("-inf")).softmax(-1)
    bias = torch.rand(1, 2, 3, generator=generator) * 0.1
    calibrated = calibrate_row(probs, KeyDocuments.of(documents), bias, temperature=0.05)
    assert torch.equal(calibrated[..., 4:6], torch.zeros(1, 2, 2))
    (calibrated * torch.randn(calibrated.shape, generator=generator)).sum().backward()
    assert logits.grad.isfinite().all()


def test_calibration_in_the_model_rewrites_the_last_row_of_its_layers_only():
    model = strong_positions(tiny_model(num_hidden_layers=3))
    model.set_attn_implementation("eager")
    ids = random_ids(1, 14)
    option = AttentionCalibration(spans=(SPANS,), temperature=0.01)  # default layers: the last half, 1 and 2
    with torch.no_grad():
        base = model(ids, output_attentions=True)
        calibrated = model(ids, output_attentions=True, attention_calibration=option)
    assert torch.equal(calibrated.attentions[0], base.attentions[0])
    torch.testing.assert_close(calibrated.logits[:, :-1], base.logits[:, :-1], rtol=0, atol=0)
    documents = torch.zeros(14, dtype=torch.bool)
    documents[:9] = True
    for layer in (1, 2):
        got, before = calibrated.attentions[layer], base.attentions[layer]
        assert torch.equal(got[:, :, :-1], before[:, :, :-1])
        last, last_before = got[0, :, -1], before[0, :, -1]
        torch.testing.assert_close(last.sum(-1), torch.ones(4))
        torch.testing.assert_close(last[:, documents].sum(-1), last_before[:, documents].sum(-1))
        torch.testing.assert_close(last[:, ~documents], last_before[:, ~documents])


def test_calibration_bias_is_the_dummy_documents_attention():
    model = strong_positions(tiny_model())
    model.set_attn_implementation("eager")
    ids = random_ids(1, 12)
    dummy = (7, 7)
    option = AttentionCalibration(spans=(SPANS,), layers=(1,), dummy_document=dummy)
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_calibration=option)
        bias = cache.mitigation_state["attention_calibration"].bias[1]  # (1, H, K)
        for k, (start, end) in enumerate(SPANS):
            spliced = torch.cat((ids[:, :start], torch.tensor([dummy]), ids[:, end:]), 1)
            row = model(spliced, output_attentions=True).attentions[1][0, :, -1]  # (H, kv)
            torch.testing.assert_close(bias[0, :, k], row[:, start : start + len(dummy)].mean(-1))


def test_the_dummy_passes_read_the_positions_the_call_gives():
    """Given `position_ids`, each dummy pass reads the prompt's positions (the dummy keeps its tokens' places):
    `bias(k)` is the dummy's attention at those positions; a `dummy_document` of another length, which moves the
    tokens after it, refuses positions other than the default ones."""
    model = strong_positions(tiny_model(attn_implementation="eager"))  # a learned table: absolute positions matter
    ids, shifted = random_ids(2, 12), torch.arange(12)[None] + torch.tensor([[3], [9]])  # each row its own
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        option = AttentionCalibration(spans=(SPANS, SPANS), layers=(1,))
        model(ids, position_ids=shifted, past_key_values=cache, use_cache=True, attention_calibration=option)
        bias = cache.mitigation_state["attention_calibration"].bias[1]  # (2, H, K)
        for row in range(2):
            for k, (start, end) in enumerate(SPANS):
                spliced = ids[row : row + 1].clone()
                spliced[:, start:end] = model.config.pad_token_id
                positions = shifted[row : row + 1]
                attention = model(spliced, position_ids=positions, output_attentions=True).attentions[1][0, :, -1]
                torch.testing.assert_close(bias[row, :, k], attention[:, start:end].mean(-1), rtol=1e-5, atol=1e-6)
        other_length = AttentionCalibration(spans=(SPANS,), dummy_document=(7, 7))
        with pytest.raises(ValueError, match=r"runs the dummy passes of a dummy_document, .* position_ids are others"):
            model(ids[:1], position_ids=shifted[:1], attention_calibration=other_length)
        model(ids[:1], position_ids=torch.arange(12)[None], attention_calibration=other_length)  # the default ones


@pytest.mark.parametrize("model_name", ["sepformer", "llama"])
def test_the_default_dummy_passes_of_rows_padded_differently_measure_each_row_as_alone(model_name):
    """Each row's `bias(k)` is the attention its own prompt, run alone without padding, gives the default dummy
    (`pad_token_id` repeated) in place of document `k`: the dummy batch keeps each row's tokens, padding and order."""
    if model_name == "sepformer":
        model = strong_positions(tiny_model(attn_implementation="eager"))
    else:
        model = sepformer.add_mitigations(tiny_llama(attn="eager"))
    model.config.pad_token_id = 1
    prompts = [random_ids(1, length, seed=length)[0] for length in (12, 10, 11)]
    ids, mask = left_padded(prompts)
    option = AttentionCalibration(spans=(SPANS,) * len(prompts), layers=(1,))
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, attention_calibration=option)
        bias = cache.mitigation_state["attention_calibration"].bias[1]  # (rows, H, K)
        for row, prompt in enumerate(prompts):
            for k, (start, end) in enumerate(SPANS):
                spliced = prompt.clone()
                spliced[start:end] = model.config.pad_token_id
                attention = model(spliced[None], output_attentions=True).attentions[1][0, :, -1]  # (H, kv)
                torch.testing.assert_close(bias[row, :, k], attention[:, start:end].mean(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eos", [2, [5, 2]])
def test_without_a_pad_token_the_default_dummy_document_repeats_eos(eos):
    """Llama 3 and Mistral configs have no pad_token_id: the default dummy is the (first) eos repeated, the same as
    giving that document explicitly (every span of SPANS is 3 tokens long)."""
    model = sepformer.add_mitigations(tiny_llama(attn="eager"))
    model.config.pad_token_id, model.config.eos_token_id = None, eos
    first_eos = eos[0] if isinstance(eos, list) else eos
    ids = random_ids(1, 12)
    with torch.no_grad():
        default = model(ids, attention_calibration=AttentionCalibration(spans=(SPANS,), temperature=0.1)).logits
        explicit = AttentionCalibration(spans=(SPANS,), temperature=0.1, dummy_document=(first_eos,) * 3)
        torch.testing.assert_close(default, model(ids, attention_calibration=explicit).logits, rtol=0, atol=0)
        other = AttentionCalibration(spans=(SPANS,), temperature=0.1, dummy_document=(first_eos + 1,) * 3)
        assert not torch.equal(default, model(ids, attention_calibration=other).logits)
    model.config.pad_token_id = model.config.vocab_size  # a pad token outside the vocabulary is an error, not eos
    with pytest.raises(ValueError, match=re.escape(f"pad_token_id={model.config.vocab_size}, eos_token_id={eos}")):
        model(ids, attention_calibration=AttentionCalibration(spans=(SPANS,)))


def mean_document_reference(model, ids, layer, spans, **options):
    """`bias(k)` of the positional estimate, from its definition: a pass (with `options` on) in which `k_proj` of
    `layer` reads, for the tokens of document `k` only, their positional coordinates and the mean semantic
    coordinates of the documents' tokens; the attention of the last query on document `k` there. (K, H)"""
    d_pos = model.config.position_size
    in_documents = torch.zeros(ids.shape[1], dtype=torch.bool)
    for start, end in spans:
        in_documents[start:end] = True
    rows = []
    for start, end in spans:

        def mean_document(module, args, start=start, end=end):
            (key_input,) = args
            mean = key_input[:, in_documents, d_pos:].mean(1, keepdim=True)
            key_input = key_input.clone()
            key_input[:, start:end, d_pos:] = mean
            return (key_input,)

        handle = model.model.layers[layer].self_attn.k_proj.register_forward_pre_hook(mean_document)
        try:
            attention = model(ids, output_attentions=True, **options).attentions[layer][0, :, -1]  # (H, kv)
        finally:
            handle.remove()
        rows.append(attention[:, start:end].mean(-1))
    return torch.stack(rows)


def sharp_attention(model):
    """Strong positions and large query/key weights: peaked rows, where a wrong formula shows."""
    strong_positions(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.5)
            layer.self_attn.k_proj.weight.normal_(0, 0.5)
    return model


@pytest.mark.parametrize(
    "rotary_dim, other",
    [
        (0, {}),
        (4, {}),
        (4, {"ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(1,), head_order=(2, 0, 3, 1))}),
        (0, {"positional_scaling": PositionalScaling(0.5, channels=(1, 2, 20, 30), layers=(1,), skip_first=1)}),
    ],
)
def test_positional_bias_estimate_is_the_mean_documents_attention(rotary_dim, other):
    """Written from the definition (a k_proj input swapped per document), with the layer's other mitigations, on a
    row alone and left-padded, documents with a gap between them."""
    model = sharp_attention(tiny_model(rotary_dim=rotary_dim))
    model.set_attn_implementation("eager")
    ids = random_ids(2, 12)
    spans = ((1, 3), (4, 7), (7, 9))
    option = AttentionCalibration(spans=(spans,) * 2, layers=(1,), bias_estimate="positional")
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # row 1: two pads, then its own 10 tokens
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, attention_calibration=option, **other)
        bias = cache.mitigation_state["attention_calibration"].bias[1]  # (2, H, K)
        assert set(cache.mitigation_state["attention_calibration"].bias) == {1}
        torch.testing.assert_close(bias[0], mean_document_reference(model, ids[:1], 1, spans, **other).T)
        torch.testing.assert_close(bias[1], mean_document_reference(model, ids[1:, 2:], 1, spans, **other).T)
        attention = model(ids[:1], output_attentions=True, **other).attentions[1][0, :, -1]
    own = torch.stack([attention[:, a:b].mean(-1) for a, b in spans], -1)
    assert (bias[0] - own).abs().max() > 1e-2  # the estimate is not the documents' own attention


def test_positional_bias_closed_form_holds_on_peaked_rows():
    """One document far above the rest (logits 25 higher): the formula against float64, written out per document."""
    generator = torch.Generator().manual_seed(0)
    scores, dummy = torch.randn(1, 2, 12, generator=generator), torch.randn(1, 2, 12, generator=generator)
    scores[..., 3:6] += 25.0
    scores[..., 0] = float("-inf")  # a key the query may not attend (padding)
    dummy[..., 0] = 1e4  # whatever the dummy scores there, the key stays out
    documents = torch.zeros(1, 12, 3)
    documents[0, 1:3, 0], documents[0, 3:6, 1], documents[0, 8:11, 2] = 1, 1, 1
    dummy = dummy.masked_fill(scores == float("-inf"), float("-inf"))
    got = bias_from_positions(scores, dummy, KeyDocuments.of(documents))
    real, fake = scores.double().exp(), dummy.double().exp()
    for k in range(3):
        inside = documents[0, :, k].bool()
        expected = fake[..., inside].mean(-1) / (real[..., ~inside].sum(-1) + fake[..., inside].sum(-1))
        torch.testing.assert_close(got[..., k].double(), expected, rtol=1e-5, atol=0)


def test_positional_bias_is_measured_without_a_graph():
    model = tiny_model()
    option = AttentionCalibration(spans=(SPANS,), layers=(1,), bias_estimate="positional")
    cache = SepFormerCache(config=model.config)
    loss = model(random_ids(1, 12), past_key_values=cache, use_cache=True, attention_calibration=option).logits.sum()
    assert cache.mitigation_state["attention_calibration"].bias[1].grad_fn is None
    loss.backward()  # the calibrated row still carries gradients to the weights
    assert model.model.layers[1].self_attn.q_proj.weight.grad is not None


def test_bias_estimates_agree_when_every_document_is_the_dummy():
    """Documents made of the dummy's own token: a dummy pass re-runs the prompt unchanged and the mean document is
    every document, so both estimates are each document's own attention, in every layer."""
    model = strong_positions(tiny_model(num_hidden_layers=3))
    model.set_attn_implementation("eager")
    ids = random_ids(1, 12)
    ids[:, :9] = 7
    estimates = []
    for option in (
        AttentionCalibration(spans=(SPANS,), layers=(0, 1, 2), dummy_document=(7, 7, 7)),
        AttentionCalibration(spans=(SPANS,), layers=(0,), bias_estimate="positional"),
    ):
        cache = SepFormerCache(config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, attention_calibration=option)
        estimates.append(cache.mitigation_state["attention_calibration"].bias)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    for layer in (0, 1, 2):
        own = torch.stack([attentions[layer][0, :, -1, a:b].mean(-1) for a, b in SPANS], -1)
        torch.testing.assert_close(estimates[0][layer][0], own)
    torch.testing.assert_close(estimates[1][0][0], estimates[0][0][0])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_calibrated_decoding_step_returns_attentions_as_its_implementation_does(implementation):
    """A decoding step runs only the calibrated row: eager still returns it as the step's attention (equal to the last
    row of a full pass), sdpa returns none, as without calibration."""
    model = strong_positions(tiny_model(num_hidden_layers=3))
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 14)
    option = AttentionCalibration(spans=(SPANS,), temperature=0.01)
    with torch.no_grad():
        prefill = model(ids[:, :13], attention_calibration=option, use_cache=True)
        step = model(
            ids[:, 13:], past_key_values=prefill.past_key_values, attention_calibration=option, output_attentions=True
        )
    if implementation == "sdpa":
        assert step.attentions is None or all(weights is None for weights in step.attentions)
        return
    with torch.no_grad():
        model(ids[:, :13], attention_calibration=option)  # the same bias(k): measured on the same prompt
    for layer in (1, 2):
        assert step.attentions[layer].shape == (1, 4, 1, 14)
        torch.testing.assert_close(step.attentions[layer].sum(-1), torch.ones(1, 4, 1))


def test_a_decoding_step_under_autograd_computes_the_row_anew_and_backpropagates():
    """Without autograd the step's row is re-weighted in place; with it, softmax's backward reads its output, so the
    row is a new tensor: the same logits, and a backward pass through the step."""
    model = strong_positions(tiny_model(num_hidden_layers=3))
    ids = random_ids(1, 14)
    option = AttentionCalibration(spans=(SPANS,), temperature=0.01)
    steps = []
    for grad in (False, True):
        with torch.no_grad():
            cache = model(ids[:, :13], attention_calibration=option, use_cache=True).past_key_values
        with torch.set_grad_enabled(grad):
            steps.append(model(ids[:, 13:], past_key_values=cache, attention_calibration=option).logits)
    torch.testing.assert_close(steps[1].detach(), steps[0])  # without autograd the step also fuses its projections
    steps[1].logsumexp(-1).sum().backward()
    value_weight = model.model.layers[-1].self_attn.v_proj.semantic.weight  # reached through the calibrated row
    assert value_weight.grad is not None and value_weight.grad.isfinite().all() and value_weight.grad.abs().sum() > 0


def test_the_dummy_passes_of_a_causal_lm_compute_one_row_of_logits():
    """Only the dummy passes' attention is read: their LM head runs on one row (a 262k vocabulary's head over every
    row of every dummy sequence cost Gemma 3 as much as its layers)."""
    model = sepformer.add_mitigations(tiny_llama())
    rows = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: rows.append(tuple(output.shape[:2])))
    with torch.no_grad():
        model(random_ids(1, 12), attention_calibration=AttentionCalibration(spans=(SPANS,)))
    assert rows == [(len(SPANS), 1), (1, 12)]  # the dummy passes, then the call's own
