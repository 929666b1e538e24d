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
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import _active_collector, capture_outputs

from .configuration_sepformer import SepFormerConfig
from .mitigations import (
    AttentionCalibration,
    AttentionOptions,
    MSPoE,
    PositionalScaling,
    StableMask,
    cached_constant,
    check_layers,
    default_layers,
    fixed_head_ranks,
    last_row_probs,
    rank_ratios,
    sink_attention,
)
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
        position, semantic = x.split_with_sizes((self.position_size, x.shape[-1] - self.position_size), -1)
        return torch.cat((self.position(position), self.semantic(semantic)), -1)


def block_diagonal(
    config: SepFormerConfig, make: Callable[[int], nn.Module], kind: type[BlockDiagonal] = BlockDiagonal
) -> BlockDiagonal:
    """`make(width)` builds the module of one subspace; the positional one is skipped when `d_pos = 0`."""
    position = make(config.position_size) if config.position_size > 0 else None
    return kind(position, make(config.semantic_size), config.position_size)


def make_norm(config: SepFormerConfig, width: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps)


@cached_constant(maxsize=8)
def block_statistics(position_size: int, semantic_size: int, eps: float, device: torch.device):
    """float32 constants of a `BlockNorm`: the `(2, d)` block-averaging matrix, `eps` per block, the 0/1 indicator."""
    indicator = torch.block_diag(torch.ones(1, position_size), torch.ones(1, semantic_size)).to(device)
    return indicator / indicator.sum(-1, keepdim=True), torch.full((2,), eps, device=device), indicator


class BlockNorm(BlockDiagonal):
    """Each block normalised on its own (its own RMSNorm or LayerNorm, `position` and `semantic`), in one pass.

    The same function as `BlockDiagonal` of the two norms, with fewer kernels: each block's mean square (plus `eps`)
    is one matmul with the block-averaging matrix, and comes back to the block's coordinates, times the block's
    weight, through one `(2, d)` matrix; no split, no norm call per block, no cat. A decoding step's time goes by
    kernel count (a CPU `rms_norm` is ten kernels), a training step's by full-width passes. Statistics in float32,
    as the torch norms compute them.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return self.semantic(x)
        if torch.is_autocast_enabled(x.device.type):  # the matmuls below would run in half precision
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x)
        position, semantic = self.position, self.semantic
        averaging, eps, indicator = block_statistics(
            self.position_size, x.shape[-1] - self.position_size, semantic.eps, x.device
        )
        centred = isinstance(semantic, nn.LayerNorm)
        h = x.float()
        if centred:
            h = h - nn.functional.linear(h, averaging) @ indicator  # each block minus its own mean
        inverse_rms = nn.functional.linear(h * h, averaging, eps).rsqrt_()  # (..., 2): one per block
        weights = indicator * torch.cat((position.weight, semantic.weight)).float()  # (2, d): row j, block j's weight
        normed = h * (inverse_rms @ weights)
        if centred:
            normed = normed + torch.cat((position.bias, semantic.bias)).float()
        return normed.to(x.dtype)


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
    """Rotate the first `cos.shape[-1]` dimensions of each head of `q` and `k` (b, heads, seq, head_dim).

    `cos`/`sin`: (b, seq, rotary_dim), shared by the heads, or (b, heads, seq, rotary_dim), one angle per head (MS-PoE).
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rotary_dim = cos.shape[-1]

    def rotate(x):
        rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
        return torch.cat((rotated, x[..., rotary_dim:]), -1)

    return rotate(q), rotate(k)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedProjections:
    """One attention layer's projections as two dense matmuls, for decoding steps.

    A decoding step multiplies a token or a few per row, and on a CPU its time goes by the number of kernels, not by
    FLOPs: `q_proj`, `k_proj` and the two blocks of `v_proj` (four matmuls, a split and a cat) become one matmul with
    `[W_q; W_k; W_V]`, and `o_proj` (two matmuls, a split and a cat) one with `W_O`, the block-diagonal matrices
    written dense with their zero blocks. Same function; ~1e-7 apart in float32 (another summation order). Memory:
    `4 d²` per layer while the cache lives, 1.23x the attention weights at `d_pos = d / 4`.
    """

    qkv_weight: torch.Tensor  # (3 · d_model, d_model)
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # (d_model, d_model)
    o_bias: torch.Tensor | None
    sources: tuple[torch.Tensor, ...]  # the parameters they were made from
    versions: tuple[tuple[int, int], ...]  # (version counter, data pointer) of each source when made

    @classmethod
    def of(cls, attention: "SepFormerAttention") -> "FusedProjections | None":
        """The fused matrices of `attention`, or `None` unless every projection `is_plain_module`."""
        v_proj, o_proj = attention.v_proj, attention.o_proj
        v_blocks, o_blocks = (
            [block for block in (projection.position, projection.semantic) if block is not None]
            for projection in (v_proj, o_proj)
        )
        linears = (attention.q_proj, attention.k_proj, *v_blocks, *o_blocks)
        if not all(is_plain_module(module) for module in (*linears, v_proj, o_proj)):
            return None
        sources = tuple(parameter for linear in linears for parameter in linear.parameters())
        dense = [torch.block_diag(*(block.weight for block in blocks)) for blocks in (v_blocks, o_blocks)]
        qkv_weight = torch.cat((attention.q_proj.weight, attention.k_proj.weight, dense[0]))
        qkv_bias = o_bias = None
        if attention.q_proj.bias is not None:
            qkv_bias = torch.cat([attention.q_proj.bias, attention.k_proj.bias, *(block.bias for block in v_blocks)])
            o_bias = torch.cat([block.bias for block in o_blocks])
        return cls(qkv_weight, qkv_bias, dense[1], o_bias, sources, versions_of(sources))

    def is_current(self) -> bool:
        """Whether the source parameters are unchanged: in place (optimiser steps, loading) or moved (`.to`)."""
        return versions_of(self.sources) == self.versions


