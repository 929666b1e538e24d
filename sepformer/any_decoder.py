"""The position-bias mitigations on any Hugging Face decoder: `add_mitigations(model)`.

```python
model = sepformer.add_mitigations(AutoModelForCausalLM.from_pretrained(...))
model.generate(ids, attention_mask=mask, stable_mask={"gamma": 0.5})
```

Without options the model computes what it computed before, with its own attention. How it is built on transformers'
extension points (the attention registry, position ids, 4D masks, caches, forward hooks): docs/design.md, "On any
Hugging Face decoder".
"""

import copy
import functools
import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache_sepformer import SepFormerCache
from .decoder_attention import attention_modules_served, query_key_layout_problem, refuse_option_keywords
from .kept import derived_store, kept_in
from .mitigated_generation import MitigationGenerationMixin
from .mitigation_base import (
    SCORE_TERMS,
    WRAPPED_IMPLEMENTATIONS,
    CallContext,
    LayerRun,
    Mitigation,
    ModelPositions,
    RowBases,
    attention_implementation,
    refuse_under_compile,
)
from .mitigations import (
    MITIGATIONS,
    call_options,
    causal_lm_wrapper,
    kept_plan,
    parse_options,
    plan_kept_for,
    resolve_plan,
    with_mitigation_keywords,
)
from .rotary import rotary_cos_sin, rotate_partial
from .spans import default_position_ids

PREFIX = "sepformer_mitigations_"
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # transformers' rope types whose `inv_freq` follows the length
MASK_MAKERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
PROBE_TOKENS = 4  # what `add_mitigations`' probe runs through the model


def rotates_half(modeling_module: str) -> bool:
    """Whether the model file `modeling_module`'s `apply_rotary_pos_emb` pairs the first and second halves of the
    rotated dimensions (Llama, Qwen2, Mistral), as MS-PoE's further turn does; Cohere and GPT-J pair neighbours."""
    apply = getattr(sys.modules.get(modeling_module), "apply_rotary_pos_emb", None)
    if apply is None:
        return False
    angles = torch.tensor([0.3, 0.5, 0.7, 1.1])  # each pair's angle: four frequencies at position 1
    cos, sin = rotary_cos_sin(torch.ones(1, 1), angles, torch.float64)  # (1, 1, 8), cos in both layouts
    vector = torch.arange(1.0, 9.0, dtype=torch.float64)[None, None, None]  # (b, heads, seq, head_dim) = (1, 1, 1, 8)
    try:
        theirs, _ = apply(vector, vector, cos, sin.chunk(2, -1)[1].repeat(1, 1, 2))  # transformers' sine, unsigned
    except Exception:  # another signature: not a layout this check can read
        return False
    return torch.allclose(theirs, rotate_partial(vector, cos[:, None], sin[:, None]))


