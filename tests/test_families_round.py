"""Model families where an option computed something else or failed inside transformers: each is now exact against a
reference built from the model itself, or refused by name before any work."""

import functools
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import logits, random_ids
from family_matrix import tiny_config
from test_any_decoder import greedy, mitigated, plain_model, stepwise_logits
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    GenerationConfig,
    LlamaForCausalLM,
)

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    PositionalScaling,
    StableMask,
    add_mitigations,
)


def tiny(family: str, attn: str = "eager", seed: int = 0, **overrides):
    """A random tiny model of `family` (the family matrix's sizes), its queries and keys sharpened."""
    config = tiny_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    return sharpened(AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval())


def sharpened(model):
    """Query and key projections times 6, so that positions matter."""
    with torch.no_grad():
        for module in model.modules():
            for name in ("q_proj", "k_proj"):
                if isinstance(getattr(module, name, None), torch.nn.Linear):
                    getattr(module, name).weight.mul_(6)
    return model


def llama_with_rope(**rope):
    """The matrix's tiny Llama with `rope_parameters` (rope_theta 1e4 and `rope`), sharpened."""
    config = tiny_config("llama")
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(0)
    return sharpened(LlamaForCausalLM(config).eval())


def with_mitigations(model):
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return add_mitigations(clone)


def test_stable_mask_is_refused_where_the_scores_are_soft_capped():
    """Gemma-2's cap would cap the sink's logit too, and cached steps written out left the cap out (3e-2 off)."""
    model = with_mitigations(tiny("gemma2", attn_logit_softcapping=5.0))
    with pytest.raises(ValueError, match="stable_mask's sink logit.*soft-caps them"):
        logits(model, random_ids(2, 12), stable_mask=StableMask(0.3))


def test_cached_stable_mask_keeps_gpt_oss_attention_sinks():
    plain = tiny("gpt_oss")
    model, ids = with_mitigations(plain), random_ids(2, 12, seed=3)
    reference = logits(plain, ids)
    torch.testing.assert_close(
        stepwise_logits(model, ids, 8, stable_mask=StableMask(60.0)), reference, rtol=1e-5, atol=1e-5
    )
    option = StableMask(0.3)
    torch.testing.assert_close(
        stepwise_logits(model, ids, 8, stable_mask=option), logits(model, ids, stable_mask=option), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("option", "what"),
    [
        ({"attention_calibration": AttentionCalibration(spans=(((1, 4), (4, 7)),) * 2)}, "soft-capping"),
        ({"ms_poe": MSPoE()}, "soft-capping"),  # ranked from the attention row
    ],
)
def test_what_writes_the_attention_row_out_is_refused_where_the_scores_are_capped(option, what):
    model = with_mitigations(tiny("gemma2"))
    with pytest.raises(ValueError, match=f"{next(iter(option))}.*adds {what}"):
        logits(model, random_ids(2, 12), **option)


def test_ms_poe_is_refused_on_latent_attention_whose_rotary_part_is_last():
    """DeepSeek-V3's heads are [nope ‖ rope]: turning the first dimensions left the model at m / r by 1e-2."""
    model = with_mitigations(tiny("deepseek_v3", attn="sdpa"))
    with pytest.raises(ValueError, match="ms_poe.*rotary part of each head last"):
        logits(model, random_ids(1, 8), ms_poe=MSPoE(1.5, 1.5, head_order=(0, 1, 2, 3)))


@pytest.mark.parametrize("family", ["gpt_bigcode", "hunyuan_v1_dense"])
def test_positional_scaling_is_refused_where_reprojecting_the_input_misses_the_queries_and_keys(family):
    """GPT-BigCode's multi-query c_attn is not [q ‖ k ‖ v] of equal widths; HunYuan norms after the rotary."""
    model = with_mitigations(tiny(family, attn="sdpa"))
    with pytest.raises(ValueError, match="positional_scaling.*makes its queries and keys otherwise"):
        logits(model, random_ids(1, 8), positional_scaling=PositionalScaling(-1.0, channels=(0, 1)))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("phi", dict(qk_layernorm=True)),  # Phi's norms are q_layernorm / k_layernorm, on part-rotary heads
        ("phi", dict(qk_layernorm=False)),
        ("olmo2", {}),  # OLMo-2 norms the whole projection, before the head split
    ],
)
def test_positional_scaling_keeps_every_row_but_the_last(family, overrides):
    plain = tiny(family, attn="sdpa", **overrides)
    model, ids = with_mitigations(plain), random_ids(2, 10, seed=1)
    option = PositionalScaling(-1.0, channels=tuple(range(8)), layers=(0, 1))
    ours, reference = logits(model, ids, positional_scaling=option), logits(plain, ids)
    torch.testing.assert_close(ours[:, :-1], reference[:, :-1], rtol=1e-5, atol=1e-5)
    assert (ours[:, -1] - reference[:, -1]).abs().max() > 1e-3


