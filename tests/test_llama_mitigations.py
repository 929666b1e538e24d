"""examples/llama_mitigations.py: Attention Buckets and PCW on HF Llama (and PCW on GPT-2), against references."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import logits, random_ids
from test_buckets_and_windows import mixed_by_hand
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from llama_mitigations import attention_buckets_logits, parallel_context_windows_logits  # noqa: E402  (after the path)


def tiny_llama(attn="sdpa", rope_theta=10000.0, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than a fresh model's, so that positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def tiny_gpt2(attn="sdpa"):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_implementation=attn,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 1)
    return model


# ------------------------------------------------------------------------------------------------ Attention Buckets


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_one_bucket_with_llamas_own_base_is_plain_llama_bit_for_bit(attn):
    model = tiny_llama(attn, rope_theta=500.0)
    ids = random_ids(2, 16)
    assert torch.equal(attention_buckets_logits(model, ids, None, [500.0]), logits(model, ids))
    mask = torch.ones_like(ids)
    assert torch.equal(attention_buckets_logits(model, ids, mask, [500.0]), logits(model, ids, attention_mask=mask))
    assert torch.equal(model.model.rotary_emb.inv_freq, tiny_llama(attn, rope_theta=500.0).model.rotary_emb.inv_freq)


def test_llama_buckets_equal_llamas_built_with_each_base_mixed_by_confidence():
    model = tiny_llama()
    ids = random_ids(2, 16)
    bases = [10000.0, 700.0, 60.0]
    per_bucket = []
    for base in bases:
        other = tiny_llama(rope_theta=base)
        other.load_state_dict(model.state_dict())
        per_bucket.append(logits(other, ids))
    assert (per_bucket[2] - per_bucket[0]).abs().max() > 1e-3
    torch.testing.assert_close(
        attention_buckets_logits(model, ids, None, bases), mixed_by_hand(per_bucket), rtol=1e-5, atol=1e-5
    )


def test_llama_buckets_of_a_left_padded_row_equal_the_row_alone():
    model = tiny_llama()
    ids = random_ids(2, 16)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    together = attention_buckets_logits(model, ids, mask, [10000.0, 300.0])
    alone = attention_buckets_logits(model, ids[1:, 5:], None, [10000.0, 300.0])
    torch.testing.assert_close(together[1, 5:], alone[0], rtol=1e-5, atol=1e-5)


def test_buckets_are_refused_on_gpt2_and_with_bad_bases():
    with pytest.raises(ValueError, match="Attention Buckets is not defined there"):
        attention_buckets_logits(tiny_gpt2(), random_ids(1, 8), None, [10000.0])
    with pytest.raises(ValueError, match="base=0.0 must be >= 1e-09"):
        attention_buckets_logits(tiny_llama(), random_ids(1, 8), None, [10000.0, 0.0])
    with pytest.raises(ValueError, match="is empty"):
        attention_buckets_logits(tiny_llama(), random_ids(1, 8), None, [])


# -------------------------------------------------------------------------------------- Parallel Context Windows

MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def windows_encoded_separately(model, ids, spans):
    """PCW as its reference code runs it: each window encoded alone after the shared prefix, the caches concatenated
    (the prefix once), then the task tokens with positions from `prefix + longest window` on. `ids` is one row."""
    first, last = spans[0][0], spans[-1][1]
    longest = max(end - start for start, end in spans)
    with torch.no_grad():
        runs = [model(torch.cat((ids[:, :first], ids[:, start:end]), 1), use_cache=True) for start, end in spans]
        combined = DynamicCache(config=model.config)
        for layer in range(model.config.num_hidden_layers):
            parts = [run.past_key_values.layers[layer] for run in runs]
            keys = torch.cat([parts[0].keys[:, :, :first]] + [part.keys[:, :, first:] for part in parts], 2)
            values = torch.cat([parts[0].values[:, :, :first]] + [part.values[:, :, first:] for part in parts], 2)
            combined.update(keys, values, layer)
        task = ids[:, last:]
        positions = torch.arange(task.shape[1])[None] + first + longest
        task_logits = model(
            task, past_key_values=combined, position_ids=positions, attention_mask=torch.ones(1, ids.shape[1])
        ).logits
    window_logits = [run.logits[:, first:] for run in runs]
    return torch.cat([runs[0].logits[:, :first], *window_logits, task_logits], 1)


WINDOWS = ((2, 6), (6, 13), (13, 16))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_windows_equal_windows_encoded_separately_with_caches_concatenated(kind, attn):
    model = MODELS[kind](attn)
    ids = random_ids(1, 21)
    windows = parallel_context_windows_logits(model, ids, [WINDOWS])
    torch.testing.assert_close(windows, windows_encoded_separately(model, ids, WINDOWS), rtol=1e-5, atol=1e-5)
    assert (windows - logits(model, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_one_window_is_the_plain_model_bit_for_bit(kind, attn):
    model = MODELS[kind](attn)
    ids = random_ids(2, 16)
    mask = torch.ones_like(ids)
    for span in [(0, 16), (1, 12)]:
        assert torch.equal(parallel_context_windows_logits(model, ids, [[span]] * 2), logits(model, ids))
        windows = parallel_context_windows_logits(model, ids, [[span]] * 2, attention_mask=mask)
        assert torch.equal(windows, logits(model, ids, attention_mask=mask))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_windows_of_a_left_padded_row_equal_the_row_alone(kind):
    model = MODELS[kind]()
    ids = random_ids(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    spans = [((1, 5), (5, 12)), ((0, 6), (6, 10))]
    together = parallel_context_windows_logits(model, ids, spans, attention_mask=mask)
    alone = parallel_context_windows_logits(model, ids[1:, 4:], spans[1:])
    torch.testing.assert_close(together[1, 4:], alone[0], rtol=1e-5, atol=1e-5)


def test_bad_windows_are_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match="out of range: the prompt of that row has 8"):
        parallel_context_windows_logits(model, random_ids(1, 8), [((0, 4), (4, 9))])
    with pytest.raises(ValueError, match="between two windows"):
        parallel_context_windows_logits(model, random_ids(1, 8), [((0, 3), (4, 6))])
    with pytest.raises(ValueError, match="spans for 1 rows; the batch has 2"):
        parallel_context_windows_logits(model, random_ids(2, 8), [((0, 3),)])