@dataclass(frozen=True, eq=False, kw_only=True)
class DecoderPositions(ModelPositions):
    """Where a Hugging Face decoder keeps its positions, for the mitigations that read them, and what its probe run
    found."""

    rotates_half: bool  # whether its modeling file's `apply_rotary_pos_emb` rotates in the rotate-half layout
    attention_modules: tuple[nn.Module, ...]  # what the probe found calling the registered attention, by layer
    calls_position_hooks: bool = False
    knows_position_channels: bool = False
    extrapolates: bool = False

    @property
    def description(self) -> str:
        kind = "rotary positions" if self.rotary is not None else "no rotary embedding, e.g. GPT-2's learned positions"
        return f"{self.model_name} ({kind})"

    @property
    def no_positional_block(self) -> str:
        return f"{self.description} has none (a SepFormer's)"

    def positional_channels(self, config) -> tuple[int, ...]:
        raise ValueError(
            f"positional_scaling on {self.model_name} needs channels=(...): only a SepFormer knows its positional "
            "channels by construction (search_positional_scaling finds candidates for other models)."
        )

    def check_head_turn(self, config) -> None:
        """Refuse MS-PoE where each head's rotary cannot be turned further, from `m` to `m / r_h`, in the attention
        function: no single rotary, another layout than rotate-half, latent attention, or frequencies that follow the
        length."""
        if self.rotary is None:
            raise ValueError(
                f"ms_poe rescales the rotary positions of each head, but {self.description} has no (single) rotary "
                "embedding: MS-PoE is not defined for it."
            )
        if not self.rotates_half:
            raise ValueError(
                f"ms_poe turns each head's rotary further in the rotate-half layout (Llama, Qwen2, Mistral), and "
                f"{self.model_name}'s apply_rotary_pos_emb does not rotate so (or was not found in its modeling "
                "file): MS-PoE is not served for it."
            )
        if getattr(config, "qk_nope_head_dim", 0):
            raise ValueError(
                f"ms_poe turns the first rotary dimensions of each head, but {self.model_name}'s latent attention "
                "puts the rotary part of each head last ([nope ‖ rope], qk_rope_head_dim): MS-PoE is not served for it."
            )
        rope_type = getattr(self.rotary, "rope_type", "default")  # a dict of one per layer type, or one
        rope_types = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
        if length_dependent := sorted(rope_types & set(LENGTH_DEPENDENT_ROPE)):
            raise ValueError(
                f"ms_poe turns the rotary angles by the rotary's frequencies, but {self.model_name}'s rope_type "
                f"{length_dependent[0]!r} changes them with the sequence length during the forward."
            )

    def check_query_key_inputs(self, option: str, rewritten: str) -> None:
        """Refuse also a traced call: the projections read the rewritten input through hooks registered for it."""
        super().check_query_key_inputs(option, rewritten)
        refuse_under_compile(
            f"{option} makes the query and key projections of {self.model_name} read {rewritten} "
            "through hooks registered for the call"
        )

    def bucket_bases(self, options, config) -> tuple[tuple[float, ...] | None, None]:
        """The Attention Buckets' rotary bases (`None`: the model's own), each read by a rotary of the model's class
        built with that `rope_theta` (`rotary_at_base`)."""
        if self.rotary is None:
            raise ValueError(
                f"attention_buckets reads positions with other rotary bases or scales, but {self.description} has "
                "no (single) rotary embedding: learned absolute positions have no base to change, and a table is not "
                "read between its rows. Attention Buckets is not defined for it."
            )
        if options.bases is None:
            return None, None
        if self.layer_types is not None:
            raise ValueError(
                f"attention_buckets bases replace the one rotary base rope_theta, but {self.model_name} rotates each "
                f"layer type ({', '.join(sorted(set(self.layer_types)))}) with a base of its own: give scales=[...] "
                "instead (positions m · scale, read by every layer's own rotary)."
            )
        parameters = getattr(getattr(self.rotary, "config", None), "rope_parameters", None)
        rope_type = getattr(self.rotary, "rope_type", None)
        if not isinstance(parameters, dict) or "rope_theta" not in parameters or rope_type in LENGTH_DEPENDENT_ROPE:
            raise ValueError(
                f"attention_buckets bases replace the rotary base rope_theta of {self.description}, whose rotary "
                f"({type(self.rotary).__name__}, rope_type {rope_type!r}) "
                + (
                    "changes its frequencies with the sequence length"
                    if rope_type in LENGTH_DEPENDENT_ROPE
                    else "has no rope_parameters['rope_theta']"
                )
                + ": give scales=[...] instead, or use a model with a fixed rotary."
            )
        refuse_under_compile(
            f"attention_buckets bases build a rotary of {type(self.rotary).__name__}'s class at each base"
        )
        return options.bases, None

    def rotary_at_base(self, base: float | RowBases, positions: torch.Tensor, dtype: torch.dtype, cache):
        """What a rotary of the model's class built with `rope_theta=base` (one float, or one per row; kept for the
        generation) returns at `positions`: cos, sin (b or 1, seq, head_dim), or one complex tensor (DeepSeek-V2). Its
        frequencies have the dtype of the model's own (cast with the model by `.to(dtype)`, or kept in float32)."""

        def build(base: float) -> nn.Module:
            config = copy.deepcopy(self.rotary.config)
            config.rope_parameters = {**config.rope_parameters, "rope_theta": base}
            return type(self.rotary)(config).to(self.rotary.inv_freq.device, self.rotary.inv_freq.dtype)

        def tables(base: float) -> tuple:
            rotary = kept_in(derived_store(cache), ("rotary at base", base), lambda: build(base))
            return rotary(torch.empty(0, dtype=dtype, device=positions.device), positions)

        if not isinstance(base, RowBases):
            return tables(base)
        positions = positions.expand(len(base.bucket), -1)
        by_bucket = [tables(value) for value in base.values]  # every row read as each bucket
        rows = torch.arange(len(base.bucket), device=base.bucket.device)
        if isinstance(by_bucket[0], torch.Tensor):
            return torch.stack(by_bucket)[base.bucket, rows]
        return tuple(torch.stack(parts)[base.bucket, rows] for parts in zip(*by_bucket, strict=True))


