"""What a generation fixes at prefill lives on the `SepFormerCache` and follows the batch through `generate`."""

import pytest
import torch
from conftest import tiny_model
from transformers import GenerationConfig

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    SepFormerCache,
    SepFormerTokenizer,
    StableMask,
)

PROMPTS = ["def f(x): return x", "import os, sys  # x", "a longer prompt, with more bytes"]
SPANS = ((0, 5), (5, 10), (10, 15))


def strong_model():
    model = tiny_model(rotary_dim=4)
    with torch.no_grad():
        model.model.embed_positions.weight.normal_(0, 1)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.5)
            layer.self_attn.k_proj.weight.normal_(0, 0.5)
    return model


OPTIONS = {
    "ms_poe": lambda rows: {"ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1))},
    "calibration": lambda rows: {
        "attention_calibration": AttentionCalibration(spans=(SPANS,) * rows, temperature=1e-2, layers=(0, 1))
    },
    "calibration_positional": lambda rows: {
        "attention_calibration": AttentionCalibration(
            spans=(SPANS,) * rows, temperature=1e-2, layers=(0, 1), bias_estimate="positional"
        )
    },
}


def generate_alone(model, tokenizer, options, **kwargs):
    return [model.generate(**tokenizer([prompt], return_tensors="pt"), **options(1), **kwargs)[0] for prompt in PROMPTS]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_beam_search_gives_each_row_what_it_gives_alone(name):
    model, tokenizer = strong_model(), SepFormerTokenizer(padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    together = model.generate(**batch, **OPTIONS[name](len(PROMPTS)), **kwargs)[:, batch.input_ids.shape[1] :]
    for row, alone in enumerate(generate_alone(model, tokenizer, OPTIONS[name], **kwargs)):
        assert torch.equal(together[row], alone[-6:]), PROMPTS[row]
    without = model.generate(**batch, **kwargs)[:, batch.input_ids.shape[1] :]
    assert not torch.equal(together, without)  # the option changed the generation


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_several_return_sequences_each_carry_their_rows_state(name):
    """Sampling restricted to the top token is deterministic: every returned sequence is its row's greedy output."""
    model, tokenizer = strong_model(), SepFormerTokenizer(padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
    sampled = model.generate(
        **batch, **OPTIONS[name](len(PROMPTS)), do_sample=True, top_k=1, num_return_sequences=2, **kwargs
    )[:, batch.input_ids.shape[1] :]
    for row, alone in enumerate(generate_alone(model, tokenizer, OPTIONS[name], do_sample=False, **kwargs)):
        assert torch.equal(sampled[2 * row], alone[-6:]) and torch.equal(sampled[2 * row + 1], alone[-6:])


BUCKETS = AttentionBuckets(bases=[10000.0, 500.0])
ROW_SPANS = (((0, 5), (5, 10)), ((1, 4), (4, 9)), ((2, 8), (8, 12)))  # rows differ, so their order shows
BATCH_OPERATIONS = {  # (operation, the rows it leaves, the tokens it leaves of 16)
    "reorder": (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 0])), [2, 0, 0], 16),
    "repeat": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2], 16),
    "select": (lambda cache: cache.batch_select_indices(torch.tensor([1, 2])), [1, 2], 16),
    "crop": (lambda cache: cache.crop(-3), [0, 1, 2], 13),
    "reset": (lambda cache: cache.reset(), None, 0),
    "crop everything": (lambda cache: cache.crop(-16), None, 0),
}


def prefill_state(cache: SepFormerCache) -> dict[str, torch.Tensor]:
    """What a prefill fixed on `cache`, by name: each per row (bucket 1's keys per row and token: each row's second
    copy)."""
    kept = cache.mitigation_state
    ms_poe, calibration = (kept.get(name) for name in ("ms_poe", "attention_calibration"))
    state = {
        "bucket keys": cache.layers[0].keys[1::2] if cache.row_copies == 2 else None,
        "ranks": ms_poe.ranks.get(0) if ms_poe else None,
        "bias": calibration.bias.get(1) if calibration else None,
        "spans": calibration.spans if calibration else None,
    }
    return {name: tensor.clone() for name, tensor in state.items() if tensor is not None}


