"""The decoding fast path: `FusedLayer`, a decoder layer's weights laid out for decoding steps on 2D rows, made once per
generation and kept on its `SepFormerCache`; `fused_layer` decides whether a layer may use it. The layer's modules stay
what is trained, saved and adapted."""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .blocks import BlockDiagonal, BlockNorm, SepFormerMLP, block_statistics, blockwise, rms_normed_rows
from .kept import derived_store, kept_in
from .mitigation_base import InputScale, LayerCall


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
class FusedLayer:
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

    @classmethod
    def of(cls, layer: nn.Module, input_scale: InputScale) -> "FusedLayer | None":
        """The fused weights of `layer`, or `None` unless `is_fusable(layer)`."""
        if not is_fusable(layer):
            return None
        attention, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
        v_blocks, o_blocks, mlps = (blocks_of(module) for module in (attention.v_proj, attention.o_proj, layer.mlp))
        row_norms = [norm for norm in norms if len(blocks_of(norm)) == 2 and type(norm.semantic) is nn.RMSNorm]
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
        )

    def mlp(self, rows: torch.Tensor) -> torch.Tensor:
        """The block-diagonal MLP of (rows, d_model)."""
        return self.mlps[0](rows) if len(self.mlps) == 1 else blockwise(rows, self.mlps, self.mlp_widths)

    def step(self, layer: nn.Module, layer_call: LayerCall, **kwargs) -> torch.Tensor:
        """The decoder `layer` on the new tokens `layer_call.residual` (b, seq, d_model): its attention's own steps
        (positions, cache, attention function) around these weights' matmuls."""
        attention, hidden_states = layer.self_attn, layer_call.residual
        batch, seq, width = hidden_states.shape
        rows = hidden_states.reshape(-1, width)  # (b · seq, d_model): one matmul call per weight
        normed = self.input_norm(rows)
        qkv = self.qkv(normed).view(batch, seq, 3, -1, attention.head_dim).transpose(1, 3)  # (b, H, 3, seq, hd)
        query_states, key_states, value_states = qkv.unbind(2)
        query_states, key_states = attention.apply_positions(query_states, key_states, layer_call)
        attention_input = normed.view(hidden_states.shape)
        attn_output, _ = attention.attend(query_states, key_states, value_states, attention_input, layer_call, **kwargs)
        rows = rows + self.o(attn_output.reshape(-1, width))
        rows = rows + self.mlp(self.post_attention_norm(rows))
        return rows.view(hidden_states.shape)


def blocks_of(module: BlockDiagonal) -> list[nn.Module]:
    return [block for block in (module.position, module.semantic) if block is not None]


def is_plain_module(module: nn.Module | None, kind: type[nn.Module]) -> bool:
    """`module` is a `kind` (not a subclass) with dense parameters (no quantised, distributed or other tensor
    subclass), whose forward is its class's and runs no hooks: what fused weights can stand in for."""
    return (
        type(module) is kind
        and all(type(parameter) is nn.Parameter for parameter in module.parameters(recurse=False))
        and "forward" not in vars(module)  # accelerate's hooks replace the instance's forward
        and not (module._forward_pre_hooks or any(map(is_foreign_hook, module._forward_hooks.values())))
        and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    )


def is_foreign_hook(hook: Callable) -> bool:
    """A forward hook other than transformers' output recording, which `output_attentions` installs for good and which
    records nothing unless a call asks for it (a call that asks for attentions runs the modules: `fused_layer`)."""
    return getattr(hook, "__module__", None) != "transformers.utils.output_capturing"


def is_fusable(layer: nn.Module) -> bool:
    """Whether the modules of `layer` are what SepFormer builds, unhooked: the attention, its projections, the MLPs
    with their projections and activations, and the norms with their blocks. The fused step does not call them, or
    calls them on rows where the modules' path may pass `(b, seq, ·)`, which a hook would see; PEFT adapters,
    quantised layers and accelerate's hooks keep the modules."""
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    containers = [(attention, type(layer).attention_class), (mlp, BlockDiagonal)]
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


def fused_layer(layer: nn.Module, layer_call: LayerCall, output_attentions: bool | None) -> FusedLayer | None:
    """`layer`'s `FusedLayer` for a decoding step (a call continuing a grown cache, without autograd), with the
    input scale of the layer's mitigation hooks in the columns of `W_q` and `W_k`.

    Made at the first decoding step and kept on the generation's `SepFormerCache` (`derived_store`), per input scale,
    so they live as long as the generation and no longer. `None` (the layer runs its modules) when a mitigation rewrites
    the query and key inputs otherwise (`decoding_input_scale` is `None`), with `fuse_decoding_projections=False`, in
    training, under autograd, autocast or `torch.compile`, with another kind of cache, at prefill, in a call that
    records the attentions (the fused step does not call the attention module), or when the
    attention, a projection, a norm or an MLP is not SepFormer's plain, unhooked class at the first decoding step (PEFT
    adapters, quantised layers, accelerate's or torch's hooks), which the fused step would bypass or call on rows
    (`is_fusable`). Within one generation the weights, modules and hooks are taken as they were at its first decoding
    step.
    """
    past_key_values = layer_call.past_key_values
    store = derived_store(past_key_values)
    if (
        store is None
        or output_attentions
        or layer.training
        or not layer.config.fuse_decoding_projections
        or torch.is_autocast_enabled(layer.self_attn.q_proj.weight.device.type)  # the norms' statistics in float32
        or past_key_values.get_seq_length(layer.layer_idx) == 0
    ):
        return None
    input_scale = layer_call.hooks.decoding_input_scale(layer.layer_idx)
    if input_scale is None:
        return None
    key = ("fused layer", layer.layer_idx, input_scale)
    return kept_in(store, key, lambda: FusedLayer.of(layer, input_scale))
