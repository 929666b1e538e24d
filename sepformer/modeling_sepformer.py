"""SepFormer: a decoder-only causal LM whose residual stream is `[p(i) ‖ s(token)]`.

Coordinates `[0, d_pos)` of every hidden state are the positional block, the rest the semantic block. Queries and
keys read the whole (normalised) vector, so attention may route on position and meaning together; values, the
output projection, the MLPs and the norms are block-diagonal, so positional and semantic coordinates never mix.
"""

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_sepformer import SepFormerCache
from .configuration_sepformer import SepFormerConfig
from .mitigation_base import (
    NO_HOOKS,
    CallContext,
    InputScale,
    LayerHooks,
    LayerRun,
    MitigationPlan,
    QueryKeyProjection,
    cached_constant,
    is_watchable,
    kept_while_unchanged,
    versions_of,
)
from .mitigations import MITIGATIONS, causal_lm_wrapper, resolve_plan, with_mitigation_keywords
from .positional_maps import (
    POSITIONAL_MAP_CLASSES,
    BSplinePositions,
    apply_partial_rotary,
    call_extrapolation,
    positions_from_mask,
)


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
        # (..., d) -> (rows, d): a linear layer on 2D rows is one matmul call, on more dimensions a matmul and two
        # reshapes, and decoding steps go by call count.
        return self.each_block(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def each_block(self, x: torch.Tensor) -> torch.Tensor:
        widths = (self.position_size, x.shape[-1] - self.position_size)
        return blockwise(x, (self.position, self.semantic), widths)


def blockwise(x: torch.Tensor, functions, widths: tuple[int, ...]) -> torch.Tensor:
    """`[f_1(x_1) ‖ f_2(x_2) ‖ ...]` over blocks of the last dimension of the given widths.

    One split rather than slices: its backward is one cat, where each slice's backward fills a zero tensor of the full
    width and they are summed."""
    blocks = x.split_with_sizes(widths, -1)
    return torch.cat([function(block) for function, block in zip(functions, blocks, strict=True)], -1)


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
    """float32 constants of an RMS `BlockNorm`: the `(d, 2)` block-averaging matrix, `eps` per block, the `(2, d)` 0/1
    indicator."""
    indicator = torch.block_diag(torch.ones(1, position_size), torch.ones(1, semantic_size)).to(device)
    averaging = (indicator / indicator.sum(-1, keepdim=True)).t().contiguous()
    return averaging, torch.full((2,), eps, device=device), indicator


class BlockNorm(BlockDiagonal):
    """Each block normalised on its own (its own RMSNorm or LayerNorm, `position` and `semantic`).

    LayerNorms run as `BlockDiagonal`'s blocks do: torch's layer norm is one fused kernel per block. RMSNorms run in
    one pass over the rows, seven aten calls where the two torch RMSNorms with their split and cat are fourteen (six
    each on CPU): each block's mean square (plus `eps`) is one matmul with the block-averaging matrix, and comes back
    to the block's coordinates, times the block's weight, through one `(2, d)` matrix. Statistics in float32, as the
    torch norms compute them.
    """

    def __init__(self, position: nn.Module | None, semantic: nn.Module, position_size: int):
        super().__init__(position, semantic, position_size)
        self.kept = {}  # what `block_weights` made, with the versions of the norms' weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.position is None:
            return self.semantic(x)
        if not isinstance(self.semantic, nn.RMSNorm):  # layer norms work on any shape: no reshapes
            return self.each_block(x)
        if torch.is_autocast_enabled(x.device.type):  # the matmuls below would run in half precision
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x)
        averaging, eps, indicator = block_statistics(
            self.position_size, x.shape[-1] - self.position_size, self.semantic.eps, x.device
        )
        h = x.float().reshape(-1, x.shape[-1])  # (rows, d): 2D matmuls, no reshapes around each
        return rms_normed_rows(h, averaging, eps, self.block_weights(indicator)).view(x.shape).to(x.dtype)

    def block_weights(self, indicator: torch.Tensor) -> torch.Tensor:
        """float32 `(2, d)` weights, row j block j's weight on its coordinates and 0 elsewhere. Outside autograd they
        are kept until a weight changes in place or moves: a decoding step then runs two kernels fewer per norm."""
        sources = (self.position.weight, self.semantic.weight)
        return kept_while_unchanged(self.kept, "weights", sources, lambda: indicator * torch.cat(sources).float())


