"""The decoding fast path: `FusedLayer`, a decoder layer's weights laid out for decoding steps on 2D rows, made once per
generation and kept on its `SepFormerCache`; `fused_layer` decides whether a layer may use it. The layer's modules stay
what is trained, saved and adapted."""

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from .blocks import BlockDiagonal, BlockNorm, SepFormerMLP, blockwise
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


def row_mlp(mlp: SepFormerMLP) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `SepFormerMLP` on 2D rows, its weights laid out by `RowLinear` (a partial, so a cache still pickles)."""
    up, down = (RowLinear.of(linear.weight, linear.bias) for linear in (mlp.up_proj, mlp.down_proj))
    return functools.partial(mlp_rows, up=up, down=down, act_fn=mlp.act_fn)


def mlp_rows(rows: torch.Tensor, up: RowLinear, down: RowLinear, act_fn: nn.Module) -> torch.Tensor:
    return down(act_fn(up(rows)))


@dataclasses.dataclass(frozen=True, eq=False)
class FusedLayer:
    """One decoder layer's weights laid out for decoding steps on 2D rows (docs/design.md, "Decoding steps").

    `q_proj`, `k_proj` and `v_proj` are one matmul with `[W_q; W_k; W_V]` and `o_proj` one with `W_O`, the
    block-diagonal `W_V` and `W_O` written dense; the MLPs stay one per block (dense, they would read `8 d²` of weights
    where the blocks hold `5 d²`), laid out `(in, out)` on a CPU (`RowLinear`); RMS block norms run their kernels with
    their constants made once. Same function, ~1e-7 apart in float32 (another summation order). A mitigation that
    scales channels of the query and key inputs is carried in the columns of `W_q` and `W_k`:
    `W (s ⊙ h) = (W diag(s)) h`.
    """

    input_scale: InputScale  # (channels, factor) of the query and key inputs, folded into `W_q` and `W_k`
    qkv: RowLinear  # d_model -> 3 · d_model
    o: RowLinear  # d_model -> d_model
    mlp: Callable[[torch.Tensor], torch.Tensor]  # the block-diagonal MLP of (rows, d_model), one `row_mlp` per block
    # the layer's two norms: `BlockNorm.normed_rows`, or the module itself (layer norms, or a norm of one block)
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_attention_norm: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, layer: nn.Module, input_scale: InputScale) -> "FusedLayer | None":
        """The fused weights of `layer`, or `None` unless `is_fusable(layer)`."""
        if not is_fusable(layer):
            return None
        attention, mlps = layer.self_attn, blocks_of(layer.mlp)
        v_blocks, o_blocks = blocks_of(attention.v_proj), blocks_of(attention.o_proj)
        query_key = torch.cat((attention.q_proj.weight, attention.k_proj.weight))  # (2 · d_model, d_model)
        channels, factor = input_scale
        if channels:
            query_key[:, list(channels)] *= factor

        def dense(weight: torch.Tensor, linears) -> RowLinear:
            biases = [linear.bias for linear in linears]
            return RowLinear.of(weight, None if biases[0] is None else torch.cat(biases))

        def row_norm(norm: BlockNorm) -> Callable[[torch.Tensor], torch.Tensor]:
            if norm.position is None or type(norm.semantic) is not nn.RMSNorm:
                return norm
            return norm.normed_rows(norm.semantic.normalized_shape[0], norm.semantic.weight.device)

        value_weight = torch.block_diag(*(block.weight for block in v_blocks))
        row_mlps, widths = [row_mlp(mlp) for mlp in mlps], tuple(mlp.up_proj.in_features for mlp in mlps)
        return cls(
            input_scale,
            qkv=dense(torch.cat((query_key, value_weight)), (attention.q_proj, attention.k_proj, *v_blocks)),
            o=dense(torch.block_diag(*(block.weight for block in o_blocks)), o_blocks),
            mlp=row_mlps[0] if len(mlps) == 1 else functools.partial(blockwise, functions=row_mlps, widths=widths),
            input_norm=row_norm(layer.input_layernorm),
            post_attention_norm=row_norm(layer.post_attention_layernorm),
        )

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


def all_plain(modules: list[tuple[nn.Module | None, type[nn.Module]]]) -> bool:
    """Each `(module, kind)`: `module` is a `kind` (not a subclass) with dense parameters (no quantised, distributed or
    other tensor subclass), whose forward is its class's and runs no hooks: what fused weights can stand in for."""
    return not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks) and all(
        type(module) is kind
        and all(type(parameter) is nn.Parameter for parameter in module.parameters(recurse=False))
        and "forward" not in vars(module)  # accelerate's hooks replace the instance's forward
        and not (module._forward_pre_hooks or any(map(is_foreign_hook, module._forward_hooks.values())))
        for module, kind in modules
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
    norms, projections = (layer.input_layernorm, layer.post_attention_layernorm), (attention.v_proj, attention.o_proj)
    containers = [(attention, type(layer).attention_class), (mlp, BlockDiagonal)]
    containers += [(module, BlockDiagonal) for module in projections] + [(norm, BlockNorm) for norm in norms]
    if not all_plain(containers):
        return False
    norm_kind, mlps = type(layer.input_layernorm.semantic), blocks_of(mlp)
    parts = [(attention.q_proj, nn.Linear), (attention.k_proj, nn.Linear)]
    parts += [(block, nn.Linear) for projection in projections for block in blocks_of(projection)]
    parts += [(block, norm_kind) for norm in norms for block in blocks_of(norm)] + [
        (block, SepFormerMLP) for block in mlps
    ]
    if norm_kind not in (nn.RMSNorm, nn.LayerNorm) or not all_plain(parts):
        return False
    parts = [(linear, nn.Linear) for block in mlps for linear in (block.up_proj, block.down_proj)]
    return all_plain(parts + [(block.act_fn, type(block.act_fn)) for block in mlps])


def fused_layer(layer: nn.Module, layer_call: LayerCall, output_attentions: bool | None) -> FusedLayer | None:
    """`layer`'s `FusedLayer` for a decoding step, with the input scale of the layer's mitigation hooks, made at the
    first decoding step and kept on the generation's `SepFormerCache` (`derived_store`) per input scale.

    `None` (the layer runs its modules) where docs/design.md, "Decoding steps", says it is not used: a mitigation that
    rewrites the query and key inputs otherwise (`decoding_input_scale` is `None`), `fuse_decoding_projections=False`,
    training, autograd, autocast, `torch.compile`, another kind of cache, prefill, a call that records the attentions
    (the fused step does not call the attention module), or a layer that is not `is_fusable`.
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
    key = ("fused layer", layer.layer_idx, input_scale)
    return None if input_scale is None else kept_in(store, key, lambda: FusedLayer.of(layer, input_scale))
