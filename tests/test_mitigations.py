"""Position-bias mitigations, checked against formulas written from the papers, independently of the code."""

import dataclasses
import math

import pytest
import torch
from conftest import logits, random_ids, tiny_model
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AttentionInterface
from transformers.models.llama.modeling_llama import rotate_half

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    SepFormerCache,
    SepFormerConfig,
    SepFormerForCausalLM,
    SepFormerTokenizer,
    StableMask,
)
from sepformer.attention_calibration import bias_from_positions
from sepformer.mitigation_options import REFUSED_TOGETHER, SAME_LAYERS_ONLY
from sepformer.mitigations import (
    KeyDocuments,
    calibrate_row,
    fixed_head_ranks,
    head_ratios,
    position_awareness,
)
from sepformer.stable_mask import StableMaskMitigation, sink_logits

SPANS = ((0, 3), (3, 6), (6, 9))
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


def paper_ratios(option, num_heads):
    """`r_i = r_min + (i-1)(r_max - r_min)/(H-1)` for ranks i = 1..H, written out."""
    step = (option.r_max - option.r_min) / max(num_heads - 1, 1)
    return torch.tensor([option.r_min + i * step for i in range(num_heads)], dtype=torch.float64)


def strong_positions(model):
    """A fresh table has rows of std 0.02, too small to move anything: make positions matter."""
    with torch.no_grad():
        model.model.embed_positions.weight.normal_(0, 1)
    return model


# ------------------------------------------------------------------------------------------------------- StableMask


@pytest.mark.parametrize("gamma", [0.01, 0.3, 2.0])
def test_sink_logit_closed_form_equals_the_explicit_sum(gamma):
    length = 20
    tau = sink_logits(StableMask(gamma=gamma, columns=length), torch.arange(25), default_columns=99)
    for t in range(1, 26):  # t = position + 1
        terms = [math.exp(-gamma * (j - 1)) for j in range(t + 1, length + 1)]
        expected = math.log(sum(terms)) if terms else -math.inf
        assert tau[t - 1].item() == pytest.approx(expected, rel=1e-5, abs=1e-5), t


def test_a_billion_columns_cost_only_the_positions_read():
    """`τ_t` depends on `t` and `N` only: `N = 10⁹` builds nothing over the columns (a table of them took 8 GB per
    float64 temporary and the process was killed)."""
    gamma, columns = 0.01, 10**9
    positions = [0, 5, 1000, columns - 2, columns - 1, columns, 2 * columns]
    tau = sink_logits(StableMask(gamma, columns=columns), torch.tensor([positions]), default_columns=64)[0]
    for position, got in zip(positions, tau.tolist(), strict=True):
        t = position + 1
        expected = -math.inf
        if t < columns:
            expected = -gamma * t + math.log(-math.expm1(-gamma * (columns - t))) - math.log(-math.expm1(-gamma))
        assert got == pytest.approx(expected, rel=1e-6), position
    model = tiny_model()
    ids = random_ids(2, 12)
    # e^{-γ(N - t)} is below float32's resolution for N = 10⁴ already: the same sink logits as N = 10⁹
    billion = logits(model, ids, stable_mask=StableMask(gamma, columns=columns))
    torch.testing.assert_close(billion, logits(model, ids, stable_mask=StableMask(gamma, columns=10**4)))
    assert not torch.allclose(billion, logits(model, ids), atol=1e-4)