@pytest.mark.parametrize("operation", sorted(BATCH_OPERATIONS))
def test_every_batch_operation_applies_to_every_state_a_prefill_fixed(operation):
    """Beam search reorders, several return sequences repeat, other strategies select, assisted decoding crops:
    MS-PoE's ranks, calibration's bias(k) and spans follow the rows (a crop keeps them: they are per row), the
    buckets' copies of each row the rows and tokens. A reset, or a crop of every token, drops them all: the next call
    is a prefill."""
    model = strong_model()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    ranked_and_calibrated = {
        "ms_poe": MSPoE(layers=(0,)),
        "attention_calibration": AttentionCalibration(spans=ROW_SPANS, temperature=1e-2, layers=(1,)),
    }
    caches = {}
    with torch.no_grad():
        for name, options in (("mitigations", ranked_and_calibrated), ("buckets", {"attention_buckets": BUCKETS})):
            caches[name] = SepFormerCache(config=model.config)
            model(ids, past_key_values=caches[name], use_cache=True, **options)
    before = {name: state for cache in caches.values() for name, state in prefill_state(cache).items()}
    assert sorted(before) == ["bias", "bucket keys", "ranks", "spans"]
    operate, rows, tokens = BATCH_OPERATIONS[operation]
    for cache in caches.values():
        operate(cache)
        assert cache.get_seq_length() == tokens
    after = {name: state for cache in caches.values() for name, state in prefill_state(cache).items()}
    if rows is None:
        assert after == {}
        assert all(cache.prefill_options is None and cache.mitigation_state == {} for cache in caches.values())
        return
    for name, state in before.items():
        expected = state[rows][:, :, :tokens] if name == "bucket keys" else state[rows]
        assert torch.equal(after[name], expected), name
        if operation == "reorder":  # the rows differ: a state left in place would show
            assert not torch.equal(expected, state), name


@pytest.mark.parametrize("empty", ["reset", "crop everything"])
@pytest.mark.parametrize(
    "first, second",
    [
        ({"ms_poe": MSPoE(layers=(0, 1))}, {"ms_poe": MSPoE(layers=(0, 1))}),
        ({"attention_buckets": BUCKETS}, {}),
        ({"positional_scaling": PositionalScaling(0.5)}, {}),
    ],
    ids=["ms_poe", "buckets then none", "scaling then none"],
)
def test_an_emptied_cache_is_prefilled_as_a_new_one(empty, first, second):
    """A prefill on an emptied cache fixed nothing of its own where the last prefill had: MS-PoE kept the last
    prompt's ranks, and a cache prefilled with buckets or positional scaling refused to go on without them."""
    model = strong_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    emptied, fresh = SepFormerCache(config=model.config), SepFormerCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 12)), past_key_values=emptied, use_cache=True, **first)
        BATCH_OPERATIONS[empty][0](emptied)
        logits = {}
        for name, cache in (("emptied", emptied), ("fresh", fresh)):
            prefill = model(ids[:, :11], past_key_values=cache, use_cache=True, **second).logits
            step = model(ids[:, 11:], past_key_values=cache, use_cache=True, **second).logits
            logits[name] = torch.cat((prefill, step), 1)
    assert torch.equal(logits["emptied"], logits["fresh"])


LOOPING_PROMPT = torch.tensor([[5, 6, 7, 8, 9] * 3 + [5, 6, 7]])  # prompt lookup finds drafts in it
TWO_DOCUMENTS = (((0, 5), (5, 10)),)
ACTS_ON_THE_LAST_TOKEN = {
    "positional_scaling": PositionalScaling(-1.0, layers=(0, 1)),
    "attention_calibration": AttentionCalibration(spans=TWO_DOCUMENTS, temperature=1e-2, layers=(0, 1)),
    "ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1)),
}
ACTS_ALIKE_ON_EVERY_TOKEN = {
    "stable_mask": StableMask(0.2, columns=40),
    "ms_poe": MSPoE(r_min=1.5, r_max=3.0, layers=(0, 1), head_order=(2, 0, 3, 1)),
    "parallel_context_windows": ParallelContextWindows(spans=TWO_DOCUMENTS),
    "attention_buckets": BUCKETS,
}
ASSISTANCE = {
    "prompt_lookup": lambda: {"prompt_lookup_num_tokens": 3},
    "assistant_model": lambda: {"assistant_model": tiny_model(seed=1, rotary_dim=4)},
    "prompt_lookup in a generation config": lambda: {"generation_config": GenerationConfig(prompt_lookup_num_tokens=3)},
}