class AttentionProbe:
    """A plan that records which layers' attention it reaches (`add_mitigations`' check of the model), with the
    inputs of each module and the queries and keys its attention function receives."""

    def __init__(self):
        self.modules: list[nn.Module] = []
        self.score_keywords: set[str] = set()
        self.inputs: dict[nn.Module, tuple] = {}  # module -> (its input, position embeddings): `before_attention`
        self.queries_keys: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # of the probe's tokens, at the model's own positions
        self.counted_from_zero: torch.Tensor | None = None  # of the same tokens, given positions 0, 1, 2, ...


@functools.cache
def eager_function(attention_class: type):
    """The eager attention of the module that defines `attention_class` (transformers' `eager_attention_forward`)."""
    return getattr(sys.modules[attention_class.__module__], "eager_attention_forward", None)


def mitigated_attention(
    implementation,
    module,
    query,
    key,
    value,
    attention_mask,
    mitigation_plan=None,
    mitigation_projection=None,
    **kwargs,
):
    """The registered attention: `implementation`'s own function, with the attention hooks of `mitigation_plan`
    (`mitigation_projection`: the module's input and projections, where the plan rewrites them, `decoder_attention`)."""
    function = eager_function(type(module)) if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    if isinstance(mitigation_plan, AttentionProbe):
        mitigation_plan.modules.append(module)
        mitigation_plan.score_keywords |= {name for name in SCORE_TERMS if kwargs.get(name) is not None}
        mitigation_plan.queries_keys[module] = query, key
    elif mitigation_plan is not None:
        hooks = mitigation_plan.layers[module.layer_idx]
        return hooks.attend(function, module, query, key, value, attention_mask, mitigation_projection, **kwargs)
    return function(module, query, key, value, attention_mask, **kwargs)


def register_wrapper(implementation: str) -> str:
    """The registered name of the attention that wraps `implementation`, registered on first use."""
    name = PREFIX + implementation
    if name not in WRAPPED_IMPLEMENTATIONS:
        AttentionInterface.register(name, functools.partial(mitigated_attention, implementation))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
        WRAPPED_IMPLEMENTATIONS[name] = implementation
    return name


def forward_inputs(model, args, kwargs) -> dict:
    """The arguments of a call of the model's own `forward`, by name (its `**kwargs` spread out)."""
    if not args:  # by keyword already (generate's): binding would give them back as they are
        return dict(kwargs)
    signature = type(model).unmitigated_signature
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    del arguments[next(iter(signature.parameters))]  # self
    variadic = [name for name, parameter in signature.parameters.items() if parameter.kind is parameter.VAR_KEYWORD]
    return {**arguments, **arguments.pop(variadic[0], {})}


