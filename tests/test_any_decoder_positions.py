"""`add_mitigations`: Attention Buckets and positional scaling on Hugging Face decoders, against the models run at
each base, a reference written from the scaling's formula, and positional scaling by hooks."""

import copy
import dataclasses

import pytest
import torch
from conftest import logits, random_ids
from test_any_decoder import ROTARY, SIZES, greedy, left_padded, mitigated, plain_model, stepwise_logits
from test_buckets_and_windows import mixed_by_hand
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

import sepformer
from sepformer import AttentionBuckets, PositionalScaling
from sepformer.positional_search import search_positional_scaling

BASES = (10000.0, 500.0, 3e5)
SCALING = PositionalScaling(-0.5, channels=(1, 7, 30), layers=(1, 2))


def built_at_base(plain, base: float):
    """The model `plain` built again with `rope_theta=base`, its weights loaded."""
    config = copy.deepcopy(plain.config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": base}
    model = type(plain)(config).eval()
    model.load_state_dict(plain.state_dict())
    return model


def at_base(name: str, base: float, scale: float, ids: torch.Tensor) -> torch.Tensor:
    """The model built with `rope_theta=base`, read at positions `m · scale`: one bucket, written out."""
    positions = torch.arange(ids.shape[1])[None] * scale
    return logits(
        built_at_base(plain_model(name), base), ids, attention_mask=torch.ones_like(ids), position_ids=positions
    )


# ------------------------------------------------------------------------------------------------ Attention Buckets


@pytest.mark.parametrize("name", ROTARY)
def test_buckets_are_the_models_at_each_base_mixed_by_confidence(name):
    model = mitigated(name)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    ids = random_ids(2, 12)
    ours = logits(model, ids, attention_buckets=AttentionBuckets(bases=BASES))
    by_hand = mixed_by_hand([at_base(name, base, 1.0, ids) for base in BASES])
    torch.testing.assert_close(ours, by_hand, rtol=1e-5, atol=1e-5)
    scales = (1.0, 0.5, 0.25)
    ours = logits(model, ids, attention_buckets=AttentionBuckets(bases=BASES, scales=scales))
    buckets = zip(BASES, scales, strict=True)
    by_hand = mixed_by_hand([at_base(name, base, scale, ids) for base, scale in buckets])
    torch.testing.assert_close(ours, by_hand, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)  # the model's rotary is left alone
    assert torch.equal(logits(model, ids), logits(plain_model(name), ids))


def test_buckets_with_parallel_context_windows_are_each_base_with_the_windows_mixed_by_confidence():
    windows = {"parallel_context_windows": {"spans": [[(1, 4), (4, 7), (7, 10)]] * 2}}
    ids = random_ids(2, 14)
    ours = logits(mitigated("llama"), ids, attention_buckets={"bases": BASES[1:]}, **windows)
    per_base = [
        logits(sepformer.add_mitigations(built_at_base(plain_model("llama"), base)), ids, **windows)
        for base in BASES[1:]
    ]
    torch.testing.assert_close(ours, mixed_by_hand(per_base), rtol=1e-5, atol=1e-5)


def test_bucket_bases_beside_calibration_are_each_base_with_calibration_mixed_by_confidence():
    """Calibration's dummy passes repeat each row's copies in place: each copy still reads its own bucket's base, with
    the bases out of order and one given twice."""
    calibration = {"attention_calibration": {"spans": [[(1, 4), (4, 7), (7, 10)]] * 2, "temperature": 0.05}}
    bases = (3e5, 500.0, 3e5)
    ids = random_ids(2, 14)
    ours = logits(mitigated("llama"), ids, attention_buckets={"bases": bases}, **calibration)
    per_base = [
        logits(sepformer.add_mitigations(built_at_base(plain_model("llama"), base)), ids, **calibration)
        for base in bases
    ]
    torch.testing.assert_close(ours, mixed_by_hand(per_base), rtol=1e-5, atol=1e-5)


def test_one_bucket_at_the_models_own_base_is_the_plain_model_bit_for_bit():
    model = mitigated("qwen2")
    ids = random_ids(2, 10)
    assert torch.equal(logits(model, ids, attention_buckets={"bases": [10000.0]}), logits(model, ids))
    assert torch.equal(greedy(model, ids, attention_buckets={"bases": [10000.0]}), greedy(model, ids))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_buckets_cached_decoding_equals_the_full_pass(name):
    model = mitigated(name)
    ids = random_ids(2, 16)
    buckets = AttentionBuckets(bases=BASES[:2], scales=(1.0, 0.5))
    full = logits(model, ids, attention_buckets=buckets)
    cache = sepformer.SepFormerCache(config=model.config)
    steps = stepwise_logits(model, ids, 11, cache=cache, attention_buckets=buckets)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="continue it with the same attention_buckets"):
        model(ids[:, :1], past_key_values=cache)


