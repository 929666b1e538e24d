"""What `add_mitigations` reaches inside a Hugging Face attention module besides its attention function, through
forward hooks registered for a call with a `mitigation_plan` only: the rotary tables of a bucket's base, and the
inputs of the query and key projections (Llama-like `q_proj`/`k_proj` or GPT-2's fused `c_attn`).
docs/design.md, "On any Hugging Face decoder", "Inside the attention module".
"""

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .mitigation_base import MitigationPlan
from .mitigations import MITIGATIONS

Rewrite = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # input -> (query input, key input)
QUERY, KEY = 0, 1  # `projected`'s sides


def is_llama_like(attention: nn.Module) -> bool:
    return hasattr(attention, "q_proj") and hasattr(attention, "k_proj")


def is_gpt2_like(attention: nn.Module) -> bool:
    return hasattr(attention, "c_attn") and not getattr(attention, "is_cross_attention", False)


def rotary_function(attention: nn.Module):
    """The `apply_rotary_pos_emb` of the file that defines the attention module (what the module rotates with)."""
    return getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)


def query_key_layout_problem(attention: nn.Module, attention_input, position_embeddings, query, key) -> str | None:
    """Why the query and key inputs of `attention` cannot be rewritten and reprojected, or `None` when they can: the
    `query` and `key` its attention function received must be what its projections and rotary make of its input
    (their `forward` called directly: their hooks, the rewriting among them, do not run)."""
    name = type(attention).__name__
    if is_llama_like(attention) and rotary_function(attention) is None and position_embeddings is not None:
        return f"the file of {name} has no apply_rotary_pos_emb to rotate queries and keys with"
    if not (is_gpt2_like(attention) or is_llama_like(attention)):
        return f"{name} has neither q_proj and k_proj nor GPT-2's c_attn"
    try:
        projections = (projected(attention, attention_input, side) for side in (QUERY, KEY))
        ours = rotated(attention, *projections, position_embeddings)
    except Exception:  # noqa: BLE001 - a layout this reprojection does not know, reported below
        ours = None
    if ours is not None and all(
        mine.shape == their.shape and torch.allclose(mine, their, rtol=1e-3, atol=1e-4 * (1 + their.abs().max()))
        for mine, their in zip(ours, (query, key), strict=True)
    ):
        return None
    return (
        f"{name} makes its queries and keys otherwise than its projections (q_proj/k_proj or GPT-2's c_attn), "
        "per-head or whole q/k norms and rotary on the first dimensions of each head compute them from its input"
    )


def projected(attention: nn.Module, hidden: torch.Tensor, side: int) -> torch.Tensor:
    """(b, seq, d_model) -> (b, heads, seq, head_dim): the module's queries (`side` QUERY) or keys (KEY) of `hidden`,
    normed as it norms them, not rotated."""
    if is_llama_like(attention):
        states = (attention.q_proj, attention.k_proj)[side].forward(hidden)
        norm = (query_key_norms(attention) or (None, None))[side]
    else:
        split = attention.split_size
        states, norm = attention.c_attn.forward(hidden)[..., side * split : (side + 1) * split], None
    weight = getattr(norm, "weight", None)  # a norm without weight, or one of head_dim, is applied per head
    per_head = norm is not None and (not isinstance(weight, torch.Tensor) or weight.shape[-1] == attention.head_dim)
    if norm is not None and not per_head:  # OLMo-2: the whole projection
        states = norm(states)
    states = states.view(*hidden.shape[:-1], -1, attention.head_dim)  # (b, seq, heads, head_dim)
    return (norm(states) if per_head else states).transpose(1, 2)


