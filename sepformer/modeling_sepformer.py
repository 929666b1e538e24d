"""SepFormer: a decoder-only causal LM whose residual stream is `[p(i) ‖ s(token)]`.

Coordinates `[0, d_pos)` of every hidden state are the positional block, the rest the semantic block. Queries and
keys read the whole (normalised) vector, so attention may route on position and meaning together; values, the
output projection, the MLPs and the norms are block-diagonal, so positional and semantic coordinates never mix.
"""

import contextlib
import copy
import functools
import os
import re
import shutil
import tempfile

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .blocks import BlockDiagonal, SepFormerMLP, block_diagonal, block_norm
from .cache_sepformer import SepFormerCache
from .configuration_sepformer import SepFormerConfig
from .decoding import fused_layer
from .input_checks import check_checkpoint_folder, check_inputs, check_labels, unreadable_weights
from .kept import derived_store
from .mitigated_generation import LOSS_KEYWORDS, MitigationGenerationMixin, check_fed_token_ids, check_last_position
from .mitigation_base import (
    NO_HOOKS,
    CallContext,
    LayerCall,
    LayerRun,
    MitigationPlan,
    ModelPositions,
    QueryKeyProjection,
    base_tensor,
    continues,
)
from .mitigations import (
    call_options,
    causal_lm_wrapper,
    kept_plan,
    plan_kept_for,
    resolve_plan,
    with_mitigation_keywords,
)
from .positional_maps import POSITIONAL_MAPS, BSplinePositions, call_extrapolation
from .rotary import SepFormerRotaryEmbedding, apply_partial_rotary
from .spans import default_position_ids