class MitigatedDecoder(MitigationGenerationMixin):
    """The mixin `add_mitigations` puts in front of a Hugging Face causal LM's class."""

    decoder_positions: DecoderPositions

    def forward(self, *args, **kwargs):
        """The model's `forward`; the option keywords, or `mitigation_plan` (mitigations already resolved, for passes
        a mitigation runs itself), switch the mitigations on for the call."""
        plan = kwargs.pop("mitigation_plan", None)
        options = call_options(kwargs, plan)
        refuse_option_keywords(self, kwargs)  # reorder_documents: generate's
        inputs = forward_inputs(self, args, kwargs)
        cache = inputs.get("past_key_values")
        kept = plan_kept_for(cache, self.config, options) if plan is None else None  # checked when it was resolved
        if plan is None and kept is None and not parse_options(self.config, options) and not holds_prefill_state(cache):
            return super().forward(*args, **kwargs)
        if kept is not None:
            plan = kept_plan(self.call_context(inputs), kept)
        implementation = self.config._attn_implementation
        if implementation not in WRAPPED_IMPLEMENTATIONS:
            raise ValueError(
                f"the mitigations run in the attention add_mitigations registered, but this model's attention "
                f"implementation was set to {implementation!r} since: call sepformer.add_mitigations(model) again, "
                "which wraps it."
            )
        if plan is None:
            self.check_served(options, inputs.get("attention_mask"))
            wrapper = causal_lm_wrapper(options, cache)  # also every option's rule on continuing the cache
            if wrapper is not None:  # several attention buckets: this forward on a copy of each row per bucket
                mitigation, parsed, options_of_call = wrapper
                inputs = {"labels": None, "use_cache": None, "past_key_values": None, **inputs}
                return_dict = inputs.pop("return_dict", None)  # the buckets' forward returns its output's fields
                output = mitigation.run_causal_lm(parsed, self, inputs, options_of_call)
                as_dict = return_dict if return_dict is not None else self.config.return_dict
                return output if as_dict else output.to_tuple()
            use_cache = inputs.get("use_cache")
            if cache is None and (use_cache if use_cache is not None else getattr(self.config, "use_cache", False)):
                inputs["past_key_values"] = SepFormerCache(config=self.config)
            plan = resolve_plan(self.call_context(inputs), options)  # refuses a cache continued without its options
            if plan is None:  # an empty cache that held a failed prefill's state, continued without options
                return super().forward(**inputs)
        inputs, bucket_rotary = self.with_plan(inputs, plan, self.dtype if kept is None else kept.dtype)
        with attention_modules_served(self, inputs["mitigation_plan"], bucket_rotary):  # for this call only
            return super().forward(**inputs)

    def __reduce_ex__(self, protocol):
        """Pickled (`torch.save(model)`, multiprocessing) as the model's class with the mixin made again on loading:
        the class itself is not importable under its name, which the model's own class holds."""
        _, _, *state = super().__reduce_ex__(protocol)
        return new_mitigated, (type(self).__bases__[1],), *state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        implementation = self.config._attn_implementation
        if implementation.startswith(PREFIX):  # in a new process, the wrapper is registered again
            register_wrapper(implementation.removeprefix(PREFIX))

    def call_context(self, inputs: dict) -> CallContext:
        return CallContext.of(
            self,
            call_tokens(inputs),
            input_ids=inputs.get("input_ids"),
            attention_mask=inputs.get("attention_mask"),
            cache=inputs.get("past_key_values"),
            position_ids=inputs.get("position_ids"),
        )

    def with_plan(self, inputs: dict, plan, dtype: torch.dtype) -> tuple[dict, tuple | None]:
        """The inputs of the model's own `forward` for one run with `plan`: the positions where the tokens are read,
        the mask, and the plan started on them (with the model's `dtype`), which the attention function receives; and
        the rotary tables of the plan's base where it has one (`rotary_at_base`), which the attention modules rotate
        with instead of theirs."""
        tokens, cache, mask = call_tokens(inputs), inputs.get("past_key_values"), inputs.get("attention_mask")
        position_ids = inputs.get("position_ids")
        if position_ids is None:
            position_ids = default_position_ids(tokens, mask, cache)
        batch, new_tokens = tokens.shape[:2]
        reading = LayerRun.of(plan, position_ids, mask, cache, new_tokens, tokens.device)
        moved = reading.read_positions is not position_ids
        if mask is None and moved:  # without a mask, moved positions read as packing: no padding, said explicitly
            mask = torch.ones(batch, reading.kv_length, dtype=torch.long, device=tokens.device)
        if reading.mask_function is not None:
            mask = self.masks_with(
                reading.mask_function, reading.padding_mask, cache, position_ids, (batch, new_tokens), dtype
            )
        started = reading.start(dtype)
        inputs = {**inputs, "attention_mask": mask, "mitigation_plan": started}
        if self.decoder_positions.positions_problem is None or moved:
            inputs["position_ids"] = reading.read_positions  # counted from each row's first real token (left padding)
        if reading.rotary_base is None:
            return inputs, None
        positions = self.decoder_positions
        return inputs, positions.rotary_at_base(reading.rotary_base, reading.read_positions, dtype, cache)

    def masks_with(self, and_mask_function, padding_mask, cache, position_ids, tokens: tuple[int, int], dtype):
        """The model's causal masks (4D, in the form its attention takes) with `and_mask_function` applied: one for
        all layers, or one per layer type where the model has sliding-window layers beside full ones."""
        config = self.config
        arguments = dict(
            config=config,
            inputs_embeds=torch.empty(*tokens, 0, dtype=dtype, device=position_ids.device),  # (b, seq): its shape
            attention_mask=padding_mask,
            past_key_values=cache,
            position_ids=position_ids,
            and_mask_function=and_mask_function,
        )
        layer_types = set(getattr(config, "layer_types", None) or ())
        if not layer_types:  # one kind of layer: sliding windows when the config has one (Mistral)
            sliding = getattr(config, "sliding_window", None) is not None
            return (create_sliding_window_causal_mask if sliding else create_causal_mask)(**arguments)
        masks = {kind: MASK_MAKERS[kind](**arguments) for kind in layer_types}
        return masks["full_attention"] if layer_types == {"full_attention"} else masks

    def check_served(self, options: dict, attention_mask) -> None:
        """Refuse, before any work, the options this model cannot serve."""
        unknown = set(getattr(self.config, "layer_types", None) or ()) - set(MASK_MAKERS)
        active = sorted(name for name, value in options.items() if value not in (None, False))
        if active and isinstance(attention_mask, dict):
            raise ValueError(
                f"{', '.join(active)} read the padding mask and build the model's masks, but this call was given "
                f"masks already built per layer type ({sorted(attention_mask)}), as generate does with a static "
                f"cache on {type(self).__name__}: use the default dynamic cache."
            )
        for name in options:
            if unknown and name in active and MITIGATIONS[name].mask_function is not Mitigation.mask_function:
                raise ValueError(
                    f"{name} restricts the causal mask, but {type(self).__name__} has layer types {sorted(unknown)}, "
                    f"whose masks are not transformers' causal or sliding-window ones."
                )


