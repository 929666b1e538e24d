"""`add_mitigations`: SepFormer's mitigations on Hugging Face decoders (Llama, Qwen2, Mistral with grouped-query
attention, GPT-2), against the plain models and references written from the formulas."""

import copy
import dataclasses

import pytest
import torch
from conftest import logits, random_ids, tiny_model
from test_stable_mask import dense_stable_mask
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward, repeat_kv

import sepformer
from sepformer import (
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    SepFormerForCausalLM,
    StableMask,
    add_mitigations,
)

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, max_position_embeddings=64)
ROTARY = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
}
MODELS = (*ROTARY, "gpt2")
SPANS = ((1, 4), (4, 7), (7, 10))  # documents or windows of every prompt (>= 10 tokens), from its first real token


def plain_model(name: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A tiny random model of the family `name`, attention sharpened so that positions matter."""
    torch.manual_seed(seed)
    if name == "gpt2":
        config = GPT2Config(
            vocab_size=256,
            n_embd=32,
            n_layer=3,
            n_head=4,
            n_positions=64,
            attn_implementation=attn,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            initializer_range=0.1,
            **overrides,
        )
        model = GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            model.transformer.wpe.weight.normal_(0, 1)
            for block in model.transformer.h:
                block.attn.c_attn.weight[:, :64].mul_(6)  # queries and keys
        return model
    model_class, config_class, heads = ROTARY[name]
    config = config_class(**SIZES, **heads, attn_implementation=attn, pad_token_id=0, **overrides)
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def mitigated(name: str, attn: str = "sdpa", **overrides):
    return add_mitigations(plain_model(name, attn, **overrides))


def greedy(model, ids, mask=None, new=6, **options):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **options)


def stepwise_logits(model, ids, prefill: int, cache=None, **options) -> torch.Tensor:
    """The logits of `ids` from a prefill of its first `prefill` tokens, then one cached decoding step per token."""
    cache = cache if cache is not None else sepformer.SepFormerCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True, **options).logits]
        steps += [
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **options).logits
            for t in range(prefill, ids.shape[1])
        ]
    return torch.cat(steps, 1)


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :], mask[index, width - len(row) :] = row, 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------- the core


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_without_options_the_model_computes_what_it_computed_before(name, attn):
    plain = plain_model(name, attn)
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    before = logits(plain, ids, attention_mask=mask)
    tokens = greedy(plain, ids, mask)
    model = add_mitigations(plain)
    assert model is plain and type(model).__name__ == type(plain).__name__
    torch.testing.assert_close(logits(model, ids, attention_mask=mask), before, rtol=0, atol=1e-6)
    assert torch.equal(greedy(model, ids, mask), tokens)
    assert torch.equal(greedy(model, ids, mask, stable_mask=None, ms_poe=False), tokens)
    assert sepformer.any_decoder.attention_implementation(model.config) == attn
    assert add_mitigations(model) is model


def hooks_on(model) -> dict[str, int]:
    """The forward hooks of every module but the base model (whose pre-hook refuses options given to it), by name."""
    return {
        name: len(module._forward_pre_hooks) + len(module._forward_hooks)
        for name, module in model.named_modules()
        if module is not model.base_model and (module._forward_pre_hooks or module._forward_hooks)
    }


def hooks_within_call(model, ids, stop: bool = False, **options) -> int:
    """The forward hooks on the model's modules (`hooks_on`) while the call with `options` runs its head; `stop`: the
    call raises there."""
    seen = []

    def count(module, args):
        seen.append(sum(hooks_on(model).values()) - 1)  # but this one
        if stop:
            raise RuntimeError("stopped within the call")

    watcher = model.lm_head.register_forward_pre_hook(count)
    try:
        logits(model, ids, **options)
    finally:
        watcher.remove()
    return seen[0]


def stopped_in_the_attention(module, args):
    raise RuntimeError("stopped in an attention module")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hooks_are_registered_for_a_call_that_reaches_inside_the_attention_modules_only(name):
    """Without options a call runs the model's modules unhooked; positional scaling (the projections' inputs) and
    bucket bases (the modules' rotary tables) hook the attention modules they change for their call, however it ends.
    """
    model, ids = mitigated(name), random_ids(1, 10)
    assert hooks_on(model) == {} and len(model.base_model._forward_pre_hooks) == 1
    layers = model.config.num_hidden_layers
    scaling = sepformer.PositionalScaling(-1.0, channels=(0, 1, 2), layers=(0, 2))
    projection_hooks = 2 if name == "llama" else 1  # q_proj and k_proj, or c_attn
    # in the scaled layers: before and after each module call, and its projections' hooks
    assert hooks_within_call(model, ids, positional_scaling=scaling) == 2 * (2 + projection_hooks)
    assert hooks_within_call(model, ids) == 0
    assert hooks_within_call(model, ids, stable_mask=StableMask(0.5)) == 0
    with pytest.raises(RuntimeError, match="stopped within the call"):
        hooks_within_call(model, ids, stop=True, positional_scaling=scaling)
    attention = model.decoder_positions.attention_modules[0]  # its module call raises after the projections ran
    output_projection = attention.o_proj if name == "llama" else attention.c_proj
    raising = output_projection.register_forward_pre_hook(stopped_in_the_attention)
    with pytest.raises(RuntimeError, match="stopped in an attention module"):
        logits(model, ids, positional_scaling=scaling)
    raising.remove()
    assert hooks_on(model) == {}
    if name == "llama":
        assert hooks_within_call(model, ids, attention_buckets=sepformer.AttentionBuckets(bases=(500.0,))) == 2 * layers
    assert hooks_on(model) == {}


class LargeOutputs(TorchDispatchMode):
    """Records the aten calls that write an output of at least `elements` elements (views write none)."""

    def __init__(self, elements: int):
        super().__init__()
        self.elements, self.calls = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(output, torch.Tensor) and output.numel() >= self.elements:
            self.calls.append(func.overloadpacket.__name__)
        return output


@pytest.mark.parametrize("option", ["stable_mask", "positional_scaling", "attention_calibration"])
def test_a_decoding_step_reads_grouped_query_keys_and_values_as_the_cache_holds_them(option):
    """On a grouped-query decoder a decoding step with StableMask, positional scaling or calibration writes nothing
    the size of the keys expanded to one head per query head (a copy of the cache per layer), as without options."""
    options = {
        "stable_mask": StableMask(0.3),
        "positional_scaling": sepformer.PositionalScaling(-1.0, channels=(0, 1, 2)),
        "attention_calibration": AttentionCalibration(spans=(SPANS,), temperature=0.05),
    }
    model, ids = mitigated("qwen2"), random_ids(1, 40)
    config = model.config
    expanded = ids.shape[1] * config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    assert config.num_key_value_heads < config.num_attention_heads

    def large_outputs_of_a_step(**given) -> list[str]:
        with torch.no_grad():
            output = model(ids, use_cache=True, **given)
            for _ in range(2):  # the second step writes into the buffers the first one made
                with LargeOutputs(expanded) as recorded:
                    output = model(ids[:, -1:], past_key_values=output.past_key_values, use_cache=True, **given)
        return recorded.calls

    assert large_outputs_of_a_step(**{option: options[option]}) == large_outputs_of_a_step() == []


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stable_masks_decoding_row_adds_an_additive_masks_bias_as_the_attention_does(attn):
    """A 4D additive mask with a finite bias on one key: a StableMask decoding step (its row written out) equals the
    full pass (the attention function's), and the bias changes the logits."""
    model, ids = mitigated("qwen2", attn), random_ids(1, 12)
    bias = torch.full((1, 1, 12, 12), torch.finfo(torch.float32).min).triu(1)
    bias[..., 3] -= 3.0  # a soft bias on key 3
    option = dict(stable_mask=StableMask(0.3))
    with torch.no_grad():
        full = model(ids, attention_mask=bias, **option).logits[:, -1]
        prefill = model(ids[:, :11], attention_mask=bias[:, :, :11, :11], use_cache=True, **option)
        cache = prefill.past_key_values
        step = model(ids[:, 11:], attention_mask=bias[:, :, 11:], past_key_values=cache, use_cache=True, **option)
        unbiased = model(ids, **option).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-5, atol=1e-5)
    assert (full - unbiased).abs().max() > 1e-2


def test_a_call_without_the_plan_is_left_as_it_is_while_another_call_hooks_the_modules():
    """Another thread's call while one call with bucket bases has the attention modules hooked: its own rotary."""
    model, ids = mitigated("llama"), random_ids(1, 10)
    plain = logits(model, ids)
    other_calls_plan = sepformer.mitigation_base.MitigationPlan.of((), model.config.num_hidden_layers)
    tables = torch.zeros(1, 10, 8), torch.zeros(1, 10, 8)
    with sepformer.decoder_attention.attention_modules_served(model, other_calls_plan, tables):
        assert hooks_on(model)
        torch.testing.assert_close(logits(model, ids), plain, rtol=0, atol=0)
        scaled = logits(model, ids, positional_scaling=sepformer.PositionalScaling(-1.0, channels=(0, 1, 2)))
    torch.testing.assert_close(
        logits(model, ids, positional_scaling=sepformer.PositionalScaling(-1.0, channels=(0, 1, 2))),
        scaled,
        rtol=0,
        atol=0,
    )


def test_generate_keeps_transformers_default_cache_without_options_and_a_sepformer_cache_with():
    """A generation without options is the plain model's, its cache included; one with options keeps their state."""
    model, ids = mitigated("llama"), random_ids(1, 8)
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert type(model.generate(ids, **settings).past_key_values) is DynamicCache
    assert type(model.generate(ids, **settings, stable_mask=None, ms_poe=False).past_key_values) is DynamicCache
    with_option = model.generate(ids, **settings, ms_poe=MSPoE(1.2, 1.8))
    assert isinstance(with_option.past_key_values, sepformer.SepFormerCache)
    assert with_option.past_key_values.prefill_options
    plain = model.generate(ids, **settings)  # continued with options that fix state at prefill: refused, saying why
    for option, requirement in (
        ({"ms_poe": MSPoE(1.2, 1.8)}, "ms_poe ranks the heads at prefill: it must be on from the first"),
        ({"attention_buckets": sepformer.AttentionBuckets(scales=(0.5, 1.0))}, "attention_buckets reads positions"),
    ):
        with pytest.raises(ValueError, match=f"{requirement}.* This cache, a DynamicCache, was prefilled without it"):
            model.generate(plain.sequences, past_key_values=copy.deepcopy(plain.past_key_values), **settings, **option)


def test_an_implementation_set_after_add_mitigations_is_refused_until_wrapped_again():
    model = mitigated("llama")
    ids = random_ids(1, 8)
    with_sdpa = logits(model, ids, stable_mask={"gamma": 0.5})
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="implementation was set to 'eager' since: call sepformer.add_mitigations"):
        model(ids, stable_mask={"gamma": 0.5})
    assert add_mitigations(model) is model and model.config._attn_implementation == "sepformer_mitigations_eager"
    with torch.no_grad():
        with_eager = model(ids, stable_mask={"gamma": 0.5}, output_attentions=True)
    torch.testing.assert_close(with_eager.logits, with_sdpa, rtol=1e-5, atol=1e-5)
    assert len(with_eager.attentions) == 3 and (with_eager.attentions[0].sum(-1) < 1).all()  # the sink's share