def test_buckets_return_a_tuple_with_return_dict_false():
    model = mitigated("llama")
    ids, option = random_ids(2, 8), {"attention_buckets": AttentionBuckets(bases=BASES)}
    with torch.no_grad():
        as_tuple = model(ids, return_dict=False, **option)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], logits(model, ids, **option))


def test_buckets_train_on_the_mixed_logits():
    model = mitigated("llama").train()
    ids = random_ids(2, 10)
    output = model(ids, labels=ids, attention_buckets={"bases": BASES})
    expected = model.loss_function(logits=output.logits, labels=ids, vocab_size=model.config.vocab_size)
    torch.testing.assert_close(output.loss, expected)
    output.loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="returns mixed logits only: output_attentions"):
        model(ids, attention_buckets={"bases": BASES}, output_attentions=True)


def test_buckets_are_refused_where_no_base_or_scale_is_defined():
    ids = random_ids(1, 6)
    with pytest.raises(ValueError, match="GPT2LMHeadModel .* learned absolute positions have no base"):
        mitigated("gpt2")(ids, attention_buckets={"bases": [500.0, 10000.0]})
    dynamic = mitigated("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic'.* changes its frequencies with the sequence length"):
        dynamic(ids, attention_buckets={"bases": [500.0]})
    assert logits(dynamic, ids, attention_buckets={"scales": [0.5]}).isfinite().all()


# --------------------------------------------------------------------------------------------- positional scaling


def dense_scaled(model, ids, options: PositionalScaling, scaled_from: int) -> torch.Tensor:
    """Llama, Qwen2 or Mistral written out with positional scaling: in the option's layers, rows from `scaled_from` on
    attend with `q̄ = W_Q f(h)` to every `K̄ = W_K f(h)` (rotary on both), the rows before with the plain queries and
    keys; values unscaled. A prefill recomputes its last rows, and each decoding step is such a row (its query and the
    cache's keys scaled), so `scaled_from` is the prompt's length minus `last_recompute_tokens`."""
    config = model.config
    batch, n = ids.shape
    head_dim = config.hidden_size // config.num_attention_heads
    groups = config.num_attention_heads // config.num_key_value_heads
    scale = torch.ones(config.hidden_size)
    scale[list(options.channels)] = options.factor

    def heads(x):  # (b, n, H · hd) -> (b, H, n, hd)
        return x.view(batch, n, -1, head_dim).transpose(1, 2)

    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(n)[None])
    scaled_rows = (torch.arange(n) >= scaled_from)[:, None]
    for index, layer in enumerate(model.model.layers):
        attention, normed = layer.self_attn, layer.input_layernorm(hidden)

        def scores(query_input, key_input, attention=attention):
            query, key = heads(attention.q_proj(query_input)), heads(attention.k_proj(key_input))
            if hasattr(attention, "q_norm"):  # Qwen3: each head's query and key normed before the rotary
                query, key = attention.q_norm(query), attention.k_norm(key)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            return query @ repeat_kv(key, groups).transpose(2, 3)

        logit = scores(normed, normed)
        if index in options.layers:
            logit = torch.where(scaled_rows, scores(normed * scale, normed * scale), logit)
        logit = (logit / head_dim**0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
        attended = logit.softmax(-1) @ repeat_kv(heads(attention.v_proj(normed)), groups)
        hidden = hidden + attention.o_proj(attended.transpose(1, 2).reshape(batch, n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.model.norm(hidden))


@pytest.mark.parametrize("name", ROTARY)
def test_positional_scaling_equals_the_dense_reference_at_prefill_and_at_each_decoding_step(name):
    model = mitigated(name)
    ids = random_ids(2, 15)
    option = PositionalScaling(-0.5, channels=(1, 7, 30), layers=(1, 2), last_recompute_tokens=3)
    with torch.no_grad():
        reference = dense_scaled(model, ids, option, scaled_from=12 - 3)
    prefill = logits(model, ids[:, :12], positional_scaling=option, use_cache=False)
    torch.testing.assert_close(prefill, reference[:, :12], rtol=1e-5, atol=1e-5)
    assert (prefill - logits(model, ids[:, :12]))[:, -3:].abs().max() > 1e-3  # the option acts
    steps = stepwise_logits(model, ids, 12, positional_scaling=option)
    torch.testing.assert_close(steps, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*ROTARY, "gpt2"])
def test_positional_scaling_keeps_the_rows_before_the_last_and_factor_one_is_the_plain_model_bit_for_bit(name):
    model, plain, ids = mitigated(name), plain_model(name), random_ids(2, 12)
    ours = logits(model, ids, positional_scaling=SCALING)
    torch.testing.assert_close(ours[:, :-1], logits(plain, ids)[:, :-1], rtol=1e-6, atol=1e-6)
    if name != "gpt2":  # the last row, written out
        with torch.no_grad():
            torch.testing.assert_close(ours, dense_scaled(model, ids, SCALING, 12 - 1), rtol=1e-5, atol=1e-5)
    unscaled = PositionalScaling(1.0, channels=(1, 7, 30), last_recompute_tokens=4)
    assert torch.equal(logits(model, ids, positional_scaling=unscaled), logits(plain, ids))
    assert torch.equal(greedy(model, ids, positional_scaling=unscaled), greedy(plain, ids))


def test_positional_scaling_with_query_and_key_norms_equals_the_dense_reference():
    """Qwen3 normalises each head's query and key after the projection: the base keys are reprojected the same way."""
    torch.manual_seed(0)
    config = Qwen3Config(**SIZES, num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="sdpa")
    plain = Qwen3ForCausalLM(config).eval()
    model = sepformer.add_mitigations(Qwen3ForCausalLM(config).eval())
    model.load_state_dict(plain.state_dict())
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference = dense_scaled(model, ids, SCALING, 12 - 1)
    torch.testing.assert_close(logits(model, ids, positional_scaling=SCALING), reference, rtol=1e-5, atol=1e-5)
    unscaled = PositionalScaling(1.0, channels=(1, 7, 30), last_recompute_tokens=4)
    assert torch.equal(logits(model, ids, positional_scaling=unscaled), logits(plain, ids))


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize(
    ("option", "name"),
    [("buckets", name) for name in ROTARY] + [("scaling", name) for name in ("qwen2", "gpt2")],
)
def test_left_padded_rows_beams_and_return_sequences_give_each_prompt_what_it_gives_alone(option, name, beams):
    keywords = {"buckets": {"attention_buckets": AttentionBuckets(bases=BASES)}}
    keywords["scaling"] = {"positional_scaling": PositionalScaling(-0.5, channels=(1, 7, 30), skip_first=2)}
    model = mitigated(name)
    prompts = [random_ids(1, 13, seed=1)[0], random_ids(1, 10, seed=2)[0]]
    ids, mask = left_padded(prompts)
    settings = dict(new=5, num_beams=beams, num_return_sequences=beams, **keywords[option])
    together = greedy(model, ids, mask, **settings)[:, -5:]
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt[None], **settings)[:, -5:]
        assert torch.equal(together[row * beams : (row + 1) * beams], alone), row


