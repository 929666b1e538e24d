"""The positional-dimension search and positional scaling on Hugging Face models by hooks, against references
written here from the paper's formulas."""

import math
import re

import numpy as np
import pytest
import torch
from conftest import tiny_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sepformer import PositionalScaling, add_mitigations, positional_search
from sepformer.decoder_attention import Rewriting, projection_hooks
from sepformer.positional_search import (
    NoPositionalChannelError,
    attention_input_curves,
    positional_channel_candidates,
    search_positional_scaling,
)

PLANTED = 5  # the positional channel that carries the recency bias in `planted_model`


def planted_model():
    """A one-layer SepFormer whose attention reads position through channel 5 only: every head scores key `j` from
    query `i` by `a² h_5(i) h_5(j) / √8`, with `p_5(m) = (m - 6) / 3` rising with position, so the last row attends to
    the latest tokens (a recency bias); values copy the semantic block, the head reads it back, the MLPs are off.
    Scaling channel 5 by `s` multiplies those scores by `s²`; no other channel moves the attention."""
    model = tiny_model(num_hidden_layers=1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.norm.position.weight.fill_(1)
        model.model.norm.semantic.weight.fill_(1)
        layer = model.model.layers[0]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.position.weight.fill_(1)
            norm.semantic.weight.fill_(1)
        table = model.model.embed_positions.weight
        table.fill_(1.0)
        table[:, PLANTED] = (torch.arange(table.shape[0]) - 6) / 3
        attention = layer.self_attn
        for head in range(4):
            attention.q_proj.weight[8 * head, PLANTED] = 2.0
            attention.k_proj.weight[8 * head, PLANTED] = 2.0
        attention.v_proj.semantic.weight.copy_(torch.eye(24))
        attention.o_proj.semantic.weight.copy_(torch.eye(24))
        embeddings = torch.randn(259, 24, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(embeddings)
        model.lm_head.weight.copy_(3 * embeddings)
    return model


def retrieval_batches(num_tokens=12, batches=2, seed=0):
    """Each example: 12 distinct tokens, then the token at its gold position (the answer, the only label); every gold
    position 0..10 in each batch."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(batches):
        gold = torch.arange(num_tokens - 1)
        tokens = torch.stack([torch.randperm(256, generator=generator)[:num_tokens] for _ in gold])
        answers = tokens[torch.arange(len(gold)), gold][:, None]
        input_ids = torch.cat((tokens, answers), 1)
        labels = torch.full_like(input_ids, -100)
        labels[:, -1] = answers[:, 0]
        made.append({"input_ids": input_ids, "labels": labels, "gold_position": gold})
    return made


@pytest.mark.slow
def test_the_search_finds_the_planted_positional_channel_and_reports_every_candidate():
    model = planted_model()
    batches = retrieval_batches()
    result = search_positional_scaling(model, batches)
    # 8 single channels, 4 pairs, 2 quadruples, the block; each with the 4 factors
    assert len(result.candidates) == 15 * 4
    sets = {candidate.channels for candidate in result.candidates}
    assert len(sets) == 15 and (PLANTED,) in sets and tuple(range(8)) in sets
    assert {candidate.factor for candidate in result.candidates} == {0.5, 0.0, -0.5, -1.0}
    assert result.best.channels == (PLANTED,) and result.best.factor in (0.5, 0.0, -0.5)
    assert result.best.loss < result.base.loss - 0.1 and result.improves
    assert result.option == PositionalScaling(result.best.factor, channels=(PLANTED,), layers=(0,))
    for candidate in result.candidates:
        assert sorted(candidate.position_losses) == list(range(11))
        assert candidate.loss == pytest.approx(sum(candidate.position_losses.values()) / 11)
        if PLANTED not in candidate.channels or candidate.factor == -1.0:  # s² = 1: the scores are unchanged
            assert candidate.loss == pytest.approx(result.base.loss, abs=1e-5)
    # the base model's loss, written out: the mean over gold positions of the cross-entropy of the answer
    with torch.no_grad():
        per_example = torch.cat(
            [
                torch.nn.functional.cross_entropy(
                    model(batch["input_ids"]).logits[:, -2], batch["labels"][:, -1], reduction="none"
                )
                for batch in batches
            ]
        )
    assert result.base.loss == pytest.approx(per_example.view(2, 11).mean().item(), rel=1e-5)


def test_a_candidate_of_nan_loss_is_never_the_best_and_improves_compares_with_the_unscaled_model(monkeypatch):
    """`min` keeps a NaN first (nothing compares below it): the search skips it, and `improves` says whether the best
    beats the unscaled model, since a scaling is returned in any case."""
    losses = iter([2.0, math.nan, 3.0, 2.5])  # the base, then the candidates in order

    def scored(model, batches, channels, layers, factor):
        return positional_search.ScalingCandidate(tuple(channels), tuple(layers), factor, next(losses), {})

    monkeypatch.setattr(positional_search, "evaluated", scored)
    result = search_positional_scaling(
        planted_model(), retrieval_batches(batches=1), factors=(0.5,), channel_sets=[(0,), (1,), (2,)]
    )
    assert result.best.channels == (2,) and result.best.loss == 2.5 and not result.improves
    unscaled_nan = positional_search.ScalingCandidate((), (), 1.0, math.nan, {})
    assert positional_search.PositionalSearchResult(result.best, unscaled_nan, result.candidates).improves
    every_nan = positional_search.ScalingCandidate((0,), (), 0.5, math.nan, {})
    assert not positional_search.PositionalSearchResult(every_nan, unscaled_nan, (every_nan,)).improves


# -------------------------------------------------------------------------- scaling on HF models (add_mitigations)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.weight.normal_(0, 0.4)
    return add_mitigations(model)


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    return add_mitigations(GPT2LMHeadModel(config).eval())


def llama_reference(model, ids, channels, factor, layers, rows):
    """Llama written out with positional scaling: in `layers`, the last `rows` rows attend with `q̄ = W_Q f(h)` to
    `K̄ = W_K f(h)` (rotary applied to both), values and the other rows unscaled."""
    config = model.config
    batch, n = ids.shape
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    scale = torch.ones(config.hidden_size)
    scale[list(channels)] = factor
    split = lambda x: x.view(batch, n, heads, head_dim).transpose(1, 2)  # noqa: E731
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(n)[None])
    recomputed = (torch.arange(n) >= n - rows)[:, None]
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        q, k = apply_rotary_pos_emb(split(attention.q_proj(normed)), split(attention.k_proj(normed)), cos, sin)
        scores = q @ k.transpose(2, 3)
        if index in layers:
            q_bar, k_bar = apply_rotary_pos_emb(
                split(attention.q_proj(normed * scale)), split(attention.k_proj(normed * scale)), cos, sin
            )
            scores = torch.where(recomputed, q_bar @ k_bar.transpose(2, 3), scores)
        probs = (scores / head_dim**0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        attended = (probs.softmax(-1) @ split(attention.v_proj(normed))).transpose(1, 2).reshape(batch, n, -1)
        hidden = hidden + attention.o_proj(attended)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden))


@pytest.mark.parametrize("rows", [1, 3])
def test_scaling_on_llama_equals_the_formula(rows):
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    option = PositionalScaling(-0.5, channels=(1, 7, 30), layers=(1, 2), last_recompute_tokens=rows)
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        ours = model(ids, use_cache=False, positional_scaling=option).logits
        reference = llama_reference(model, ids, (1, 7, 30), -0.5, (1, 2), rows)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[:, :-rows], base[:, :-rows])
    assert (ours - base)[:, -rows:].abs().max() > 1e-3


@pytest.mark.parametrize(
    "make", [tiny_llama, tiny_gpt2, lambda: tiny_model(num_hidden_layers=3)], ids=["llama", "gpt2", "sepformer"]
)
def test_scaling_with_factor_one_is_the_base_model_bit_for_bit(make):
    model = make()
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))

    def scaled(factor):
        option = PositionalScaling(factor, channels=(0, 3), layers=(0, 1, 2), last_recompute_tokens=4)
        return model(ids, use_cache=False, positional_scaling=option).logits

    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        assert torch.equal(scaled(1.0), base)
        zero = scaled(0.0)
    assert torch.equal(zero[:, :-4], base[:, :-4]) and (zero - base)[:, -4:].abs().max() > 1e-6


def test_gpt2_scaling_leaves_the_values_alone():
    """GPT-2 projects [q ‖ k ‖ v] in one matmul: under the hook its query and key columns read the scaled input, its
    value columns the input itself."""
    attention = tiny_gpt2().transformer.h[1].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    scale = torch.ones(32)
    scale[[4, 11]] = -0.5
    with torch.no_grad():
        plain, scaled = attention.c_attn(x), attention.c_attn(x * scale)
        rewritings = {}
        handles = projection_hooks(attention, rewritings)
        assert torch.equal(attention.c_attn(x), plain)  # no module call has a rewriting
        rewritings[attention] = Rewriting(lambda inputs: (inputs * scale,) * 2)
        hooked = attention.c_attn(x)
        for handle in handles:
            handle.remove()
    assert torch.equal(hooked[..., :64], scaled[..., :64])  # queries and keys
    assert torch.equal(hooked[..., 64:], plain[..., 64:])  # values


# ------------------------------------------------------------------------------------------ the candidate filter


def test_the_filter_keeps_monotone_smooth_channels_smoothest_first():
    n = torch.linspace(0, 1, 40)[:, None]
    noise = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    curves = torch.cat(
        (
            noise[:, :1],  # 0: noise, not monotone
            n**2,  # 1: monotone and smooth
            torch.sin(6 * n),  # 2: not monotone
            -n + 0.05 * noise[:, 1:2],  # 3: monotone, a little rough
            torch.ones(40, 1),  # 4: constant, dropped
            n + 0.1 * noise[:, 2:3],  # 5: monotone, rougher
            torch.where(n < 0.5, 0.0, 1.0),  # 6: a step: its cubic fit overshoots, not monotone
        ),
        1,
    )
    assert positional_channel_candidates(curves) == [1, 3, 5]
    assert positional_channel_candidates(curves, top_k=1) == [1]
    with pytest.raises(ValueError, match="needs at least 5 positions after skip=38"):
        positional_channel_candidates(curves, skip=38)


def test_the_filter_finds_a_planted_channel_of_gpt2_and_the_search_runs_on_it():
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.wpe.weight[:, 9] = torch.linspace(-0.1, 0.1, 64)
    ids = torch.randint(0, 100, (16, 24), generator=torch.Generator().manual_seed(0))
    curves = attention_input_curves(model, ids, layers=(1,))
    assert curves.shape == (24, 32)
    assert positional_channel_candidates(curves, top_k=1) == [9]
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, 3]
    batches = [{"input_ids": ids, "labels": labels, "gold_position": torch.arange(16) % 4}]
    result = search_positional_scaling(model, batches, factors=(0.0,), top_k=1)
    assert [candidate.channels for candidate in result.candidates] == [(9,)]
    assert result.best.layers == (1,)


def test_the_loss_of_a_left_padded_answer_of_several_tokens_is_its_cross_entropy_written_out():
    """The search scores a candidate on the answer's rows only (the causal LM's head on them alone): the base loss of
    a batch of left-padded prompts with 3-token answers is each example's mean cross-entropy over its answer, averaged
    by gold position, from the full logits of a plain forward; and so with every token labelled (the first one
    predicted by no row, as in a causal LM's loss)."""
    model = tiny_llama()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (4, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :1] = 0  # left padding
    answers = torch.full_like(ids, -100)
    answers[:, -3:] = ids[:, -3:]
    answers[1, -1] = -100  # a shorter answer: its own mean
    gold = torch.tensor([0, 1, 1, 2])

    def written_out(ids, labels, mask=None) -> dict[int, float]:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits  # (4, n, vocab)
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none"
        )
        per_example = losses.sum(-1) / (labels[:, 1:] != -100).sum(-1)
        return {position: per_example[gold == position].mean().item() for position in (0, 1, 2)}

    for batch in (
        {"input_ids": ids, "labels": answers, "attention_mask": mask, "gold_position": gold},
        {"input_ids": ids[:, 3:], "labels": ids[:, 3:], "gold_position": gold},
    ):
        result = search_positional_scaling(model, [batch], factors=(0.0,), channel_sets=[(3,)])
        expected = written_out(batch["input_ids"], batch["labels"], batch.get("attention_mask"))
        assert result.base.position_losses == pytest.approx(expected, rel=1e-5)


def test_a_model_without_a_positional_channel_raises_its_own_error():
    """No position in the input (one token repeated, no position table) and no attention in the first block: every
    channel of the scaled layer's input is constant in position, so the filter keeps none and the search says so."""
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
        model.transformer.h[0].attn.c_proj.weight.zero_()
        model.transformer.h[0].attn.c_proj.bias.zero_()
    ids = torch.full((4, 12), 7)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = 7
    batches = [{"input_ids": ids, "labels": labels, "gold_position": torch.arange(4)}]
    assert positional_channel_candidates(attention_input_curves(model, ids, layers=(1,))) == []
    with pytest.raises(NoPositionalChannelError, match="no channel of the attention input is monotone"):
        search_positional_scaling(model, batches)
    assert issubclass(NoPositionalChannelError, ValueError)
    channel_sets = search_positional_scaling(model, batches, factors=(0.0,), channel_sets=[(3,)]).candidates
    assert [candidate.channels for candidate in channel_sets] == [(3,)]
    without_block = tiny_model(position_size=0, rotary_dim=4).eval()
    with pytest.raises(NoPositionalChannelError, match="no positional block"):
        search_positional_scaling(without_block, retrieval_batches(batches=1))


# --------------------------------------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_refused_with_a_clear_error():
    model = planted_model()
    batches = retrieval_batches(batches=1)
    with pytest.raises(ValueError, match="factors must be finite numbers < 1"):
        search_positional_scaling(model, batches, factors=(0.5, 1.0))
    width = model.config.hidden_size
    for channel_sets, bad in (([], "no set"), ([(0,), ()], "[()]"), ([(0, width)], f"[(0, {width})]")):
        message = f"sets of distinct channels in 0..{width - 1} (e.g. [(3,), (3, 5)]); got {bad}"
        with pytest.raises(ValueError, match=re.escape(message)):
            search_positional_scaling(model, batches, channel_sets=channel_sets)
    numpy_typed = search_positional_scaling(model, batches, factors=(np.float32(0.5),), channel_sets=[(np.int64(5),)])
    assert numpy_typed.best.factor == 0.5 and numpy_typed.best.channels == (5,)
    with pytest.raises(ValueError, match="at least one validation batch"):
        search_positional_scaling(model, [])
    with pytest.raises(ValueError, match="lacks \\['gold_position'\\]"):
        search_positional_scaling(model, [{"input_ids": batches[0]["input_ids"], "labels": batches[0]["labels"]}])
    shifted = dict(batches[0], labels=batches[0]["labels"].clone())
    shifted["labels"][0, -2] = 7
    with pytest.raises(ValueError, match="answers start at different indices"):
        search_positional_scaling(model, [shifted])
    with pytest.raises(ValueError, match="2 gold positions for 11 examples"):
        search_positional_scaling(model, [dict(batches[0], gold_position=[0, 1])])
    with pytest.raises(ValueError, match="put the model in eval mode"):
        search_positional_scaling(model.train(), batches)
    model.eval()
    with pytest.raises(ValueError, match="layers \\[3\\] are out of range"):
        search_positional_scaling(model, batches, layers=(3,))
    ids, plain = torch.randint(0, 100, (1, 6)), LlamaForCausalLM(tiny_llama().config).eval()
    with pytest.raises(
        ValueError, match="positional_scaling option, which LlamaForCausalLM does not take.*add_mitigations"
    ):
        search_positional_scaling(plain, batches)
    padded = {
        "input_ids": ids,
        "labels": torch.tensor([[-100] * 5 + [3]]),
        "gold_position": [0],
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]]),
    }
    with pytest.raises(ValueError, match="first batch, which has padding"):
        search_positional_scaling(tiny_llama(), [padded])


