"""Reordering the documents of a prompt by relevance ("Lost in the Middle"; attention sorting, arXiv 2310.01427):
`relevance_order`, `reorder_prompt` and `document_relevance`, all three in `reorder_documents`, which `generate`'s
`reorder_documents=` option runs on the prompt. Spans count from each row's first real token, like calibration's."""

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from .mitigation_base import model_positions
from .mitigation_options import (
    MitigationOptions,
    PositionalScaling,
    as_int_tuple,
    as_spans,
    check_combination,
    check_number,
    checked,
    integer,
    one_of,
    with_bounds,
)
from .positional_maps import check_position_readable
from .spans import (
    check_dummy_document,
    check_last_column_real,
    check_mask_values,
    check_spans,
    default_dummy_token,
    dummy_batch,
    key_documents,
    key_positions,
    positions_from_mask,
    prompt_lengths,
)

STRATEGIES = ("ends", "last", "first")
SOURCES = ("attention", "calibrated", "position_free")
check_strategy = one_of(STRATEGIES)
SCORING_KEYWORDS = ("position_ids", "output_attentions", "use_cache", "logits_to_keep", "past_key_values")


@dataclass(frozen=True)
class ReorderDocuments(MitigationOptions):
    """`generate`'s `reorder_documents=`: the prompt's documents reordered by relevance before generating.

    Args:
        spans: per batch row, the documents' `(start, end)` token spans (end exclusive), counted from the row's first
            real token; the same number of documents in every row, not overlapping, inside the prompt.
        by: the relevance: per row, one score per document (a (b, K) tensor or nested sequence, e.g. a retriever's),
            or read from the model (see `document_relevance`): `"attention"`, `"calibrated"`, `"position_free"`.
        strategy: where the most relevant documents go (see `relevance_order`): `"ends"`, `"last"`, `"first"`.
        rounds: attention sorting's rounds: `rounds - 1` times the documents are scored and sorted with the most
            relevant last (`"last"`), each time on the prompt the previous round made; the last round's scores are
            then placed by `strategy`. Only relevance read from the model changes with the order: given scores take 1.
        layers: the layers whose attention is averaged (`None`: all); read only by relevance from the model.
        dummy_document: token ids of the dummy document that measures `bias(k)` for `by="calibrated"`; `None` is
            `pad_token_id` (or, without one, `eos_token_id`) repeated to document `k`'s length, as in
            `attention_calibration`.
    """

    spans: tuple[tuple[tuple[int, int], ...], ...] = checked(as_spans)
    by: str | tuple[tuple[float, ...], ...] = "attention"
    strategy: str = checked(check_strategy, default="ends")
    rounds: int = checked(integer(1), default=1)
    layers: tuple[int, ...] | None = checked(as_int_tuple, default=None)
    dummy_document: tuple[int, ...] | None = checked(with_bounds(as_int_tuple, empty=False), default=None)
    name: ClassVar[str] = "reorder_documents"

    def check_across_fields(self) -> None:
        object.__setattr__(self, "by", self._as_source(self.by))
        if self.dummy_document is not None and self.by != "calibrated":
            raise ValueError(
                f"reorder_documents dummy_document is only read by by='calibrated' (which measures bias(k) with it); "
                f"got by={self.by!r}."
            )
        if not self.from_model:
            for field, value, allowed in (("rounds", self.rounds, 1), ("layers", self.layers, None)):
                if value != allowed:
                    raise ValueError(
                        f"reorder_documents {field}={value!r} is read only by relevance from the model "
                        f"(by in {list(SOURCES)}); given scores do not change with the order: leave it at {allowed}."
                    )

    def _as_source(self, by):
        if isinstance(by, str):
            if by not in SOURCES:
                raise ValueError(
                    f"reorder_documents by={by!r} is not one of {list(SOURCES)}, nor scores (one per document)."
                )
            return by
        rows, documents = len(self.spans), len(self.spans[0])
        try:
            scores = tuple(tuple(row) for row in (by.tolist() if hasattr(by, "tolist") else by))
        except TypeError:
            scores = None
        if scores is None or len(scores) != rows or any(len(row) != documents for row in scores):
            shape = "not a (rows, documents) array" if scores is None else [len(row) for row in scores]
            raise ValueError(
                f"reorder_documents by={by!r} must be one of {list(SOURCES)} or one score per document: shape "
                f"({rows}, {documents}) for these spans; got {shape} (scores per row)."
            )
        return tuple(tuple(float(check_number(self.name, "by score", score)) for score in row) for row in scores)

    @property
    def from_model(self) -> bool:
        return isinstance(self.by, str)