@pytest.mark.parametrize("assistance", sorted(ASSISTANCE))
def test_assisted_decoding_refuses_what_acts_on_the_prompts_last_token(assistance):
    """Assisted decoding prefills the prompt with drafted tokens after it and verifies several drafts per call:
    positional scaling, calibration and ranked MS-PoE acted on a drafted token (greedy assisted decoding gave other
    tokens than plain greedy). Refused before the model runs; the other options give plain greedy's tokens."""
    model = strong_model()
    passes = []
    model.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    greedy = dict(max_new_tokens=12, do_sample=False)
    for name, option in ACTS_ON_THE_LAST_TOKEN.items():
        with pytest.raises(ValueError, match=f"{name} acts on the prompt's last token, but assisted decoding"):
            model.generate(LOOPING_PROMPT, **greedy, **ASSISTANCE[assistance](), **{name: option})
    assert not passes
    for name, option in ACTS_ALIKE_ON_EVERY_TOKEN.items():
        plain = model.generate(LOOPING_PROMPT, **greedy, **{name: option})
        assisted = model.generate(LOOPING_PROMPT, **greedy, **ASSISTANCE[assistance](), **{name: option})
        assert torch.equal(assisted, plain), name


def test_assisted_decoding_set_on_the_models_generation_config_is_refused_too():
    """`generate` merges the model's generation config into the settings it is given: prompt lookup set there drafts."""
    model = strong_model()
    model.generation_config.prompt_lookup_num_tokens = 3
    with pytest.raises(ValueError, match="ms_poe acts on the prompt's last token, but assisted decoding"):
        model.generate(LOOPING_PROMPT, max_new_tokens=4, do_sample=False, ms_poe=ACTS_ON_THE_LAST_TOKEN["ms_poe"])


@pytest.mark.parametrize("name", sorted(ACTS_ON_THE_LAST_TOKEN))
def test_a_call_continuing_a_cache_with_several_tokens_is_as_many_steps(name):
    """Positional scaling and MS-PoE act alike on every token of a call that continues a cache: three tokens in one
    call give the logits of three calls of one. Calibration calibrates each call's last row only, so it refuses."""
    model = strong_model()
    ids = LOOPING_PROMPT[:, :13]
    option = {name: ACTS_ON_THE_LAST_TOKEN[name]}
    one_call, one_by_one = SepFormerCache(config=model.config), SepFormerCache(config=model.config)
    with torch.no_grad():
        for cache in (one_call, one_by_one):
            model(ids[:, :10], past_key_values=cache, use_cache=True, **option)
        if name == "attention_calibration":
            with pytest.raises(ValueError, match="calibrates each decoding step's token: .* this one has 3, "):
                model(ids[:, 10:], past_key_values=one_call, use_cache=True, **option)
            return
        together = model(ids[:, 10:], past_key_values=one_call, use_cache=True, **option).logits
        steps = [
            model(ids[:, t : t + 1], past_key_values=one_by_one, use_cache=True, **option).logits for t in (10, 11, 12)
        ]
    torch.testing.assert_close(together, torch.cat(steps, 1), rtol=1e-5, atol=1e-5)


def test_forward_and_generate_make_a_sepformer_cache():
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert isinstance(model(ids, use_cache=True).past_key_values, SepFormerCache)
    out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, SepFormerCache)


def test_state_needs_a_cache_that_keeps_it():
    from transformers import DynamicCache, StaticCache

    model = tiny_model()
    ids = torch.randint(0, 256, (1, 12))
    with pytest.raises(ValueError, match=r"needs a cache that grows with the tokens and carries that state.* got Dyn"):
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True, ms_poe=MSPoE())
    static = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match=r"carries that state .*; got StaticCache \(a static cache\)\.$"):
        model(ids, past_key_values=static, use_cache=True, ms_poe=MSPoE())
    # a fixed head order keeps nothing: any cache will do
    model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True, ms_poe=MSPoE(head_order=(0, 1, 2, 3)))


def test_generate_continues_a_cache_the_caller_passes():
    """A cache given to `generate` is used and grown, whatever its class (only the one `generate` makes is ours)."""
    from transformers import DynamicCache

    model = tiny_model()
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
    continued = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == 12  # 10 prompt tokens, then the first two generated tokens fed back
    assert torch.equal(continued, model.generate(ids, max_new_tokens=3, do_sample=False))


