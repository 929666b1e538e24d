"""Behaviour the rest of the suite leaves loose, pinned through the public API against references written here.

Fresh weights (std 0.02) hide most of what the mitigations do behind differences of ~1e-6 in the logits, so the
models here get a positional table of std 1 and larger attention and head weights; every comparison is made with a
tolerance well below the effect it checks, and the effect itself is asserted.
"""

import copy

import pytest
import torch
from conftest import logits, random_ids, tiny_model

from sepformer import AttentionCalibration, MSPoE, PositionalScaling, SepFormerCache, StableMask
from sepformer.mitigations import KeyDocuments, calibrate_row
from sepformer.positional_maps import fourier_rows

PAD = 256  # the tiny config's pad_token_id
LOGITS = dict(rtol=1e-5, atol=1e-4)  # logits of scale 10 here: float32 noise ~1e-5, the effects checked > 1e-2


def strong_model(seed=0, query_key_std=0.35, **overrides):
    """`tiny_model` whose positions and attention matter: table rows of std 1, query/key weights of std
    `query_key_std`, value/output and LM-head weights of std 0.5."""
    model = tiny_model(seed, **overrides)
    with torch.no_grad():
        if model.config.position_size > 0 and model.config.positional_map == "learned":
            model.model.embed_positions.weight.normal_(0, 1)
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection, std in (
                (attention.q_proj, query_key_std),
                (attention.k_proj, query_key_std),
                (attention.v_proj, 0.5),
                (attention.o_proj, 0.5),
            ):
                for name, parameter in projection.named_parameters():
                    if name.endswith("weight"):
                        parameter.normal_(0, std)
        model.lm_head.weight.normal_(0, 0.5)
    return model


def eager(model):
    model.set_attn_implementation("eager")
    return model


# ----------------------------------------------------------------------------------------------- MS-PoE: the ranking


def awareness_order(row):
    """Heads from most to least position-aware by `S_P = (1/l) Σ_i 1(A_i >= 3 · mean(A))` of one attention row
    (H, l) over unpadded keys, ties broken by head index; and the smallest distance of an `A_i` to its threshold."""
    threshold = 3 * row.mean(-1, keepdim=True)
    scores = (row >= threshold).float().mean(-1)
    order = sorted(range(row.shape[0]), key=lambda head: (-scores[head].item(), head))
    return tuple(order), scores, (row - threshold).abs().min().item()


def test_ms_poe_gives_the_smallest_ratio_to_the_most_position_aware_head():
    """Ranked MS-PoE (layer 1) equals MS-PoE with the fixed order the S_P scores of the base model give, per batch
    row; the reversed order gives other logits."""
    model = eager(strong_model())
    candidates = random_ids(48, 32, seed=1)
    with torch.no_grad():
        attention = model(candidates, output_attentions=True).attentions[1][:, :, -1]  # (b, H, kv): layer 1, last query
    chosen = {}  # two prompts whose heads are clearly ranked (>= 3 distinct scores), in different orders
    for index in range(len(candidates)):
        order, scores, margin = awareness_order(attention[index])
        if len(set(scores.tolist())) >= 3 and margin > 1e-4 and order not in chosen.values():
            chosen[index] = order
        if len(chosen) == 2:
            break
    assert len(chosen) == 2, "no two prompts with clearly ranked heads among the candidates"
    ids = candidates[list(chosen)]
    option = dict(r_min=1.0, r_max=3.0, layers=(1,))
    ranked = logits(model, ids, ms_poe=MSPoE(**option))
    for row, order in enumerate(chosen.values()):
        fixed = logits(model, ids[row : row + 1], ms_poe=MSPoE(**option, head_order=order))
        backwards = logits(model, ids[row : row + 1], ms_poe=MSPoE(**option, head_order=order[::-1]))
        torch.testing.assert_close(ranked[row : row + 1], fixed, **LOGITS)
        assert (backwards - fixed).abs().max() > 1e-2