def as_scores(scores) -> torch.Tensor:
    """`scores` as a (K,) or (b, K) float64 tensor of finite numbers (K >= 1)."""
    if isinstance(scores, torch.Tensor) and (scores.dtype == torch.bool or scores.is_complex()):
        raise ValueError(f"relevance scores must be real numbers; got a tensor of {scores.dtype}.")
    try:
        tensor = torch.as_tensor(scores, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"relevance scores must be a (K,) or (b, K) tensor or sequence of numbers; got {scores!r} ({error})."
        ) from None
    if tensor.dim() not in (1, 2) or tensor.shape[-1] == 0:
        raise ValueError(
            f"relevance scores must have shape (K,) or (b, K) with K >= 1 documents; got shape {tuple(tensor.shape)}."
        )
    if not tensor.isfinite().all():
        raise ValueError(f"relevance scores must be finite; got {scores!r}.")
    return tensor


def relevance_order(scores, strategy: str = "ends") -> torch.LongTensor:
    """For each row of `scores` ((K,) or (b, K), higher is more relevant), the new order of its `K` documents: entry
    `j` is the (old) index of the document that goes to place `j`.

    - `"ends"`: the most relevant first, the second last, the third second, the fourth second to last, ...: the least
      relevant end up in the middle.
    - `"last"`: ascending, the most relevant last (closest to the question).
    - `"first"`: descending, the most relevant first.

    Ties keep the documents' original order: in `"first"` and `"last"` tied documents appear in it, and in `"ends"`
    the earlier of two tied documents takes the place of the more relevant.
    """
    check_strategy("reorder_documents", "strategy", strategy)
    scores = as_scores(scores)
    if strategy == "last":
        return scores.sort(dim=-1, stable=True).indices
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices  # best first, ties in original order
    if strategy == "first":
        return ranked
    rank = torch.arange(ranked.shape[-1])
    place = torch.where(rank % 2 == 0, rank // 2, ranked.shape[-1] - 1 - rank // 2)
    return torch.empty_like(ranked).index_copy_(-1, place, ranked)


def as_order(order, rows: int, documents: int) -> list[list[int]]:
    """`order` as `rows` lists, each a permutation of `0..documents - 1`."""
    try:
        values = torch.as_tensor(order)
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or values.shape != (rows, documents) or values.is_floating_point() or values.dtype == torch.bool:
        shape = "not an integer array" if values is None else f"{tuple(values.shape)} of {values.dtype}"
        raise ValueError(
            f"reorder_prompt order must be integer indices of shape (rows, documents) = ({rows}, {documents}); got "
            f"{shape}."
        )
    lists = values.tolist()
    for row, permutation in enumerate(lists):
        if sorted(permutation) != list(range(documents)):
            raise ValueError(
                f"reorder_prompt order of row {row} is {permutation}: it must be a permutation of 0..{documents - 1} "
                "(each document's index once)."
            )
    return lists


def check_prompt(name: str, input_ids, attention_mask, spans) -> list[int]:
    """`input_ids` (b, n) integer ids with `attention_mask` None or (b, n), one row of spans per row, inside the row's
    real tokens. Returns each row's number of real tokens."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            f"{name} needs input_ids as a 2-D tensor of token ids (batch, sequence); got "
            f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}."
        )
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"{name} needs attention_mask None or a 2-D padding mask of input_ids' shape {tuple(input_ids.shape)}; "
                f"got {tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}."
            )
        check_mask_values(attention_mask, f"{name} ")
    lengths = prompt_lengths(attention_mask, *input_ids.shape)
    check_spans(name, spans, len(input_ids), lengths)
    for row, (row_spans, length) in enumerate(zip(spans, lengths, strict=True)):
        last = max(row_spans, key=lambda span: span[1])
        if last[1] == length:
            raise ValueError(
                f"{name} span {last} of row {row} holds the prompt's last token ({length - 1}, counted from the row's "
                "first real token): that is the question, which stays after the documents: end the documents before it."
            )
    return lengths


def reorder_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, spans, order):
    """The prompt with each row's documents moved to `order` ((b, K): entry `j` the index in `spans` of the document
    that goes to place `j`, as `relevance_order` gives it). Returns `(input_ids, spans)`: the new ids (same shape,
    same padding: `attention_mask` still describes them) and, per row, the documents' new spans in place order.

    The tokens between two documents keep their order, the `i`-th gap following the document in place `i`; the tokens
    before and after the documents and the padding do not move. Spans count from the row's first real token.
    """
    spans = as_spans("reorder_prompt", "spans", spans)
    check_prompt("reorder_prompt", input_ids, attention_mask, spans)
    return move_documents(input_ids, attention_mask, spans, as_order(order, len(spans), len(spans[0])))


def move_documents(input_ids, attention_mask, spans, order: list[list[int]]):
    """`reorder_prompt` on checked inputs."""
    reordered, new_spans = input_ids.clone(), []
    for row, (row_spans, row_order) in enumerate(zip(spans, order, strict=True)):
        columns = slice(None) if attention_mask is None else attention_mask[row].nonzero().flatten()
        tokens = input_ids[row, columns]
        by_start = sorted(row_spans)
        # what follows each place: the gaps between the documents in their old order, then the rest of the prompt
        after = [
            tokens[end:start] for (_, end), (start, _) in zip(by_start, [*by_start[1:], (None, None)], strict=True)
        ]
        pieces, placed, cursor = [tokens[: by_start[0][0]]], [], by_start[0][0]
        for document, gap in zip(row_order, after, strict=True):
            start, end = row_spans[document]
            pieces += [tokens[start:end], gap]
            placed.append((cursor, cursor + end - start))
            cursor += end - start + len(gap)
        reordered[row, columns] = torch.cat(pieces)
        new_spans.append(tuple(placed))
    return reordered, tuple(new_spans)


def check_combinable(keywords: dict) -> None:
    """The options of `keywords` (`generate`'s, or the scoring passes') that reordering cannot run with."""
    given = {**keywords, "reorder_documents": True}
    check_combination({name: frozenset() for name, value in given.items() if value is not None and value is not False})


def check_reordering(model, options: ReorderDocuments, input_ids, attention_mask, model_kwargs: dict) -> None:
    """Everything `reorder_documents` needs from the model, the prompt and the forwards' `model_kwargs`, before any
    work."""
    lengths = check_prompt(options.name, input_ids, attention_mask, options.spans)
    check_combinable(model_kwargs)
    if options.by == "position_free" and model_kwargs.get("positional_scaling") is not None:
        raise ValueError(
            "reorder_documents by='position_free' sets positional_scaling itself (factor 0 on the positional block "
            f"in every layer); got positional_scaling={model_kwargs['positional_scaling']!r}: drop it."
        )
    own = sorted(set(SCORING_KEYWORDS) & set(model_kwargs))
    if own:
        raise TypeError(
            f"reorder_documents sets {own} of its scoring passes itself (they read the last token's attention of the "
            f"whole prompt, uncached, at the positions of its padding mask): drop them."
        )
    if not options.from_model:
        if model_kwargs:
            raise TypeError(
                f"reorder_documents with relevance scores given runs no forward, so the forward keywords "
                f"{sorted(model_kwargs)} would be ignored: drop them, or score with the model (by='attention')."
            )
        return
    if model.training:
        raise ValueError(
            f"reorder_documents by={options.by!r} scores the documents with the model, whose dropout is on in train "
            "mode: put the model in eval mode (model.eval())."
        )
    options.layer_set(model.config.num_hidden_layers)
    if attention_mask is not None:
        reader = f"reorder_documents by={options.by!r} reads the last prompt token's attention from the last column"
        check_last_column_real(attention_mask, reader)
    if options.by == "calibrated":
        check_dummy_document(options, model.config)
        check_dummy_length(model, options, lengths, model_kwargs)
    if options.by == "position_free":
        config, positions = model.config, model_positions(model)
        if positions is None or not positions.knows_position_channels:
            raise ValueError(
                f"reorder_documents by='position_free' zeroes SepFormer's positional block; this is a "
                f"{type(model).__name__} ({config.model_type!r}), whose positions are not in known channels: use "
                "by='attention' or by='calibrated'."
            )
        if positions.positional_map is None or positions.rotary is not None:
            raise ValueError(
                f"reorder_documents by='position_free' needs positions only in the positional block "
                f"(position_size > 0, rotary_dim = 0); this model has position_size={config.position_size}, "
                f"rotary_dim={config.rotary_dim}: use by='attention' or by='calibrated'."
            )


def check_dummy_length(model, options: ReorderDocuments, lengths: list[int], model_kwargs: dict) -> None:
    """The dummy passes of `by="calibrated"` read no position past what the model reads: a dummy document longer than
    the document it replaces makes a sequence longer than the prompt."""
    longest = max(
        length - (end - start) + len(options.dummy_document or range(start, end))
        for row_spans, length in zip(options.spans, lengths, strict=True)
        for start, end in row_spans
    )
    limit = getattr(model.config, "max_position_embeddings", None)
    if longest <= max(lengths) or limit is None or longest <= limit:
        return
    why = f"past max_position_embeddings={limit} and the prompt's {max(lengths)} tokens"
    positions = model_positions(model)
    if positions is not None and positions.extrapolates:  # reads positions past L by its position_extrapolation
        try:
            return check_position_readable(model, longest - 1, model_kwargs.get("position_extrapolation"), False)
        except ValueError as error:
            why = str(error).rstrip(".")
    raise ValueError(
        f"reorder_documents dummy_document of {len(options.dummy_document)} tokens makes dummy passes of {longest} "
        f"tokens, {why}: give a shorter dummy_document."
    )


@contextlib.contextmanager
def eager_attention(model):
    """`model` running attention "eager", the implementation that returns the probabilities (`output_attentions`);
    then its own implementation again, also after an error."""
    implementation = model.config._attn_implementation
    if implementation != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if implementation != "eager":
            model.set_attn_implementation(implementation)


def last_row_attention(model, input_ids, attention_mask, layers, **model_kwargs) -> torch.Tensor:
    """(b, n) the last token's attention probabilities, averaged over the heads of `layers` (read in eager attention,
    whatever the model runs: sdpa and flash attention return no probabilities)."""
    # positions from the padding mask, as generate gives them: a left-padded row is read as the row alone
    positions = None if attention_mask is None else positions_from_mask(attention_mask).clamp(min=0)
    with torch.no_grad(), eager_attention(model):
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            output_attentions=True,
            use_cache=False,
            logits_to_keep=1,
            **model_kwargs,
        )
    return torch.stack([outputs.attentions[layer][:, :, -1].float() for layer in sorted(layers)], 1).mean((1, 2))


def relevance(model, options: ReorderDocuments, input_ids, attention_mask, *, spans, **model_kwargs) -> torch.Tensor:
    """(b, K) `options.by`'s relevance of the documents at `spans` (`options.spans` or where the previous round moved
    them; checked by `check_reordering`)."""
    if not options.from_model:
        return torch.tensor(options.by, dtype=torch.float64)
    layers = options.layer_set(model.config.num_hidden_layers)
    if options.by == "position_free":
        all_layers = tuple(range(model.config.num_hidden_layers))
        model_kwargs = {**model_kwargs, "positional_scaling": PositionalScaling(factor=0.0, layers=all_layers)}
    attention = last_row_attention(model, input_ids, attention_mask, layers, **model_kwargs)  # (b, n)
    positions = key_positions(attention_mask, input_ids.shape[1], input_ids.device)
    membership = key_documents(torch.tensor(spans, device=input_ids.device), positions)  # (b, n, K)
    scores = torch.einsum("bn,bnk->bk", attention, membership) / membership.sum(1)
    if options.by == "calibrated":
        filler = default_dummy_token(model.config)
        ids, padding, probe = dummy_batch(spans, options.dummy_document, filler, input_ids, attention_mask)
        dummy = last_row_attention(model, ids, padding, layers, **model_kwargs)  # (b · K, width)
        bias = (dummy * probe).sum(-1) / probe.sum(-1)
        scores = scores - bias.view(scores.shape)
    return scores.double().cpu()


def document_relevance(
    model, input_ids, attention_mask, spans, by="attention", layers=None, dummy_document=None, **model_kwargs
) -> torch.Tensor:
    """(b, K) the relevance of each row's documents (`spans`, counted from the row's first real token).

    `by`: scores given by the caller ((b, K), returned as float64), or read from any Hugging Face causal LM, with
    `a(x)` the last prompt token's attention on token `x` averaged over the heads and the chosen `layers` (default all):

    - `"attention"`: `Attn(doc_k) = mean_{x in doc_k} a(x)`;
    - `"calibrated"`: `Attn(doc_k) - bias(k)`, `bias(k)` the same mean on a dummy document (`dummy_document`, default
      `pad_token_id` repeated) put in document `k`'s place;
    - `"position_free"` (SepFormer, positions in the positional block only): `Attn(doc_k)` with the positional block
      scaled to 0 in every layer.

    Details: docs/design.md, "Reordering documents". `model_kwargs` go to every forward (e.g. `position_extrapolation`).
    """
    options = ReorderDocuments(spans=spans, by=by, layers=layers, dummy_document=dummy_document)
    check_reordering(model, options, input_ids, attention_mask, model_kwargs)
    return relevance(model, options, input_ids, attention_mask, spans=options.spans, **model_kwargs)


def reorder_documents(model, input_ids, attention_mask, options, **model_kwargs):
    """The prompt with its documents reordered by `options` (a `ReorderDocuments` or the dict of its fields):
    `options.rounds` rounds of scoring and sorting, each on the prompt the previous one made (see `ReorderDocuments`).

    Returns `(input_ids, spans, order)`: the new ids (`attention_mask` still describes them), the documents' new spans
    in place order, and (b, K) `order`, entry `j` the index in `options.spans` of the document now in place `j`.
    Everything is checked before the first forward; `model_kwargs` go to every forward.
    """
    options = ReorderDocuments.parse(options)
    check_reordering(model, options, input_ids, attention_mask, model_kwargs)
    spans, documents = options.spans, len(options.spans[0])
    order = torch.arange(documents).expand(len(input_ids), documents)
    for done in range(1, options.rounds + 1):  # each round on the checked prompt the last one made: not checked again
        scores = relevance(model, options, input_ids, attention_mask, spans=spans, **model_kwargs)
        step = relevance_order(scores, options.strategy if done == options.rounds else "last")
        input_ids, spans = move_documents(input_ids, attention_mask, spans, step.tolist())
        order = order.gather(1, step)
    return input_ids, spans, order


__all__ = ["ReorderDocuments", "document_relevance", "relevance_order", "reorder_documents", "reorder_prompt"]