def test_windows_are_refused_with_positions_other_than_the_default():
    """A uniform offset leaves Llama's logits as they are, but moved the windows' positions (0.12 off)."""
    model, ids = mitigated("llama"), random_ids(1, 12)
    plain = plain_model("llama")
    offset = torch.arange(12)[None] + 7
    torch.testing.assert_close(logits(plain, ids, position_ids=offset), logits(plain, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="parallel_context_windows places its windows.*leave position_ids out"):
        logits(model, ids, position_ids=offset, parallel_context_windows={"spans": [((0, 4), (4, 8))]})


def test_windows_and_buckets_are_refused_where_the_model_counts_positions_otherwise():
    """RoBERTa's positions start after its padding index: positions counted from 0 would move every token."""
    plain = tiny("roberta", attn="sdpa")
    model, ids = with_mitigations(plain), random_ids(1, 10, seed=1, vocab=250) + 3  # no padding token
    with pytest.raises(ValueError, match="parallel_context_windows moves the positions.*RoBERTa"):
        logits(model, ids, parallel_context_windows={"spans": [((0, 4), (4, 8))]})
    with pytest.raises(ValueError, match="attention_buckets moves the positions.*RoBERTa"):
        logits(model, ids, attention_buckets=AttentionBuckets(scales=(1.0, 0.5)))
    with pytest.raises(ValueError, match="attention_buckets.*no \\(single\\) rotary"):  # bases move no position
        logits(model, ids, attention_buckets=AttentionBuckets(bases=(10000.0, 20000.0)))
    torch.testing.assert_close(logits(model, ids, stable_mask=StableMask(60.0)), logits(plain, ids))


@pytest.mark.parametrize("where", ["argument", "model"])
def test_options_on_a_generation_config_are_refused(where):
    model, ids = mitigated("llama"), random_ids(1, 8)
    config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)
    if where == "argument":
        config.ms_poe = MSPoE()
        with pytest.raises(ValueError, match="ms_poe found on the generation_config given to generate"):
            model.generate(ids, generation_config=config)
    else:
        model.generation_config.stable_mask = StableMask(0.3)
        with pytest.raises(ValueError, match="stable_mask found on model.generation_config.*keywords of generate"):
            model.generate(ids, max_new_tokens=2)


def test_an_assistant_without_mitigations_is_refused_by_name():
    model, assistant, ids = mitigated("llama"), plain_model("llama", seed=1), random_ids(1, 8)
    with pytest.raises(ValueError, match="stable_mask.*add_mitigations on the assistant too"):
        greedy(model, ids, new=3, assistant_model=assistant, stable_mask=StableMask(0.3))
    served = add_mitigations(plain_model("llama", seed=1))
    assert greedy(model, ids, new=3, assistant_model=served, stable_mask=StableMask(0.3)).shape == (1, 11)


def test_a_served_assistant_drafts_past_a_sliding_window_with_an_option_on():
    """The assistant's `SepFormerCache` records its past, as transformers marks an assistant's cache: the main model
    crops the drafts it rejects, also once a sliding window is full. Assisted greedy decoding gives greedy's tokens."""
    model = mitigated("mistral", sliding_window=5)
    assistant = add_mitigations(plain_model("mistral", seed=1, sliding_window=5))
    ids, option = random_ids(1, 12), {"stable_mask": StableMask(0.3)}
    alone = greedy(model, ids, new=10, **option)
    torch.testing.assert_close(greedy(model, ids, new=10, assistant_model=assistant, **option), alone, rtol=0, atol=0)


