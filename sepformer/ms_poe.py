"""MS-PoE (arXiv 2403.04797): head `h` of the chosen layers sees positions `m / r_h`."""

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv

from .cache_sepformer import MitigationState, SepFormerCache, appended_in_place, fits_in_place
from .kept import cached_constant, derived_store, kept_in
from .mitigation_base import (
    CallContext,
    LayerRun,
    Mitigation,
    ModelPositions,
    attention_implementation,
    checkpoints_activations,
    last_row_scores,
    refuse_under_compile,
)
from .mitigation_options import MSPoE
from .positional_options import PositionExtrapolation
from .rotary import apply_partial_rotary, rotary_table, rotate_partial
from .spans import check_default_positions, key_positions


def ms_poe_ratios(option: MSPoE, num_heads: int) -> torch.Tensor:
    """`r_i = r_min + (i-1)(r_max - r_min)/(H-1)`, `i` the rank (1 = most position-aware), float64 (H,)."""
    return torch.linspace(option.r_min, option.r_max, num_heads, dtype=torch.float64)


@cached_constant(maxsize=16)
def rank_ratios(option: MSPoE, num_heads: int, device: torch.device) -> torch.Tensor:
    """(H, 1, 1) float32 ratios by rank on `device`, made once per option rather than at every decoding step."""
    return ms_poe_ratios(option, num_heads).float().to(device)[:, None, None]


def by_head(by_rank: torch.Tensor, head_ranks: torch.Tensor) -> torch.Tensor:
    """Each head's row of a table by rank: `by_rank` (H, b or 1, seq, x), `head_ranks` (H, b or 1, 1, 1) ->
    (H, b, seq, x)."""
    shape = (by_rank.shape[0], max(by_rank.shape[1], head_ranks.shape[1]), *by_rank.shape[2:])
    return torch.gather(by_rank.expand(shape), 0, head_ranks.expand(shape))