def test_positional_scaling_is_refused_without_channels_or_where_the_inputs_cannot_be_reached():
    model = mitigated("mistral")
    ids = random_ids(1, 6)
    with pytest.raises(ValueError, match="on MistralForCausalLM needs channels"):
        model(ids, positional_scaling={"factor": 0.0})
    with pytest.raises(ValueError, match=r"channels \[32\] are out of range"):
        model(ids, positional_scaling={"channels": [32]})
    with pytest.raises(ValueError, match="rows \\[0\\] end in padding"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]]), positional_scaling=SCALING)
    cache = sepformer.SepFormerCache(config=model.config)
    model(ids, past_key_values=cache, positional_scaling=SCALING)
    with pytest.raises(ValueError, match="prefilled with positional_scaling"):
        model(ids[:, :1], past_key_values=cache)
    unreachable = dataclasses.replace(model.decoder_positions, query_key_problem="its file has no rotary")
    model.decoder_positions = unreachable
    with pytest.raises(ValueError, match="from a scaled input, but its file has no rotary"):
        model(ids, positional_scaling=SCALING)


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_the_search_on_grouped_query_models_scores_what_the_option_computes(name):
    model = mitigated(name)
    ids = random_ids(8, 14, seed=3)
    labels = torch.full_like(ids, -100)
    labels[:, -2:] = ids[:, 2:4]
    batches = [{"input_ids": ids, "labels": labels, "gold_position": torch.arange(8) % 4}]
    result = search_positional_scaling(model, batches, factors=(0.0,), channel_sets=[(1, 7, 30)])
    option = PositionalScaling(0.0, channels=(1, 7, 30), last_recompute_tokens=3)
    scaled = logits(model, ids, positional_scaling=option, use_cache=False)[:, -3:-1]
    losses = torch.nn.functional.cross_entropy(scaled.transpose(1, 2), labels[:, -2:], reduction="none").mean(-1)
    expected = losses.view(2, 4).mean(0).mean().item()  # by gold position, then over positions
    assert result.best.loss == pytest.approx(expected, rel=1e-5)
    assert abs(result.best.loss - result.base.loss) > 1e-4