def searched_before_any_forward(model, error, message, batches, **kwargs):
    """The search raises `error` matching `message` before the model runs a layer."""
    layer_calls = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *args: layer_calls.append(1))
    try:
        with pytest.raises(error, match=message):
            search_positional_scaling(model, batches, **kwargs)
    finally:
        handle.remove()
    assert not layer_calls


def test_every_argument_and_batch_is_checked_before_the_first_forward_pass():
    model = planted_model()
    good = retrieval_batches(batches=1)[0]
    labels = good["labels"]
    cases = [
        ({"factors": (0.5, float("nan"))}, [good], r"factors must be finite numbers < 1 .*; got \[nan\]"),
        ({"factors": (-math.inf,)}, [good], r"factors must be finite numbers < 1 .*; got \[-inf\]"),
        ({"layers": (3,)}, [good], r"positional_scaling layers \[3\] are out of range"),
        ({}, [good, {"input_ids": good["input_ids"]}], r"batch 1 lacks \['labels', 'gold_position'\]"),
        (
            {},
            [good, dict(good, gold_position=good["gold_position"] + 0.5)],
            r"batch 1: gold_position 0.5 is no integer: a gold position is the slot \(an int\)",
        ),
        ({}, [dict(good, gold_position=good["gold_position"].float())], r"batch 0: gold_position 0.0 is no integer"),
        ({}, [dict(good, gold_position=[True] * 11)], r"batch 0: gold_position True is no integer"),
        ({}, [dict(good, labels=labels.float())], r"batch 0: labels must be token ids of torch.int64; got torch.float"),
        (
            {},
            [dict(good, labels=labels.masked_fill(labels != -100, 300))],
            r"batch 0: labels contains 300, outside the vocabulary 0..258 \(-100 where no loss is taken\)",
        ),
        (
            {},
            [dict(good, input_ids=good["input_ids"].masked_fill(labels != -100, 259))],
            r"batch 0: input_ids contains 259, outside the vocabulary 0..258\.",
        ),
        ({}, [dict(good, input_ids=good["input_ids"].tolist())], r"batch 0: input_ids must be a torch tensor"),
        ({"factors": 0.5}, [good], r"factors=0.5 must be a sequence of numbers < 1"),
        ({"channel_sets": [(3,), (5, 5)]}, [good], r"distinct channels in 0..31 .*; got \[\(5, 5\)\]"),
        ({"channel_sets": [(True,)]}, [good], r"distinct channels in 0..31 .*; got \[\(True,\)\]"),
        ({"channel_sets": [3, 5]}, [good], r"distinct channels in 0..31 .*; got \[3, 5\]"),
        ({"channel_sets": 3}, [good], r"channel_sets=3 must be a list of channel sets"),
        ({"channel_sets": [[[3]]]}, [good], r"distinct channels in 0..31 .*; got \[\(\[3\],\)\]"),
        (
            {},
            [dict(good, attention_mask=torch.ones(11, 5, dtype=torch.long))],
            r"batch 0: attention_mask is of shape \(11, 5\): a tensor of 0 \(padding\) and 1 of input_ids' shape",
        ),
        (
            {},
            [dict(good, attention_mask=torch.full_like(good["input_ids"], 2))],
            r"batch 0: attention_mask is of shape .*: a tensor of 0 \(padding\) and 1",
        ),
        ({}, [dict(good, gold_position=["a"] * 11)], r"batch 0: gold_position \['a', .* is no integer"),
    ]
    for kwargs, batches, message in cases:
        error = TypeError if "torch tensor" in message else ValueError
        searched_before_any_forward(model, error, message, batches, **kwargs)
    int32 = search_positional_scaling(
        model, [dict(good, input_ids=good["input_ids"].int())], factors=(0.0,), channel_sets=[(PLANTED,)]
    )
    assert int32.best.channels == (PLANTED,)


