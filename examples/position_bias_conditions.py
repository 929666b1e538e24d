"""The conditions of `position_bias.py`: each mitigation's sweep (and reordering by relevance), built once and run on
every model that accepts it (a model that refuses one gets no row, and the run says why), scored by gold slot; and the
last token's attention to each group of key positions."""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from experiment_common import first_line
from position_bias_task import Vocabulary, document_spans
from tqdm.auto import tqdm

from sepformer import ReorderDocuments, SepFormerCache, reorder_documents
from sepformer.positional_search import NoPositionalChannelError, is_sepformer, search_positional_scaling
from sepformer.reordering import eager_attention

NONE, IN2, REORDER = "none", "in2", "reorder"
MITIGATION_NAMES = (
    *(NONE, "stable_mask", "ms_poe", "attention_calibration", "positional_scaling", "attention_buckets"),
    *("parallel_context_windows", IN2, REORDER),
)
SEARCH_PICK = "search's pick"  # the setting of positional scaling at the search's channels and factor


@dataclass
class Condition:
    """One evaluation of a model: `logits(model, input_ids)` gives the last token's logits (b, V); with `reorder`,
    `reorder(model, input_ids)` first gives the prompts with their documents reordered and the (b, K) orders (entry
    `j`: the original slot of the document now in place `j`), and the logits are read on the reordered prompts."""

    mitigation: str
    setting: str  # the same on every seed: rows of one setting are averaged over seeds
    logits: Callable
    # what this seed's run chose (the search's channels and factor), in results.csv; or `details(model)`, computed
    # only where the model runs the condition
    details: str | Callable = ""
    reorder: Callable | None = None


def plain_logits(model, input_ids, **kwargs):
    return model(input_ids=input_ids, use_cache=False, logits_to_keep=1, **kwargs).logits[:, -1]


def keyword(mitigation: str, setting: str, make_value: Callable, details: str | Callable = "") -> Condition:
    """A mitigation option keyword of `forward` (SepFormer's own, `add_mitigations`' on the Hugging Face models);
    `make_value(batch_size)` its value for a batch."""
    return Condition(
        mitigation, setting, lambda model, ids: plain_logits(model, ids, **{mitigation: make_value(len(ids))}), details
    )


def mitigation_conditions(spans, vocab: Vocabulary) -> list[Condition]:
    """Every mitigation's sweep, built once for every model: a model that refuses a setting (`refusal`) gets no row
    for it. Attention Buckets sweeps the positions' scales (SepFormer's learned table, Llama's rotary) and the rotary
    bases (Llama)."""
    conditions = [Condition(NONE, "-", plain_logits)]
    conditions += [keyword("stable_mask", f"gamma={g}", lambda b, g=g: {"gamma": g}) for g in (0.02, 0.05, 0.2)]
    conditions += [keyword("ms_poe", f"r_max={r}", lambda b, r=r: {"r_min": 1.2, "r_max": r}) for r in (1.5, 1.8, 2.4)]
    conditions += calibrated(spans, "dummy passes", {"dummy_document": vocab.dummy_document})
    conditions += [
        keyword("positional_scaling", f"factor={s}", lambda b, s=s: {"factor": s}) for s in (0.5, 0.0, -0.5, -1.0)
    ]
    conditions += [
        keyword("attention_buckets", f"scales={list(s)}", lambda b, s=s: {"scales": s})
        for s in ((1.0, 0.9, 0.8), (1.0, 0.75, 0.5))
    ]
    conditions += [
        keyword("attention_buckets", f"bases={list(bases)}", lambda b, bases=bases: {"bases": bases})
        for bases in ((10000, 17500, 25000), (10000, 13000, 16000, 19000, 22000, 25000, 28000))
    ]
    conditions += [
        keyword("parallel_context_windows", setting, lambda b, w=windows: {"spans": [w] * b})
        for setting, windows in window_settings(spans)
    ]
    # the experiment's SepFormer has no rotary (rotary_dim 0): its positions are in the positional block only
    return (
        conditions
        + reorder_conditions(spans, vocab)
        + [reordered("position-free attention (SepFormer)", spans, by="position_free")]
    )


def every_layer_conditions(spans, vocab: Vocabulary, num_layers: int) -> list[Condition]:
    """MS-PoE and calibration in every layer: their papers' defaults leave out the first layers (MS-PoE the first
    `min(2, n // 2)`, calibration the first half), which in a two-layer model is the layer where the bias sits."""
    every = {"layers": tuple(range(num_layers))}
    conditions = [
        keyword("ms_poe", f"r_max={r}, every layer", lambda b, r=r: {"r_min": 1.2, "r_max": r, **every})
        for r in (1.5, 1.8, 2.4)
    ]
    return conditions + calibrated(
        spans, "dummy passes, every layer", {"dummy_document": vocab.dummy_document, **every}
    )


def calibrated(spans, estimate: str, option: dict, details: str | Callable = "") -> list[Condition]:
    """Attention calibration of each document at each temperature, `bias(k)` estimated as `option` says."""
    return [
        keyword(
            "attention_calibration",
            f"temperature={t}, {estimate}",
            lambda b, t=t: {"spans": [spans] * b, "temperature": t, **option},
            details,
        )
        for t in (5e-5, 1e-3, 1e-2)
    ]