def dense_stable_mask(gamma, length):
    """`softmax(A ⊙ C + P) ⊙ C` over `N` columns, `P_ij = -γ(j-1)` for `j > i` (1-indexed), as an attention function
    for an unpadded full forward pass."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        seq = query.shape[2]
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (b, H, seq, seq): A
        i = torch.arange(1, seq + 1)[:, None]
        j = torch.arange(1, length + 1)[None]
        causal = (j <= i).float()  # (seq, N): C
        pseudo = torch.where(j > i, -gamma * (j - 1.0), 0.0)  # P
        masked = torch.zeros(*scores.shape[:3], length)
        masked[..., :seq] = scores
        probs = torch.softmax(masked * causal + pseudo, -1) * causal  # (b, H, seq, N)
        probs = probs[..., :seq]
        return torch.matmul(probs, value).transpose(1, 2), probs

    return attention


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 4}, {"position_size": 0}])
def test_stable_mask_equals_dense_reference(overrides):
    gamma, length = 0.3, 24
    model = tiny_model(**overrides)
    ids = random_ids(2, 16)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ours = model(ids, stable_mask=StableMask(gamma, length), output_attentions=True)
    AttentionInterface.register("dense_stable_mask", dense_stable_mask(gamma, length))
    model.set_attn_implementation("dense_stable_mask")
    with torch.no_grad():
        reference = model(ids, output_attentions=True)
    torch.testing.assert_close(ours.logits, reference.logits, rtol=1e-5, atol=1e-5)
    for got, expected in zip(ours.attentions, reference.attentions, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert (got.sum(-1) < 1).all()  # the pseudo-columns take mass from every row before N


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_very_large_gamma_is_the_base_model(attn):
    model = tiny_model(rotary_dim=4)
    model.set_attn_implementation(attn)
    ids = random_ids(2, 12)
    torch.testing.assert_close(logits(model, ids, stable_mask={"gamma": 1e4}), logits(model, ids), rtol=0, atol=1e-6)


def test_stable_mask_sdpa_equals_eager_with_padding_and_past_the_pseudo_columns():
    model = tiny_model()
    ids = random_ids(3, 20)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    option = StableMask(gamma=0.1, columns=12)  # rows at t >= 12 get no sink
    model.set_attn_implementation("eager")
    eager = logits(model, ids, attention_mask=mask, stable_mask=option)
    model.set_attn_implementation("sdpa")
    sdpa = logits(model, ids, attention_mask=mask, stable_mask=option)
    unpadded = logits(model, ids, stable_mask=option)  # sdpa's causal path: no mask at all
    real = mask.bool()
    torch.testing.assert_close(eager[real], sdpa[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpadded[[0, 2]], sdpa[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unpadded, logits(model, ids), atol=1e-3)


def test_stable_mask_from_the_config_trains_and_round_trips(tmp_path):
    model = tiny_model(stable_mask={"gamma": 0.1})
    model.train()
    ids = random_ids(4, 16)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    assert torch.equal(logits(model, ids), logits(model, ids, stable_mask=StableMask(0.1)))
    model.save_pretrained(tmp_path)
    reloaded = SepFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.stable_mask == {"gamma": 0.1}
    assert torch.equal(logits(reloaded, ids), logits(model, ids))


def test_stable_mask_in_training_with_random_position_offsets_reads_the_absolute_position(monkeypatch):
    """`random_position_offsets` shifts where the table is read (here past N), not where a row is in its sequence: τ
    is taken at positions 0..n-1, so StableMask stays on for shifted rows."""
    model = tiny_model(position_table_size=256, random_position_offsets=True).train()
    shifted = lambda position_ids, batch: position_ids + 100  # noqa: E731  every row read past N = 64
    monkeypatch.setattr(model.model.embed_positions, "training_positions", shifted)
    started, start = [], StableMaskMitigation.start

    def recorded_start(self, run):
        started.append(start(self, run))
        return started[-1]

    monkeypatch.setattr(StableMaskMitigation, "start", recorded_start)
    ids = random_ids(2, 12)
    option = StableMask(gamma=0.3)
    with torch.no_grad():
        on, off = logits(model, ids, stable_mask=option), logits(model, ids, stable_mask=False)
    expected = sink_logits(option, torch.arange(12)[None], model.config.max_position_embeddings)
    torch.testing.assert_close(started[0].sink_logits[:, 0, :, 0], expected)
    assert torch.isfinite(started[0].sink_logits).all()
    assert (on - off).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------------------- MS-PoE


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 4}, {"position_size": 0, "rotary_dim": 8}])
@pytest.mark.parametrize("head_order", [None, (3, 1, 0, 2)])
def test_ms_poe_with_all_ratios_one_is_the_base_model_bit_for_bit(overrides, head_order):
    model = tiny_model(**overrides)
    ids = random_ids(2, 14)
    option = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=head_order)
    assert torch.equal(logits(model, ids, ms_poe=option), logits(model, ids))


def test_position_awareness_counts_keys_over_three_times_the_mean():
    probs = torch.tensor([[[0.7, 0.1, 0.1, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]]])  # (1, 2 heads, 5 keys)
    valid = torch.tensor([[[True, True, True, True, False]]])  # l = 4, mean 0.25, threshold 0.75 ... and 3/4
    torch.testing.assert_close(position_awareness(probs, valid), torch.tensor([[0.0, 0.0]]))
    probs[0, 0] = torch.tensor([0.8, 0.1, 0.05, 0.05, 0.0])
    torch.testing.assert_close(position_awareness(probs, valid), torch.tensor([[0.25, 0.0]]))


def test_ratios_are_monotone_in_the_score_with_the_papers_semantics():
    option = MSPoE(r_min=1.2, r_max=1.8)
    scores = torch.rand(5, 7, generator=torch.Generator().manual_seed(0))
    ratios = head_ratios(option, scores)
    for row_scores, row_ratios in zip(scores, ratios, strict=True):
        order = torch.argsort(row_scores, descending=True)
        assert torch.all(row_ratios[order].diff() > 0)  # more position-aware -> smaller ratio
        torch.testing.assert_close(row_ratios.sort().values, paper_ratios(option, 7))
    # heads 1 and 3 tie (head 1 first); the authors' code would give head i the ratio of rank order[i] instead
    ratios = head_ratios(option, torch.tensor([[0.1, 0.5, 0.3, 0.5]]))
    torch.testing.assert_close(ratios, torch.tensor([[1.8, 1.2, 1.6, 1.4]], dtype=torch.float64))
    order = torch.tensor([1, 3, 2, 0])
    assert not torch.equal(paper_ratios(option, 4)[order], ratios[0])
    fixed = MSPoE(head_order=(1, 3, 2, 0))
    assert torch.equal(paper_ratios(fixed, 4)[fixed_head_ranks(fixed, 4)], ratios[0])


def ms_poe_reference_logits(model, ids, option, positions=None):
    """A one-layer model written out head by head: head `h` reads `[p(m / r_h) ‖ s]` and rotates by `m / r_h`;
    values (and the residual) keep `p(m)`. `positions`: where the table is read (default `m`; compressed under
    `interpolate` past the table)."""
    cfg, layer = model.config, model.model.layers[0]
    attn, heads, head_dim = layer.self_attn, cfg.num_attention_heads, cfg.head_dim
    seq = ids.shape[1]
    ratios = paper_ratios(option, heads)[fixed_head_ranks(option, heads)].float()
    table = model.model.embed_positions.weight
    tokens = model.model.embed_tokens(ids)

    def rows(positions):  # linear interpolation between table rows
        low = positions.floor().long()
        weight = (positions - low)[:, None]
        return table[low] * (1 - weight) + table[(low + 1).clamp(max=table.shape[0] - 1)] * weight

    coordinates = torch.arange(seq).float() if positions is None else positions
    base = torch.cat((rows(coordinates)[None].expand(ids.shape[0], -1, -1), tokens), -1)
    values = attn.v_proj(layer.input_layernorm(base)).view(*ids.shape, heads, head_dim)
    outputs = []
    for h in range(heads):
        normed = layer.input_layernorm(
            torch.cat((rows(coordinates / ratios[h])[None].expand(ids.shape[0], -1, -1), tokens), -1)
        )
        q = attn.q_proj(normed).view(*ids.shape, heads, head_dim)[:, :, h]  # (b, seq, head_dim)
        k = attn.k_proj(normed).view(*ids.shape, heads, head_dim)[:, :, h]
        if cfg.rotary_dim:
            inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2).float() / cfg.rotary_dim)
            angles = (torch.arange(seq) / ratios[h])[:, None] * inv_freq
            cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
            r = cfg.rotary_dim
            q = torch.cat((q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]), -1)
            k = torch.cat((k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]), -1)
        scores = (q @ k.transpose(1, 2)) * head_dim**-0.5
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        outputs.append(scores.softmax(-1) @ values[:, :, h])
    hidden = base + attn.o_proj(torch.cat(outputs, -1))
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden)[..., cfg.position_size :])


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 4}])
def test_ms_poe_equals_a_head_by_head_reference(overrides):
    model = strong_positions(tiny_model(num_hidden_layers=1, **overrides))
    ids = random_ids(2, 12)
    option = MSPoE(r_min=1.3, r_max=2.5, layers=(0,), head_order=(2, 0, 3, 1))
    with torch.no_grad():
        reference = ms_poe_reference_logits(model, ids, option)
    ours = logits(model, ids, ms_poe=option)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
    assert (ours - logits(model, ids)).abs().max() > 1e-4  # the ratios did something


def test_ms_poe_reads_the_weights_of_each_call():
    """The positional columns of W_q and W_k that MS-PoE multiplies by are laid out per head once per generation; a
    later call reads the weights as they are, also after a write through `.data` (PEFT's merge), which moves no
    version counter."""
    model = strong_positions(tiny_model())
    ids = random_ids(2, 12)
    option = MSPoE(layers=(1,))
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        before = model(ids, ms_poe=option).logits
        attention.q_proj.weight.data.mul_(2.0)
        after = model(ids, ms_poe=option).logits
    assert not torch.equal(after, before)
    fresh = type(model)(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(after, fresh(ids, ms_poe=option).logits)


def test_ms_poe_ranking_is_made_at_prefill_and_kept():
    model = strong_positions(tiny_model(rotary_dim=4))
    ids = random_ids(2, 12)
    option = MSPoE(layers=(1,))
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, ms_poe=option)
        ranked = cache.mitigation_state["ms_poe"].ranks[1].clone()
        model(ids[:, :1], past_key_values=cache, use_cache=True, ms_poe=option)
    assert torch.equal(cache.mitigation_state["ms_poe"].ranks[1], ranked)
    assert ranked.shape == (2, 4, 1, 1)
    ranked = ranked[..., 0, 0]
    assert torch.equal(ranked.sort(-1).values, torch.arange(4).expand(2, 4))  # a permutation of the ranks per row
    later = SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=later, use_cache=True)
        with pytest.raises(ValueError, match="ranks the heads at prefill"):
            model(ids[:, :1], past_key_values=later, use_cache=True, ms_poe=option)


def dense_head_ranks(model, ids) -> torch.Tensor:
    """(b, H) ranks of layer 0's heads written from the paper: the last query's attention row over every key, with the
    queries and keys rotated by their positions `m`; `S_P = (1/l) Σ_i 1(A_i >= 3 · mean(A))`; rank 0 the highest,
    ties to the lower head."""
    cfg, attention = model.config, model.model.layers[0].self_attn
    seq, heads, head_dim, r = ids.shape[1], cfg.num_attention_heads, cfg.head_dim, cfg.rotary_dim
    rows = model.model.embed_positions.weight[:seq].expand(len(ids), -1, -1)
    normed = model.model.layers[0].input_layernorm(torch.cat((rows, model.model.embed_tokens(ids)), -1))
    projections = (attention.q_proj, attention.k_proj)
    q, k = (linear(normed).view(*ids.shape, heads, -1).transpose(1, 2) for linear in projections)  # (b, H, seq, hd)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2).float() / r)
    angles = torch.arange(seq)[:, None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = (torch.cat((x[..., :r] * cos + rotate_half(x[..., :r]) * sin, x[..., r:]), -1) for x in (q, k))
    row = ((q[:, :, -1:] @ k.transpose(-1, -2)) * head_dim**-0.5).softmax(-1)[:, :, 0]  # (b, H, seq)
    scores = (row >= 3 * row.mean(-1, keepdim=True)).float().mean(-1)  # (b, H)
    ranks = torch.empty(scores.shape, dtype=torch.long)
    for b, order in enumerate(torch.sort(-scores, dim=-1, stable=True).indices):
        ranks[b, order] = torch.arange(heads)
    return ranks


def test_ms_poe_ranks_the_heads_from_rotated_queries_and_keys():
    """On a rotary model the prefill's ranking reads the attention the layer computes: queries and keys rotated."""
    model = strong_positions(tiny_model(num_hidden_layers=1, hidden_size=64, num_attention_heads=8, rotary_dim=8))
    attention = model.model.layers[0].self_attn
    ids = random_ids(4, 48)
    cache = SepFormerCache(config=model.config)
    with torch.no_grad():
        for projection in (attention.q_proj, attention.k_proj):  # peaked rows: heads that differ in S_P
            projection.weight.mul_(10)
        model(ids, past_key_values=cache, use_cache=True, ms_poe=MSPoE(layers=(0,)))
        expected = dense_head_ranks(model, ids)
    assert torch.equal(cache.mitigation_state["ms_poe"].ranks[0][..., 0, 0], expected)
    assert not torch.equal(expected, torch.arange(8).expand(4, 8))  # not every score tied


# ---------------------------------------------------------------------------------------------- attention calibration


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


# ------------------------------------------------------------------------------------------------ positional scaling


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


# -------------------------------------------------------------------------------------- every option: cache, padding


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
    no_pad = tiny_model(pad_token_id=None)
    with pytest.raises(ValueError, match="no pad_token_id: give dummy_document"):
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


def test_ms_poe_reads_the_table_on_the_scale_of_interpolate_past_the_table():
    model = strong_positions(tiny_model())  # L = 64 rows
    ids = random_ids(1, 70)
    identity = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=(0, 1, 2, 3))
    base = logits(model, ids, position_extrapolation="interpolate")
    assert torch.equal(logits(model, ids, position_extrapolation="interpolate", ms_poe=identity), base)
    # one layer, one ratio for every head: the positional block of every head reads p((m · 63/69) / r)
    one = strong_positions(tiny_model(num_hidden_layers=1))
    option = MSPoE(r_min=2.0, r_max=2.0, layers=(0,), head_order=(0, 1, 2, 3))
    table = one.model.embed_positions.weight
    compressed = torch.arange(70) * 63 / 69
    with torch.no_grad():
        ours = one(ids, position_extrapolation="interpolate", ms_poe=option, output_hidden_states=True)
        position_rows = torch.lerp(
            table[compressed.floor().long()],
            table[(compressed.floor().long() + 1).clamp(max=63)],
            (compressed - compressed.floor())[:, None],
        )
        assert torch.equal(ours.hidden_states[0][0, :, :8], position_rows)
        reference = ms_poe_reference_logits(one, ids, option, positions=compressed)
    torch.testing.assert_close(ours.logits, reference, rtol=1e-4, atol=1e-5)


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