@pytest.mark.parametrize(("num_layers", "untouched"), [(2, 1), (4, 2), (6, 2)])
def test_ms_poe_default_layers_leave_the_first_two_alone(num_layers, untouched):
    """`layers=None` is every layer but the first `min(2, num_layers // 2)`: the hidden states after those equal the
    base model's bit for bit, the next layer's differ, and the logits are those of the explicit layer list."""
    model = strong_model(num_hidden_layers=num_layers)
    ids = random_ids(2, 16)
    option = dict(r_min=1.0, r_max=3.0, head_order=(2, 0, 3, 1))
    with torch.no_grad():
        base = model(ids, output_hidden_states=True)
        ours = model(ids, output_hidden_states=True, ms_poe=MSPoE(**option))
    for layer in range(untouched):
        assert torch.equal(ours.hidden_states[layer + 1], base.hidden_states[layer + 1]), layer
    assert (ours.hidden_states[untouched + 1] - base.hidden_states[untouched + 1]).abs().max() > 1e-2
    explicit = MSPoE(**option, layers=tuple(range(untouched, num_layers)))
    assert torch.equal(ours.logits, logits(model, ids, ms_poe=explicit))


# ------------------------------------------------------------------------------------------------ Fourier extension


def fourier_reference(table, positions, components):
    """Each dimension keeps its `components` largest coefficients of the real DFT (by modulus); the rest are zeroed
    and the inverse DFT of length L, periodic, is read at `positions`."""
    length = table.shape[0]
    spectrum = torch.fft.rfft(table.double(), dim=0)
    keep = spectrum.abs().argsort(dim=0, descending=True)[:components]
    kept = torch.zeros_like(spectrum).scatter(0, keep, spectrum.gather(0, keep))
    return torch.fft.irfft(kept, n=length, dim=0)[positions % length]


@pytest.mark.parametrize("length", [15, 16])
@pytest.mark.parametrize("components", ["all", 3])
def test_fourier_rows_equal_the_inverse_dft_for_odd_and_even_lengths(length, components):
    """With every coefficient the rows at 0..L-1 are the table, for odd L too (no Nyquist term there); with K
    coefficients the rows are the inverse DFT of the K largest, periodic past L."""
    table = torch.randn(length, 6, generator=torch.Generator().manual_seed(length))
    k = length // 2 + 1 if components == "all" else components
    positions = torch.arange(3 * length)
    got = fourier_rows(table, positions, k)
    torch.testing.assert_close(got.double(), fourier_reference(table, positions, k), rtol=1e-4, atol=1e-5)
    if components == "all":
        torch.testing.assert_close(got[:length], table, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------- positional scaling


def rotary_reference(x, positions, rotary_dim, theta):
    """Llama's half-split rotary embedding of the first `rotary_dim` dimensions of each head: x (b, H, n, head_dim)."""
    inverse_frequencies = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    angles = positions[:, None].float() * inverse_frequencies  # (n, rotary_dim / 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    head, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-head[..., half:], head[..., :half]), -1)
    return torch.cat((head * cos + rotated_half * sin, rest), -1)


def scaling_reference(model, ids, option, prompt_length=None):
    """The model written out with positional scaling (arXiv 2406.02536) when the first `prompt_length` tokens (all by
    default) are a prompt and every later token is decoded one at a time.

    `f(h)` multiplies channels `c` of a layer's normed input by `s` at positions `>= skip_first`. In a scaled layer
    row `i` is "recomputed" when `i >= prompt_length - last_recompute_tokens` (the prompt's last rows, and every
    decoded token): it attends with `q̄_i = W_Q f(h_i)` to `K̄_j = W_K f(h_j)`, `j <= i`; any other row with `q_i`, `K_j`
    unscaled. Values are never scaled. Returns the logits of every row."""
    config, table = model.config, model.model.embed_positions.weight
    batch, n = ids.shape
    heads, d_pos, head_dim = config.num_attention_heads, config.position_size, config.head_dim
    prompt_length = n if prompt_length is None else prompt_length
    positions = torch.arange(n)
    channels = list(option.channels if option.channels is not None else range(d_pos))
    scale = torch.ones(n, config.hidden_size)
    scale[:, channels] = option.factor
    scale[positions < option.skip_first] = 1.0
    recomputed = (positions >= prompt_length - option.last_recompute_tokens)[:, None]  # (n, 1): rows reading q̄, K̄
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)

    def project(attention, x):  # (b, n, d) -> queries and keys (b, H, n, head_dim), rotary applied
        split = lambda y: y.view(batch, n, heads, head_dim).transpose(1, 2)  # noqa: E731
        q, k = split(attention.q_proj(x)), split(attention.k_proj(x))
        if config.rotary_dim:
            q, k = (rotary_reference(y, positions, config.rotary_dim, config.rope_theta) for y in (q, k))
        return q, k

    hidden = torch.cat((table[:n].expand(batch, -1, -1), model.model.embed_tokens(ids)), -1)
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        q, k = project(attention, normed)
        scores = q @ k.transpose(2, 3)
        if index in option.layer_set(config.num_hidden_layers):
            q_bar, k_bar = project(attention, normed * scale)
            scores = torch.where(recomputed, q_bar @ k_bar.transpose(2, 3), scores)
        v = attention.v_proj(normed).view(batch, n, heads, head_dim).transpose(1, 2)
        probs = (scores / head_dim**0.5).masked_fill(causal, float("-inf")).softmax(-1)
        hidden = hidden + attention.o_proj((probs @ v).transpose(1, 2).reshape(batch, n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden)[..., d_pos:])