# ------------------------------------------------------------------ the growing layers: in-place appends, no aliasing


def steps_with(model, cache, ids, prefill):
    """Logits of a prefill and then one step per remaining token, with `cache`."""
    with torch.no_grad():
        logits = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, 1)


def test_growing_layers_equal_a_dynamic_cache_across_regrowths():
    """A prefill stored as a `DynamicLayer` stores it, then room made at the first step and once more when it ran out
    (past 17 + 128 tokens): the logits of a `DynamicCache`, which concatenates."""
    from transformers import DynamicCache

    model = tiny_model(max_position_embeddings=256)
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(0))
    cache = SepFormerCache(config=model.config)
    capacities = set()
    with torch.no_grad():
        model(ids[:, :16], past_key_values=cache, use_cache=True)
        assert cache.layers[0].key_buffer is None  # a prefill (or a plain forward) keeps no room
        for t in range(16, 200):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            capacities.add(cache.layers[0].key_buffer.shape[2])
    assert capacities == {17 + 128, 146 + 128}
    assert cache.layers[0].keys._base is cache.layers[0].key_buffer
    grown = steps_with(model, SepFormerCache(config=model.config), ids, 16)
    torch.testing.assert_close(grown, steps_with(model, DynamicCache(config=model.config), ids, 16), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_name", ["sepformer", "qwen2"])
def test_a_cache_filled_under_inference_mode_continues_outside_it(model_name):
    """Buffers made under `torch.inference_mode` cannot be written outside it: the steps after make new ones, and give
    a `DynamicCache`'s logits (on a grouped-query decoder with MS-PoE, whose kept keys and values have buffers too)."""
    from test_any_decoder import mitigated, options
    from transformers import DynamicCache

    model = tiny_model() if model_name == "sepformer" else mitigated(model_name)
    keywords = {} if model_name == "sepformer" else options("ms_poe_fixed")
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))

    def steps(cache) -> torch.Tensor:
        logits = []
        for start, end in ((0, 8), (8, 9), (9, 10), (10, 11), (11, 12), (12, 14)):
            with torch.inference_mode() if end <= 10 else torch.no_grad():
                logits.append(model(ids[:, start:end], past_key_values=cache, use_cache=True, **keywords).logits)
        return torch.cat(logits, 1)

    grown = steps(SepFormerCache(config=model.config))
    torch.testing.assert_close(grown, steps(DynamicCache(config=model.config)), rtol=1e-5, atol=1e-5)


def test_a_step_does_not_change_keys_handed_out_before():
    """Not after a step, nor after a crop (whose dropped tokens a tensor taken before it still holds), nor after the
    keys were assigned."""
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    cache = SepFormerCache(config=model.config)
    layer = cache.layers[0]
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        model(ids[:, 8:9], past_key_values=cache, use_cache=True)
        handed_out = [layer.keys]
        model(ids[:, 9:10], past_key_values=cache, use_cache=True)
        handed_out.append(layer.keys)
        cache.crop(-2)
        kept = [keys.clone() for keys in handed_out]
        model(ids[:, 10:11], past_key_values=cache, use_cache=True)
        handed_out.append(layer.keys)
        kept.append(handed_out[-1].clone())
        assigned = layer.keys = layer.keys * 2  # the buffers no longer hold the keys
        model(ids[:, 11:12], past_key_values=cache, use_cache=True)
    assert all(torch.equal(keys, copy) for keys, copy in zip(handed_out, kept, strict=True))
    assert layer.keys.shape[2] == 10 and layer.keys._base is layer.key_buffer
    assert torch.equal(layer.keys[:, :, :9], assigned)


