"""SepFormer: a decoder-only causal LM whose residual stream is `[p(i) ‖ s(token)]`.

Coordinates `[0, d_pos)` of every hidden state are the positional block, the rest the semantic block. Queries and
keys read the whole (normalised) vector, so attention may route on position and meaning together; values, the
output projection, the MLPs and the norms are block-diagonal, so positional and semantic coordinates never mix.
"""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_sepformer import SepFormerConfig
from .positional_maps import POSITIONAL_MAP_CLASSES, PositionExtrapolation


class BlockDiagonal(nn.Module):
    """`[x_pos ‖ x_sem] -> [position(x_pos) ‖ semantic(x_sem)]`: one module per subspace, nothing crosses.

    With `d_pos = 0` there is no positional block: `position` is `None` and the input is all semantic.
    """

    def __init__(self, position: nn.Module | None, semantic: nn.Module, position_size: int):
        super().__init__()
        self.position = position
        self.semantic = semantic
        self.position_size = position_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return self.semantic(x)
        # One split rather than two slices: its backward is one cat, where each slice's backward fills a zero tensor
        # of the full width and the two are summed.
        position, semantic = x.split((self.position_size, x.shape[-1] - self.position_size), -1)
        return torch.cat((self.position(position), self.semantic(semantic)), -1)


def block_diagonal(config: SepFormerConfig, make: Callable[[int], nn.Module]) -> BlockDiagonal:
    """`make(width)` builds the module of one subspace; the positional one is skipped when `d_pos = 0`."""
    position = make(config.position_size) if config.position_size > 0 else None
    return BlockDiagonal(position, make(config.semantic_size), config.position_size)


def make_norm(config: SepFormerConfig, width: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps)