SCALINGS = [
    PositionalScaling(factor=-0.5, layers=(1,)),
    PositionalScaling(factor=0.0, layers=(0, 2), last_recompute_tokens=4),
    PositionalScaling(factor=-1.0, channels=(1, 3, 20), layers=(1, 2), skip_first=3, last_recompute_tokens=2),
]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("option", SCALINGS, ids=["last_row", "four_rows", "channels_skip_first"])
def test_positional_scaling_prefill_equals_the_formula(option, attn):
    """A full pass equals the written-out model: rows before the last `last_recompute_tokens` are the base model's
    (bit for bit), the last ones change; the value cache is the base model's."""
    model = strong_model(num_hidden_layers=3, rotary_dim=4)
    model.set_attn_implementation(attn)
    ids = random_ids(2, 12)
    cache, base_cache = SepFormerCache(config=model.config), SepFormerCache(config=model.config)
    with torch.no_grad():
        ours = model(ids, past_key_values=cache, use_cache=True, positional_scaling=option).logits
        base = model(ids, past_key_values=base_cache, use_cache=True).logits
        reference = scaling_reference(model, ids, option)
    torch.testing.assert_close(ours, reference, **LOGITS)
    kept = 12 - option.last_recompute_tokens
    assert torch.equal(ours[:, :kept], base[:, :kept])
    assert (ours - base)[:, kept:].abs().amax((0, 2)).min() > 1e-2  # every recomputed row changes
    for layer in range(3):
        assert torch.equal(cache.layers[layer].values[:, :, :kept], base_cache.layers[layer].values[:, :, :kept])


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "biases"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("option", SCALINGS, ids=["last_row", "four_rows", "channels_skip_first"])
def test_positional_scaling_decoding_steps_follow_the_method_not_the_full_pass(option, attn, bias):
    """A prefill of 10 tokens then 4 decoding steps equals the written-out model in which each decoded token attends
    with its scaled query to the scaled keys of every earlier token (those of the prompt too, as the cache holds them);
    that is not the full forward pass of the final sequence, which the test shows. A continuing call of several
    tokens gives what as many one-token steps give. With biases, `W_Q f(h) + b_Q`: the factor never reaches `b`."""
    model = strong_model(num_hidden_layers=3, rotary_dim=4, attention_bias=bias)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    model.set_attn_implementation(attn)
    ids = random_ids(2, 14, seed=1)
    ours = prefill_and_steps(model, ids, 10, positional_scaling=option)
    with torch.no_grad():
        reference = scaling_reference(model, ids, option, prompt_length=10)
        full = logits(model, ids, positional_scaling=option)
    torch.testing.assert_close(ours, reference, **LOGITS)
    assert (ours - full)[:, 10:].abs().max() > 1e-2
    cache = SepFormerCache(config=model.config)  # a continuing call of several tokens is that many decoding steps
    with torch.no_grad():
        model(ids[:, :10], past_key_values=cache, use_cache=True, positional_scaling=option)
        chunk = model(ids[:, 10:], past_key_values=cache, use_cache=True, positional_scaling=option).logits
    torch.testing.assert_close(chunk, ours[:, 10:], **LOGITS)