def rms_normed_rows(h: torch.Tensor, averaging: torch.Tensor, eps: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 rows (rows, d), each block RMS-normed and times its weights: `block_statistics` and `block_weights`."""
    inverse_rms = torch.addmm(eps, h * h, averaging).rsqrt_()  # (rows, 2): one per block
    return h * (inverse_rms @ weights)


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

    def compute_inv_freq(self, base: float | None = None) -> torch.Tensor:
        base = self.rope_theta if base is None else base
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, base: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`base`: another rotary base than the config's `rope_theta` (Attention Buckets)."""
        inv_freq = self.inv_freq if base is None else self.compute_inv_freq(base)
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # (b, seq, rotary_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, seq, rotary_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RowLinear:
    """`rows @ weight + bias` on 2D rows, the weight stored `(in, out)`: one `mm` or `addmm` call, no transpose."""

    weight: torch.Tensor  # (in, out), or a transposed view of (out, in)
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "RowLinear":
        """From an `nn.Linear`'s `(out, in)` weight: a copy laid out `(in, out)` on a CPU, where a matrix-vector product
        reads it faster; elsewhere a transposed view (the GPU libraries take either layout), no copy."""
        return cls(weight.t().contiguous() if weight.device.type == "cpu" else weight.t(), bias)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.mm(rows, self.weight) if self.bias is None else torch.addmm(self.bias, rows, self.weight)


@dataclasses.dataclass(frozen=True, eq=False)
class RowRMSNorm:
    """An RMS `BlockNorm` on 2D rows with its float32 constants made once: its kernels, without the module's checks."""

    averaging: torch.Tensor  # (d, 2)
    eps: torch.Tensor  # (2,)
    weights: torch.Tensor  # (2, d)

    @classmethod
    def of(cls, norm: BlockNorm) -> "RowRMSNorm":
        averaging, eps, indicator = block_statistics(
            norm.position_size, norm.semantic.normalized_shape[0], norm.semantic.eps, norm.semantic.weight.device
        )
        return cls(averaging, eps, norm.block_weights(indicator))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return rms_normed_rows(rows.float(), self.averaging, self.eps, self.weights).to(rows.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RowMLP:
    """A `SepFormerMLP` on 2D rows with its weights laid out `(in, out)` and its own activation."""

    up: RowLinear
    down: RowLinear
    act_fn: nn.Module

    @classmethod
    def of(cls, mlp: SepFormerMLP) -> "RowMLP":
        return cls(*(RowLinear.of(linear.weight, linear.bias) for linear in (mlp.up_proj, mlp.down_proj)), mlp.act_fn)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_fn(self.up(rows)))


@dataclasses.dataclass(frozen=True, eq=False)
class FusedProjections:
    """One decoder layer's weights laid out for decoding steps on 2D rows.

    A decoding step multiplies a token or a few per row. On a CPU its time goes by the number of kernels and by the
    bytes of weights read, not by FLOPs, and a matrix-vector product reads a weight faster laid out `(in, out)` than
    as `nn.Linear`'s `(out, in)`. So `q_proj`, `k_proj` and the two blocks of `v_proj` become one matmul with
    `[W_q; W_k; W_V]` and `o_proj` one with `W_O`, the block-diagonal `W_V` and `W_O` written dense with their zero
    blocks (small next to `W_q` and `W_k`). The MLPs, most of the layer's weights, stay one per block (dense zero
    blocks would read 8 d² where the blocks hold 5 d²), their weights laid out `(in, out)` on a CPU (`RowLinear`). RMS
    block norms run their kernels with their constants made once (`RowRMSNorm`). Same function; ~1e-7 apart in float32
    (another summation order). Memory while the cache lives: `4 d²` per layer for attention, and on a CPU the MLPs'
    weights once more (`5 d²` at the default widths and `d_pos = d / 4`: in all 1.09x the layer's weights). A
    mitigation that scales channels of the query and key inputs (positional scaling) is carried in the columns of
    `W_q` and `W_k`: `W (s ⊙ h) = (W diag(s)) h`.
    """

    input_scale: InputScale  # (channels, factor) of the query and key inputs, folded into `W_q` and `W_k`
    qkv: RowLinear  # d_model -> 3 · d_model
    o: RowLinear  # d_model -> d_model
    mlps: tuple[RowMLP, ...]  # the positional block's (when d_pos > 0) and the semantic block's
    mlp_widths: tuple[int, ...]  # their input widths
    # the layer's two norms: a `RowRMSNorm`, or the module itself (layer norms, or a norm of one block)
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_attention_norm: Callable[[torch.Tensor], torch.Tensor]
    sources: tuple[torch.Tensor, ...]  # the parameters they were made from
    versions: tuple[tuple[int, int], ...]  # (version counter, data pointer) of each source when made

    @classmethod
    def of(cls, layer: "SepFormerDecoderLayer", input_scale: InputScale) -> "FusedProjections | None":
        """The fused weights of `layer`, or `None` unless `is_fusable(layer)`."""
        if not is_fusable(layer):
            return None
        attention, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
        v_blocks, o_blocks, mlps = (blocks_of(module) for module in (attention.v_proj, attention.o_proj, layer.mlp))
        linears = (attention.q_proj, attention.k_proj, *v_blocks, *o_blocks)
        linears += tuple(linear for mlp in mlps for linear in (mlp.up_proj, mlp.down_proj))
        row_norms = [norm for norm in norms if len(blocks_of(norm)) == 2 and type(norm.semantic) is nn.RMSNorm]
        sources = tuple(parameter for module in (*linears, *row_norms) for parameter in module.parameters())
        query_key = torch.cat((attention.q_proj.weight, attention.k_proj.weight))  # (2 · d_model, d_model)
        channels, factor = input_scale
        if channels:
            query_key[:, list(channels)] *= factor

        def dense(weight: torch.Tensor, linears) -> RowLinear:
            biases = [linear.bias for linear in linears]
            return RowLinear.of(weight, None if biases[0] is None else torch.cat(biases))

        value_weight = torch.block_diag(*(block.weight for block in v_blocks))
        return cls(
            input_scale,
            qkv=dense(torch.cat((query_key, value_weight)), (attention.q_proj, attention.k_proj, *v_blocks)),
            o=dense(torch.block_diag(*(block.weight for block in o_blocks)), o_blocks),
            mlps=tuple(RowMLP.of(mlp) for mlp in mlps),
            mlp_widths=tuple(mlp.up_proj.in_features for mlp in mlps),
            input_norm=RowRMSNorm.of(norms[0]) if norms[0] in row_norms else norms[0],
            post_attention_norm=RowRMSNorm.of(norms[1]) if norms[1] in row_norms else norms[1],
            sources=sources,
            versions=versions_of(sources),
        )

    def mlp(self, rows: torch.Tensor) -> torch.Tensor:
        """The block-diagonal MLP of (rows, d_model)."""
        return self.mlps[0](rows) if len(self.mlps) == 1 else blockwise(rows, self.mlps, self.mlp_widths)

    def is_current(self) -> bool:
        """Whether the source parameters are unchanged: in place (optimiser steps, loading) or moved (`.to`)."""
        return versions_of(self.sources) == self.versions


def blocks_of(module: BlockDiagonal) -> list[nn.Module]:
    return [block for block in (module.position, module.semantic) if block is not None]


def is_plain_module(module: nn.Module | None, kind: type[nn.Module]) -> bool:
    """`module` is a `kind` (not a subclass) with dense parameters (no quantised, distributed or other tensor
    subclass), whose forward is its class's and runs no hooks: what fused weights can stand in for."""
    return (
        type(module) is kind
        and all(is_watchable(parameter) for parameter in module.parameters(recurse=False))
        and "forward" not in vars(module)  # accelerate's hooks replace the instance's forward
        and not (module._forward_hooks or module._forward_pre_hooks)
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    )


def is_fusable(layer: "SepFormerDecoderLayer") -> bool:
    """Whether the modules of `layer` are what SepFormer builds, unhooked: the attention, its projections, the MLPs
    with their projections and activations, and the norms with their blocks. The fused step does not call them, or
    calls them on rows where the modules' path may pass `(b, seq, ·)`, which a hook would see; PEFT adapters,
    quantised layers and accelerate's hooks keep the modules."""
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    containers = [(attention, SepFormerAttention), (mlp, BlockDiagonal)]
    containers += [(projection, BlockDiagonal) for projection in (attention.v_proj, attention.o_proj)]
    containers += [(norm, BlockNorm) for norm in norms]
    if not all(is_plain_module(module, kind) for module, kind in containers):
        return False
    norm_kind = type(layer.input_layernorm.semantic)
    parts = [(attention.q_proj, nn.Linear), (attention.k_proj, nn.Linear)]
    parts += [
        (block, nn.Linear) for projection in (attention.v_proj, attention.o_proj) for block in blocks_of(projection)
    ]
    parts += [(block, norm_kind) for norm in norms for block in blocks_of(norm)]
    parts += [(block, SepFormerMLP) for block in blocks_of(mlp)]
    if norm_kind not in (nn.RMSNorm, nn.LayerNorm) or not all(is_plain_module(module, kind) for module, kind in parts):
        return False
    parts = [(linear, nn.Linear) for block in blocks_of(mlp) for linear in (block.up_proj, block.down_proj)]
    parts += [(block.act_fn, type(block.act_fn)) for block in blocks_of(mlp)]
    return all(is_plain_module(module, kind) for module, kind in parts)


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
        hooks: LayerHooks = NO_HOOKS,
        residual: torch.Tensor | None = None,
        fused: FusedProjections | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states`: the layer's normed input (b, seq, d_model); with `fused` (a decoding step), its rows
        (b · seq, d_model), and the output is rows too. `residual`: the layer's input before its norm (b, seq, d_model),
        for mitigations that re-read positions there. `hooks`: the layer's mitigation hooks."""
        input_shape = hidden_states.shape[:-1] if fused is None else residual.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        def positions_into(query_states, key_states):
            if hooks.position_hook is not None:
                return hooks.position_hook.position_query_key(
                    self, query_states, key_states, position_embeddings, residual, attention_mask
                )
            if position_embeddings is not None:
                return apply_partial_rotary(query_states, key_states, *position_embeddings)
            return query_states, key_states

        def project_query_key(query_input, key_input):
            """(b, seq, d_model) inputs -> (b, heads, seq, head_dim) queries and keys, positions applied."""
            query_states = self.q_proj(query_input).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(key_input).view(hidden_shape).transpose(1, 2)
            return positions_into(query_states, key_states)

        # (b, seq, d_model) -> (b, heads, seq, head_dim). Value heads may straddle the two blocks: attention
        # mixes rows (tokens), never columns, so the blocks stay apart.
        if fused is not None:
            qkv = fused.qkv(hidden_states)  # (b · seq, 3 · d_model)
            qkv = qkv.view(*input_shape, 3, -1, self.head_dim).transpose(1, 3)  # (b, heads, 3, seq, head_dim)
            query_states, key_states, value_states = qkv.unbind(2)
            query_states, key_states = positions_into(query_states, key_states)
        else:
            query_input, key_input = hooks.query_key_inputs(self.layer_idx, hidden_states)
            query_states, key_states = project_query_key(query_input, key_input)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if hooks.rewrites_inputs:  # the attention function may attend with other readings of the same input
            attention_input = hidden_states.view(*input_shape, -1)  # (b, seq, d_model), also from rows
            kwargs["query_key_projection"] = QueryKeyProjection(attention_input, project_query_key)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        attention_interface: Callable = hooks.attention_function(self.layer_idx, interface)
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
        if fused is not None:
            return fused.o(attn_output.reshape(-1, hidden_states.shape[-1])), attn_weights  # (b · seq, d_model)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (b, seq, d_model)
        return self.o_proj(attn_output), attn_weights


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
        attention_inputs = dict(
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            hooks=hooks,
            residual=hidden_states,
            **kwargs,
        )
        fused = self.decoding_projections(past_key_values, hooks)
        if fused is not None:
            # (b, seq, d_model) -> (b · seq, d_model): the step runs on 2D rows, one matmul call per weight
            rows = hidden_states.reshape(-1, hidden_states.shape[-1])
            attn_output, _ = self.self_attn(fused.input_norm(rows), fused=fused, **attention_inputs)
            rows = rows + attn_output
            rows = rows + fused.mlp(fused.post_attention_norm(rows))
            return rows.view(hidden_states.shape)
        attn_output, _ = self.self_attn(self.input_layernorm(hidden_states), **attention_inputs)
        dropout = self.training and self.dropout.p > 0  # otherwise an identity: not called (decoding is per-call bound)
        hidden_states = hidden_states + (self.dropout(attn_output) if dropout else attn_output)
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + (self.dropout(mlp_output) if dropout else mlp_output)

    def decoding_projections(self, past_key_values: Cache | None, hooks: LayerHooks) -> FusedProjections | None:
        """This layer's `FusedProjections` for a decoding step (a call continuing a grown cache, without autograd),
        with the input scale of the mitigation `hooks` in the columns of `W_q` and `W_k`.

        Made at the first decoding step and kept on the `SepFormerCache`, so they live as long as the generation;
        remade when a source parameter changed in place or moved, or for another input scale. `None` (the layer runs
        its modules) when a mitigation rewrites the query and key inputs otherwise (`decoding_input_scale` is `None`),
        with `config.fuse_decoding_projections=False`, in training, under autograd, autocast or `torch.compile`, with
        another kind of cache, at prefill, or when the attention, a projection, a norm or an MLP is not SepFormer's
        plain, unhooked class at the first decoding step (PEFT adapters, quantised layers, accelerate's or torch's
        hooks), which the fused step would bypass or call on rows (`is_fusable`). Not seen within one cache: modules or
        hooks replaced or added later, and in-place writes through `.data` (they bypass the version counter; a
        `.data = tensor` swap moves the data pointer and is seen).
        """
        if (
            not isinstance(past_key_values, SepFormerCache)
            or torch.is_grad_enabled()
            or self.training
            or torch.compiler.is_compiling()
            or not self.config.fuse_decoding_projections
            or torch.is_autocast_enabled(self.self_attn.q_proj.weight.device.type)  # the norms' statistics in float32
        ):
            return None
        input_scale = hooks.decoding_input_scale(self.layer_idx)
        if input_scale is None:
            return None
        per_layer = past_key_values.fused_projections
        if self.layer_idx in per_layer:
            fused = per_layer[self.layer_idx]
            if fused is None or (fused.input_scale == input_scale and fused.is_current()):
                return fused
        elif past_key_values.get_seq_length(self.layer_idx) == 0:
            return None
        per_layer[self.layer_idx] = FusedProjections.of(self, input_scale)
        return per_layer[self.layer_idx]


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
    _can_record_outputs = {
        "hidden_states": SepFormerDecoderLayer,
        "attentions": SepFormerAttention,
    }

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

    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict: dict | None = None, **kwargs):
        """transformers' `save_pretrained`, after the checks that would otherwise fail halfway (transformers writes
        the Hub code files first, the config after): a refused save writes nothing."""
        self.config.check_combinations()
        self.check_config_describes_weights(state_dict)
        return super().save_pretrained(save_directory, is_main_process, state_dict, **kwargs)

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


def check_inputs(config, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs) -> None:
    """Refuse what the layers would fail on deep inside torch, or silently ignore, before any work is done."""
    unknown = sorted(set(kwargs) - set(TransformersKwargs.__optional_keys__))
    if unknown:
        raise TypeError(
            f"SepFormer got unknown keyword arguments {unknown}. Besides the named arguments of `forward`, it takes "
            f"the mitigations {', '.join(map(repr, MITIGATIONS))} and transformers' "
            f"{', '.join(sorted(TransformersKwargs.__optional_keys__))}."
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None and (input_ids.dim() != 2 or input_ids.is_floating_point()):
        hint = "integer token ids" if input_ids.dim() == 2 else "a batch dimension: input_ids[None]"
        raise ValueError(
            f"input_ids must be a 2-D tensor of token ids (batch, sequence); got shape {tuple(input_ids.shape)} of "
            f"{input_ids.dtype} (give {hint})."
        )
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.semantic_size):
        raise ValueError(
            f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, but SepFormer's inputs_embeds is the semantic "
            f"block s(token): (batch, sequence, semantic_size={config.semantic_size})."
        )
    batch, seq = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if batch == 0 or seq == 0:
        raise ValueError(f"the input has no tokens (shape {(batch, seq)}): give at least one row of one token or more.")
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if input_ids is not None and past == 0:  # a prompt; decoding steps feed back ids the model chose (no sync there)
        low, high = (value.item() for value in torch.aminmax(input_ids))
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids contains id {low if low < 0 else high}, outside the vocabulary 0..{config.vocab_size - 1}."
            )
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape != (batch, past + seq):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; a 2-D padding mask must be (batch, past + new "
            f"tokens) = {(batch, past + seq)}."
        )
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask (batch, past + new tokens) or a 4-D mask; got shape "
            f"{tuple(attention_mask.shape)}."
        )
    if position_ids is not None and (
        position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq
    ):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; it must be (batch or 1, new tokens) = "
            f"({batch} or 1, {seq})."
        )


class SepFormerModel(SepFormerPreTrainedModel):
    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        config = self.config  # with its sizes fixed
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
        options = {name: kwargs.pop(name) for name in MITIGATIONS if name in kwargs}
        if not torch.compiler.is_compiling():  # the checks read shapes and values that a graph would guard on
            check_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, kwargs)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = SepFormerCache(config=self.config)
        batch = inputs_embeds.shape[0]
        continuing = past_key_values is not None and past_key_values.get_seq_length() > 0
        extrapolation = call_extrapolation(self.config, position_extrapolation, continuing)
        if mitigation_plan is None:
            new_tokens = inputs_embeds.shape[1]
            call = CallContext(
                self, input_ids, attention_mask, past_key_values, extrapolation, batch, new_tokens, continuing
            )
            mitigation_plan = resolve_plan(call, options)
        elif options:
            raise ValueError(f"give either mitigation_plan or the options {sorted(options)}, not both.")
        if position_ids is None:
            position_ids = default_position_ids(inputs_embeds, attention_mask, past_key_values)
        padding_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        mask_function, rotary_base, map_base = None, None, None
        read_positions = position_ids  # where the positional map and rotary are read
        if mitigation_plan is not None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            kv_length = past + inputs_embeds.shape[1]
            mask_function = mitigation_plan.mask_function(padding_mask, kv_length, inputs_embeds.device)
            read_positions = mitigation_plan.read_positions(position_ids)
            rotary_base, map_base = mitigation_plan.position_bases()

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,  # the tokens' own: rewritten positions would read as packed sequences
            and_mask_function=mask_function,
        )
        hidden_states = inputs_embeds  # (b, seq, d_sem)
        table_positions, position_rows = read_positions, None
        if self.embed_positions is not None:
            if self.training and not continuing:  # drawn for whole sequences: a call continuing a cache reads its own
                table_positions = self.embed_positions.training_positions(read_positions, batch)
            map_reading = {} if map_base is None else {"base": map_base}
            # (b or 1, seq, d_pos)
            position_rows = self.embed_positions(table_positions, extrapolation, **map_reading).to(inputs_embeds.dtype)
            hidden_states = torch.cat((position_rows.expand(batch, -1, -1), inputs_embeds), dim=-1)  # [p(i) ‖ s(t)]
        hidden_states = self.embed_dropout(hidden_states)
        position_embeddings = None
        if self.rotary_emb is not None:
            position_embeddings = self.rotary_emb(hidden_states, read_positions, rotary_base)
        if mitigation_plan is not None:
            run = LayerRun(
                position_ids,
                table_positions,
                position_rows,
                padding_mask,
                past_key_values,
                inputs_embeds.dtype,
                inputs_embeds.device,
            )
            mitigation_plan = mitigation_plan.start(run)

        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                mitigation_plan=mitigation_plan,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)


LOSS_KEYWORDS = ("ignore_index", "shift_labels")  # keywords of transformers' causal-LM loss, not of the model


class SepFormerForCausalLM(SepFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    loss_keywords = ("num_items_in_batch", *LOSS_KEYWORDS)  # what `loss_function` takes besides logits and labels

    def __init__(self, config: SepFormerConfig):
        super().__init__(config)
        config = self.config  # with its sizes fixed: the one object the whole model reads
        self.model = SepFormerModel(config)
        head_width = config.semantic_size if config.lm_head_input == "semantic" else config.hidden_size
        self.lm_head = nn.Linear(head_width, config.vocab_size, bias=False)
        self.post_init()

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
            Likewise; several attention buckets run this forward once per bucket and return the mixed logits.
        """
        model_inputs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            position_extrapolation=position_extrapolation,
        )
        wrapper = causal_lm_wrapper(kwargs, past_key_values)
        if wrapper is not None:  # a mitigation that runs this forward itself (several attention buckets)
            mitigation, options = wrapper
            options_of_call = {name: kwargs.pop(name) for name in MITIGATIONS if name in kwargs}
            inputs = dict(model_inputs, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
            return mitigation.run_causal_lm(options, self, inputs, options_of_call)
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

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """`GenerationMixin.generate`, with the prompt checked first (an empty or 1-D prompt fails deep inside it)."""
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if isinstance(prompt, torch.Tensor) and not prompt.is_floating_point():
            check_inputs(self.config, prompt, None, None, None, None, {})
        return super().generate(inputs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` makes a `DynamicCache` by default: make it a `SepFormerCache`, which also carries the
        mitigation state and the fused decoding projections (transformers has no public hook for the cache class)."""
        given = model_kwargs.get("past_key_values")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        made = model_kwargs.get("past_key_values")
        if given is None and type(made) is DynamicCache and generation_config.cache_implementation in (None, "dynamic"):
            model_kwargs["past_key_values"] = SepFormerCache(config=self.config)

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Beams and return sequences repeat each input row; options given per input row are repeated with it."""
        for name, mitigation in MITIGATIONS.items():
            if model_kwargs.get(name) not in (None, False):
                model_kwargs[name] = mitigation.options_class.parse(model_kwargs[name]).repeat_rows(expand_size)
        return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **model_kwargs)


__all__ = ["SepFormerPreTrainedModel", "SepFormerModel", "SepFormerForCausalLM"]