def call_tokens(inputs: dict) -> torch.Tensor:
    """The call's `input_ids`, or its `inputs_embeds`: (b, seq, ...)."""
    return inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]


def holds_prefill_state(cache) -> bool:
    """Whether `cache` holds what a prefill with options fixed: a call continuing it is checked against them."""
    return isinstance(cache, SepFormerCache) and bool(cache.prefill_options or cache.mitigation_state)


@functools.cache
def mitigated_class(model_class: type) -> type:
    """`model_class` with the mixin in front, under the same name (what `save_pretrained` writes as architecture)."""

    @functools.wraps(model_class.forward)
    def forward(self, *args, **kwargs):
        return MitigatedDecoder.forward(self, *args, **kwargs)

    return type(
        model_class.__name__,
        (MitigatedDecoder, model_class),
        {
            "forward": with_mitigation_keywords(forward),
            "unmitigated_forward": model_class.forward,
            "unmitigated_signature": inspect.signature(model_class.forward),  # read once, not in a traced call
            "__module__": model_class.__module__,
            "__qualname__": model_class.__qualname__,
        },
    )


def new_mitigated(model_class: type) -> MitigatedDecoder:
    mitigated = mitigated_class(model_class)
    return mitigated.__new__(mitigated)


def find_rotary(model: nn.Module) -> tuple[nn.Module | None, tuple[str, ...] | None]:
    """The model's one rotary embedding: a module with `inv_freq`, or with `{type}_inv_freq` for each of the config's
    layer types (Gemma 3), then those types by layer; `None` without, or with several, which the mitigations that
    read it refuse."""
    layer_types = tuple(getattr(model.config, "layer_types", None) or ())
    per_type = [f"{kind}_inv_freq" for kind in layer_types]

    def has(module: nn.Module, *names: str) -> bool:
        return all(isinstance(getattr(module, name, None), torch.Tensor) for name in names)

    rotaries = [
        module for module in model.modules() if has(module, "inv_freq") or (per_type and has(module, *per_type))
    ]
    if len(rotaries) != 1:
        return None, None
    return rotaries[0], (None if has(rotaries[0], "inv_freq") else layer_types)