def test_the_filters_options_are_checked_and_refused_where_no_filter_runs():
    model = planted_model()
    batches = retrieval_batches(batches=1)
    searched_before_any_forward(model, ValueError, r"top_k=2.5 must be an integer >= 1", batches, top_k=2.5)
    searched_before_any_forward(model, ValueError, r"skip=-1 must be an integer >= 0", batches, skip=-1)
    ignored = r"top_k=2 would be ignored: top_k and skip tune the channel filter, which runs only without channel_sets"
    searched_before_any_forward(model, ValueError, ignored, batches, top_k=2)  # a SepFormer: its positional block
    gpt2 = tiny_gpt2()
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, 3]
    gpt2_batches = [{"input_ids": ids, "labels": labels, "gold_position": torch.arange(4)}]
    with pytest.raises(ValueError, match=r"skip=3 would be ignored"):
        search_positional_scaling(gpt2, gpt2_batches, channel_sets=[(0,)], skip=3)


@pytest.mark.parametrize("position_size", [1, 2, 3, 6, 8, 32])
def test_sepformer_candidates_are_each_channel_its_aligned_groups_and_the_block_each_once(position_size):
    expected = {(channel,) for channel in range(position_size)} | {tuple(range(position_size))}
    size = 2
    while size < position_size:
        expected |= {tuple(range(start, start + size)) for start in range(0, position_size - size + 1, size)}
        size *= 2
    sets = positional_search.sepformer_channel_sets(position_size)
    assert len(sets) == len(set(sets)) and set(sets) == expected
    assert position_size != 32 or len(sets) == 63  # 32 + 16 + 8 + 4 + 2 + 1