def refusal(model, condition: Condition, prompt: torch.Tensor) -> str | None:
    """Why `model` refuses `condition`, from the ValueError its option checks raise before any work (MS-PoE on a
    model without rotary, ...), run on one prompt (1, n); None when it runs. A search without candidates is not a
    refusal: its row says why (`evaluate_model`)."""
    try:
        with torch.no_grad():
            if condition.reorder is not None:
                prompt, _ = condition.reorder(model, prompt)
            condition.logits(model, prompt)
    except NoPositionalChannelError:
        return None
    except ValueError as error:
        return first_line(error)
    return None


def accepted(model, conditions: list[Condition], prompt: torch.Tensor, name: str) -> list[Condition]:
    """The conditions `model` runs; the refused ones are printed, by mitigation, with the model's reason."""
    kept, refused = [], {}
    for condition in conditions:
        if (why := refusal(model, condition, prompt)) is None:
            kept.append(condition)
        else:
            refused.setdefault((condition.mitigation, why), []).append(condition.setting)
    for (mitigation, why), settings in refused.items():
        tqdm.write(f"  {name}: no {mitigation} row for {'; '.join(settings)}: refused: {why}")
    return kept


def window_settings(spans) -> list[tuple[str, list]]:
    """PCW's sweep: each document its own window, then windows of 4 documents and two windows (half the list each)."""
    settings = [("documents as windows", spans)]
    for per_window in sorted({4, len(spans) // 2}):
        if 1 < per_window < len(spans):
            windows = [
                (spans[i][0], spans[min(i + per_window, len(spans)) - 1][1]) for i in range(0, len(spans), per_window)
            ]
            settings.append((f"{len(windows)} windows of {per_window} documents", windows))
    return settings


def reordered(setting: str, spans, **options) -> Condition:
    """Each prompt's documents reordered by relevance read from the model (`reorder_documents` with strategy "ends":
    the most relevant first, the second last, ...; scored in eager attention), then the model, as it is, predicts on
    the reordered prompt."""

    def reorder(model, ids):
        ids, _, order = reorder_documents(
            model, ids, None, ReorderDocuments(spans=[spans] * len(ids), strategy="ends", **options)
        )
        return ids, order

    return Condition(REORDER, setting, plain_logits, reorder=reorder)


def reorder_conditions(spans, vocab: Vocabulary) -> list[Condition]:
    """The relevance sources every model has: its attention, attention sorting, and calibrated attention (`bias(k)`
    measured with the calibration rows' dummy document)."""
    return [
        reordered("by attention", spans, by="attention"),
        reordered("attention sorting, 3 rounds", spans, by="attention", rounds=3),
        reordered("by calibrated attention", spans, by="calibrated", dummy_document=vocab.dummy_document),
    ]


def searched_scaling(model, validation: list[dict]) -> list[Condition]:
    """Positional scaling at the setting the dimension search picks, and, on a model without SepFormer's positional
    block (which the fixed sweep scales), the factor sweep on the picked channels. Where the search finds no
    candidate (the paper's filter can keep no channel of a model), the search's pick is a row that says so."""
    try:
        result = search_positional_scaling(model, validation)
    except NoPositionalChannelError as error:

        def no_candidate(model, input_ids, error=error):
            raise error

        return [Condition("positional_scaling", SEARCH_PICK, no_candidate)]
    best = result.best
    details = (
        f"channels={list(best.channels)}, factor={best.factor} (validation loss {best.loss:.3f}, "
        f"unscaled {result.base.loss:.3f})"
    )
    sweep = [
        keyword(
            "positional_scaling",
            f"searched channels, factor={factor}",
            lambda b, f=factor: replace(result.option, factor=f),
            f"channels={list(best.channels)}",
        )
        for factor in (() if is_sepformer(model) else (0.5, 0.0, -0.5, -1.0))
    ]
    return sweep + [keyword("positional_scaling", SEARCH_PICK, lambda b: result.option, details)]


@torch.no_grad()
def calibration_bias(model, prompts: torch.Tensor, options: dict) -> torch.Tensor:
    """`bias(k)` as attention calibration measures it at prefill: (prompts, calibrated layers, heads, documents)."""
    cache = SepFormerCache(config=model.config)
    model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1, attention_calibration=options)
    bias = cache.mitigation_state["attention_calibration"].bias  # per calibrated layer, (b, H, K)
    return torch.stack([bias[layer] for layer in sorted(bias)], 1).cpu()


def pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson's r along the last dimension."""
    x, y = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
    return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))