def test_ranked_ms_poe_is_refused_under_gradient_checkpointing_and_a_fixed_order_trains():
    model = mitigated("llama")
    model.gradient_checkpointing_enable()
    model.train()
    ids = random_ids(2, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # read by its name now, not the deprecated one
        with pytest.raises(ValueError, match="ms_poe ranks the heads once per forward.*gradient checkpointing"):
            model(ids, labels=ids, ms_poe=MSPoE())
    model(ids, labels=ids, ms_poe=MSPoE(head_order=(0, 1, 2, 3))).loss.backward()


def checkpointed(model, kind: str):
    """`model` with activation checkpointing: transformers' (reentrant or not), or torch's around each layer's
    `forward` (as FSDP's `checkpoint_wrapper`, which transformers does not know of)."""
    if kind == "torch":
        for layer in model.model.layers:
            forward = layer.forward
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})
    return model


@pytest.mark.parametrize("kind", ["reentrant", "non-reentrant", "torch"])
def test_every_option_trains_alike_under_activation_checkpointing(kind):
    """Checkpointing runs each layer again in backward, after the call: positional scaling and bucket bases, which hook
    the attention modules, keep their hooks until the graph (holding the call's plan) is freed. Every option's
    gradients with checkpointing are those without it, and no hook is left once the graph is gone."""
    ids = random_ids(2, 10)
    options = {
        "positional_scaling": PositionalScaling(-1.0, channels=(0, 1, 2)),
        "attention_buckets": AttentionBuckets(bases=(500.0,)),
        "stable_mask": StableMask(0.3),
    }

    def gradients(checkpointing: bool, **option) -> list[torch.Tensor]:
        model = mitigated("llama", "eager")
        model = checkpointed(model, kind) if checkpointing else model
        model.train()
        attention_calls = []
        counter = model.model.layers[0].self_attn.register_forward_hook(lambda *args: attention_calls.append(1))
        output = model(ids, use_cache=False, **option)
        hooked = any(module._forward_pre_hooks for module in model.decoder_positions.attention_modules)
        # kept for backward's re-run under checkpointing only: without it nothing holds the plan past the call
        assert hooked == (checkpointing and bool(option.keys() & {"positional_scaling", "attention_buckets"}))
        output.logits.logsumexp(-1).mean().backward()  # every row: positional scaling changes the last one only
        assert len(attention_calls) == (2 if checkpointing else 1)  # run again in backward
        counter.remove()
        del output
        assert not any(module._forward_pre_hooks for module in model.decoder_positions.attention_modules)
        return [parameter.grad for parameter in model.parameters()]

    plain = gradients(False)
    for name, option in options.items():
        without = gradients(False, **{name: option})
        assert max((a - b).abs().max() for a, b in zip(without, plain, strict=True)) > 1e-3  # the option matters
        for with_checkpoints, expected in zip(gradients(True, **{name: option}), without, strict=True):
            torch.testing.assert_close(with_checkpoints, expected, rtol=1e-5, atol=1e-6)


def test_an_interrupted_rerun_in_backward_leaves_the_projections_reading_their_own_input():
    """A KeyboardInterrupt in an attention module while backward runs it again (checkpointing): the rewriting of its
    projections is undone by the module's next call, which reads its own input."""
    model, ids, other = mitigated("llama"), random_ids(1, 10), random_ids(2, 7, seed=3)
    expected = greedy(model, other)
    checkpointed(model, "reentrant").train()
    output = model(ids, use_cache=False, positional_scaling=PositionalScaling(-1.0, channels=(0, 1, 2), layers=(1,)))

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(interrupt)  # inside the attention
    with pytest.raises(KeyboardInterrupt):
        output.logits.sum().backward()
    handle.remove()
    assert torch.equal(greedy(model.eval(), other), expected)  # the graph, and the call's hooks, still alive


def test_windows_keep_mistrals_sliding_window():
    """One window over the prompt's start is the plain model: on Mistral with a window of 4, only with the window."""
    plain = plain_model("mistral", sliding_window=4)
    model, ids = mitigated("mistral", sliding_window=4), random_ids(2, 12)
    ours = logits(model, ids, parallel_context_windows={"spans": [((0, 8),)] * 2})
    torch.testing.assert_close(ours, logits(plain, ids), rtol=1e-5, atol=1e-5)
    assert (logits(plain, ids) - logits(plain_model("mistral"), ids)).abs().max() > 1e-3  # the window matters