def rotated(attention: nn.Module, query, key, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """`query`, `key` (b, heads, seq, head_dim) rotated by the module's file's `apply_rotary_pos_emb`, on the first
    `cos.shape[-1]` dimensions of each head (Phi: part of them)."""
    if position_embeddings is None:
        return query, key
    rotary_dim = position_embeddings[0].shape[-1]
    turned = rotary_function(attention)(query[..., :rotary_dim], key[..., :rotary_dim], *position_embeddings)
    return tuple(torch.cat((part, x[..., rotary_dim:]), -1) for part, x in zip(turned, (query, key), strict=True))


def query_key_norms(attention: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The module's query and key norms (`q_norm`/`k_norm`, Phi's `q_layernorm`/`k_layernorm`), or `None`."""
    for query_name, key_name in (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm")):
        norms = getattr(attention, query_name, None), getattr(attention, key_name, None)
        if all(isinstance(norm, nn.Module) for norm in norms):
            return norms
    return None


class Rewriting:
    """The query and key inputs of one attention module call, `rewrite(x)` of its projections' input `x`, computed
    once for both projections."""

    def __init__(self, rewrite: Rewrite):
        self.rewrite = rewrite
        self.source: torch.Tensor | None = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def of(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden is not self.source:
            self.source, self.inputs = hidden, self.rewrite(hidden)
        return self.inputs


def projection_hooks(attention: nn.Module, rewritings: dict) -> list:
    """Hooks on the query and key projections of `attention` (Llama-like `q_proj`/`k_proj`, or GPT-2's `c_attn`), which
    read `rewritings[attention]`'s inputs while a module call has one there; values read the input itself."""
    if is_llama_like(attention):

        def rewritten_input(index: int, module, args):
            rewriting = rewritings.get(attention)
            return None if rewriting is None else (rewriting.of(args[0])[index], *args[1:])

        projections = attention.q_proj, attention.k_proj
        return [
            projection.register_forward_pre_hook(functools.partial(rewritten_input, index))
            for index, projection in enumerate(projections)
        ]
    if is_gpt2_like(attention):  # [q ‖ k ‖ v] in one projection
        split = attention.split_size

        def rewritten_output(module, args, output):
            rewriting = rewritings.get(attention)
            if rewriting is None:
                return None
            query_input, key_input = rewriting.of(args[0])
            # `forward` called directly runs no hook: the query and key columns from their inputs
            query = module.forward(query_input)
            key = query if key_input is query_input else module.forward(key_input)
            return torch.cat((query[..., :split], key[..., split : 2 * split], output[..., 2 * split :]), -1)

        return [attention.c_attn.register_forward_hook(rewritten_output)]
    raise ValueError(
        f"{type(attention).__name__} has neither q_proj and k_proj nor GPT-2's c_attn: its queries and keys cannot "
        "read another input than its values."
    )


@dataclass(frozen=True, eq=False)
class DecoderProjection:
    """The `QueryKeyProjection` of a Hugging Face attention module: its input, and how it makes queries and keys."""

    attention: nn.Module
    attention_input: torch.Tensor  # (b, seq, d_model): the layer's normed input, as the values read it
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # the cos, sin the module rotates with

    def project_keys(self, key_input: torch.Tensor) -> torch.Tensor:
        """(b, seq, d_model) -> (b, H_kv, seq, head_dim) keys as the module makes them, without the rewriting (the
        keys stand in for the queries in the rotary function, which rotates both alike)."""
        key = projected(self.attention, key_input, KEY)
        return rotated(self.attention, key, key, self.position_embeddings)[1]


def refuse_option_keywords(module: nn.Module, kwargs: dict) -> None:
    """Refuse the option keywords reaching `module` (given to the base model, or `reorder_documents` to `forward`),
    which would be ignored there: the causal LM's `forward` takes them off. `MITIGATIONS` is read at each call:
    mitigations registered later are refused too."""
    names = (*MITIGATIONS, "reorder_documents")
    if not kwargs.keys() & names:  # most calls bring none
        return
    options = [name for name in names if kwargs.get(name) not in (None, False)]
    if options:
        raise TypeError(
            f"{options} reached {type(module).__name__} as keywords it ignores: give the mitigations to the causal "
            "LM that add_mitigations served (its forward or generate), not to its base model; reorder_documents to "
            "generate only (or sepformer.reorder_documents)."
        )


@contextlib.contextmanager
def attention_modules_served(model: nn.Module, plan: MitigationPlan, bucket_rotary):
    """For the causal LM's call with `plan`: on each attention module where the plan reaches inside, a forward
    pre-hook with keywords (`before_attention`) and a forward hook that ends each module call's rewriting
    (`after_attention`), with the hooks of its query and key projections where the plan rewrites their inputs. The
    call removes them however it ends; a call with autograd on leaves them until the plan is freed (the hooks hold it
    weakly), with the graph where activation checkpointing runs the layers again in backward."""
    modules = [
        module
        for module in model.decoder_positions.attention_modules
        if bucket_rotary is not None or plan.layers[module.layer_idx].input_hooks
    ]
    if not modules:
        yield
        return
    rewritings: dict[nn.Module, Rewriting] = {}  # per attention module, its running call's rewriting
    before = functools.partial(before_attention, weakref.ref(plan), bucket_rotary, rewritings)  # the hooks hold no plan
    after = functools.partial(after_attention, rewritings)
    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, always_call=True))
            if plan.layers[module.layer_idx].input_hooks:
                handles.extend(projection_hooks(module, rewritings))
        yield
    except BaseException:  # a KeyboardInterrupt too, which the forward hooks do not see
        served_no_more(handles, rewritings)
        raise
    if torch.is_grad_enabled():
        # activation checkpointing (transformers' or torch's) runs the layers again in backward, with this plan: the
        # hooks stay until the graph frees it (without checkpointing nothing holds it past the call)
        weakref.finalize(plan, served_no_more, handles, rewritings)
    else:
        served_no_more(handles, rewritings)


def served_no_more(handles: list, rewritings: dict) -> None:
    """Remove the hooks of `attention_modules_served` and any rewriting a module call left (one interrupted by a
    `KeyboardInterrupt`, which the forward hooks do not see)."""
    for handle in handles:
        handle.remove()
    rewritings.clear()


def before_attention(
    plan_of_the_call: weakref.ref, bucket_rotary, rewritings: dict, module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """The rotary tables of the plan's base (`bucket_rotary`, the tables of a bucket's rotary) and, where the plan
    rewrites the layer's query and key inputs, their rewriting for this module call. Another call of the module
    meanwhile (another thread's) is left as it is."""
    rewritings.pop(module, None)  # a rewriting a KeyboardInterrupt left (in backward's re-run)
    plan = plan_of_the_call()
    if plan is None or kwargs.get("mitigation_plan") is not plan:
        return None
    hooks = plan.layers[module.layer_idx]
    if bucket_rotary is not None:
        if "position_embeddings" not in kwargs:
            raise ValueError(
                f"{type(module).__name__} is not given its rotary tables as the keyword position_embeddings: another "
                "rotary base (attention_buckets) cannot be given to it."
            )
        kwargs = {**kwargs, "position_embeddings": bucket_rotary}
    if hooks.input_hooks:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        rewritings[module] = Rewriting(functools.partial(hooks.query_key_inputs, module.layer_idx))
        projection = DecoderProjection(module, hidden_states, kwargs.get("position_embeddings"))
        kwargs = {**kwargs, "mitigation_projection": projection}
    return args, kwargs


def after_attention(rewritings: dict, module, args: tuple, output) -> None:
    """End the rewriting of this module call, if it made one (whether the call returned or raised)."""
    rewritings.pop(module, None)