# ---------------------------------------------------------------------------------------------- attention calibration

SPANS = ((0, 4), (5, 9), (10, 14))


def document_membership(length, spans):
    """(1, length, K) one-hot: which document each key belongs to."""
    documents = torch.zeros(1, length, len(spans))
    for k, (start, end) in enumerate(spans):
        documents[0, start:end, k] = 1
    return documents


def dummy_bias(model, ids, spans, layer, **options):
    """`bias(k)` by hand: document `k` replaced by pad tokens, the mean attention the last token of `layer` gives
    them, per head: (1, H, K). `options`: the other mitigations of the call."""
    bias = []
    for start, end in spans:
        spliced = ids.clone()
        spliced[:, start:end] = PAD
        with torch.no_grad():
            row = model(spliced, output_attentions=True, **options).attentions[layer][:, :, -1]  # (1, H, kv)
        bias.append(row[..., start:end].mean(-1))
    return torch.stack(bias, -1)


def calibrated_last_logits(model, ids, spans, bias, temperature, **options):
    """The last token's logits with the last layer's last attention row calibrated, by hand: the uncalibrated pass
    (with `options`) gives that layer's input and row; the row goes through `calibrate_row`, the rest is written out."""
    layer, d_pos = model.model.layers[-1], model.config.position_size
    with torch.no_grad():
        output = model(ids, output_attentions=True, output_hidden_states=True, **options)
        hidden = output.hidden_states[-2]  # the last layer's input
        values = layer.self_attn.v_proj(layer.input_layernorm(hidden))
        values = values.view(*ids.shape, model.config.num_attention_heads, -1)  # (1, kv, H, head_dim)
        documents = KeyDocuments.of(document_membership(ids.shape[1], spans))
        row = calibrate_row(output.attentions[-1][:, :, -1], documents, bias, temperature)
        attended = torch.einsum("bhk,bkhd->bhd", row, values).flatten(1)
        last = hidden[:, -1] + layer.self_attn.o_proj(attended)
        last = last + layer.mlp(layer.post_attention_layernorm(last))
        return model.lm_head(model.model.norm(last)[..., d_pos:])


def test_calibration_acts_at_decoding_steps():
    """A decoding step's logits are those of its last attention row calibrated with the bias(k) measured at
    prefill, and differ from the uncalibrated step."""
    model = eager(strong_model())
    prompt, new = random_ids(1, 16), random_ids(1, 2, seed=1)
    option = AttentionCalibration(spans=(SPANS,), temperature=1e-2, layers=(1,))
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True, attention_calibration=option)
        steps = [
            model(new[:, t : t + 1], past_key_values=cache, use_cache=True, attention_calibration=option).logits
            for t in range(2)
        ]
    bias = dummy_bias(model, prompt, SPANS, layer=1)
    for t, step in enumerate(steps):
        ids = torch.cat((prompt, new[:, : t + 1]), 1)
        torch.testing.assert_close(step[:, -1], calibrated_last_logits(model, ids, SPANS, bias, 1e-2), **LOGITS)
        assert (step[:, -1] - logits(model, ids)[:, -1]).abs().max() > 1e-2