class SepFormerMLP(nn.Module):
    def __init__(self, config: SepFormerConfig, width: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(width, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, width, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class SepFormerRotaryEmbedding(nn.Module):
    """cos/sin of rotary embedding for the first `rotary_dim` dimensions of each head, computed once per forward."""

    def __init__(self, config: SepFormerConfig):
        super().__init__()
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.rope_theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)  # (b, seq, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, seq, rotary_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_partial_rotary(q, k, cos, sin):
    """Rotate the first `cos.shape[-1]` dimensions of each head of `q` and `k` (b, heads, seq, head_dim)."""
    rotary_dim = cos.shape[-1]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
    return torch.cat((q_rot, q[..., rotary_dim:]), -1), torch.cat((k_rot, k[..., rotary_dim:]), -1)


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
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        # (b, seq, d_model) -> (b, heads, seq, head_dim). Value heads may straddle the two blocks: attention
        # mixes rows (tokens), never columns, so the blocks stay apart.
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if position_embeddings is not None:
            query_states, key_states = apply_partial_rotary(query_states, key_states, *position_embeddings)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (b, seq, d_model)
        return self.o_proj(attn_output), attn_weights


def default_position_ids(
    inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Cache | None
) -> torch.LongTensor:
    """Absolute positions of the new tokens, counted from each row's first real token.

    With a 2D padding mask (covering past and new tokens) a left-padded row gets the same positions as the row alone;
    padding slots get 0. Without one, positions continue from the cache.
    """
    seq_len = inputs_embeds.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (b, past + seq)
        return position_ids[:, -seq_len:]
    past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
    return (torch.arange(seq_len, device=inputs_embeds.device) + past_seen_tokens).unsqueeze(0)  # (1, seq)


class SepFormerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: SepFormerConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SepFormerAttention(config, layer_idx)
        self.mlp = BlockDiagonal(
            SepFormerMLP(config, config.position_size, config.position_intermediate_size)
            if config.position_size > 0
            else None,
            SepFormerMLP(config, config.semantic_size, config.semantic_intermediate_size),
            config.position_size,
        )
        self.input_layernorm = block_diagonal(config, lambda width: make_norm(config, width))
        self.post_attention_layernorm = block_diagonal(config, lambda width: make_norm(config, width))
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            **kwargs,
        )
        dropout = self.training and self.dropout.p > 0  # otherwise an identity: not called (decoding is per-call bound)
        hidden_states = hidden_states + (self.dropout(attn_output) if dropout else attn_output)
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + (self.dropout(mlp_output) if dropout else mlp_output)


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
    _can_record_outputs = {
        "hidden_states": SepFormerDecoderLayer,
        "attentions": SepFormerAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # Non-persistent buffers are not loaded: recompute them, or `from_pretrained` leaves meta-device garbage.
        if isinstance(module, SepFormerRotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq())


class SepFormerModel(SepFormerPreTrainedModel):
    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.semantic_size)
        self.embed_positions = (
            POSITIONAL_MAP_CLASSES[config.positional_map](config) if config.position_size > 0 else None
        )
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            [SepFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = block_diagonal(config, lambda width: make_norm(config, width))
        self.rotary_emb = SepFormerRotaryEmbedding(config) if config.rotary_dim > 0 else None
        self.gradient_checkpointing = False
        self.post_init()

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
        position_extrapolation: str | dict | PositionExtrapolation | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        inputs_embeds (`torch.FloatTensor` of shape `(batch, seq, semantic_size)`, *optional*):
            The semantic block `s(token)` in place of `embed_tokens(input_ids)`; the positional block is always
            computed from `position_ids`.
        position_extrapolation (`str`, `dict` or `PositionExtrapolation`, *optional*):
            Overrides `config.position_extrapolation` for this call: how a learned table answers positions past
            its rows (`"clamp"`, `"sinusoidal"`, `"fourier"`, `"interpolate"`, or `"none"` for an error).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        elif inputs_embeds.shape[-1] != self.config.semantic_size:
            raise ValueError(
                f"inputs_embeds has width {inputs_embeds.shape[-1]}, but SepFormer's inputs_embeds is the semantic "
                f"block s(token) of width semantic_size={self.config.semantic_size}."
            )

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, attention_mask, past_key_values)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )

        hidden_states = inputs_embeds  # (b, seq, d_sem)
        extrapolation = self.resolve_extrapolation(position_extrapolation, past_key_values)
        if self.embed_positions is not None:
            batch = inputs_embeds.shape[0]
            table_positions = self.random_offset(position_ids, batch) if self.training else position_ids
            positions = self.embed_positions(table_positions, extrapolation).to(inputs_embeds.dtype)  # (b|1,seq,d_pos)
            positions = positions.expand(batch, -1, -1)
            hidden_states = torch.cat((positions, inputs_embeds), dim=-1)  # (b, seq, d_model) = [p(i) ‖ s(t)]
        hidden_states = self.embed_dropout(hidden_states)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                **kwargs,
            )

        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    def resolve_extrapolation(self, value, past_key_values: Cache | None) -> PositionExtrapolation:
        config = self.config
        if value is None:
            extrapolation = config.default_extrapolation()
        else:
            extrapolation = PositionExtrapolation.parse(value)
            if extrapolation.method != "none" and not config.has_positional_table:
                raise ValueError(
                    f"position_extrapolation={extrapolation.method!r} applies to a learned positional table; this "
                    f"model has positional_map={config.positional_map!r}, position_size={config.position_size} (a "
                    "sinusoid is defined at every position, position_size=0 has no positions)."
                )
            config.check_interpolation_length(extrapolation)
        continuing = past_key_values is not None and past_key_values.get_seq_length() > 0
        if extrapolation.method == "interpolate" and extrapolation.length is None and continuing:
            # The cached keys were made with the scale of an earlier length: only positions inside the table, where
            # the scale is 1, can continue them exactly.
            extrapolation = dataclasses.replace(extrapolation, length=config.position_table_size)
        return extrapolation

    def random_offset(self, position_ids: torch.LongTensor, batch: int) -> torch.LongTensor:
        """Training with `random_position_offsets`: shift rows so that every row of the table gets trained.

        Half the rows keep their positions: inference starts at 0, and with uniform offsets alone row 0 would be
        trained by one sequence in `position_table_size - seq` only.
        """
        if not self.config.random_position_offsets:
            return position_ids
        room = self.config.position_table_size - int(position_ids.max())  # offsets in [0, room)
        if room < 1:
            raise ValueError(
                f"random_position_offsets: a training sequence reaches position {int(position_ids.max())}, past the "
                f"table of position_table_size={self.config.position_table_size} rows; train on shorter sequences."
            )
        offsets = torch.randint(0, room, (batch, 1), device=position_ids.device)
        keep = torch.rand(batch, 1, device=position_ids.device) < 0.5
        return position_ids + offsets.masked_fill(keep, 0)  # (b, seq)


class SepFormerForCausalLM(SepFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        self.model = SepFormerModel(config)
        head_width = config.semantic_size if config.lm_head_input == "semantic" else config.hidden_size
        self.lm_head = nn.Linear(head_width, config.vocab_size, bias=False)
        self.post_init()

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
        position_extrapolation: str | dict | PositionExtrapolation | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        position_extrapolation (`str`, `dict` or `PositionExtrapolation`, *optional*):
            Overrides `config.position_extrapolation` for this call and, through `generate`, for every decoding step.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            position_extrapolation=position_extrapolation,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if self.config.lm_head_input == "semantic":
            hidden_states = hidden_states[..., self.config.position_size :]
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["SepFormerPreTrainedModel", "SepFormerModel", "SepFormerForCausalLM"]