class SepFormerAttention(nn.Module):
    """Full `q_proj`/`k_proj`; block-diagonal `v_proj`/`o_proj` (each block its own `nn.Linear`)."""

    def __init__(self, config: SepFormerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.v_proj = block_diagonal(config, lambda width: nn.Linear(width, width, bias=bias))
        self.o_proj = block_diagonal(config, lambda width: nn.Linear(width, width, bias=bias))

    def forward(
        self, hidden_states: torch.Tensor, layer_call: LayerCall, **kwargs: Unpack[TransformersKwargs]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states`: the layer's normed input (b, seq, d_model); `layer_call`: the rest of the layer's call."""
        query_input, key_input = layer_call.hooks.query_key_inputs(self.layer_idx, hidden_states)
        query_states, key_states = self.by_head(self.q_proj(query_input)), self.by_head(self.k_proj(key_input))
        # Value heads may straddle the two blocks: attention mixes rows (tokens), never columns, so they stay apart.
        value_states = self.by_head(self.v_proj(hidden_states))
        query_states, key_states = self.apply_positions(query_states, key_states, layer_call)
        attn_output, weights = self.attend(query_states, key_states, value_states, hidden_states, layer_call, **kwargs)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()  # (b, seq, d_model)
        return self.o_proj(attn_output), weights

    def by_head(self, states: torch.Tensor) -> torch.Tensor:
        """(b, seq, heads · head_dim) -> (b, heads, seq, head_dim)."""
        return states.view(*states.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def apply_positions(self, query_states, key_states, layer_call: LayerCall):
        """Positions into the queries and keys: a mitigation's position hook, or rotary when on."""
        if layer_call.hooks.position_hook is not None:
            return layer_call.hooks.position_hook.position_query_key(self, query_states, key_states, layer_call)
        if layer_call.position_embeddings is not None:
            return apply_partial_rotary(query_states, key_states, *layer_call.position_embeddings)
        return query_states, key_states

    def attend(self, query_states, key_states, value_states, attention_input, layer_call: LayerCall, **kwargs):
        """The cache's update and the attention function, wrapped by the mitigation hooks: (b, seq, H, head_dim).
        Where a hook rewrites the query and key inputs, the wrappers get the `QueryKeyProjection` of `attention_input`
        (the layer's normed input), to attend with other readings of it."""
        if layer_call.past_key_values is not None:
            key_states, value_states = layer_call.past_key_values.update(key_states, value_states, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        hooks = layer_call.hooks
        projection = QueryKeyProjection(self, attention_input, layer_call) if hooks.input_hooks else None
        dropout = 0.0 if not self.training else self.attention_dropout
        states = (query_states, key_states, value_states, layer_call.attention_mask)
        return hooks.attend(interface, self, *states, projection, dropout=dropout, scaling=self.scaling, **kwargs)


class SepFormerDecoderLayer(GradientCheckpointingLayer):
    attention_class = SepFormerAttention  # what the decoding fast path may stand in for (`is_fusable`)

    def __init__(self, config: SepFormerConfig, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx)
        position_size = config.position_size
        position_mlp = SepFormerMLP(config, position_size, config.position_intermediate_size) if position_size else None
        semantic_mlp = SepFormerMLP(config, config.semantic_size, config.semantic_intermediate_size)
        self.mlp = BlockDiagonal(position_mlp, semantic_mlp, position_size)
        self.input_layernorm = block_norm(config)
        self.post_attention_layernorm = block_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.config = config
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        mitigation_plan: MitigationPlan | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        hooks = mitigation_plan.layers[self.layer_idx] if mitigation_plan is not None else NO_HOOKS
        layer_call = LayerCall(hidden_states, attention_mask, position_embeddings, past_key_values, hooks)
        records_attentions = kwargs.get("output_attentions", self.config.output_attentions)
        fused = fused_layer(self, layer_call, records_attentions)
        if fused is not None:  # a decoding step: the same function on 2D rows, with fewer kernels
            return fused.step(self, layer_call, **kwargs)
        attn_output, _ = self.self_attn(self.input_layernorm(hidden_states), layer_call, **kwargs)
        dropout = self.training and self.dropout.p > 0  # otherwise an identity: not called (decoding is per-call bound)
        hidden_states = hidden_states + (self.dropout(attn_output) if dropout else attn_output)
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + (self.dropout(mlp_output) if dropout else mlp_output)


class _OnModelOrClass:
    """A classmethod that, called on a model, is given the model: transformers calls `is_remote_code` on classes and
    on models."""

    def __init__(self, function):
        self.function = function

    def __get__(self, model, cls):
        return functools.partial(self.function, cls if model is None else model)


class SepFormerPreTrainedModel(PreTrainedModel):
    config: SepFormerConfig
    config_class = SepFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SepFormerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": SepFormerDecoderLayer, "attentions": SepFormerAttention}

    def __init__(self, config: SepFormerConfig, *inputs, **kwargs):
        # Assignments are checked one field at a time (`config.num_attention_heads = 3` passes): check them together.
        # Not the token ids (`save_pretrained` checks them): transformers' tests build models from `vocab_size=4,
        # pad_token_id=3`, which leaves the other ids outside the vocabulary.
        config.validate_architecture()
        super().__init__(config.with_sizes_fixed(), *inputs, **kwargs)

    @_OnModelOrClass
    def is_remote_code(model_or_class) -> bool:
        """transformers' `is_remote_code`, which is also true of a model `prepare_for_hub` marked (its own
        `_auto_class`): that model alone saves as Hub code, not its class."""
        return model_or_class._auto_class is not None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`, with a missing folder, a folder without `config.json` and a weights file
        cut short named (transformers reads the first as a Hub id, builds a default config for the second and does
        not name the file of the third)."""
        check_checkpoint_folder(pretrained_model_name_or_path, kwargs)
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise unreadable_weights(pretrained_model_name_or_path, error) from error

    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict: dict | None = None, **kwargs):
        """transformers' `save_pretrained`, after the checks that would otherwise fail halfway (transformers writes
        the Hub code files first, the config after): a refused save writes nothing. It saves into a staging folder
        (`staged`), so a save that fails (a full disk, a weights file that cannot be written) leaves the folder as it
        was; a push to the Hub, which uploads the folder it saved to, saves in place."""
        if os.path.isfile(save_directory):  # transformers logs an error and returns
            raise ValueError(
                f"save_pretrained: {os.fspath(save_directory)!r} is a file; give a folder (made if absent)."
            )
        self.config.check_combinations()
        self.check_config_describes_weights(state_dict)
        if kwargs.get("push_to_hub"):
            return super().save_pretrained(save_directory, is_main_process, state_dict, **kwargs)
        with staged(save_directory) as staging:
            return super().save_pretrained(staging, is_main_process, state_dict, **kwargs)

    def check_config_describes_weights(self, state_dict: dict | None = None) -> None:
        """Refuse a config that no longer describes the weights to be saved (`state_dict`, by default all the model's),
        as after `model.config.position_size = 4` on a built model: saved together, they would make a checkpoint that
        cannot be loaded, or that loads other weights."""
        if getattr(self, "hf_quantizer", None) is not None or getattr(self, "_hf_peft_config_loaded", False):
            return  # weights in the quantiser's layout, or only adapters saved (without the config)
        with torch.device("meta"):
            described = type(self)(copy.deepcopy(self.config)).state_dict()
        weights = self.state_dict() if state_dict is None else state_dict
        # given weights may be a part (DeepSpeed's Trainer saves `{}` when ZeRO-3 keeps them sharded): only theirs
        names = described.keys() | weights.keys() if state_dict is None else weights.keys()
        differences = [
            f"{name} {tuple(weights[name].shape) if name in weights else 'absent'} in the weights, "
            f"{tuple(described[name].shape) if name in described else 'absent'} for the config"
            for name in sorted(names)
            if name not in weights or name not in described or weights[name].shape != described[name].shape
        ]
        if differences:
            raise ValueError(
                f"model.config no longer describes the model's weights ({'; '.join(differences[:3])}"
                f"{f'; and {len(differences) - 3} more' if len(differences) > 3 else ''}): a config field that shapes "
                "the weights was changed after the model was built. Nothing was saved. Change it back, or build a new "
                "model from the changed config."
            )

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # Non-persistent buffers are not loaded: recompute them, or `from_pretrained` leaves meta-device garbage.
        if isinstance(module, SepFormerRotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq())
        if isinstance(module, BSplinePositions):
            init.normal_(module.control_points, mean=0.0, std=self.config.initializer_range)


@contextlib.contextmanager
def staged(folder):
    """A staging folder beside `folder` whose files move into `folder` when the block ends without an error, as a
    save into `folder` would leave it (older shards of the saved weights removed); dropped in any case."""
    folder = os.path.abspath(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.saving-", dir=os.path.dirname(folder))
    try:
        yield staging
        os.makedirs(folder, exist_ok=True)
        written = os.listdir(staging)
        # transformers removes the shards of an earlier save of the same weights that this save does not rewrite
        shard = r"-\d{5}-of-\d{5}"
        weights = [name.removesuffix(".safetensors") for name in written if name.endswith(".safetensors")]
        stems = {re.sub(shard + "$", "", name) for name in weights}
        for name in set(os.listdir(folder)) - set(written):
            unsuffixed = name.replace(".bin", "").replace(".safetensors", "")
            if any(name.startswith(stem) for stem in stems) and re.fullmatch(".*" + shard, unsuffixed):
                os.remove(os.path.join(folder, name))
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class SepFormerModel(SepFormerPreTrainedModel):
    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        config = self.config  # with its sizes fixed
        self.embed_tokens = nn.Embedding(config.vocab_size, config.semantic_size)
        self.embed_positions = POSITIONAL_MAPS[config.map_options().map](config) if config.position_size > 0 else None
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            [SepFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = block_norm(config)
        self.rotary_emb = SepFormerRotaryEmbedding(config) if config.rotary_dim > 0 else None
        self.gradient_checkpointing = False
        self.post_init()

    @with_mitigation_keywords
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        position_extrapolation: str | dict | None = None,
        mitigation_plan: MitigationPlan | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        inputs_embeds (`torch.FloatTensor` of shape `(batch, seq, semantic_size)`, *optional*):
            The semantic block `s(token)` in place of `embed_tokens(input_ids)`; the positional block is always
            computed from `position_ids`.
        position_extrapolation (`str`, `dict` or `PositionExtrapolation`, *optional*):
            Overrides `config.position_extrapolation` for this call: how a learned table answers positions past
            its rows (`"clamp"`, `"sinusoidal"`, `"fourier"`, `"interpolate"`, or `"none"` for an error).
        stable_mask, ms_poe, attention_calibration, positional_scaling (*optional*):
            Position-bias mitigations (`sepformer.mitigations`), each a dataclass or the dict of its fields; off
            when `None` (`stable_mask` then falls back to `config.stable_mask`; `False` switches that off).
        parallel_context_windows, attention_buckets (*optional*):
            Likewise; the base model runs one attention bucket at a time (the causal LM mixes several).
        mitigation_plan (`MitigationPlan`, *optional*):
            Mitigations already resolved, in place of the options: for passes that a mitigation runs itself.
        """
        options = call_options(kwargs, mitigation_plan)
        if not torch.compiler.is_compiling():  # the checks read shapes and values that a graph would guard on
            check_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs)
        if inputs_embeds is None:
            inputs_embeds = self.embed_ids(input_ids)
        continuing = continues(past_key_values)  # the caller's cache: one made here starts with this call
        if use_cache and past_key_values is None:
            past_key_values = SepFormerCache(config=self.config)
        extrapolation = call_extrapolation(self.config, position_extrapolation, continuing)
        if mitigation_plan is None:
            call = CallContext.of(
                self,
                inputs_embeds,
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=past_key_values,
                extrapolation=extrapolation,
                position_ids=position_ids,
            )
            kept = plan_kept_for(past_key_values, self.config, options)
            mitigation_plan = kept_plan(call, kept) or resolve_plan(call, options)
        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, attention_mask, past_key_values)
        hidden_states, layer_inputs = self.layer_inputs(
            inputs_embeds, attention_mask, position_ids, past_key_values, extrapolation, continuing, mitigation_plan
        )
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, past_key_values=past_key_values, **layer_inputs, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    @property
    def decoder_positions(self) -> ModelPositions:
        """What the mitigations ask of its positions: the plain answers, with its rotary and positional map."""
        return ModelPositions.of_sepformer(self)

    def layer_inputs(
        self, inputs_embeds, attention_mask, position_ids, past_key_values, extrapolation, continuing, plan
    ) -> tuple[torch.Tensor, dict]:
        """The first hidden states (b, seq, d_model) and what every layer is given besides the cache: the causal mask,
        the rotary tables and the mitigation plan, started with this run's positions. Positions are read where the plan
        says."""
        new_tokens = inputs_embeds.shape[1]
        reading = LayerRun.of(plan, position_ids, attention_mask, past_key_values, new_tokens, inputs_embeds.device)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,  # the tokens' own: rewritten positions would read as packed sequences
            and_mask_function=reading.mask_function,
        )
        table_positions, position_rows = reading.read_positions, None
        hidden_states = inputs_embeds  # (b, seq, d_sem)
        if self.embed_positions is not None:  # [p(i) ‖ s(t)]
            if self.training and not continuing:  # drawn for whole sequences: a call continuing a cache reads its own
                table_positions = self.embed_positions.training_positions(table_positions, inputs_embeds.shape[0])
            map_base = base_tensor(reading.map_base)
            map_reading = {} if map_base is None else {"base": map_base}
            store = derived_store(past_key_values)
            position_rows = self.embed_positions(table_positions, extrapolation, store=store, **map_reading)
            position_rows = position_rows.to(inputs_embeds.dtype)  # (b or 1, seq, d_pos)
            hidden_states = torch.cat((position_rows.expand(inputs_embeds.shape[0], -1, -1), inputs_embeds), dim=-1)
        hidden_states = self.embed_dropout(hidden_states)
        position_embeddings = None
        if self.rotary_emb is not None:
            rotary_base = base_tensor(reading.rotary_base)
            position_embeddings = self.rotary_emb(hidden_states, reading.read_positions, rotary_base)
        started = reading.start(inputs_embeds.dtype, table_positions, position_rows)
        return hidden_states, dict(
            attention_mask=causal_mask, position_embeddings=position_embeddings, mitigation_plan=started
        )

    def embed_ids(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """`embed_tokens(input_ids)`, naming an id outside the vocabulary where the embedding refuses it (a CPU's
        `IndexError`): a decoding step's ids are not read before (`check_inputs`), which would wait for the device."""
        try:
            return self.embed_tokens(input_ids)
        except IndexError as error:
            outside = input_ids[(input_ids < 0) | (input_ids >= self.config.vocab_size)]
            if not outside.numel():
                raise
            raise ValueError(
                f"input_ids contains id {outside[0].item()}, outside the vocabulary 0..{self.config.vocab_size - 1}."
            ) from error


class SepFormerForCausalLM(MitigationGenerationMixin, SepFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        config = self.config  # with its sizes fixed: the one object the whole model reads
        self.model = SepFormerModel(config)
        head_width = config.semantic_size if config.lm_head_input == "semantic" else config.hidden_size
        self.lm_head = nn.Linear(head_width, config.vocab_size, bias=False)
        self.post_init()

    @property
    def decoder_positions(self) -> ModelPositions:
        return self.model.decoder_positions

    @with_mitigation_keywords
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        position_extrapolation: str | dict | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        position_extrapolation (`str`, `dict` or `PositionExtrapolation`, *optional*):
            Overrides `config.position_extrapolation` for this call and, through `generate`, for every decoding step.
        stable_mask, ms_poe, attention_calibration, positional_scaling (*optional*):
            Position-bias mitigations (`sepformer.mitigations`); through `generate`, for the prompt and every step.
        parallel_context_windows, attention_buckets (*optional*):
            Likewise; several attention buckets run this forward once, on a copy of each row per bucket, and return the
            mixed logits.
        """
        if not torch.compiler.is_compiling():  # as `check_inputs`
            check_labels(self.config, input_ids, inputs_embeds, labels, logits_to_keep, kwargs)
        model_inputs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            position_extrapolation=position_extrapolation,
        )
        wrapped = self.wrapped_forward(dict(model_inputs, labels=labels, logits_to_keep=logits_to_keep), kwargs)
        if wrapped is not None:
            return wrapped
        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_KEYWORDS if name in kwargs}
        outputs: BaseModelOutputWithPast = self.model(**model_inputs, **kwargs)
        hidden_states = outputs.last_hidden_state
        if self.config.lm_head_input == "semantic":
            hidden_states = hidden_states[..., self.config.position_size :]
        # An int keeps the last `logits_to_keep` positions (0: all), a tensor the positions it lists, as in Llama.
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, kept])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs, **loss_kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def wrapped_forward(self, inputs: dict, kwargs: dict) -> CausalLMOutputWithPast | None:
        """The output of a mitigation that runs this forward itself (several attention buckets), or None where the
        call's options have none. A decoding step with the options of a plan kept for its cache has none: they were
        found not to wrap the causal LM."""
        cache = inputs["past_key_values"]
        wrapper = None if plan_kept_for(cache, self.config, kwargs) is not None else causal_lm_wrapper(kwargs, cache)
        if wrapper is None:
            return None
        mitigation, options, options_of_call = wrapper
        call_options(kwargs)  # taken out of the keywords the forward runs with
        return mitigation.run_causal_lm(options, self, {**inputs, **kwargs}, options_of_call)

    def generation_keeps_state(self, model_kwargs: dict) -> bool:
        """Always: the decoding steps' fused projections are kept on the cache too (`decoding.fused_layer`)."""
        return True

    def call_context(self, inputs: dict) -> CallContext:
        """The base model's call on `inputs` (keywords of `forward` with `input_ids`), as its options are resolved."""
        cache = inputs.get("past_key_values")
        extrapolation = call_extrapolation(self.config, inputs.get("position_extrapolation"), continues(cache))
        return CallContext.of(
            self.model,
            inputs["input_ids"],
            input_ids=inputs["input_ids"],
            attention_mask=inputs.get("attention_mask"),
            cache=cache,
            extrapolation=extrapolation,
            position_ids=inputs.get("position_ids"),
        )

    def check_generate_inputs(self, prompt, generation_config, kwargs: dict) -> None:
        """The prompt and its padding mask (an empty or 1-D prompt fails deep inside `generate`), the last position it
        may reach (`check_last_position`) and the padding it feeds (`check_fed_token_ids`)."""
        embeds = kwargs.get("inputs_embeds") if prompt is None else None
        check_inputs(self.model, prompt, embeds, kwargs.get("attention_mask"), None, None, {})
        check_last_position(self, prompt if embeds is None else embeds, generation_config, kwargs)
        check_fed_token_ids(self, generation_config, kwargs)


__all__ = ["SepFormerPreTrainedModel", "SepFormerModel", "SepFormerForCausalLM"]