OTHER_OPTIONS = {
    "ms_poe_fixed": {"ms_poe": MSPoE(r_min=1.0, r_max=3.0, layers=(0,), head_order=(2, 0, 3, 1))},
    "ms_poe_ranked": {"ms_poe": MSPoE(r_min=1.0, r_max=3.0, layers=(0,))},
    "scaling": {"positional_scaling": PositionalScaling(factor=-0.5, layers=(0,))},
}


@pytest.mark.parametrize("name", sorted(OTHER_OPTIONS))
def test_calibration_measures_bias_with_the_other_mitigations_on(name):
    """bias(k) comes from dummy passes with the call's other mitigations (here in layer 0): the calibrated logits
    equal the hand reference whose dummy passes have them, and not the one whose dummy passes do not."""
    model = eager(strong_model())
    ids = random_ids(1, 16)
    others = OTHER_OPTIONS[name]
    option = AttentionCalibration(spans=(SPANS,), temperature=1e-2, layers=(1,))
    ours = logits(model, ids, attention_calibration=option, **others)[:, -1]
    with_others = calibrated_last_logits(model, ids, SPANS, dummy_bias(model, ids, SPANS, 1, **others), 1e-2, **others)
    without = calibrated_last_logits(model, ids, SPANS, dummy_bias(model, ids, SPANS, 1), 1e-2, **others)
    torch.testing.assert_close(ours, with_others, **LOGITS)
    assert (with_others - without).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ decoding, training


def test_a_new_generation_follows_a_projection_weight_swapped_through_data():
    """A projection weight replaced through `.data` (no version counter moves) after a generation: the next generation
    decodes with the new weight, as a model without fused decoding projections does; within one generation the fused
    weights are those of its first decoding step."""
    fused = strong_model()
    unfused = copy.deepcopy(fused)
    unfused.config.fuse_decoding_projections = False
    assert fused.config.fuse_decoding_projections  # the default
    ids = random_ids(2, 12)

    def decoding_steps(model):
        cache = SepFormerCache(config=model.config)
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        return torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(8, 12)])

    with torch.no_grad():
        before = decoding_steps(fused)
        for model in (fused, unfused):
            query = model.model.layers[0].self_attn.q_proj
            query.weight.data = query.weight.flip(0) * 2
        after = {model: decoding_steps(model) for model in (fused, unfused)}
    torch.testing.assert_close(after[fused], after[unfused], **LOGITS)
    assert (after[fused] - before).abs().max() > 1e-2


def test_random_position_offsets_shift_about_half_the_rows():
    """Training with `random_position_offsets`: every row reads consecutive table rows from its offset, and about
    half the rows keep offset 0 (inference starts there) while the others are spread over the table."""
    length, rows = 16, 200
    model = tiny_model(
        max_position_embeddings=length, position_table_size=4 * length, random_position_offsets=True, hidden_dropout=0.0
    )
    model.train()
    table = model.model.embed_positions.weight.detach()
    torch.manual_seed(0)
    with torch.no_grad():
        positional = model(random_ids(rows, length), output_hidden_states=True).hidden_states[0]
    positional = positional[..., : model.config.position_size]
    offsets = []
    for row in positional:
        matches = (table == row[0]).all(-1).nonzero().flatten()
        assert len(matches) == 1
        offset = matches.item()
        assert torch.equal(row, table[offset : offset + length])
        offsets.append(offset)
    offsets = torch.tensor(offsets)
    assert 0.35 < (offsets == 0).float().mean() < 0.65
    assert len(offsets.unique()) > 20 and offsets.max() > 2 * length


# ------------------------------------------------------------------------------------ every option: bfloat16, padding