def position_awareness(probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, H) MS-PoE's `S_P = (1/l) Σ_i 1(A_i >= 3 · mean(A))` of the last query's row `probs` (b, H, kv), over the
    `l` keys it may attend, `valid` (b, 1 or H, kv)."""
    count = valid.sum(-1, dtype=probs.dtype)  # (b, 1 or H): l
    mean = (probs * valid).sum(-1) / count  # (b, H)
    return ((probs >= 3 * mean[..., None]) & valid).sum(-1, dtype=probs.dtype) / count


def last_row_keys(attention_mask: torch.Tensor | None, kv: int, device: torch.device) -> torch.Tensor:
    """(b or 1, 1, kv): the keys the last query may attend, as the attention functions read `attention_mask` (`None`,
    boolean with True = attend, or additive with its dtype's minimum where not)."""
    if attention_mask is None:
        return torch.ones(1, 1, kv, dtype=torch.bool, device=device)
    valid = attention_mask[:, :, -1, :kv]
    return valid if valid.dtype == torch.bool else valid > torch.finfo(valid.dtype).min / 2


def head_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each head's rank (0 = most position-aware) from its score (..., H), ties broken by head index."""
    order = torch.argsort(-scores, dim=-1, stable=True)  # heads, most position-aware first
    return order.argsort(-1)  # the inverse permutation: ranks[order[i]] = i


def head_ratios(option: MSPoE, scores: torch.Tensor) -> torch.Tensor:
    """Each head's ratio from its score (b, H): the highest score gets `r_min`, ties broken by head index. This is the
    paper's `r_h = r[rank(h)]`, through the *inverse* of the sort permutation; the authors' code indexes with the
    permutation itself (docs/design.md, MS-PoE)."""
    return ms_poe_ratios(option, scores.shape[-1]).to(scores.device)[head_ranks(scores)]


def fixed_head_ranks(option: MSPoE, num_heads: int) -> torch.Tensor:
    """(H,) ranks of a fixed `head_order` (its first head has rank 0)."""
    if sorted(option.head_order) != list(range(num_heads)):
        raise ValueError(
            f"ms_poe head_order={option.head_order} must be a permutation of the {num_heads} heads 0..{num_heads - 1}."
        )
    return torch.tensor(option.head_order).argsort()


def ranking(options: MSPoE, call: CallContext) -> torch.Tensor | None:
    """The (1, H, 1, 1) ranks of a fixed `head_order`, or `None` where each layer ranks its heads at prefill from the
    last query's attention row (kept on the call's cache), which the call must then give."""
    config = call.model.config
    if options.head_order is not None:
        return fixed_head_ranks(options, config.num_attention_heads)[None, :, None, None].to(call.model.device)
    if attention_implementation(config) == "flex_attention":
        raise ValueError(
            "ms_poe ranks the heads from the last query's attention row, which flex_attention's block mask does "
            "not give: use attn_implementation 'eager' or 'sdpa', or a fixed head_order."
        )
    if call.model.training and checkpoints_activations(call.model):
        raise ValueError(
            "ms_poe ranks the heads once per forward and keeps the ranks, but gradient checkpointing runs each layer "
            "again in the backward pass, where the ranks are already kept and the layer saves other tensors: give a "
            "fixed head_order to train with gradient checkpointing, or train without it."
        )
    call.positions.check_plain_scores("ms_poe", "ranks the heads by the last query's attention row, written out")
    return None


def check_plain_projections(model: nn.Module, layers: frozenset[int]) -> None:
    """Refuse adapters on `q_proj`, `k_proj` of a SepFormer's `layers`: MS-PoE's positional additions multiply by their
    weights directly."""
    wrapped = {
        f"layers.{layer}.self_attn.{name}": f"{type(projection).__module__}.{type(projection).__qualname__}"
        for layer in sorted(layers)
        for name in ("q_proj", "k_proj")
        if type(projection := getattr(model.layers[layer].self_attn, name)) is not nn.Linear
    }
    if wrapped:
        raise ValueError(
            f"ms_poe multiplies by the weights of q_proj and k_proj, which would leave out what these modules "
            f"add to them: {wrapped}. Merge adapters first (PEFT's merge_and_unload()), or leave ms_poe's "
            "layers without them."
        )


@dataclass(eq=False)
class MSPoEState(MitigationState):
    """What MS-PoE keeps on the cache, by layer: the head ranks from prefill and, on a Hugging Face decoder, the keys
    turned to `m / r_h` and the values per query head, so that a decoding step turns and expands its own only
    (docs/design.md, "On any Hugging Face decoder"). Where they are every key seen, they lead buffers with room
    (`rooms`) that a step without autograd writes into in place, as `GrowingLayer` does."""

    ranks: dict[int, torch.Tensor] = field(default_factory=dict)  # (b, H, 1, 1), 0 = most position-aware
    turned_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # (b, H, kv, head_dim)
    turned_seen: dict[int, int] = field(default_factory=dict)  # the keys seen when they were turned
    expanded_values: dict[int, torch.Tensor] = field(default_factory=dict)  # (b, H, kv, head_dim)
    rooms: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # by ("keys" or "values", layer)
    turned_by: MSPoE | None = None  # the options that turned them

    def forget_turned(self) -> None:
        """Drop every turned key and expanded value: the next step makes them anew."""
        for kept in (self.turned_keys, self.turned_seen, self.expanded_values, self.rooms):
            kept.clear()

    def map_rows(self, function) -> None:
        """The kept tensors follow the rows; the rooms are dropped (as `GrowingLayer` drops its buffers)."""
        self.rooms.clear()
        super().map_rows(function)

    def crop(self, tokens_to_remove: int) -> None:
        """The ranks stay (per row); the turned keys go: steps without MS-PoE after the crop could bring the cache back
        to as many keys as were turned, other ones."""
        self.forget_turned()

    def kept(self, part: str) -> dict[int, torch.Tensor]:
        """The turned keys (`part` "keys") or the expanded values ("values"), by layer."""
        return self.turned_keys if part == "keys" else self.expanded_values

    def keep(self, part: str, layer: int, tensor: torch.Tensor | None) -> None:
        """Keep `tensor` as the layer's turned keys (`part` "keys") or expanded values ("values"), made anew; `None`
        keeps none."""
        kept = self.kept(part)
        if tensor is None:
            kept.pop(layer, None)
        else:
            kept[layer] = tensor
        self.rooms.pop((part, layer), None)

    def written_after(self, part: str, layer: int, seen: int, new: torch.Tensor) -> torch.Tensor | None:
        """The layer's kept `part` of all `seen` keys followed by `new` (b, H, n, head_dim), written in place into their
        buffer's room and kept; `None` where they cannot be (none kept of `seen` keys, autograd on, compiled, or another
        dtype or shape)."""
        by_layer = self.kept(part)
        kept = by_layer.get(layer)
        if (
            kept is None
            or kept.shape[2] != seen
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not fits_in_place(kept, new)
        ):
            return None
        self.rooms[part, layer], by_layer[layer] = appended_in_place(self.rooms.get((part, layer)), kept, new)
        return by_layer[layer]


def turned_by_ratios(positions: torch.Tensor, ratios: torch.Tensor, inv_freq: torch.Tensor, dtype, rotated: bool):
    """`cos ‖ sin` (b or 1, H, n, 2 · rotary_dim), by rank `i` (dim 1), of the rotation that takes queries or keys at
    `positions` (b or 1, n) to `m / r_i`, `ratios` (H, 1, 1): from unrotated ones, the rotation at `m / r_i`; from ones
    already `rotated` at `m`, the further turn by `m / r_i - m` (rotations of the same planes compose). One table, so
    that each head's rows of both are one gather (`heads_turn`)."""
    positions = positions.float()
    angles = positions / ratios - positions if rotated else positions / ratios  # (H, b or 1, n)
    return rotary_table(angles.transpose(0, 1), inv_freq, dtype)


def heads_turn(turn: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (b, H, n, rotary_dim): each head's rows of a `turned_by_ratios` table (b or 1, H, n, 2 · rotary_dim),
    by its rank `ranks` (b or 1, H, 1, 1)."""
    shape = (max(turn.shape[0], ranks.shape[0]), *turn.shape[1:])
    return torch.gather(turn if turn.shape == shape else turn.expand(shape), 1, ranks.expand(shape)).chunk(2, -1)


@dataclass(frozen=True, eq=False)
class MSPoEMitigation(Mitigation):
    """Head `h` of its layers reads positions `m / r_h` (docs/design.md, MS-PoE): on SepFormer in the position hook
    (unrotated queries and keys, before the cache), on a Hugging Face decoder in its attention function, which turns
    the keys rotated at `m` further, the cache's included. Heads are query heads: grouped-query keys are expanded."""

    options_class = MSPoE
    prefill_requirement = (
        "ms_poe ranks the heads at prefill: it must be on from the first (prefill) call of a cached generation, or "
        "be given a fixed head_order."
    )
    turns_queries_keys = True

    positions: ModelPositions | None = None  # the model's rotary (its frequency tables, by layer)
    heads: int = 0  # query heads
    # Ranks are kept (b or 1, H, 1, 1): they index the rotary turns by rank below, and transposed the positional shift.
    fixed_ranks: torch.Tensor | None = None  # (1, H, 1, 1) from `head_order`
    cache: SepFormerCache | None = None  # keeps the ranks made at prefill, and the turned keys (`MSPoEState`)
    state: MSPoEState | None = None  # the cache's, from `start` (emptied of keys other options turned)
    store: dict | None = None  # where the generation keeps tensors derived from the weights (`derived_store`)
    model: nn.Module | None = None  # a SepFormerModel with a positional block: its map and input norms
    extrapolation: PositionExtrapolation | None = None  # the call's: how the map is read past its table
    # The `H` ratios are one set for every layer: what they do to positions is computed once per run, by rank.
    # Rank first, so that a layer's (H, b, ...) tensors are one batched matmul without a copy.
    position_shift: torch.Tensor | None = None  # (H, b or 1, seq, d_pos): p(m / r_i) - p(m) for rank i
    # per frequency table (one per layer type where the rotary has several), `cos ‖ sin` (b or 1, H, seq,
    # 2 · rotary_dim) by rank that take the call's queries, and its new keys, to `m / r_i` (`turned_by_ratios`)
    query_turn: dict | None = None
    padding_mask: torch.Tensor | None = None  # (b, kv) the call's padding mask, where the keys' positions come from
    seen: int = 0  # the keys the cache held before this call

    @classmethod
    def fixes_state_at_prefill(cls, options: MSPoE) -> bool:
        return options.head_order is None  # the heads are ranked from the prefill's last row

    acts_on_last_rows = fixes_state_at_prefill

    @classmethod
    def resolve(cls, options: MSPoE, call: CallContext) -> "MSPoEMitigation":
        config, positions = call.model.config, call.positions
        positions.check_head_turn(config)
        if not positions.calls_position_hooks:  # SepFormer's hook reads each call's own positions
            check_default_positions(call, "ms_poe on a Hugging Face decoder turns the keys (the cached ones included)")
        if not positions.calls_position_hooks and getattr(call.cache, "is_compileable", False):
            refuse_under_compile(
                "ms_poe turns the keys a static cache hands a Hugging Face decoder's attention by how many it has "
                "seen (a tensor, compiled)"
            )
        layers = options.layer_set(config.num_hidden_layers)
        model = call.model if positions.positional_map is not None else None
        if model is not None:  # `position_query_key` multiplies by `q_proj.weight`, `k_proj.weight` directly
            check_plain_projections(model, layers)
        return cls(
            options,
            layers,
            positions=positions,
            heads=config.num_attention_heads,
            fixed_ranks=ranking(options, call),
            cache=call.sepformer_cache,
            store=derived_store(call.sepformer_cache),
            model=model,
            extrapolation=call.extrapolation,
        )

    def start(self, run: LayerRun) -> "MSPoEMitigation":
        ratios = rank_ratios(self.options, self.heads, run.device)  # (H, 1, 1)
        position_shift = query_turn = None
        if run.position_rows is not None:  # the positional block's rows p(m)
            map_ = self.positions.positional_map
            coordinates = map_.table_coordinates(run.table_positions, self.extrapolation)
            rows = map_(coordinates / ratios, self.extrapolation, store=self.store)  # p(m / r_i)
            position_shift = rows.to(run.dtype) - run.position_rows
        if self.positions.rotary is not None:
            rotated = not self.positions.calls_position_hooks
            query_turn = {
                kind: turned_by_ratios(run.position_ids, ratios, inverse, run.dtype, rotated)
                for kind, inverse in self.positions.inverse_frequencies().items()
            }
        seen = run.cache.get_seq_length() if run.cache is not None else 0
        state = None if self.cache is None else kept_in(self.cache.mitigation_state, self.options.name, MSPoEState)
        if state is not None and state.turned_by is not self.options and state.turned_by != self.options:
            state.forget_turned()
            state.turned_by = self.options
        return self.replace(
            position_shift=position_shift,
            query_turn=query_turn,
            padding_mask=run.padding_mask,
            seen=seen,
            state=state,
        )

    def layer_ranks(self, attention, query, key, attention_mask, position_embeddings=None) -> torch.Tensor:
        """(b or 1, H, 1, 1) ranks of one layer's heads: fixed, kept from prefill, or made now (a prefill) from the last
        query's attention row with `query` and `key` rotated at `m` (by `position_embeddings` where given)."""
        if self.fixed_ranks is not None:
            return self.fixed_ranks
        ranks = self.state.ranks
        if attention.layer_idx not in ranks:
            if position_embeddings is not None:
                query, key = apply_partial_rotary(query, key, *position_embeddings)
            key = repeat_kv(key, query.shape[1] // key.shape[1])  # grouped-query keys: one per query head
            probs = last_row_scores(query, key, attention_mask, attention.scaling).softmax(-1)
            valid = last_row_keys(attention_mask, key.shape[2], key.device)
            ranks[attention.layer_idx] = head_ranks(position_awareness(probs, valid))[..., None, None]
        return ranks[attention.layer_idx]

    def position_query_key(self, attention, query, key, layer_call):
        ranks = self.layer_ranks(attention, query, key, layer_call.attention_mask, layer_call.position_embeddings)
        if self.position_shift is not None:
            norm = self.model.layers[attention.layer_idx].input_layernorm.position
            positional = layer_call.residual[..., : self.position_shift.shape[-1]]  # (b, seq, d_pos)
            shift = by_head(self.position_shift, ranks.transpose(0, 1))  # p(m / r_h) - p(m): (H, b, seq, d_pos)
            # Shifted and unshifted rows through one norm call: fewer calls, and a ratio of 1 adds exactly 0.
            normed = norm(torch.cat((positional + shift, positional[None]), 0))  # (H + 1, b, seq, d_pos)
            delta = normed[:-1] - normed[-1:]  # (H, b, seq, d_pos)
            heads, batch, seq, d_pos = delta.shape

            def make() -> torch.Tensor:  # (H, d_pos, 2 · hd): W_q[h, :, pos]ᵀ ‖ W_k[h, :, pos]ᵀ, for one bmm
                q_k = (attention.q_proj.weight, attention.k_proj.weight)  # (H · hd, d_model) -> (H, hd, d_pos)
                return torch.cat([w[:, :d_pos].view(-1, attention.head_dim, d_pos) for w in q_k], 1).mT.contiguous()

            weights = kept_in(self.store, ("ms_poe weights", attention.layer_idx), make)  # once per generation
            deltas = torch.bmm(delta.view(heads, batch * seq, d_pos), weights)  # (H, b · seq, 2 · hd)
            query_delta, key_delta = deltas.view(heads, batch, seq, -1).transpose(0, 1).chunk(2, -1)  # (b, H, seq, hd)
            query, key = query + query_delta, key + key_delta
        if self.query_turn is not None:
            turn = self.query_turn[self.positions.table_of(attention.layer_idx)]
            query, key = apply_partial_rotary(query, key, *heads_turn(turn, ranks))
        return query, key

    def earlier_turned_keys(self, layer: int, earlier: torch.Tensor, ranks: torch.Tensor, total: int) -> torch.Tensor:
        """(b, H, n, head_dim) the keys `earlier` (b, H or H_kv, n, head_dim) held before this call's, of `total` keys
        seen with them, turned: kept on the cache by the call before, or turned now from their positions (the first
        call of a cache, after a crop, or other options)."""
        state = self.state
        if state is not None and state.turned_seen.get(layer) == self.seen:
            return state.turned_keys[layer]
        earlier = self.per_query_head(earlier)  # the last (sliding window) or first (static slots) keys of `seen`
        positions = key_positions(self.padding_mask, total, earlier.device).clamp(min=0)  # padding is masked: any one
        positions = positions[:, self.seen - earlier.shape[2] : self.seen]
        ratios, inverse = rank_ratios(self.options, self.heads, earlier.device), self.positions.inverse_frequencies()
        turn = turned_by_ratios(positions, ratios, inverse[self.positions.table_of(layer)], earlier.dtype, rotated=True)
        return rotate_partial(earlier, *heads_turn(turn, ranks))

    def per_query_head(self, key: torch.Tensor) -> torch.Tensor:
        """(b, H, n, head_dim) from grouped-query keys (b, H_kv, n, head_dim) (or already expanded ones)."""
        return repeat_kv(key, self.heads // key.shape[1])

    def turned_queries_keys(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, ranks: torch.Tensor, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`query` (b, H, n, head_dim) and `key` (b, H or H_kv, held, head_dim) as the cache hands it over, each query
        head's turned to `m / r_h`: the queries and the call's new keys by `cos`, `sin` (they share positions: one turn
        of both), the earlier keys kept turned on the cache's state (none kept without one: every key turned). A
        sliding-window cache hands over the last keys it has seen; a static one its slots, the first ones filled."""
        state, new, held = self.state, cos.shape[2], key.shape[2]
        total = self.seen + new
        start = held - new if held <= total else self.seen
        both = torch.stack((query, self.per_query_head(key[:, :, start : start + new])))  # (2, b, H, n, head_dim)
        query, new_turned = rotate_partial(both, cos, sin).unbind()
        if state is not None and held == total and state.turned_seen.get(layer) == self.seen:
            turned = state.written_after("keys", layer, self.seen, new_turned)  # after every earlier key, kept turned
            if turned is not None:
                state.turned_seen[layer] = total
                return query, turned
        earlier = self.earlier_turned_keys(layer, key[:, :, :start], ranks, total)
        assert earlier.shape[0] == key.shape[0], "the kept turned keys follow the cache's rows"
        turned = torch.cat((earlier, new_turned), 2)
        if state is not None:
            state.keep("keys", layer, turned[:, :, -held:])  # a sliding window's next call needs at most these
            state.turned_seen[layer] = total
        if held > total:  # a static cache's slots not filled yet
            return query, torch.cat((turned, self.per_query_head(key[:, :, total:])), 2)
        return query, turned[:, :, -held:]

    def values_per_query_head(self, layer: int, value: torch.Tensor, new: int) -> torch.Tensor:
        """`value` (b, H or H_kv, held, head_dim) one per query head: where the cache holds every key seen, this call's
        `new` ones expanded after the earlier ones kept on the cache's state, else all of them expanded."""
        if value.shape[1] == self.heads:
            return value
        state, held, total = self.state, value.shape[2], self.seen + new
        if state is None:
            return self.per_query_head(value)
        if held != total:  # a sliding window's or a static cache's: expanded at each step, none kept
            state.keep("values", layer, None)
            return self.per_query_head(value)
        expanded = state.written_after("values", layer, self.seen, self.per_query_head(value[:, :, self.seen :]))
        if expanded is None:
            expanded = self.per_query_head(value)
            state.keep("values", layer, expanded)
        return expanded

    def uses(self, hook: str) -> bool:
        if hook in ("position_query_key", "wrap_attention"):  # where the model hands it the queries and keys
            return (hook == "position_query_key") == self.positions.calls_position_hooks
        return super().uses(hook)

    def wrap_attention(self, layer_idx: int, function, projection):
        def rescaled(module, query, key, value, attention_mask, **kwargs):
            ranks = self.layer_ranks(module, query, key, attention_mask)  # (b or 1, H, 1, 1)
            cos, sin = heads_turn(self.query_turn[self.positions.table_of(layer_idx)], ranks)  # (b, H, seq, rotary_dim)
            query, key = self.turned_queries_keys(layer_idx, query, key, ranks, cos, sin)
            value = self.values_per_query_head(layer_idx, value, cos.shape[2])
            return function(module, query, key, value, attention_mask, **kwargs)

        return rescaled