@pytest.mark.parametrize("model_name", ["qwen2", "gpt2"])
def test_the_options_train(model_name):
    model = mitigated(model_name).train()
    ids = random_ids(2, 12)
    keywords = dict(stable_mask={"gamma": 0.5}, parallel_context_windows={"spans": [SPANS] * 2})
    loss = model(ids, labels=ids, **keywords).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not torch.allclose(loss, model(ids, labels=ids).loss)


def test_ms_poe_refuses_a_rotary_whose_frequencies_follow_the_length():
    model = mitigated("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' changes them with the sequence length"):
        model(random_ids(1, 6), ms_poe={})


def test_ms_poe_refuses_a_rotary_that_pairs_neighbouring_dimensions():
    """Cohere rotates pairs (0, 1), (2, 3), ...: MS-PoE's further turn in the rotate-half layout would be wrong."""
    from transformers import CohereConfig, CohereForCausalLM

    config = CohereConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        eos_token_id=0,
    )
    model = add_mitigations(CohereForCausalLM(config).eval())
    with pytest.raises(ValueError, match="CohereForCausalLM's apply_rotary_pos_emb does not rotate so"):
        model(random_ids(1, 6), ms_poe={})
    model(random_ids(1, 6), stable_mask={"gamma": 0.5})  # what does not turn the rotary is served