def versions_of(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((tensor._version, tensor.data_ptr()) for tensor in tensors)


def is_plain_module(module: nn.Module) -> bool:
    """An `nn.Linear` or `BlockDiagonal` (not a subclass) with dense parameters (no quantised, distributed or other
    tensor subclass), whose forward is its class's and runs no hooks: what the fused matrices can stand in for."""
    return (
        type(module) in (nn.Linear, BlockDiagonal)
        and all(type(parameter) is nn.Parameter for parameter in module.parameters(recurse=False))
        and "forward" not in vars(module)  # accelerate's hooks replace the instance's forward
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    )


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
        mitigations: AttentionOptions | None = None,
        position_input: tuple[torch.Tensor, nn.Module] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`position_input`: the layer's pre-norm positional block and its norm, given where MS-PoE acts."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        layer = self.layer_idx
        scaled = mitigations is not None and layer in mitigations.scaling_layers
        fused = None if scaled else self.decoding_projections(past_key_values)

        # (b, seq, d_model) -> (b, heads, seq, head_dim). Value heads may straddle the two blocks: attention
        # mixes rows (tokens), never columns, so the blocks stay apart.
        if fused is not None:
            qkv = nn.functional.linear(hidden_states, fused.qkv_weight, fused.qkv_bias)  # (b, seq, 3 · d_model)
            qkv = qkv.view(*input_shape, 3, -1, self.head_dim).transpose(1, 3)  # (b, heads, 3, seq, head_dim)
            query_states, key_states, value_states = qkv.unbind(2)
        else:
            query_input = key_input = hidden_states
            if scaled:
                query_input, key_input = mitigations.scaled_inputs(hidden_states)
            query_states = self.q_proj(query_input).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(key_input).view(hidden_shape).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if mitigations is not None and layer in mitigations.ms_poe_layers:
            query_states, key_states = self.multi_scale_positions(
                query_states, key_states, position_embeddings, attention_mask, mitigations, position_input
            )
        elif position_embeddings is not None:
            query_states, key_states = apply_partial_rotary(query_states, key_states, *position_embeddings)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attention_args = (self, query_states, key_states, value_states, attention_mask)
        attention_kwargs = dict(dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling)
        if mitigations is not None and mitigations.stable_mask is not None:
            attn_output, attn_weights = sink_attention(
                attention_interface, *attention_args, mitigations.sink_logits, **attention_kwargs, **kwargs
            )
        else:
            attn_output, attn_weights = attention_interface(*attention_args, **attention_kwargs, **kwargs)
        if mitigations is not None and layer in mitigations.calibration_layers:
            attn_output, attn_weights = mitigations.calibrate(
                layer, query_states, key_states, value_states, attention_mask, self.scaling, attn_output, attn_weights
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (b, seq, d_model)
        if fused is not None:
            return nn.functional.linear(attn_output, fused.o_weight, fused.o_bias), attn_weights
        return self.o_proj(attn_output), attn_weights

    def decoding_projections(self, past_key_values: Cache | None) -> FusedProjections | None:
        """This layer's `FusedProjections` for a decoding step (a call continuing a grown cache, without autograd).

        Made at the first decoding step and kept on the cache, so they live as long as the generation; remade when a
        source parameter changed in place or moved. `None` (the per-block modules run) with
        `config.fuse_decoding_projections=False`, in training, under autograd or `torch.compile`, with a static
        cache, at prefill, or when a projection is not a plain `nn.Linear` called as such at the first decoding step
        (PEFT adapters, quantised layers, accelerate's or torch's hooks), which the fused matrices would bypass. Not
        seen within one cache: modules or hooks replaced or added later, and writes through `.data` (they bypass the
        version counter).
        """
        if (
            past_key_values is None
            or torch.is_grad_enabled()
            or self.training
            or torch.compiler.is_compiling()
            or not self.config.fuse_decoding_projections
        ):
            return None
        per_layer = getattr(past_key_values, "fused_projections", None)
        if per_layer is not None and self.layer_idx in per_layer:
            fused = per_layer[self.layer_idx]
            if fused is None or fused.is_current():
                return fused
        elif past_key_values.is_compileable or past_key_values.get_seq_length(self.layer_idx) == 0:
            return None
        if per_layer is None:
            per_layer = past_key_values.fused_projections = {}
        per_layer[self.layer_idx] = FusedProjections.of(self)
        return per_layer[self.layer_idx]

    def multi_scale_positions(self, query, key, position_embeddings, attention_mask, mitigations, position_input):
        """MS-PoE: head `h` of this layer sees positions `m / r_h` wherever positions enter its queries and keys.

        Rotary (when on) rotates by `m / r_h`. The positional block enters through the normalised residual, whose
        positional part is `p(m) + u(m)`, `u` what earlier layers added: head `h` reads `p(m / r_h) + u(m)` instead,
        i.e. its queries and keys get `W[h, :, pos] · (norm(x_pos + p(m / r_h) - p(m)) - norm(x_pos))` added. Only the
        embedding's `p(m)` is rescaled; `u` depends on content as well and has no position to rescale.
        Query/key: (b, H, seq, head_dim).
        """

        def ranking_row():  # the last query's attention with the base positions, keys of this (prefill) call
            base_query, base_key = query, key
            if position_embeddings is not None:
                base_query, base_key = apply_partial_rotary(query, key, *position_embeddings)
            return last_row_probs(base_query, base_key, attention_mask, self.scaling)

        ranks = mitigations.ms_poe_ranks(self.layer_idx, ranking_row)[..., None, None]  # (b or 1, H, 1, 1)
        if position_input is not None:
            residual, norm = position_input  # (b, seq, d_pos), the positional block's input norm
            d_pos = residual.shape[-1]
            shift = torch.take_along_dim(mitigations.rank_position_shift, ranks, 1)  # p(m / r_h) - p(m)
            # Shifted and unshifted rows through one norm call: fewer calls, and a ratio of 1 adds exactly 0.
            normed = norm(torch.cat((residual[:, None] + shift, residual[:, None]), 1))  # (b, H + 1, seq, d_pos)
            delta = normed[:, :-1] - normed[:, -1:]  # (b, H, seq, d_pos)
            heads, head_dim = self.config.num_attention_heads, self.head_dim
            for_head = (heads, head_dim, -1)  # W[:, :d_pos] (H·hd, d_pos) -> (H, hd, d_pos): W[h, :, pos]
            query = query + torch.matmul(delta, self.q_proj.weight[:, :d_pos].view(for_head).transpose(1, 2))
            key = key + torch.matmul(delta, self.k_proj.weight[:, :d_pos].view(for_head).transpose(1, 2))
        if position_embeddings is not None:
            cos, sin = (torch.take_along_dim(table, ranks, 1) for table in mitigations.rank_rotary)  # (b, H, seq, rd)
            query, key = apply_partial_rotary(query, key, cos, sin)
        return query, key


def positions_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """(b, past + seq) positions counted from each row's first real token, -1 on left padding."""
    return attention_mask.long().cumsum(-1) - 1


def default_position_ids(
    inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Cache | None
) -> torch.LongTensor:
    """Absolute positions of the new tokens, counted from each row's first real token.

    With a 2D padding mask (covering past and new tokens) a left-padded row gets the same positions as the row alone;
    padding slots get 0. Without one, positions continue from the cache.
    """
    seq_len = inputs_embeds.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        return positions_from_mask(attention_mask).clamp(min=0)[:, -seq_len:]
    past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
    return (torch.arange(seq_len, device=inputs_embeds.device) + past_seen_tokens).unsqueeze(0)  # (1, seq)


def key_documents(
    calibration: AttentionCalibration,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    inputs_embeds: torch.Tensor,
) -> torch.Tensor:
    """(b, kv, K) one-hot: which document each key (cached and new) belongs to; spans count like positions."""
    if attention_mask is not None:  # 2D (checked with the options)
        key_positions = positions_from_mask(attention_mask).masked_fill(attention_mask == 0, -1)  # (b, kv)
    else:
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        key_positions = torch.arange(past + inputs_embeds.shape[1], device=inputs_embeds.device)[None]  # (1, kv)
    spans = torch.tensor(calibration.spans, device=inputs_embeds.device)  # (b, K, 2)
    starts, ends = spans[..., 0][:, None], spans[..., 1][:, None]  # (b, 1, K)
    inside = (key_positions[..., None] >= starts) & (key_positions[..., None] < ends)
    return inside.float()  # calibration re-weights rows of probabilities kept in float32


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
        self.input_layernorm = block_diagonal(config, lambda width: make_norm(config, width), BlockNorm)
        self.post_attention_layernorm = block_diagonal(config, lambda width: make_norm(config, width), BlockNorm)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        mitigations: AttentionOptions | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        position_input = None
        norm = self.input_layernorm
        ms_poe_here = mitigations is not None and self.self_attn.layer_idx in mitigations.ms_poe_layers
        if ms_poe_here and norm.position is not None:
            position_input = (hidden_states[..., : norm.position_size], norm.position)
        attn_output, _ = self.self_attn(
            norm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            mitigations=mitigations,
            position_input=position_input,
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
        self.norm = block_diagonal(config, lambda width: make_norm(config, width), BlockNorm)
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
        stable_mask: StableMask | dict | None = None,
        ms_poe: MSPoE | dict | None = None,
        attention_calibration: AttentionCalibration | dict | None = None,
        positional_scaling: PositionalScaling | dict | None = None,
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
            when `None` (`stable_mask` then falls back to `config.stable_mask`).
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

        extrapolation = self.resolve_extrapolation(position_extrapolation, past_key_values)
        mitigations = self.resolve_mitigations(
            stable_mask,
            ms_poe,
            attention_calibration,
            positional_scaling,
            past_key_values,
            attention_mask,
            inputs_embeds.shape[0],
        )
        if mitigations is not None and mitigations.calibration is not None:
            self.estimate_calibration_bias(input_ids, attention_mask, mitigations, extrapolation)
        hidden_states = self.run_layers(
            inputs_embeds, attention_mask, position_ids, past_key_values, extrapolation, mitigations, **kwargs
        )
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)

    def run_layers(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        past_key_values: Cache | None,
        extrapolation: PositionExtrapolation,
        mitigations: AttentionOptions | None,
        **kwargs,
    ) -> torch.Tensor:
        """Positions, mask, `[p(i) ‖ s(t)]`, the layers and the final norm: (b, seq, d_sem) -> (b, seq, d_model)."""
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
        batch = inputs_embeds.shape[0]
        table_positions = position_ids
        positions = None
        if self.embed_positions is not None:
            table_positions = self.random_offset(position_ids, batch) if self.training else position_ids
            positions = self.embed_positions(table_positions, extrapolation).to(inputs_embeds.dtype)  # (b|1,seq,d_pos)
            hidden_states = torch.cat((positions.expand(batch, -1, -1), inputs_embeds), dim=-1)  # [p(i) ‖ s(t)]
        hidden_states = self.embed_dropout(hidden_states)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        if mitigations is not None:
            self.prepare_mitigations(
                mitigations, table_positions, positions, extrapolation, attention_mask, past_key_values, inputs_embeds
            )

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                mitigations=mitigations,
                **kwargs,
            )
        return self.norm(hidden_states)

    def resolve_mitigations(
        self,
        stable_mask,
        ms_poe,
        attention_calibration,
        positional_scaling,
        past_key_values: Cache | None,
        attention_mask: torch.Tensor | None,
        batch: int,
    ) -> AttentionOptions | None:
        """Parse and check the mitigation options of a call against this model; `None` when all are off."""
        config = self.config
        stable_mask = StableMask.parse(stable_mask if stable_mask is not None else config.stable_mask)
        ms_poe = MSPoE.parse(ms_poe)
        calibration = AttentionCalibration.parse(attention_calibration)
        scaling = PositionalScaling.parse(positional_scaling)
        if (stable_mask, ms_poe, calibration, scaling) == (None, None, None, None):
            return None
        layers = config.num_hidden_layers
        for option in (ms_poe, calibration, scaling):
            if option is not None:
                check_layers(option.option_name, option.layers, layers)
        if stable_mask is not None and config._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"stable_mask runs on the 'eager' and 'sdpa' attention implementations (its sink is an extra key); "
                f"this model uses {config._attn_implementation!r}."
            )
        if stable_mask is not None and calibration is not None:
            raise ValueError(
                "stable_mask and attention_calibration cannot be combined: calibration redistributes a softmax row "
                "that sums to 1, and StableMask's rows do not."
            )
        if ms_poe is not None and config.position_size == 0 and config.rotary_dim == 0:
            raise ValueError("ms_poe rescales positions, but this model has none (position_size=0, rotary_dim=0).")
        if ms_poe is not None and ms_poe.head_order is not None:
            fixed_head_ranks(ms_poe, config.num_attention_heads)  # raises unless a permutation of the heads
        if scaling is not None:
            if scaling.channels is None and config.position_size == 0:
                raise ValueError(
                    "positional_scaling scales the positional block by default, but this model has position_size=0: "
                    "give channels=(...) explicitly."
                )
            bad = [c for c in scaling.channels or () if not 0 <= c < config.hidden_size]
            if bad:
                raise ValueError(
                    f"positional_scaling channels {bad} are out of range: channels are 0..{config.hidden_size - 1}."
                )
        if calibration is not None and past_key_values is not None and past_key_values.is_compileable:
            raise ValueError(
                "attention_calibration needs a cache that grows with the tokens (DynamicCache, the default): its "
                "spans are matched to cached keys; got a static cache (cache_implementation='static')."
            )
        if calibration is not None and attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"attention_calibration needs the 2D padding mask (batch, length) to place the spans; got a "
                f"{attention_mask.dim()}D attention_mask."
            )
        if calibration is not None and len(calibration.spans) != batch:
            raise ValueError(
                f"attention_calibration has spans for {len(calibration.spans)} rows; the batch has {batch} rows."
            )
        ms_poe_layers = default_layers(ms_poe, layers) if ms_poe is not None else frozenset()
        scaling_layers = default_layers(scaling, layers) if scaling is not None else frozenset()
        if ms_poe_layers & scaling_layers:
            raise ValueError(
                f"ms_poe and positional_scaling both rewrite the positional part of the queries and keys of layers "
                f"{sorted(ms_poe_layers & scaling_layers)}: give them disjoint `layers`."
            )

        # What is fixed at prefill lives on the cache, for the later decoding steps of the same generation.
        continuing = past_key_values is not None and past_key_values.get_seq_length() > 0
        state = getattr(past_key_values, "mitigation_state", None) if continuing else None
        if state is None:
            state = {}
            if past_key_values is not None:
                past_key_values.mitigation_state = state
        if calibration is not None and continuing and "calibration_bias" not in state:
            raise ValueError(
                "attention_calibration measures bias(k) on the prompt: it must be on from the first (prefill) call."
            )
        # What was fixed at prefill belongs to the options of that call: continuing with others would reuse it wrongly.
        if state.setdefault("prefill_options", (ms_poe, calibration)) != (ms_poe, calibration):
            raise ValueError(
                "ms_poe and attention_calibration are fixed at prefill (head ranking, bias(k) per span): continuing "
                "a cache needs the same options as its prefill; start a new cache for new options or spans."
            )
        return AttentionOptions(
            state=state,
            continuing=continuing,
            stable_mask=stable_mask,
            ms_poe=ms_poe,
            ms_poe_layers=ms_poe_layers,
            calibration=calibration,
            calibration_layers=default_layers(calibration, layers) if calibration is not None else frozenset(),
            scaling=scaling,
            scaling_layers=scaling_layers,
        )

    def prepare_mitigations(
        self, mitigations, position_ids, positions, extrapolation, attention_mask, past_key_values, inputs_embeds
    ) -> None:
        """The per-call tensors the attention layers read: sink logits, positions, each key's document."""
        if mitigations.scaling is not None:
            factor = torch.ones(self.config.hidden_size, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
            factor[list(mitigations.scaling.channels or range(self.config.position_size))] = mitigations.scaling.factor
            mitigations.scaling_factor = factor
        if mitigations.stable_mask is not None:
            tau = mitigations.stable_mask.sink_logits(position_ids, self.config.max_position_embeddings)
            mitigations.sink_logits = tau.to(inputs_embeds.device)[:, None, :, None]  # (b or 1, 1, seq, 1)
        if mitigations.ms_poe is not None:
            ratios = rank_ratios(mitigations.ms_poe, self.config.num_attention_heads, position_ids.device)  # (H, 1)
            if positions is not None:
                coordinates = self.embed_positions.table_coordinates(position_ids, extrapolation)[:, None] / ratios
                rows = self.embed_positions(coordinates, extrapolation).to(positions.dtype)  # p(m / r_i)
                mitigations.rank_position_shift = rows - positions[:, None]
            if self.rotary_emb is not None:
                angles = (position_ids[:, None] / ratios)[..., None] * self.rotary_emb.inv_freq  # (b|1, H, seq, rd/2)
                angles = torch.cat((angles, angles), -1)
                mitigations.rank_rotary = angles.cos().to(inputs_embeds.dtype), angles.sin().to(inputs_embeds.dtype)
        if mitigations.calibration is not None and mitigations.probe is None:
            mitigations.key_documents = key_documents(
                mitigations.calibration, attention_mask, past_key_values, inputs_embeds
            )

    @torch.no_grad()
    def estimate_calibration_bias(
        self, input_ids, attention_mask, mitigations: AttentionOptions, extrapolation: PositionExtrapolation
    ) -> None:
        """`bias(k)`: the attention the last prompt token gives a dummy document put in place of document `k`.

        One extra forward pass per (row, document), batched and left-padded, with the call's other mitigations on;
        the result, (b, H, K) per calibrated layer, is kept on the cache for the decoding steps.
        """
        if "calibration_bias" in mitigations.state:
            return
        calibration = mitigations.calibration
        if input_ids is None:
            raise ValueError("attention_calibration needs input_ids: its dummy passes splice token ids.")
        if calibration.dummy_document is None and self.config.pad_token_id is None:
            raise ValueError(
                "attention_calibration's default dummy document is pad_token_id repeated, but the config has no "
                "pad_token_id: give dummy_document=(token ids) explicitly."
            )
        sequences, probes = [], []
        for row, spans in enumerate(calibration.spans):
            tokens = input_ids[row] if attention_mask is None else input_ids[row][attention_mask[row].bool()]
            for start, end in spans:
                if end > len(tokens):
                    raise ValueError(
                        f"attention_calibration span ({start}, {end}) of row {row} is out of range: the prompt of "
                        f"that row has {len(tokens)} tokens (spans count from its first real token)."
                    )
                if calibration.dummy_document is None:
                    dummy = tokens.new_full((end - start,), self.config.pad_token_id)
                else:
                    dummy = tokens.new_tensor(calibration.dummy_document)
                sequences.append(torch.cat((tokens[:start], dummy, tokens[end:])))
                probes.append((start, start + len(dummy)))
        width = max(len(sequence) for sequence in sequences)
        ids = input_ids.new_zeros(len(sequences), width)
        mask = torch.zeros_like(ids)
        probe = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        for index, (sequence, (start, end)) in enumerate(zip(sequences, probes, strict=True)):
            pad = width - len(sequence)  # left padding
            ids[index, pad:], mask[index, pad:] = sequence, 1
            probe[index, pad + start : pad + end] = True
        probing = dataclasses.replace(mitigations, state={}, continuing=False, probe=probe)
        not_recorded = _active_collector.set(None)  # the caller's output_attentions/hidden_states are not these passes'
        try:
            self.run_layers(self.embed_tokens(ids), mask, None, None, extrapolation, probing)
        finally:
            _active_collector.reset(not_recorded)
        rows, documents = len(calibration.spans), len(calibration.spans[0])
        mitigations.state["calibration_bias"] = {
            layer: probed.view(rows, documents, -1).transpose(1, 2)  # (b, H, K)
            for layer, probed in probing.state["probed"].items()
        }

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
        stable_mask: StableMask | dict | None = None,
        ms_poe: MSPoE | dict | None = None,
        attention_calibration: AttentionCalibration | dict | None = None,
        positional_scaling: PositionalScaling | dict | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        position_extrapolation (`str`, `dict` or `PositionExtrapolation`, *optional*):
            Overrides `config.position_extrapolation` for this call and, through `generate`, for every decoding step.
        stable_mask, ms_poe, attention_calibration, positional_scaling (*optional*):
            Position-bias mitigations (`sepformer.mitigations`); through `generate`, for the prompt and every step.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            position_extrapolation=position_extrapolation,
            stable_mask=stable_mask,
            ms_poe=ms_poe,
            attention_calibration=attention_calibration,
            positional_scaling=positional_scaling,
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