@pytest.mark.parametrize(
    "operation",
    [
        lambda cache: cache.crop(-2),
        lambda cache: cache.reorder_cache(torch.tensor([1, 0])),
        lambda cache: cache.batch_repeat_interleave(1),
        lambda cache: cache.batch_select_indices(torch.tensor([0, 1])),
        lambda cache: cache.layers[0].offload() or cache.layers[0].prefetch(),
    ],
    ids=["crop", "reorder", "repeat", "select", "offload"],
)
def test_growing_layers_drop_their_room_at_batch_operations_and_equal_a_dynamic_cache(operation):
    """A batch operation leaves new tensors (or, for a crop, a view the next step must not write into): the buffers
    are dropped at once, not kept beside them, and the next steps equal a `DynamicCache`'s."""
    import copy

    from transformers import DynamicCache

    model = tiny_model()
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(2))
    logits = {}
    caches = {"growing": SepFormerCache(config=model.config), "dynamic": DynamicCache(config=model.config)}
    for name, cache in caches.items():
        with torch.no_grad():
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            model(ids[:, 8:9], past_key_values=cache, use_cache=True)
            operation(cache)
            assert getattr(cache.layers[0], "key_buffer", None) is None
            position = cache.get_seq_length()
            copied = copy.deepcopy(cache)
            step = model(ids[:, position : position + 1], past_key_values=cache, use_cache=True).logits
            copied_step = model(ids[:, position : position + 1], past_key_values=copied, use_cache=True).logits
            again = model(ids[:, position + 1 : position + 2], past_key_values=cache, use_cache=True).logits
        assert torch.equal(step, copied_step)
        logits[name] = torch.cat((step, again), 1)
    torch.testing.assert_close(logits["growing"], logits["dynamic"], rtol=0, atol=1e-6)


def test_growing_layers_concatenate_under_autograd():
    """With autograd on, even where the keys and values need no gradient (only `q_proj` trains), a step must not
    write into tensors an earlier step's attention saved for the backward pass."""
    model = tiny_model()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("q_proj" in name)
    ids = torch.randint(0, 256, (1, 10))
    cache = SepFormerCache(config=model.config)
    first = model(ids[:, :8], past_key_values=cache, use_cache=True).logits
    second = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    (first.sum() + second.sum()).backward()
    assert cache.layers[0].key_buffer is None


def test_growing_layers_take_other_states_as_a_dynamic_cache_does():
    """Outside autograd, states of another dtype are concatenated (and promoted) as `DynamicLayer` does, not written
    into the buffers in the cache's dtype; states of another batch, in either direction, are refused, not broadcast."""
    model = tiny_model()
    for states_of in (
        lambda keys: keys.double(),
        lambda keys: keys[:1],
        lambda keys: torch.cat((keys, keys)),
    ):
        cache = SepFormerCache(config=model.config)
        with torch.no_grad():
            model(torch.randint(0, 256, (2, 6)), past_key_values=cache, use_cache=True)
            model(torch.randint(0, 256, (2, 1)), past_key_values=cache, use_cache=True)
            layer = cache.layers[0]
            assert layer.key_buffer is not None
            states = states_of(layer.keys[:, :, :1])
            if states.dtype == torch.float64:
                promoted, _ = layer.update(states, states)
                assert promoted.dtype == torch.float64 and promoted.shape[2] == 8
                continue
            with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
                layer.update(states, states)


def test_a_cache_made_from_another_caches_data_holds_it():
    """`SepFormerCache(ddp_cache_data, config=...)` (as DDP hands caches over): its growing layers take the data."""
    from transformers import DynamicCache

    model = tiny_model()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], past_key_values=dynamic, use_cache=True)
        data = [(layer.keys, layer.values) for layer in dynamic.layers]
        made = SepFormerCache(ddp_cache_data=data, config=model.config)
        assert made.get_seq_length() == 8
        logits = {
            name: torch.cat([model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in (8, 9)], 1)
            for name, cache in (("made", made), ("dynamic", dynamic))
        }
    torch.testing.assert_close(logits["made"], logits["dynamic"], rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the plan kept for the generation's decoding steps


def mitigated_llama():
    from test_any_decoder import mitigated

    return mitigated("llama")


def test_a_mitigated_decoder_given_its_cache_by_position_uses_it_as_given_by_keyword():
    model = mitigated_llama()
    ids = torch.randint(3, 200, (1, 10))
    ms_poe = MSPoE(r_min=1.2, r_max=2.0)
    by_position, by_keyword = SepFormerCache(config=model.config), SepFormerCache(config=model.config)
    with torch.no_grad():
        first = model(ids, None, None, by_position, ms_poe=ms_poe).logits  # input_ids, mask, positions, cache
        assert torch.equal(first, model(ids, past_key_values=by_keyword, ms_poe=ms_poe).logits)
        assert by_position.get_seq_length() == by_keyword.get_seq_length() == 10
        with pytest.raises(ValueError, match="this cache was prefilled with ms_poe="):
            model(ids[:, :1], None, None, by_position)  # continued without the options its prefill fixed state with


KEPT_DOCUMENTS = {  # what is done to the cache after a prefill of 14 tokens, and the rows it leaves
    "crop into a document": (lambda cache: cache.crop(-7), [0, 1, 2]),
    "crop a whole document away": (lambda cache: cache.crop(-9), [0, 1, 2]),
    "reorder": (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 1])), [2, 0, 1]),
}