def calibration_without_dummy_passes(prompts: torch.Tensor, spans, vocab: Vocabulary) -> list[Condition]:
    """Calibration with `bias(k)` read off the positional block (no dummy passes; refused by a model without one), with
    how closely that estimate tracks the dummy passes' on these prompts: Pearson's r over the documents, per prompt,
    layer and head, and for the mean over prompts, per layer and head."""
    prompts = prompts[:: max(1, len(prompts) // 64)][:64]  # spread over the gold slots
    documents = {"spans": [spans] * len(prompts)}

    @functools.cache
    def agreement(model) -> str:
        on_device = prompts.to(model.device)
        dummy = calibration_bias(model, on_device, {**documents, "dummy_document": vocab.dummy_document})
        positional = calibration_bias(model, on_device, {**documents, "bias_estimate": "positional"})
        return (
            f"bias(k) vs the dummy passes': Pearson r {pearson(positional, dummy).nanmean():.2f} per prompt, "
            f"{pearson(positional.mean(0), dummy.mean(0)).nanmean():.2f} for the mean over prompts"
        )

    return calibrated(spans, "positional bias(k)", {"bias_estimate": "positional"}, agreement)


@torch.no_grad()
def predict(model, prompts: torch.Tensor, condition: Condition, args) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The greedy next token after every prompt (the value: one token), one forward of the whole prompt, no cache;
    and, for a condition that reorders the documents, the (N, K) orders it predicted on (else None)."""
    predictions, orders = [], []
    for batch in prompts.split(args.eval_batch_size):
        batch = batch.to(model.device)
        if condition.reorder is not None:
            batch, order = condition.reorder(model, batch)
            orders.append(order.cpu())
        predictions.append(condition.logits(model, batch).argmax(-1).cpu())
    return torch.cat(predictions), torch.cat(orders) if orders else None


def gold_at_an_end(orders: torch.Tensor, gold_slot: torch.Tensor, end_slots: int) -> torch.Tensor:
    """(N,) whether each prompt's gold document (at `gold_slot` before reordering) is, in `orders` (N, K), in one of
    the first or last `end_slots` places."""
    place = (orders == gold_slot[:, None]).int().argmax(-1)
    return (place < end_slots) | (place >= orders.shape[-1] - end_slots)


def evaluate_model(
    model, conditions: list[Condition], data: dict, num_pairs: int, metric, args, contender
) -> list[dict]:
    """One row per condition and gold slot. The slot is the gold's slot in the test prompt, before any reordering; a
    reordering condition's rows also hold `gold_at_end`: the fraction of the slot's prompts whose gold document the
    reordering put in the first or last `--end-slots` places (None on other rows)."""
    rows = []
    for condition in tqdm(conditions, desc=f"  evaluate {contender.name}", leave=False, dynamic_ncols=True):
        status, at_end = "ok", None
        details = condition.details(model) if callable(condition.details) else condition.details
        try:
            predictions, orders = predict(model, data["input_ids"], condition, args)
            gold = data["gold_slot"].tolist()
            result = metric.compute(
                predictions=predictions.tolist(), references=data["answer"].tolist(), positions=gold
            )
            by_slot, counts = result["accuracy_by_position"], result["count_by_position"]
            if orders is not None:
                at_end = gold_at_an_end(orders, data["gold_slot"], args.end_slots)
        except NoPositionalChannelError as error:  # the search's pick where the search found no candidate
            status = f"not evaluated: {first_line(error)}"
            by_slot, counts = {slot: float("nan") for slot in range(num_pairs)}, {slot: 0 for slot in range(num_pairs)}
        cell = dict(model=contender.name, mitigation=condition.mitigation, setting=condition.setting)
        cell |= dict(num_pairs=num_pairs, status=status, details=details)
        for slot in range(num_pairs):
            at_slot = None if at_end is None else at_end[data["gold_slot"] == slot].float().mean().item()
            rows.append(cell | dict(slot=slot + 1, accuracy=by_slot[slot], examples=counts[slot], gold_at_end=at_slot))
    return rows


@torch.no_grad()
def attention_rows(model, name: str, seed: int, prompts: torch.Tensor, num_pairs: int, args) -> list[dict]:
    """A_G = (1/|G|) Σ_{j∈G} a_{l,j}: the last token's attention to each group of key positions, per layer and head,
    averaged over up to `eval_batch_size` prompts spread evenly over the gold slots. Groups: <bos>, each slot's key and
    value, <sep> with the query. One row per layer, head and group."""
    groups = [("<bos>", (0, 1))] + [(f"slot {k + 1}", span) for k, span in enumerate(document_spans(num_pairs))]
    groups.append(("<sep> query", (1 + num_pairs, 3 + num_pairs)))
    batch = prompts[:: max(1, len(prompts) // args.eval_batch_size)][: args.eval_batch_size].to(model.device)
    with eager_attention(model):
        attentions = model(input_ids=batch, use_cache=False, output_attentions=True).attentions
    last = torch.stack([layer[:, :, -1].float() for layer in attentions], 1).mean(0)  # (layers, heads, keys)
    by_group = torch.stack([last[..., a:b].mean(-1) for _, (a, b) in groups], -1).cpu()  # (layers, heads, groups)
    return [
        dict(model=name, seed=seed, layer=layer, head=head, group=group, attention=by_group[layer, head, g].item())
        for layer in range(by_group.shape[0])
        for head in range(by_group.shape[1])
        for g, (group, _) in enumerate(groups)
    ]