def check_servable(model) -> None:
    """Refuse a causal LM `add_mitigations` cannot serve, naming what it lacks."""
    if model.config.get_text_config() is not model.config:
        raise ValueError(
            f"add_mitigations serves text decoders, and {type(model).__name__} is a composite model (its config "
            f"{type(model.config).__name__} holds a text config beside others): not served."
        )
    implementation = model.config._attn_implementation
    if implementation not in ("eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()):
        raise ValueError(
            f"add_mitigations cannot wrap the attention implementation {implementation!r}: it is not in "
            "transformers' attention registry."
        )
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"add_mitigations wraps the attention implementation {implementation!r}, which has no mask function in "
            f"transformers' AttentionMaskInterface: use 'sdpa' or 'eager' (model.set_attn_implementation)."
        )
    if implementation == "eager" and getattr(model.config, "reorder_and_upcast_attn", False):
        raise ValueError(
            f"{type(model).__name__} with reorder_and_upcast_attn=True computes its eager attention with code of its "
            "own, which it runs only under the name 'eager': a registered wrapper would change what it computes. Use "
            "attn_implementation='sdpa', or reorder_and_upcast_attn=False."
        )
    parameters = inspect.signature(model.forward).parameters
    missing = [name for name in ("attention_mask", "position_ids", "past_key_values") if name not in parameters]
    if missing or list(parameters.values())[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise ValueError(
            f"add_mitigations passes the mitigations to the attention through forward's **kwargs, and positions, "
            f"masks and the cache by name; {type(model).__name__}.forward lacks "
            f"{', '.join(missing) if missing else '**kwargs'}."
        )


def probe_attention(model) -> AttentionProbe:
    """A few tokens through the model (its own `forward`, the registered attention on): every layer's attention must
    be the registered one and receive the keywords of `forward`, with its `layer_idx`; otherwise the mitigations would
    silently skip layers. The probe also keeps what `DecoderPositions` reads of the model (`describe_decoder`)."""
    probe = AttentionProbe()
    forward = model.unmitigated_forward if isinstance(model, MitigatedDecoder) else model.forward
    config = model.config
    special = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # an id, a list of ids (Llama 3's eos) or None
        value = getattr(config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    ordinary = [token for token in range(config.vocab_size) if token not in special][:PROBE_TOKENS]
    ids = torch.tensor([ordinary], device=model.device)  # no padding (RoBERTa counts positions from it)

    def record_input(module, args, kwargs):
        probe.inputs[module] = (args[0] if args else kwargs.get("hidden_states"), kwargs.get("position_embeddings"))

    candidates = [module for module in model.modules() if hasattr(module, "layer_idx")]
    handles = [module.register_forward_pre_hook(record_input, with_kwargs=True) for module in candidates]
    try:
        with torch.no_grad():
            probe.logits = forward(input_ids=ids, use_cache=False, mitigation_plan=probe).logits
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():  # the model's own positions, against positions counted from 0 (what moved positions count)
        counted = torch.arange(ids.shape[1], device=model.device)[None]
        probe.counted_from_zero = forward(input_ids=ids, use_cache=False, position_ids=counted).logits
    layers = model.config.num_hidden_layers
    reached = [getattr(module, "layer_idx", None) for module in probe.modules]
    numbered = sorted(layer for layer in reached if layer is not None)
    if None in reached or numbered != list(range(layers)):
        raise ValueError(
            f"add_mitigations needs every attention layer of {type(model).__name__} to call transformers' attention "
            f"registry (ALL_ATTENTION_FUNCTIONS.get_interface) with forward's keywords, from a module with its "
            f"layer_idx: of layers 0..{layers - 1}, the registered attention was reached by {numbered}"
            + (" and by modules without layer_idx" if None in reached else "")
            + "."
        )
    return probe


def describe_decoder(model, probe: AttentionProbe) -> DecoderPositions:
    """Where `model` keeps its positions, and what its attention is, from its modules and the probe's run."""
    problems = [
        query_key_layout_problem(module, *probe.inputs[module], *probe.queries_keys[module]) for module in probe.modules
    ]
    rotary, layer_types = find_rotary(model)
    counts_from_zero = torch.allclose(probe.logits, probe.counted_from_zero, rtol=1e-4, atol=1e-5)
    return DecoderPositions(
        model_name=type(model).__name__,
        query_key_problem=next(filter(None, problems), None),
        score_keywords=frozenset(probe.score_keywords),
        positions_problem=None
        if counts_from_zero
        else (
            f"{type(model).__name__} counts its own positions otherwise (its logits change when given positions "
            "0, 1, 2, ...: e.g. RoBERTa's start after the padding index)"
        ),
        rotary=rotary,
        layer_types=layer_types,
        rotates_half=rotates_half(type(model).__module__),
        attention_modules=tuple(probe.modules),
    )


def refuse_options_given_to_base_model(base_model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the base model (the causal LM's child that holds the layers): the options given to it
    rather than to the causal LM would be ignored."""
    refuse_option_keywords(base_model, kwargs)


def add_mitigations(model):
    """Give a Hugging Face causal LM SepFormer's position-bias mitigations, as keywords of `forward` and `generate`:
    `stable_mask`, `ms_poe`, `attention_calibration`, `parallel_context_windows`, `positional_scaling`,
    `attention_buckets` (and `reorder_documents` for `generate`), each its dataclass or the dict of its fields. Returns
    `model` itself, its class replaced by a subclass of the same name, and a forward pre-hook on its base model
    (which refuses the options given there).
    A SepFormer, which takes every option itself, is returned as it is. Refuses (before changing anything) what is not
    a causal LM (a `TypeError`) and a model whose attention does not go through transformers' attention registry
    with the keywords of `forward`, naming what is missing.
    """
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            f"add_mitigations takes a Hugging Face causal LM (a PreTrainedModel with GenerationMixin, e.g. from "
            f"AutoModelForCausalLM); got {type(model).__name__}."
        )
    if model.config.model_type == "sepformer":  # every option is SepFormer's own keyword already
        return model
    implementation = model.config._attn_implementation
    if isinstance(model, MitigatedDecoder) and implementation in WRAPPED_IMPLEMENTATIONS:
        return model
    check_servable(model)
    if implementation == "eager":
        attention_classes = {type(module) for module in model.modules() if hasattr(module, "layer_idx")}
        without = sorted(cls.__name__ for cls in attention_classes if eager_function(cls) is None)
        if without:
            raise ValueError(
                f"add_mitigations wraps the model's eager attention, the `eager_attention_forward` of each attention "
                f"module's file; {without} have none."
            )
    model.set_attn_implementation(register_wrapper(implementation))
    try:
        probe = probe_attention(model)
        described = None if isinstance(model, MitigatedDecoder) else describe_decoder(model, probe)
    except Exception:
        model.set_attn_implementation(implementation)
        raise
    if not isinstance(model, MitigatedDecoder):  # a second call wraps an implementation set since the first
        model.decoder_positions = described
        base_model = next(child for child in model.children() if probe.modules[0] in set(child.modules()))
        base_model.register_forward_pre_hook(refuse_options_given_to_base_model, with_kwargs=True)
        model.__class__ = mitigated_class(type(model))
    return model


__all__ = ["add_mitigations", "attention_implementation"]