@pytest.mark.parametrize("change", sorted(KEPT_DOCUMENTS))
@pytest.mark.parametrize("make_model", [strong_model, mitigated_llama], ids=["sepformer", "llama"])
def test_calibration_steps_read_the_documents_of_the_keys_the_cache_holds(make_model, change):
    """The prompt keys' documents, kept from the prefill, follow a batch operation or a crop as the documents read
    from each step's key positions do (what the step computes where the cache keeps none)."""
    model = make_model()
    ids, steps = torch.randint(3, 200, (3, 14)), torch.randint(3, 200, (3, 3))
    mask = torch.ones_like(ids)
    mask[0, :2], mask[2, :1] = 0, 0  # rows padded differently, so each row's documents sit elsewhere
    options = {"attention_calibration": AttentionCalibration(spans=ROW_SPANS, temperature=1e-2)}
    operate, rows = KEPT_DOCUMENTS[change]
    logits = {}
    with torch.no_grad():
        for kept in (True, False):
            cache = SepFormerCache(config=model.config)
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **options)
            operate(cache)
            step_mask = mask[rows, : cache.get_seq_length()]
            state, logits[kept] = cache.mitigation_state["attention_calibration"], []
            for t in range(3):
                step_mask = torch.cat((step_mask, torch.ones(len(rows), 1, dtype=torch.long)), 1)
                if not kept:
                    state.documents = None  # made anew from the step's key positions
                token = steps[rows, t : t + 1]
                output = model(token, attention_mask=step_mask, past_key_values=cache, use_cache=True, **options)
                logits[kept].append(output.logits)
    torch.testing.assert_close(torch.cat(logits[True], 1), torch.cat(logits[False], 1), rtol=1e-5, atol=1e-5)
    assert torch.cat(logits[True], 1).isfinite().all()


@pytest.fixture
def resolves(monkeypatch):
    """How many times each mitigation was resolved against a call, by option name."""
    from sepformer.mitigations import MITIGATIONS

    counts = {name: 0 for name in MITIGATIONS}
    for name, mitigation in MITIGATIONS.items():

        def counted(options, call, name=name, resolve=mitigation.resolve):
            counts[name] += 1
            return resolve(options, call)

        monkeypatch.setattr(mitigation, "resolve", counted)
    return counts


def mitigated_llama_in_bfloat16():
    return mitigated_llama().to(torch.bfloat16)


@pytest.mark.parametrize(
    "make_model", [strong_model, mitigated_llama, mitigated_llama_in_bfloat16], ids=["sepformer", "llama", "llama-bf16"]
)
def test_decoding_steps_reuse_the_plan_of_the_first_step_and_generate_the_same(make_model, resolves, monkeypatch):
    """The prefill and the first decoding step resolve the options; the other steps reuse the first step's plan (with
    the model's dtype, kept with it: MS-PoE turns the queries and keys in it), and generate what resolving at every
    step generates (beams included)."""
    import sepformer.mitigations

    model = make_model()
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    spans = ((1, 4), (4, 7), (7, 9))
    options = dict(
        ms_poe=MSPoE(r_min=1.2, r_max=2.0),
        attention_calibration=AttentionCalibration(spans=(spans,) * 3, temperature=0.1),
    )
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **options)
    kwargs |= dict(return_dict_in_generate=True, output_scores=True)

    def generated(**more) -> list[torch.Tensor]:  # the tokens and every step's scores
        output = model.generate(ids, **kwargs, **more)
        return [output.sequences, *output.scores]

    kept = generated()
    assert resolves["attention_calibration"] == 2
    assert resolves["ms_poe"] == 3  # and once more for calibration's dummy passes
    beams = generated(num_beams=2)
    monkeypatch.setattr(sepformer.mitigations, "keep_plan", lambda *args: None)  # every step resolves its options
    for ours, resolved in ((kept, generated()), (beams, generated(num_beams=2))):
        assert all(torch.equal(a, b) for a, b in zip(ours, resolved, strict=True))
    assert resolves["ms_poe"] > 3 + 5