def test_the_mitigated_model_saves_and_reloads_as_the_plain_model(tmp_path):
    model = mitigated("qwen2")
    ids = random_ids(1, 8)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is Qwen2ForCausalLM and reloaded.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=0, atol=1e-6)


def test_the_mitigated_model_pickles_with_torch_save(tmp_path):
    """Its class is not importable under its name (the plain class is): pickled as the plain class made again."""
    model = mitigated("llama")
    ids = random_ids(1, 8)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is type(model)
    assert torch.equal(logits(loaded, ids, ms_poe={}), logits(model, ids, ms_poe={}))


def test_a_model_it_cannot_serve_is_refused_naming_what_is_missing():
    with pytest.raises(TypeError, match="causal LM .*got LlamaModel"):
        add_mitigations(LlamaModel(LlamaConfig(**SIZES, num_attention_heads=4)))
    model = plain_model("llama")
    own = type("OwnAttention", (type(model.model.layers[1].self_attn),), {"forward": attention_of_its_own})
    model.model.layers[1].self_attn.__class__ = own
    ids = random_ids(1, 6)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"registry .* reached by \[0, 2\]"):
        add_mitigations(model)
    assert type(model) is LlamaForCausalLM and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(model, ids), before)
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=True computes its eager attention with code of its"):
        add_mitigations(plain_model("gpt2", "eager", reorder_and_upcast_attn=True))


def attention_of_its_own(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
    """Llama's attention computed without the attention registry."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query, key, value = (
        projection(hidden_states).view(shape).transpose(1, 2) for projection in (self.q_proj, self.k_proj, self.v_proj)
    )
    query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    output, weights = eager_attention_forward(self, query, key, value, attention_mask, scaling=self.scaling)
    return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), weights


def test_unknown_and_bad_options_are_refused_before_any_work():
    model = mitigated("llama")
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    ids = random_ids(1, 6)
    with pytest.raises(ValueError, match=r"span \(4, 7\) of row 0 is out of range: the prompt of that row has 6"):
        model.generate(ids, max_new_tokens=2, parallel_context_windows={"spans": [SPANS]})
    with pytest.raises(ValueError, match="has spans for 2 rows; the batch has 1 rows"):
        model(ids, attention_calibration={"spans": [SPANS] * 2})
    with pytest.raises(ValueError, match="stable_mask gamma=-1 must be > 0"):
        model(ids, stable_mask={"gamma": -1})
    with pytest.raises(ValueError, match="unknown keys"):
        model.generate(ids, max_new_tokens=2, stable_mask={"gama": 1})
    with pytest.raises(ValueError, match="on LlamaForCausalLM needs channels"):
        model(ids, positional_scaling={"factor": 0.5})
    with pytest.raises(ValueError, match="stable_mask and attention_calibration cannot be combined"):
        model(ids, stable_mask={"gamma": 1}, attention_calibration={"spans": [[(0, 2)]]})
    with pytest.raises(
        ValueError, match="attention_calibration acts on the prompt's last token, but assisted decoding"
    ):
        model.generate(
            random_ids(1, 12), max_new_tokens=2, prompt_lookup_num_tokens=2, attention_calibration={"spans": [SPANS]}
        )
    assert not calls


def test_options_given_where_they_would_be_ignored_are_refused():
    """The base model's forward and the causal LM's forward (reorder_documents) would pass them on unread."""
    model = mitigated("llama")
    ids, cache = random_ids(1, 6), sepformer.SepFormerCache(config=model.config)
    with pytest.raises(TypeError, match=r"\['stable_mask'\] reached LlamaModel as keywords it ignores"):
        model.model(ids, past_key_values=cache, stable_mask={"gamma": 0.5})
    with pytest.raises(TypeError, match=r"\['reorder_documents'\] reached LlamaForCausalLM .* to generate only"):
        model(ids, past_key_values=cache, reorder_documents={"spans": [SPANS]}, ms_poe=MSPoE(1.2, 1.8))
    assert cache.get_seq_length() == 0 and not cache.prefill_options  # refused before MS-PoE's prefill state is set


# ------------------------------------------------------------------------------------------------------ StableMask


def expanded(attention):
    """An attention function for one key-value head per query head (a reference written for multi-head attention)."""

    def function(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // key.shape[1]
        return attention(module, query, repeat_kv(key, groups), repeat_kv(value, groups), attention_mask, **kwargs)

    return function


@pytest.mark.parametrize("name", MODELS)
def test_stable_mask_equals_the_dense_reference(name):
    gamma, columns = 0.3, 24
    model = mitigated(name, "eager")
    ids = random_ids(2, 16)
    ours = logits(model, ids, stable_mask=StableMask(gamma, columns))
    reference = plain_model(name, "eager")
    AttentionInterface.register("dense_stable_mask_expanded", expanded(dense_stable_mask(gamma, columns)))
    reference.set_attn_implementation("dense_stable_mask_expanded")
    torch.testing.assert_close(ours, logits(reference, ids), rtol=1e-5, atol=1e-5)
    model.set_attn_implementation(sepformer.any_decoder.register_wrapper("sdpa"))
    torch.testing.assert_close(logits(model, ids, stable_mask=StableMask(gamma, columns)), ours, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- every option: cache, padding, beams


def options(name: str, rows: int = 1) -> dict:
    """The call's keywords of option `name`, for `rows` prompts."""
    return {
        "stable_mask": {"stable_mask": StableMask(0.3)},
        "pcw": {"parallel_context_windows": ParallelContextWindows(spans=(SPANS,) * rows)},
        "calibration": {"attention_calibration": AttentionCalibration(spans=(SPANS,) * rows, temperature=0.05)},
        "ms_poe": {"ms_poe": MSPoE(1.2, 1.8, layers=(1, 2))},
        "ms_poe_fixed": {"ms_poe": MSPoE(1.2, 1.8, head_order=(3, 1, 0, 2))},
    }[name]


CASES = [(name, model) for name in ("stable_mask", "pcw", "calibration") for model in MODELS] + [
    (name, model) for name in ("ms_poe", "ms_poe_fixed") for model in ROTARY
]


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize(("name", "model_name"), CASES)
def test_left_padded_rows_beams_and_return_sequences_give_each_prompt_what_it_gives_alone(name, model_name, beams):
    model = mitigated(model_name)
    prompts = [random_ids(1, 14, seed=1)[0], random_ids(1, 11, seed=2)[0]]
    ids, mask = left_padded(prompts)
    settings = dict(new=5, num_beams=beams, num_return_sequences=beams)
    together = greedy(model, ids, mask, **settings, **options(name, 2))[:, -5:]
    changed = logits(model, ids, attention_mask=mask, **options(name, 2))[:, -1]
    assert (changed - logits(model, ids, attention_mask=mask)[:, -1]).abs().max() > 1e-4  # the option acts
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt[None], **settings, **options(name))[:, -5:]
        assert torch.equal(together[row * beams : (row + 1) * beams], alone), row