OPTIONS = {
    "none": {},
    "stable_mask": {"stable_mask": StableMask(gamma=0.2, columns=12)},  # rows past N = 12 get no sink
    "ms_poe_ranked": {"ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1))},
    "ms_poe_fixed": {"ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1), head_order=(2, 0, 3, 1))},
    "calibration": {"attention_calibration": AttentionCalibration(spans=(SPANS,), temperature=1e-2, layers=(0, 1))},
    "scaling": {"positional_scaling": PositionalScaling(factor=-0.5, layers=(0, 1))},
    "scaling_rows": {"positional_scaling": PositionalScaling(-1.0, layers=(1,), skip_first=2, last_recompute_tokens=3)},
}


def with_rows(options, spans):
    """`options` with calibration spans for each row of the batch."""
    if "attention_calibration" not in options:
        return options
    calibration = options["attention_calibration"]
    return {
        "attention_calibration": AttentionCalibration(
            spans=spans, temperature=calibration.temperature, layers=calibration.layers
        )
    }


def prefill_and_steps(model, ids, prompt_length, attention_mask=None, **options):
    """Logits of a prefill of `prompt_length` tokens, then of one decoding step per remaining token."""
    cache = SepFormerCache(config=model.config)
    mask = lambda end: None if attention_mask is None else attention_mask[:, :end]  # noqa: E731
    with torch.no_grad():
        steps = [
            model(
                ids[:, :prompt_length],
                attention_mask=mask(prompt_length),
                past_key_values=cache,
                use_cache=True,
                **options,
            ).logits
        ]
        for t in range(prompt_length, ids.shape[1]):
            steps.append(
                model(
                    ids[:, t : t + 1], attention_mask=mask(t + 1), past_key_values=cache, use_cache=True, **options
                ).logits
            )
    return torch.cat(steps, 1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_bfloat16_logits_are_finite_and_near_float32(name, attn):
    """Prefill and decoding steps in bfloat16 give finite logits within 10% of the logit scale of float32's."""
    model = strong_model(rotary_dim=4, query_key_std=0.2)
    model.set_attn_implementation(attn)
    half = copy.deepcopy(model).to(torch.bfloat16)
    ids = random_ids(2, 20)
    options = with_rows(OPTIONS[name], (SPANS,) * 2)
    reference = prefill_and_steps(model, ids, 16, **options)
    ours = prefill_and_steps(half, ids, 16, **options).float()
    assert torch.isfinite(ours).all()
    assert (ours - reference).abs().max() < 0.1 * reference.abs().max()


ROW_SPANS = (((0, 3), (3, 6), (6, 9)), ((1, 4), (5, 8), (9, 13)), ((0, 5), (6, 10), (12, 17)))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_left_padded_batch_logits_equal_each_row_alone(name, attn):
    """Rows of 10, 14 and 19 prompt tokens, left-padded into one batch: the logits of the prefill (at every real
    token) and of two decoding steps are those of each row run alone; the option changes them by more than 1e-2."""
    model = strong_model(rotary_dim=4)
    model.set_attn_implementation(attn)
    lengths, steps = (10, 14, 19), 2
    width = max(lengths) + steps
    ids = random_ids(len(lengths), width, seed=3)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        mask[row, : max(lengths) - length] = 0
        ids[row, : max(lengths) - length] = PAD
    together = prefill_and_steps(model, ids, max(lengths), attention_mask=mask, **with_rows(OPTIONS[name], ROW_SPANS))
    base = prefill_and_steps(model, ids, max(lengths), attention_mask=mask)
    if name != "none":
        assert (together - base)[mask.bool()].abs().max() > 1e-2
    for row, length in enumerate(lengths):
        alone_ids = ids[row : row + 1, max(lengths) - length :]
        alone = prefill_and_steps(model, alone_ids, length, **with_rows(OPTIONS[name], ROW_SPANS[row : row + 1]))
        torch.testing.assert_close(together[row : row + 1, max(lengths) - length :], alone, **LOGITS)