@pytest.mark.parametrize("beside", ["attention_calibration", "parallel_context_windows", None])
def test_buckets_decoding_steps_reuse_the_first_steps_plan_beside_options_given_per_row(beside, resolves):
    """Several buckets repeat per-row options (spans) for the copies of each row: the steps keep the prefill's
    repeated objects, so they reuse the first step's plan as other options do."""
    model = strong_model()
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    spans = (((1, 4), (4, 7), (7, 9)),) * 3
    per_row = {
        "attention_calibration": AttentionCalibration(spans=spans, temperature=0.1),
        "parallel_context_windows": ParallelContextWindows(spans=(((0, 4), (4, 8), (8, 12)),) * 3),
        None: {},
    }
    options = {beside: per_row[beside]} if beside else {}
    buckets = AttentionBuckets(scales=(1.0, 0.8))
    model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, attention_buckets=buckets, **options)
    dummy_passes = beside == "attention_calibration"  # resolve the buckets once more, for their rows
    assert resolves["attention_buckets"] == 2 + dummy_passes  # the prefill and the first step
    if beside:
        assert resolves[beside] == 2


def test_nothing_holds_the_cache_after_generate_and_a_forward_loop_resolves_every_call(resolves):
    import gc
    import weakref

    from sepformer.mitigations import GENERATION_PLANS

    model, ids, ms_poe = strong_model(), torch.randint(3, 200, (1, 8)), MSPoE(r_min=1.2, r_max=2.0)
    gc.disable()  # a reference cycle would keep the cache until the collector runs
    try:
        output = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, ms_poe=ms_poe)
        cache = weakref.ref(output.past_key_values)
        del output
        assert cache() is None and GENERATION_PLANS.get() is None
    finally:
        gc.enable()
    cache = SepFormerCache()
    with torch.no_grad():
        for t in range(6):
            model(ids[:, t : t + 1] if t else ids[:, :3], past_key_values=cache, use_cache=True, ms_poe=ms_poe)
    assert resolves["ms_poe"] == 2 + 6  # the generation's prefill and first step; then every call of the loop


def test_a_step_resolves_and_checks_anew_when_its_options_or_its_form_change(resolves):
    from sepformer.mitigations import kept_for_generation

    model = strong_model()
    model.config.stable_mask = {"gamma": 0.5}
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    cache, ms_poe = SepFormerCache(), MSPoE(r_min=1.2, r_max=2.0)

    def step(t, options=ms_poe, rows=slice(None)):
        return model(ids[rows, t : t + 1], past_key_values=cache, use_cache=True, ms_poe=options)

    with torch.no_grad(), kept_for_generation():  # the steps of a generate call
        model(ids[:, :8], past_key_values=cache, use_cache=True, ms_poe=ms_poe)
        step(8)
        step(9)
        assert resolves["ms_poe"] == 2  # the prefill, the first step; the second step reused its plan
        step(10, MSPoE(r_min=1.2, r_max=2.0))  # equal options, another object: resolved, and accepted
        assert resolves["ms_poe"] == 3
        with pytest.raises(ValueError, match="continuing a cache needs the options of its prefill"):
            step(10, MSPoE(r_min=1.2, r_max=1.5))  # still checked against the prefill's
        step(10)
        step(10)
        assert resolves["ms_poe"] == resolves["stable_mask"] == 4  # the first object again: resolved, then kept
        model.config.stable_mask["gamma"] = 2.0  # the model's default changed in place
        step(10)
        assert resolves["stable_mask"] == 5
        cache.batch_select_indices(torch.tensor([1]))
        step(11, rows=slice(1, 2))
        assert resolves["ms_poe"] == 6  # another batch
        with torch.enable_grad():
            step(11, rows=slice(1, 2))  # autograd on: nothing kept from the weights may serve it
        assert resolves["ms_poe"] == 7
        cache.reset()
        model(ids[1:, :8], past_key_values=cache, use_cache=True, ms_poe=ms_poe)
        step(8, rows=slice(1, 2))  # a new prefill dropped the plan kept for the cache
        assert resolves["ms_poe"] == 9