@pytest.mark.parametrize(("name", "model_name"), [case for case in CASES if case[0] != "calibration"])
def test_cached_decoding_equals_the_full_pass(name, model_name):
    model = mitigated(model_name)
    ids = random_ids(2, 18)
    keywords = options(name, 2)
    if name == "ms_poe":  # ranked at prefill: the full pass ranks on its own last row
        keywords = options("ms_poe_fixed")
    full = logits(model, ids, **keywords)
    torch.testing.assert_close(stepwise_logits(model, ids, 12, **keywords), full, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------- MS-PoE


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_name", ROTARY)
def test_ms_poe_with_one_ratio_is_the_model_reading_positions_m_over_r(model_name, attn):
    model, plain = mitigated(model_name, attn), plain_model(model_name, attn)
    ids, mask = left_padded([random_ids(1, 12, seed=1)[0], random_ids(1, 9, seed=2)[0]])
    ratio, real = 1.5, mask.bool()
    ours = logits(model, ids, attention_mask=mask, ms_poe=MSPoE(ratio, ratio, layers=(0, 1, 2)))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    reference = logits(plain, ids, attention_mask=mask, position_ids=positions / ratio)  # rotary at m / r
    torch.testing.assert_close(ours[real], reference[real], rtol=1e-5, atol=1e-5)
    assert (reference - logits(plain, ids, attention_mask=mask))[real].abs().max() > 1e-3


def attention_outputs(model, ids, **kwargs) -> torch.Tensor:
    """(b, seq, H · head_dim) what the first layer's `o_proj` reads: its heads' attention outputs, side by side."""
    seen = []
    handle = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        logits(model, ids, **kwargs)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_ms_poe_turns_each_head_as_the_model_reading_positions_m_over_its_own_ratio(model_name):
    """Several ratios in a fixed head order: head `h`'s attention output is the plain model's head `h` at positions
    `m / r_h` (`head_order[i]` gets the `i`-th ratio from `r_min`), grouped-query keys included."""
    model, plain = mitigated(model_name), plain_model(model_name)
    ids, order = random_ids(2, 12), (2, 0, 3, 1)
    ours = attention_outputs(model, ids, ms_poe=MSPoE(1.2, 2.4, layers=(0,), head_order=order))
    ratios = torch.linspace(1.2, 2.4, 4, dtype=torch.float64).float()
    heads = ours.view(2, 12, 4, -1)
    for rank, head in enumerate(order):
        reference = attention_outputs(plain, ids, position_ids=torch.arange(12)[None] / ratios[rank]).view(2, 12, 4, -1)
        torch.testing.assert_close(heads[:, :, head], reference[:, :, head], rtol=1e-5, atol=1e-5)
    assert (ours - attention_outputs(plain, ids)).abs().max() > 1e-3


def two_base_gemma3():
    """A tiny random Gemma 3: sliding layers (window 4) and a full one, each layer type with a rotary base of its own
    (one rotary module, a frequency table per type), attention sharpened; and the same weights with add_mitigations."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **{**SIZES, "vocab_size": 256},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        },
        attn_implementation="sdpa",
        pad_token_id=0,
    )
    plain = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model = Gemma3ForCausalLM(config).eval()
    model.load_state_dict(plain.state_dict())
    return plain, add_mitigations(model)


def test_ms_poe_turns_each_layer_type_by_its_own_rotary_base():
    """One ratio in every layer = the plain model at positions m / r (each layer type's table; with the two swapped
    the logits are 5e-3 off); the fixed head order decodes past the sliding window as the full pass."""
    plain, model = two_base_gemma3()
    ids = random_ids(1, 14)
    reference = logits(plain, ids, position_ids=torch.arange(14)[None] / 1.5)
    torch.testing.assert_close(logits(model, ids, ms_poe=MSPoE(1.5, 1.5, layers=(0, 1, 2))), reference)
    assert (reference - logits(plain, ids)).abs().max() > 1e-2
    fixed = {"ms_poe": MSPoE(1.2, 1.8, layers=(0, 1, 2), head_order=(3, 1, 0, 2))}
    full = logits(model, ids, **fixed)
    torch.testing.assert_close(stepwise_logits(model, ids, 6, **fixed), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rotates each layer type .* with a base of its own: give scales"):
        logits(model, ids, attention_buckets={"bases": [1e4, 2e4]})
    scaled = logits(model, ids, attention_buckets={"scales": [1 / 1.5]})  # one bucket: the model at m / 1.5
    torch.testing.assert_close(scaled, reference)
    static = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")  # masks come built per layer type
    with pytest.raises(ValueError, match="ms_poe read the padding mask .* masks already built per layer type"):
        model.generate(ids, **static, ms_poe=fixed["ms_poe"])
    assert torch.equal(model.generate(ids, **static), plain.generate(ids, **static))


def test_ms_poe_refuses_position_ids_other_than_the_ones_its_keys_are_turned_from():
    """The keys (cached ones included) are turned from the default positions: other position_ids would read queries
    and keys at inconsistent positions, silently."""
    model = mitigated("llama")
    ids, cache = random_ids(1, 10), sepformer.SepFormerCache(config=model.config)
    with pytest.raises(ValueError, match=r"position_ids are others \(\[5, 6, 7"):
        model(ids, position_ids=torch.arange(5, 15)[None], ms_poe=MSPoE(1.5, 1.5), past_key_values=cache)
    assert cache.prefill_options is None and torch.equal(logits(model, ids, past_key_values=cache), logits(model, ids))
    default = logits(model, ids, position_ids=torch.arange(10)[None], ms_poe=MSPoE(1.5, 1.5))
    torch.testing.assert_close(default, logits(model, ids, ms_poe=MSPoE(1.5, 1.5)), rtol=0, atol=0)


@pytest.mark.parametrize("model_name", ["llama", "mistral"])
def test_ms_poe_ranks_the_heads_at_prefill_and_decodes_with_that_ranking(model_name):
    """In one layer, the ranked method (prefill, then cached steps) is the full pass with the prefill's ranking given as
    a fixed head order."""
    model = mitigated(model_name)
    ids = random_ids(1, 16)
    option = MSPoE(1.2, 1.8, layers=(2,))
    cache = sepformer.SepFormerCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :12], past_key_values=cache, use_cache=True, ms_poe=option).logits]
        ranks = cache.mitigation_state["ms_poe"].ranks[2].clone()  # (1, H, 1, 1): per row and query head
        for t in range(12, 16):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, ms_poe=option).logits)
    assert torch.equal(cache.mitigation_state["ms_poe"].ranks[2], ranks) and ranks.shape == (1, 4, 1, 1)
    order = tuple(ranks[0, :, 0, 0].argsort().tolist())  # heads by rank: head_order[0] gets r_min
    full = logits(model, ids, ms_poe=dataclasses.replace(option, head_order=order))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_ms_poe_decodes_past_a_sliding_window_and_on_a_static_cache_as_the_full_pass():
    """The cache holds fewer keys than it has seen (sliding window) or more slots (static): the keys are turned at
    their own positions."""
    model = mitigated("mistral", "eager", sliding_window=6)
    ids, option = random_ids(2, 16), options("ms_poe_fixed")
    full = logits(model, ids, **option)
    torch.testing.assert_close(stepwise_logits(model, ids, 11, **option), full, rtol=1e-5, atol=1e-5)
    scores = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    model = mitigated("mistral")  # a static cache's slots past the keys seen (a sliding window's are all filled)
    static = model.generate(ids[:, :11], cache_implementation="static", **scores, **option)
    dynamic = model.generate(ids[:, :11], **scores, **option)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5, atol=1e-5)
    # left-padded rows: the static cache's 4D masks do not say where a row starts, so the keys' positions are unknown
    padded, mask = left_padded([ids[0, :11], ids[1, :8]])
    with pytest.raises(ValueError, match=r"others \(\[0, 0, 0, 0, 1, .* in row 1\): the call.s attention_mask is 4D"):
        model.generate(padded, attention_mask=mask, cache_implementation="static", **scores, **option)


@pytest.mark.parametrize("model_name", ["qwen2", "mistral"])
def test_ms_poe_turns_each_step_s_keys_and_keeps_them_for_the_generation(model_name):
    """On a `SepFormerCache` a decoding step turns its own keys and reuses the earlier ones, kept turned (with the
    values per query head), written in place after them where it can; where they were not kept (MS-PoE switched on
    after a plain prefill, other options, a step without MS-PoE or with autograd on between, a crop), it turns them
    anew. Either way the steps equal those on a plain `DynamicCache`, which keeps nothing and turns every cached key at
    every step, and that equals the full pass (grouped-query keys, a sliding window of 6)."""
    model = mitigated(model_name, "eager", sliding_window=6) if model_name == "mistral" else mitigated(model_name)
    ids, fixed = random_ids(2, 20), options("ms_poe_fixed")
    stepwise = stepwise_logits(model, ids, 9, cache=DynamicCache(config=model.config), **fixed)
    torch.testing.assert_close(stepwise, logits(model, ids, **fixed), rtol=1e-5, atol=1e-5)
    first, second = fixed["ms_poe"], MSPoE(1.1, 2.0, head_order=(0, 2, 3, 1))

    def run(cache) -> torch.Tensor:
        # (start, end, option, autograd on): steps written in place, and between them steps that cannot be
        calls = [(0, 8, None, False), (8, 10, first, False), (10, 11, first, False), (11, 12, second, False)]
        calls += [(12, 13, second, False), (13, 14, None, False), (14, 15, second, False), (15, 16, second, True)]
        calls += [(16, 17, second, False), (17, 18, second, False)]
        out = []
        for start, end, option, grad in calls:
            with torch.set_grad_enabled(grad):
                step = model(ids[:, start:end], past_key_values=cache, use_cache=True, ms_poe=option).logits
            out.append(step.detach())
        with torch.no_grad():
            if model_name == "qwen2":  # a sliding-window cache past its window cannot be cropped
                cache.crop(-2)  # as assisted decoding drops rejected tokens; then a step without MS-PoE brings the
                # cache back to as many keys as were turned, other ones
                out.append(model(ids[:, 16:18], past_key_values=cache, use_cache=True).logits)
                out.append(model(ids[:, 18:20], past_key_values=cache, use_cache=True, ms_poe=second).logits)
        return torch.cat(out, 1)

    kept = sepformer.SepFormerCache(config=model.config)
    torch.testing.assert_close(run(kept), run(DynamicCache(config=model.config)), rtol=1e-5, atol=1e-5)
    assert kept.mitigation_state["ms_poe"].turned_keys, "the steps kept their turned keys"


def test_ms_poe_steps_given_equal_options_anew_reuse_the_turned_keys(monkeypatch):
    """A loop calling `forward` parses its options at every step (a new dict, equal ones): the keys turned by the
    steps before are reused, not turned again; other options turn them anew."""
    model = mitigated("qwen2")
    forgotten = []
    forget = sepformer.ms_poe.MSPoEState.forget_turned
    monkeypatch.setattr(sepformer.ms_poe.MSPoEState, "forget_turned", lambda state: forgotten.append(forget(state)))
    ids, cache = random_ids(1, 12), sepformer.SepFormerCache(config=model.config)
    fields = dict(r_min=1.2, r_max=1.8, head_order=(3, 1, 0, 2))
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True, ms_poe=dict(fields))  # the prefill: nothing kept
        forgotten.clear()
        for start in range(8, 11):
            model(ids[:, start : start + 1], past_key_values=cache, use_cache=True, ms_poe=dict(fields))
        assert not forgotten
        model(ids[:, 11:12], past_key_values=cache, use_cache=True, ms_poe={**fields, "r_max": 2.0})
    assert forgotten


def test_ms_poe_keeps_no_values_a_sliding_window_cannot_reuse():
    """Past its window a sliding-window layer holds other values at every step: MS-PoE keeps none, not even the
    prompt's that its prefill expanded, so a long prompt leaves no copy of its values on the cache."""
    model = mitigated("mistral", sliding_window=6)
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    state = model.generate(random_ids(1, 14), **settings, **options("ms_poe_fixed")).past_key_values.mitigation_state
    assert state["ms_poe"].turned_keys and not state["ms_poe"].expanded_values


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("model_name", ["qwen2", "mistral"])
def test_ms_poe_s_turned_keys_and_values_written_in_place_follow_beams_and_repeated_rows(model_name, beams):
    """The turned keys and per-query-head values a generation keeps, each step's written in place after the earlier
    ones, follow beam search's reordering and the rows `num_return_sequences` repeats (left-padded prompts): the same
    tokens and scores as on a `DynamicCache`, where every step turns every cached key and expands every value anew."""
    model = mitigated(model_name)
    ids, mask = left_padded([random_ids(1, 14, seed=1)[0], random_ids(1, 11, seed=2)[0]])
    settings = dict(max_new_tokens=8, num_beams=beams, num_return_sequences=2, output_logits=True)
    settings.update(do_sample=beams == 1, top_k=1, pad_token_id=0, return_dict_in_generate=True)
    kept = model.generate(ids, attention_mask=mask, **settings, **options("ms_poe_fixed"))
    anew = model.generate(
        ids,
        attention_mask=mask,
        past_key_values=DynamicCache(config=model.config),
        **settings,
        **options("ms_poe_fixed"),
    )
    if beams == 1:  # beam search reorders the rows at every step, which drops the rooms (the next step makes them)
        rooms = kept.past_key_values.mitigation_state["ms_poe"].rooms
        assert {part for part, _ in rooms} == {"keys", "values"}, "the steps wrote their keys and values in place"
    assert torch.equal(kept.sequences, anew.sequences)
    torch.testing.assert_close(torch.stack(kept.logits), torch.stack(anew.logits), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- Parallel Context Windows


def windows_by_hand(ids: torch.Tensor, spans, attn_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """PCW's positions and additive 4D mask for one unpadded row, written with loops: window tokens attend the tokens
    before the first window and their own window, positions restarting at its start; later tokens attend everything,
    their positions continuing from the longest window."""
    n = ids.shape[1]
    first, last = spans[0][0], spans[-1][1]
    longest = max(end - start for start, end in spans)
    window = [next((k for k, (start, end) in enumerate(spans) if start <= i < end), -1) for i in range(n)]
    positions = []
    for i in range(n):
        if window[i] >= 0:
            positions.append(first + i - spans[window[i]][0])
        else:
            positions.append(i if i < first else i - last + first + longest)
    mask = torch.full((1, 1, n, n), torch.finfo(attn_dtype).min)
    for i in range(n):
        for j in range(i + 1):
            if window[i] < 0 or window[j] < 0 or window[i] == window[j]:
                mask[0, 0, i, j] = 0.0
    return torch.tensor([positions]), mask


@pytest.mark.parametrize("model_name", MODELS)
def test_windows_are_read_alone_and_the_task_reads_them_all(model_name):
    spans = ((2, 6), (6, 9), (9, 14))
    model, plain = mitigated(model_name, "eager"), plain_model(model_name, "eager")
    ids = random_ids(1, 18)
    ours = logits(model, ids, parallel_context_windows={"spans": [spans]})
    for start, end in spans:  # the tokens before the first window, then this window alone
        alone = torch.cat((ids[:, : spans[0][0]], ids[:, start:end]), 1)
        torch.testing.assert_close(ours[:, start:end], logits(plain, alone)[:, spans[0][0] :], rtol=1e-5, atol=1e-5)
    positions, mask = windows_by_hand(ids, spans)
    reference = logits(plain, ids, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert (ours[:, 14:] - logits(plain, ids)[:, 14:]).abs().max() > 1e-3


def test_windows_keep_the_sliding_window_of_the_layers_that_have_one():
    """Qwen2 with sliding-window layers beside full ones: each kind of layer gets its own mask with the windows."""
    sliding = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model, plain = mitigated("qwen2", "eager", **sliding), plain_model("qwen2", "eager", **sliding)
    spans, ids = ((2, 6), (6, 9), (9, 14)), random_ids(1, 18)
    positions, full = windows_by_hand(ids, spans)
    within_window = full.clone()
    for i in range(18):
        within_window[0, 0, i, : max(i - 7, 0)] = torch.finfo(torch.float32).min  # keys 8 or more tokens back
    masks = {"full_attention": full, "sliding_attention": within_window}
    reference = logits(plain, ids, attention_mask=masks, position_ids=positions)
    torch.testing.assert_close(logits(model, ids, parallel_context_windows={"spans": [spans]}), reference)


# ----------------------------------------------------------------------------------------------------- calibration


def calibration_reference(model_name, ids, spans, temperature, layers, first_row, ratio=1.0):
    """Logits with attention calibration written from the paper's formula (one unpadded row): `bias(k)` is the last
    prompt token's mean attention on pad tokens put in place of document `k` (eager passes of the plain model), and
    every row from `first_row` on (the prompt's last token, then each decoded token) is re-weighted over the documents:
    document `k`'s tokens times `α_k / Attn(doc_k) · C`, `α = softmax((Attn(doc) - bias) / t)`, `C` keeping the total
    attention on the documents. Every pass reads positions `m / ratio` (MS-PoE with one ratio in every layer)."""
    plain = plain_model(model_name, "eager")
    prompt = ids[:, : first_row + 1]

    def at_ratio(length: int) -> dict:  # GPT-2's learned table takes integer positions only
        return {} if ratio == 1.0 else {"position_ids": torch.arange(length)[None] / ratio}

    bias = []
    for start, end in spans:
        dummy = prompt.clone()
        dummy[:, start:end] = plain.config.pad_token_id
        with torch.no_grad():
            attentions = plain(dummy, output_attentions=True, **at_ratio(first_row + 1)).attentions
        bias.append(torch.stack([layer[0, :, -1, start:end].mean(-1) for layer in attentions]))  # (L, H)
    bias = torch.stack(bias, -1)  # (L, H, K)

    def calibrated(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        probs = (torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask).softmax(-1)  # (1, H, n, n)
        if module.layer_idx in layers:
            for row in range(first_row, probs.shape[2]):
                attention = probs[0, :, row].clone()  # (H, n)
                mass = torch.stack([attention[:, start:end].sum(-1) for start, end in spans], -1)  # (H, K)
                sizes = torch.tensor([float(end - start) for start, end in spans])
                alpha = ((mass / sizes - bias[module.layer_idx]) / temperature).softmax(-1)
                total = mass.sum(-1, keepdim=True) / (alpha * sizes).sum(-1, keepdim=True)
                for k, (start, end) in enumerate(spans):
                    probs[0, :, row, start:end] = (
                        attention[:, start:end] * (alpha[:, k] / (mass[:, k] / sizes[k]))[:, None] * total
                    )
        return torch.matmul(probs, value).transpose(1, 2), probs

    AttentionInterface.register("calibration_reference", calibrated)
    plain.set_attn_implementation("calibration_reference")
    additive = torch.triu(torch.full((ids.shape[1],) * 2, torch.finfo(torch.float32).min), 1)[None, None]
    return logits(plain, ids, attention_mask=additive, **at_ratio(ids.shape[1]))


@pytest.mark.parametrize("model_name", MODELS)
def test_calibration_equals_the_papers_formula_at_prefill_and_at_each_decoding_step(model_name):
    spans, temperature, layers = ((1, 4), (4, 8), (8, 11)), 0.05, (1, 2)
    model = mitigated(model_name, "eager")
    ids = random_ids(1, 16)
    option = AttentionCalibration(spans=[spans], temperature=temperature, layers=layers)
    steps = stepwise_logits(model, ids, 12, attention_calibration=option)
    reference = calibration_reference(model_name, ids, spans, temperature, layers, first_row=11)
    torch.testing.assert_close(steps, reference, rtol=1e-4, atol=1e-4)
    assert (reference[:, 11:] - logits(plain_model(model_name, "eager"), ids)[:, 11:]).abs().max() > 1e-3


@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_calibration_reweights_the_attention_ms_poe_turned(model_name):
    """MS-PoE with one ratio `r` in every layer is the model at positions `m / r`; with calibration in the same layers,
    calibration's formula on the model at `m / r` (its dummy passes too), at prefill and at each decoding step: the
    calibrated row is computed from the turned queries and keys, not past them."""
    spans, temperature, layers, ratio = ((1, 4), (4, 8), (8, 11)), 0.05, (1, 2), 1.5
    model = mitigated(model_name, "eager")
    ids = random_ids(1, 16)
    option = {
        "attention_calibration": AttentionCalibration(spans=[spans], temperature=temperature, layers=layers),
        "ms_poe": MSPoE(r_min=ratio, r_max=ratio, layers=(0, 1, 2)),
    }
    steps = stepwise_logits(model, ids, 12, **option)
    reference = calibration_reference(model_name, ids, spans, temperature, layers, first_row=11, ratio=ratio)
    torch.testing.assert_close(steps[:, 11:], reference[:, 11:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_name", ["llama", "qwen2"])
def test_calibration_with_ms_poe_generates_as_its_forward_computes(model_name):
    """Calibration's dummy passes run the call's other options on a batch of their own (a row per document): given
    the call's position_ids by `generate`, as `forward` is not, they still run at their own rows' positions. The
    first generated token is the forward's argmax, the whole batch left-padded."""
    model = mitigated(model_name)
    ids, mask = left_padded([random_ids(1, 12, seed=1)[0], random_ids(1, 11, seed=2)[0]])
    option = {"attention_calibration": AttentionCalibration(spans=(SPANS,) * 2, temperature=0.1), "ms_poe": MSPoE()}
    forward = logits(model, ids, attention_mask=mask, **option)[:, -1]
    generated = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **option,
    )
    torch.testing.assert_close(generated.logits[0], forward, rtol=1e-5, atol=1e-5)


def test_calibration_decodes_past_a_sliding_window_as_with_every_key_kept():
    """A sliding-window cache drops the keys that slid out; a cache keeping them all, masked by the window, is the
    oracle."""
    model = mitigated("mistral", "eager", sliding_window=6)
    ids, option = random_ids(2, 16), options("calibration", 2)
    sliding = stepwise_logits(model, ids, 11, **option)
    every_key = stepwise_logits(model, ids, 11, cache=sepformer.SepFormerCache(), **option)
    torch.testing.assert_close(sliding, every_key, rtol=1e-5, atol=1e-5)


def test_options_a_model_lacks_are_refused_by_name_before_any_work():
    model = mitigated("gpt2")
    calls = []
    model.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    ids = random_ids(1, 12)
    refused = {
        "ms_poe": (MSPoE(1.2, 1.8), r"ms_poe rescales the rotary positions .*GPT2LMHeadModel .*no \(single\) rotary"),
        "attention_calibration": (
            AttentionCalibration(spans=[SPANS], bias_estimate="positional"),
            r"bias_estimate='positional' reads the positional block, but GPT2LMHeadModel .* has none",
        ),
    }
    for name, (option, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, **{name: option})
        with pytest.raises(ValueError, match=message):
            model(ids, **{name: option})
    assert not calls


# ----------------------------------------------------------------------------------------------------- reordering


@pytest.mark.parametrize("model_name", ["mistral", "gpt2"])
def test_generate_reorders_the_documents_as_reordering_by_hand_would(model_name):
    model = mitigated(model_name)
    prompts = [random_ids(1, 14, seed=1)[0], random_ids(1, 11, seed=2)[0]]
    ids, mask = left_padded(prompts)
    scores = ((0.1, 0.9, 0.5), (0.7, 0.2, 0.3))  # "first": documents (1, 2, 0) and (0, 2, 1)
    by_hand = []
    for prompt, order in zip(prompts, ((1, 2, 0), (0, 2, 1)), strict=True):
        documents = [prompt[start:end] for start, end in SPANS]
        by_hand.append(torch.cat((prompt[:1], *(documents[k] for k in order), prompt[10:])))
    reordered_ids, _ = left_padded(by_hand)
    for beams in (1, 2):
        settings = dict(new=4, num_beams=beams, num_return_sequences=beams)
        option = {"spans": [SPANS] * 2, "by": scores, "strategy": "first"}
        ours = greedy(model, ids, mask, reorder_documents=option, **settings)
        assert torch.equal(ours, greedy(model, reordered_ids, mask, **settings))
    from_attention = greedy(model, ids, mask, reorder_documents={"spans": [SPANS] * 2}, stable_mask={"gamma": 0.5})
    assert from_attention.shape == (2, ids.shape[1] + 6)
    assert model.config._attn_implementation == sepformer.any_decoder.register_wrapper("sdpa")  # back after scoring


def test_a_sepformer_is_returned_as_it_is_and_what_is_no_causal_lm_is_a_type_error():
    sepformer_model = tiny_model()
    assert add_mitigations(sepformer_model) is sepformer_model and type(sepformer_model) is SepFormerForCausalLM
    for other in (torch.nn.Linear(2, 2), None, LlamaModel(LlamaConfig(**SIZES, num_attention_heads=4))):
        with pytest.raises(
            TypeError, match=f"add_mitigations takes a Hugging Face causal LM .* got {type(other).__name__}"
        ):
            add_mitigations(other)


def test_ms_poe_cached_steps_of_a_long_generation_equal_the_full_pass():
    """The turns from `m` to `m / r` of prefills and decoding steps, one after another past 128 and 256 positions, with
    the turned keys kept on the cache between calls: the cached steps equal the full pass."""
    model = mitigated("llama")
    ids, fixed = random_ids(1, 262), options("ms_poe_fixed")
    cache = sepformer.SepFormerCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :125], past_key_values=cache, use_cache=True, **fixed).logits]
        steps += [
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **fixed).logits for t in range(125, 130)
        ]
        steps.append(model(ids[:, 130:258], past_key_values=cache, use_cache=True, **fixed).logits)
        steps += [
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **fixed).logits for t in range(258, 262)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), logits(model, ids, **fixed), rtol=1e-5, atol=1e-5)


def test_a_cache_first_called_plain_is_checked_once_a_prefill_with_an_option_fixed_state_on_it():
    """Whether a cache holds a prefill's state is read at each call: a plain call on the empty cache first, then a
    prefill with MS-PoE, then a call continuing it without MS-PoE, which is refused."""
    model = mitigated("llama")
    ids, cache = random_ids(1, 12), sepformer.SepFormerCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache, use_cache=True)
        cache.reset()
        model(ids[:, :11], past_key_values=cache, use_cache=True, ms_poe=MSPoE(1.2, 1.8))
        assert cache.prefill_options
        with pytest.raises(ValueError, match="this cache was prefilled with ms_poe"):
            model(ids[:, 11:], past_key_values=cache, use_cache=True)