def test_moved_positions_without_a_mask_or_cache_are_not_read_as_packed_sequences():
    model, ids = mitigated("llama"), random_ids(2, 12)
    option = {"attention_buckets": AttentionBuckets(scales=(0.5,))}
    with_mask = logits(model, ids, attention_mask=torch.ones_like(ids), use_cache=False, **option)
    torch.testing.assert_close(logits(model, ids, use_cache=False, **option), with_mask)
    assert (with_mask - logits(model, ids)).abs().max() > 1e-3


def test_a_mitigated_model_saved_with_torch_save_runs_in_a_new_process(tmp_path):
    model, ids = mitigated("llama"), random_ids(1, 8)
    torch.save(model, tmp_path / "model.pt")
    torch.save(logits(model, ids, stable_mask=StableMask(0.3)), tmp_path / "expected.pt")
    script = f"""
import torch
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
with torch.no_grad():
    out = model(torch.tensor({ids.tolist()}), stable_mask={{"gamma": 0.3}}).logits
assert torch.equal(out, torch.load({str(tmp_path / "expected.pt")!r})), "other logits"
print(type(model).__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_one_bucket_at_the_models_own_base_keeps_its_rope_scaling(rope):
    plain = llama_with_rope(**rope)
    model, ids = with_mitigations(plain), random_ids(1, 12)
    ours = logits(model, ids, attention_buckets=AttentionBuckets(bases=(10000.0,)))
    torch.testing.assert_close(ours, logits(plain, ids), rtol=1e-5, atol=1e-5)
    assert (logits(model, ids, attention_buckets=AttentionBuckets(bases=(20000.0,))) - ours).abs().max() > 1e-4


def test_one_bucket_at_the_models_own_base_is_a_model_cast_to_bfloat16_bit_for_bit():
    """`.to(bfloat16)` casts the rotary's frequencies: a rotary built at a bucket's base computes as the model's."""
    plain = plain_model("llama").to(torch.bfloat16)
    ids, base = random_ids(1, 12), plain.config.rope_parameters["rope_theta"]
    expected = logits(plain, ids)
    model = add_mitigations(plain)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    assert torch.equal(logits(model, ids, attention_buckets=AttentionBuckets(bases=(base,))), expected)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_by_ms_poe_and_bucket_bases(rope_type):
    extra = (
        {"factor": 2.0}
        if rope_type == "dynamic"
        else {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}
    )
    model, ids = with_mitigations(llama_with_rope(rope_type=rope_type, **extra)), random_ids(1, 8)
    with pytest.raises(ValueError, match=f"ms_poe.*{rope_type}"):
        logits(model, ids, ms_poe=MSPoE(head_order=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match="attention_buckets bases.*changes its frequencies with the sequence length"):
        logits(model, ids, attention_buckets=AttentionBuckets(bases=(10000.0, 20000.0)))


def test_an_interrupted_positional_scaling_call_leaves_the_projections_reading_their_own_input():
    """A KeyboardInterrupt inside the forward (its traceback kept, as a REPL keeps it), which torch's `always_call`
    hooks do not see, must not leave q_proj and k_proj reading the scaled input in later plain calls."""
    model, ids = mitigated("llama"), random_ids(1, 10)
    before = logits(model, ids)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(interrupt)  # inside the attention
    try:
        logits(model, ids, positional_scaling=PositionalScaling(-1.0, channels=(0, 1, 2), layers=(1,)))
    except KeyboardInterrupt as interrupted:
        kept = interrupted  # noqa: F841 - the traceback (and its frames) kept alive
    handle.remove()
    assert torch.equal(logits(model, ids), before)


def test_a_list_of_eos_token_ids_is_read_by_the_probe():
    """Llama 3's configs list several eos ids: the probe's ordinary tokens avoid them all."""
    model = add_mitigations(plain_model("llama", eos_token_id=[1, 2, 3]))
    ids = random_ids(1, 8)
    torch.testing.assert_close(logits(model, ids), logits(plain_model("llama", eos_token_id=[1, 2, 3]), ids))


def test_a_composite_model_is_refused_by_name():
    """Gemma 3's image-text model: its config holds a text config beside the vision one."""
    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16)
    config = Gemma3Config(text_config=text, vision_config={**vision, "patch_size": 8}, mm_tokens_per_image=4)
    with pytest.raises(ValueError, match="add_mitigations serves text decoders.*Gemma3ForConditionalGeneration"):
        add_mitigations(Gemma3ForConditionalGeneration(config))
