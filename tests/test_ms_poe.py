"""MS-PoE (`sepformer/ms_poe.py`) against a head-by-head reference (`[p(m / r_h) ‖ s]`, rotary by `m / r_h`); the ratio
assignment (the paper's semantics, not the authors' permutation), ratios 1 = the base model, the ranking kept."""

import pytest
import torch
from conftest import logits, random_ids, strong_positions, tiny_model
from transformers.models.llama.modeling_llama import rotate_half

from sepformer import MSPoE, SepFormerCache
from sepformer.mitigations import fixed_head_ranks, head_ratios, position_awareness


def paper_ratios(option, num_heads):
    """`r_i = r_min + (i-1)(r_max - r_min)/(H-1)` for ranks i = 1..H, written out."""
    step = (option.r_max - option.r_min) / max(num_heads - 1, 1)
    return torch.tensor([option.r_min + i * step for i in range(num_heads)], dtype=torch.float64)


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 4}, {"position_size": 0, "rotary_dim": 8}])
@pytest.mark.parametrize("head_order", [None, (3, 1, 0, 2)])
def test_ms_poe_with_all_ratios_one_is_the_base_model_bit_for_bit(overrides, head_order):
    model = tiny_model(**overrides)
    ids = random_ids(2, 14)
    option = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=head_order)
    assert torch.equal(logits(model, ids, ms_poe=option), logits(model, ids))


def test_ms_poe_with_all_ratios_one_in_training_with_shifted_table_positions_is_the_base_model(monkeypatch):
    """`random_position_offsets` reads the table at shifted positions in training: MS-PoE's `p(m / r) - p(m)` reads it
    there too, so ratios 1 add exactly 0 (reading `p` at the rows' own positions would add `p(m) - p(m + 100)`)."""
    model = tiny_model(position_table_size=256, random_position_offsets=True).train()
    shifted = lambda position_ids, batch: position_ids + 100  # noqa: E731  every row read past N = 64
    monkeypatch.setattr(model.model.embed_positions, "training_positions", shifted)
    ids = random_ids(2, 12)
    option = MSPoE(r_min=1.0, r_max=1.0, layers=(0, 1), head_order=(3, 1, 0, 2))
    with torch.no_grad():
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


def test_ms_poe_on_sepformer_reads_the_positions_the_call_gives():
    """SepFormer's position hook turns each call's own positions: given `position_ids`, head `h` reads `p(m / r_h)` at
    those `m` (a Hugging Face decoder, which turns cached keys from the default positions, refuses others)."""
    model = strong_positions(tiny_model(num_hidden_layers=1))
    ids, shifted = random_ids(2, 12), torch.arange(12) + 5
    option = MSPoE(r_min=1.3, r_max=2.5, layers=(0,), head_order=(2, 0, 3, 1))
    with torch.no_grad():
        reference = ms_poe_reference_logits(model, ids, option, positions=shifted.float())
    ours = logits(model, ids, position_ids=shifted[None], ms_poe=option)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


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
