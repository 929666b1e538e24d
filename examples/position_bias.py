"""Lost in the middle, one command: key-value retrieval accuracy by the gold pair's position, with each mitigation.

The synthetic task of "Lost in the Middle" (arXiv 2307.03172), scaled down to single-token keys and values:

    <bos> k1 v1 k2 v2 ... kn vn <sep> k_gold  ->  v_gold

Training is multi-query associative recall (Zoology's MQAR): after the list every key is queried once, in random
order, and every answer is supervised. A single query per sequence learns nothing in this budget, and neither does
MQAR at 8 pairs from the start: a curriculum on the number of pairs (uniform in [1, c], c growing to
`--num-pairs` over the first `--curriculum` fraction of the steps) is what makes the association click. Evaluation
asks one query right after the list (the first query of a training sequence, so in distribution) with the gold pair
at every slot, `--eval-per-slot` lists per slot, at the training number of pairs and at twice as many.

Models, same data, width, depth, heads, steps and seed:

- SepFormer (learned positional table of L = 4n + 2 rows, the training length). Twice the pairs is one token longer
  than L: SepFormer is evaluated with `position_extrapolation="interpolate"`, the identity up to L, which compresses
  the 4n + 3 positions into the trained table (no untrained row, no extrapolation guess);
- SepFormer trained with StableMask (config `stable_mask={"gamma": ...}`), when the installed sepformer has it;
- Hugging Face's `LlamaForCausalLM` (rotary), with MS-PoE implemented here as a registered attention function.

Each SepFormer is evaluated with no mitigation and with each mitigation of `sepformer.mitigations` over a small
sweep of its main parameter (`MITIGATIONS` below); Llama with none and MS-PoE. Exact match of the greedy next token
(values are one token) is scored by the package's `accuracy_by_position` evaluate metric. Also the last token's
attention to each group of key positions, `A_G = (1/|G|) Σ_{j∈G} a_{l,j}` (groups: <bos>, each key-value slot, the
<sep> and the query), per layer and head, averaged over the evaluation prompts.

Writes under `--output-dir`: `results.csv` (one row per model, mitigation, setting, seed, number of pairs and gold
slot), `results.md` (the tables, printed too), `position_bias.png` (the U-curves), `attention.csv` and
`attention_by_position.png` (the A_G heatmaps).

    python examples/position_bias.py                     # default preset, seeds 0 and 1 (about 12 min on 2 CPU cores)
    python examples/position_bias.py --quick             # one seed, SepFormer and Llama (a few minutes)
    python examples/position_bias.py --tiny              # a smoke run in seconds: learns nothing (what the test runs)
    python examples/position_bias.py --seeds 0 1 --mitigations none ms_poe
"""

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import evaluate
import torch
import transformers
from tqdm.auto import tqdm
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import rotate_half

from sepformer import SepFormerConfig, SepFormerForCausalLM
from sepformer.metrics import metric_path
from sepformer.mitigations import MSPoE, head_ratios, position_awareness

PRESETS = {
    # about 12 minutes on 2 CPU cores (6 per seed)
    "default": dict(num_pairs=8, num_keys=64, num_values=64, hidden_size=128, num_layers=2, num_heads=4,
                    batch_size=64, max_steps=2000, learning_rate=3e-3, curriculum=0.5, eval_per_slot=100,
                    train_gamma=0.05, seeds=[0, 1]),
    # a few minutes: the default's task, models and training (SepFormer learns it), one seed, no StableMask-trained
    # model, half the evaluation prompts
    "quick": dict(num_pairs=8, num_keys=64, num_values=64, hidden_size=128, num_layers=2, num_heads=4,
                  batch_size=64, max_steps=2000, learning_rate=3e-3, curriculum=0.5, eval_per_slot=50,
                  train_gamma=0.0, seeds=[0]),
    # seconds: checks the plumbing, learns nothing (the test and CI run this)
    "tiny": dict(num_pairs=4, num_keys=16, num_values=16, hidden_size=32, num_layers=2, num_heads=2,
                 batch_size=16, max_steps=20, learning_rate=3e-3, curriculum=0.5, eval_per_slot=6,
                 train_gamma=0.05, seeds=[0]),
}


@dataclass
class Mitigation:
    """A forward/generate keyword of SepFormerForCausalLM and the sweep of its main parameter.

    `option(value, spans, dummy)` is the keyword's value: a dict of the option's dataclass fields, which the model
    accepts as well as the dataclass. `spans` are the documents' token spans of the prompts (every prompt has the same
    layout), `dummy` a content-free document's token ids."""

    keyword: str
    parameter: str
    values: tuple
    option: Callable


MITIGATIONS = [
    Mitigation("stable_mask", "gamma", (0.02, 0.05, 0.2), lambda v, spans, dummy: {"gamma": v}),
    Mitigation("ms_poe", "r_max", (1.5, 1.8, 2.4), lambda v, spans, dummy: {"r_min": 1.2, "r_max": v}),
    Mitigation("attention_calibration", "temperature", (5e-5, 1e-3, 1e-2),
               lambda v, spans, dummy: {"spans": spans, "temperature": v, "dummy_document": dummy}),
    Mitigation("positional_scaling", "factor", (0.5, 0.0, -0.5, -1.0), lambda v, spans, dummy: {"factor": v}),
]
LLAMA_MITIGATIONS = [m for m in MITIGATIONS if m.keyword == "ms_poe"]  # implemented below for HF Llama
NONE = "none"


# ----------------------------------------------------------------------------------------------------------- task


@dataclass(frozen=True)
class Vocabulary:
    """Our own ids, no tokenizer: keys, then values, then the special tokens."""

    num_keys: int
    num_values: int

    def value(self, i):
        return self.num_keys + i

    @property
    def bos(self):
        return self.num_keys + self.num_values

    @property
    def sep(self):
        return self.bos + 1

    @property
    def pad(self):
        return self.bos + 2

    @property
    def dummy_document(self) -> tuple[int, int]:
        """A key-value pair of reserved ids, never in training data, never queried: the calibration's dummy."""
        return self.bos + 3, self.bos + 4

    def __len__(self):
        return self.bos + 5


def random_lists(generator: torch.Generator, count: int, num_pairs: int, vocab: Vocabulary):
    """`count` lists of `num_pairs` pairs: distinct keys within a list, values drawn with replacement."""
    keys = torch.rand(count, vocab.num_keys, generator=generator).argsort(-1)[:, :num_pairs]
    values = vocab.value(torch.randint(0, vocab.num_values, (count, num_pairs), generator=generator))
    pairs = torch.stack([keys, values], -1).view(count, 2 * num_pairs)  # k1 v1 k2 v2 ...
    prefix = torch.cat([torch.full((count, 1), vocab.bos), pairs, torch.full((count, 1), vocab.sep)], 1)
    return prefix, keys, values


def training_examples(generator: torch.Generator, count: int, num_pairs: int, vocab: Vocabulary) -> dict:
    """MQAR: the list, <sep>, then every key once in random order followed by its value; only values are labelled."""
    prefix, keys, values = random_lists(generator, count, num_pairs, vocab)
    order = torch.rand(count, num_pairs, generator=generator).argsort(-1)
    queries = torch.stack([keys.gather(1, order), values.gather(1, order)], -1).view(count, 2 * num_pairs)
    input_ids = torch.cat([prefix, queries], 1)
    labels = torch.full_like(input_ids, -100)
    answers = slice(prefix.shape[1] + 1, None, 2)  # the value after each query key
    labels[:, answers] = input_ids[:, answers]
    return {"input_ids": input_ids.tolist(), "labels": labels.tolist()}


def curriculum_pairs(step: int, args) -> int:
    """The largest number of pairs at `step`: 2 at first, `num_pairs` from `curriculum · max_steps` on."""
    ramp = min(1.0, step / max(1.0, args.curriculum * args.max_steps))
    return min(args.num_pairs, 2 + int((args.num_pairs - 2) * ramp))


def training_set(seed: int, vocab: Vocabulary, args) -> datasets.Dataset:
    """Every step's batch, in order: a batch has one number of pairs (one length, no padding), uniform in
    [1, curriculum_pairs(step)]."""
    generator = torch.Generator().manual_seed(seed)
    columns = {"input_ids": [], "labels": []}
    for step in range(args.max_steps):
        num_pairs = int(torch.randint(1, curriculum_pairs(step, args) + 1, (1,), generator=generator))
        for name, rows in training_examples(generator, args.batch_size, num_pairs, vocab).items():
            columns[name] += rows
    return datasets.Dataset.from_dict(columns).with_format("torch")


def evaluation_set(seed: int, num_pairs: int, vocab: Vocabulary, args) -> datasets.Dataset:
    """`eval_per_slot` prompts per gold slot: the list, <sep>, the gold key; the answer is the gold value."""
    generator = torch.Generator().manual_seed(10_000 + seed)  # never the training stream
    columns = {"input_ids": [], "answer": [], "gold_slot": []}
    for slot in range(num_pairs):
        prefix, keys, values = random_lists(generator, args.eval_per_slot, num_pairs, vocab)
        columns["input_ids"] += torch.cat([prefix, keys[:, slot:slot + 1]], 1).tolist()
        columns["answer"] += values[:, slot].tolist()
        columns["gold_slot"] += [slot] * args.eval_per_slot
    return datasets.Dataset.from_dict(columns).with_format("torch")


def document_spans(num_pairs: int) -> tuple[tuple[int, int], ...]:
    """Each key-value pair is a document of 2 tokens, after <bos>."""
    return tuple((1 + 2 * k, 3 + 2 * k) for k in range(num_pairs))


def train_length(num_pairs: int) -> int:
    return 4 * num_pairs + 2  # <bos>, n pairs, <sep>, n query pairs


# ----------------------------------------------------------------------------------------------- MS-PoE for Llama


def ms_poe_sdpa(module, query, key, value, attention_mask, ms_poe=None, position_ids=None, **kwargs):
    """SDPA attention with MS-PoE (arXiv 2403.04797) on HF Llama: head `h` of the chosen layers sees positions `m/r_h`.

    `query`/`key` arrive rotated by the model's rotary at positions `m`. Rotations of the same planes compose, so
    rotating again by `angle(m/r_h) - angle(m)` gives exactly the rotation at `m/r_h`. The ratios come from the
    package's `position_awareness` and `head_ratios` (most position-aware head gets `r_min`), scored on the last
    query's attention row with the original positions. Full forward passes only (no cache): this example evaluates
    Llama at the answer position with one forward of the whole prompt, positions `arange` (no padding).
    """
    option = MSPoE.parse(ms_poe)
    num_layers = module.config.num_hidden_layers
    layers = option.layers if option is not None and option.layers is not None else range(min(2, num_layers // 2),
                                                                                          num_layers)
    if option is None or module.layer_idx not in layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if key.shape[2] != query.shape[2]:
        raise ValueError("ms_poe_sdpa handles full forward passes only (no cache)")
    if module.num_key_value_groups != 1:
        raise ValueError("ms_poe_sdpa: this example's Llama has as many key-value heads as heads (ratios are per head)")
    batch, heads, length, head_dim = query.shape
    scaling = kwargs.get("scaling") or module.scaling

    # the last query's attention row, as the model computes it
    valid = torch.ones(batch, 1, length, dtype=torch.bool, device=query.device)
    if attention_mask is not None:  # a bool mask (True = attend) or an additive one
        last = attention_mask[:, :, -1, -length:]
        valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    scores = (query[:, :, -1:] @ key.transpose(-1, -2)).squeeze(2) * scaling
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1)
    ratios = head_ratios(option, position_awareness(probs, valid)).to(query.dtype)  # (b, H)

    if position_ids is None:
        position_ids = torch.arange(length, device=query.device).expand(batch, length)
    rope = module.config.rope_parameters
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    shift = position_ids[:, None, :, None].float() * (1 / ratios - 1)[:, :, None, None]  # m/r - m: (b, H, n, 1)
    angles = torch.cat([shift * inv_freq, shift * inv_freq], -1).to(query.dtype)  # Llama's layout: halves
    cos, sin = angles.cos(), angles.sin()
    query = query * cos + rotate_half(query) * sin
    key = key * cos + rotate_half(key) * sin
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("ms_poe_sdpa", ms_poe_sdpa)


# ------------------------------------------------------------------------------------------------------- models


@dataclass
class Contender:
    name: str
    build: Callable
    mitigations: list
    is_sepformer: bool


def contenders(args, vocab: Vocabulary) -> list[Contender]:
    d, layers, heads = args.hidden_size, args.num_layers, args.num_heads
    special = dict(pad_token_id=vocab.pad, bos_token_id=vocab.bos, eos_token_id=vocab.sep, tie_word_embeddings=False)

    def sepformer(**overrides):
        return SepFormerForCausalLM(SepFormerConfig(
            vocab_size=len(vocab), hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
            max_position_embeddings=train_length(args.num_pairs), **special, **overrides))

    def llama():
        config = LlamaConfig(vocab_size=len(vocab), hidden_size=d, intermediate_size=round(8 * d / 3),
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=train_length(2 * args.num_pairs), **special)
        model = LlamaForCausalLM(config)
        model.set_attn_implementation("ms_poe_sdpa")  # plain sdpa unless an `ms_poe=` keyword reaches it
        return model

    sepformer_mitigations = [m for m in MITIGATIONS if m.keyword in args.mitigations]
    every = [Contender("SepFormer", sepformer, sepformer_mitigations, True)]
    if args.train_gamma:
        every.append(Contender(f"SepFormer, StableMask training (γ={args.train_gamma})",
                               lambda: sepformer(stable_mask={"gamma": args.train_gamma}), sepformer_mitigations,
                               True))
    every.append(Contender("Llama (rotary)", llama,
                           [m for m in LLAMA_MITIGATIONS if m.keyword in args.mitigations], False))
    chosen = [c for c in every if any(w.lower() in c.name.lower() for w in args.models)] if args.models else every
    if not chosen:
        raise SystemExit(f"--models {args.models} matches none of: {', '.join(c.name for c in every)}")
    return chosen


# ------------------------------------------------------------------------------------------------ train, evaluate


def train(model, data: datasets.Dataset, args, description: str) -> float:
    """AdamW, warm-up then cosine decay, clipping at 1; returns the mean loss of the last 10% of the steps."""
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, args.max_steps // 20), args.max_steps)
    losses = []
    bar = tqdm(range(args.max_steps), desc=description, leave=False, dynamic_ncols=True)
    for step in bar:
        batch = data[step * args.batch_size:(step + 1) * args.batch_size]  # one step's rows: one length
        loss = model(input_ids=batch["input_ids"].to(args.device), labels=batch["labels"].to(args.device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", pairs=batch["input_ids"].shape[1] // 4)
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


@torch.no_grad()
def predict(model, prompts: torch.Tensor, args, make_kwargs: Callable) -> torch.Tensor:
    """The greedy next token after every prompt (the value: one token), `make_kwargs(batch_size)` the extra forward
    keywords of a batch. One forward of the whole prompt, no cache: exact for every model here."""
    model.eval()
    predictions = []
    for batch in prompts.split(args.eval_batch_size):
        batch = batch.to(args.device)
        logits = model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False, logits_to_keep=1,
                       **make_kwargs(len(batch))).logits[:, -1]
        predictions.append(logits.argmax(-1).cpu())
    return torch.cat(predictions)


def conditions(contender: Contender) -> list[tuple[str, str, object, Mitigation | None]]:
    """(mitigation, parameter, value, its Mitigation) for every evaluation of a model: none first, then the sweeps."""
    rows = [(NONE, "-", "-", None)]
    for mitigation in contender.mitigations:
        rows += [(mitigation.keyword, mitigation.parameter, value, mitigation) for value in mitigation.values]
    return rows


def evaluate_model(model, contender: Contender, evaluation: dict[int, dict], vocab: Vocabulary, metric,
                   args) -> list[dict]:
    """One row per condition, number of pairs and gold slot."""
    rows = []
    cells = [(pairs, condition) for pairs in evaluation for condition in conditions(contender)]
    for pairs, (keyword, parameter, value, mitigation) in tqdm(cells, desc=f"  evaluate {contender.name}",
                                                              leave=False, dynamic_ncols=True):
        data = evaluation[pairs]
        spans = document_spans(pairs)

        def make_kwargs(batch_size, mitigation=mitigation, value=value, spans=spans):
            kwargs = {}
            if contender.is_sepformer:  # 2n pairs is one token past L: interpolate (the identity up to L)
                kwargs["position_extrapolation"] = "interpolate"
            if mitigation is not None:
                kwargs[mitigation.keyword] = mitigation.option(value, [spans] * batch_size, vocab.dummy_document)
            return kwargs

        status = "ok"
        try:
            predictions = predict(model, data["input_ids"], args, make_kwargs)
            result = metric.compute(predictions=predictions.tolist(), references=data["answer"].tolist(),
                                    positions=data["gold_slot"].tolist())
            by_slot, counts = result["accuracy_by_position"], result["count_by_position"]
        except ValueError as error:  # a combination the model refuses (calibration on a StableMask-trained model)
            status = f"refused: {str(error).splitlines()[0][:200]}"
            by_slot, counts = {slot: float("nan") for slot in range(pairs)}, {slot: 0 for slot in range(pairs)}
        for slot in range(pairs):
            rows.append(dict(model=contender.name, mitigation=keyword, parameter=parameter, value=value,
                             eval_pairs=pairs, gold_slot=slot + 1, accuracy=by_slot[slot], examples=counts[slot],
                             status=status))
    return rows


@torch.no_grad()
def attention_by_group(model, prompts: torch.Tensor, num_pairs: int, args, **kwargs) -> tuple[list[str], torch.Tensor]:
    """A_G = (1/|G|) Σ_{j∈G} a_{l,j}: the last token's attention to each group of key positions, per layer and head,
    averaged over up to `eval_batch_size` prompts spread evenly over the gold slots. Groups: <bos>, each slot's key and
    value, <sep> with the query. (layers, heads, groups).
    """
    groups = [("<bos>", (0, 1))] + [(f"slot {k + 1}", span) for k, span in enumerate(document_spans(num_pairs))]
    groups.append(("<sep> query", (1 + 2 * num_pairs, 3 + 2 * num_pairs)))
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns the probabilities
    model.eval()
    try:
        batch = prompts[::max(1, len(prompts) // args.eval_batch_size)][:args.eval_batch_size].to(args.device)
        attentions = model(input_ids=batch, use_cache=False, output_attentions=True, **kwargs).attentions
    finally:
        model.set_attn_implementation(implementation)
    last = torch.stack([layer[:, :, -1].float() for layer in attentions], 1).mean(0)  # (layers, heads, keys)
    return [name for name, _ in groups], torch.stack([last[..., a:b].mean(-1) for _, (a, b) in groups], -1).cpu()


def run_seed(seed: int, vocab: Vocabulary, metric, args) -> tuple[list[dict], list[dict]]:
    data = training_set(seed, vocab, args)
    # columns as tensors: {pairs: {"input_ids": (N, 2 pairs + 3), "answer": (N,), "gold_slot": (N,)}}
    evaluation = {pairs: evaluation_set(seed, pairs, vocab, args)[:] for pairs in (args.num_pairs, 2 * args.num_pairs)}
    rows, attention_rows = [], []
    for contender in contenders(args, vocab):
        torch.manual_seed(seed)
        model = contender.build()
        started = time.time()
        train_loss = train(model, data, args, f"seed {seed} · train {contender.name}")
        train_seconds = time.time() - started
        new_rows = evaluate_model(model, contender, evaluation, vocab, metric, args)
        for row in new_rows:
            row.update(seed=seed, train_pairs=args.num_pairs, parameters=model.num_parameters(),
                       train_steps=args.max_steps, train_loss=round(train_loss, 4), train_seconds=round(train_seconds))
        at_n = [r["accuracy"] for r in new_rows if r["mitigation"] == NONE and r["eval_pairs"] == args.num_pairs]
        tqdm.write(f"seed {seed} · {contender.name:40s} {model.num_parameters() / 1e6:.3f}M params, trained in "
                   f"{train_seconds:5.1f} s to loss {train_loss:.3f}; accuracy at {args.num_pairs} pairs "
                   f"{statistics.fmean(at_n):.3f}, by slot " + " ".join(f"{a:.2f}" for a in at_n))
        rows += new_rows

        extra = {"position_extrapolation": "interpolate"} if contender.is_sepformer else {}
        names, groups = attention_by_group(model, evaluation[args.num_pairs]["input_ids"], args.num_pairs, args,
                                           **extra)
        for layer in range(groups.shape[0]):
            for head in range(groups.shape[1]):
                attention_rows += [dict(model=contender.name, seed=seed, layer=layer, head=head, group=name,
                                        attention=groups[layer, head, g].item()) for g, name in enumerate(names)]
    return rows, attention_rows


# --------------------------------------------------------------------------------------------------------- report


def setting(row) -> str:
    """The condition as one label: `none`, `ms_poe r_max=1.8`, ..."""
    return NONE if row["mitigation"] == NONE else f"{row['mitigation']} {row['parameter']}={row['value']}"


def summarise(rows: list[dict]) -> dict:
    """{(model, setting, eval_pairs): (per-slot mean accuracy over seeds, status)}, in run order."""
    cells = {}
    for row in rows:
        key = (row["model"], setting(row), row["eval_pairs"])
        slots, status = cells.setdefault(key, ({}, row["status"]))
        slots.setdefault(row["gold_slot"], []).append(row["accuracy"])
    return {key: ([statistics.fmean(v) for _, v in sorted(slots.items())], status)
            for key, (slots, status) in cells.items()}


def markdown_table(rows: list[dict], args) -> str:
    cells = summarise(rows)
    seeds = sorted({r["seed"] for r in rows})
    lines = []
    for pairs in (args.num_pairs, 2 * args.num_pairs):
        header = ["model", "mitigation", "mean"] + [str(slot) for slot in range(1, pairs + 1)]
        title = "training length" if pairs == args.num_pairs else "twice the training pairs"
        lines += [f"**{pairs} pairs ({title})**: exact-match accuracy by gold slot", "",
                  "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (pairs + 1)]
        for (model, label, n), (accuracy, status) in cells.items():
            if n != pairs:
                continue
            if status != "ok":
                lines.append(f"| {model} | {label} | {status} |" + " |" * pairs)
                continue
            lines.append(f"| {model} | {label} | **{statistics.fmean(accuracy):.3f}** | "
                         + " | ".join(f"{a:.2f}" for a in accuracy) + " |")
        lines.append("")
    lines.append(
        f"Trained on MQAR with {args.num_pairs} pairs ({args.num_keys} keys, {args.num_values} values; curriculum "
        f"over the first {args.curriculum:.0%} of {args.max_steps} steps of {args.batch_size}); "
        f"{args.eval_per_slot} prompts per gold slot; "
        + (f"mean over seeds {seeds}. " if len(seeds) > 1 else f"seed {seeds[0]}. ")
        + f"SepFormer (L = {train_length(args.num_pairs)}) runs {2 * args.num_pairs} pairs "
        f"({train_length(args.num_pairs) + 1} tokens with the query) with position_extrapolation='interpolate'.")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path, fields: list[str]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.5f}" if isinstance(v, float) and k in ("accuracy", "attention") else v)
                             for k, v in row.items() if k in fields})


RESULT_FIELDS = ["model", "mitigation", "parameter", "value", "seed", "train_pairs", "eval_pairs", "gold_slot",
                 "accuracy", "examples", "status", "parameters", "train_steps", "train_loss", "train_seconds"]


def plot_curves(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summarise(rows)
    models = list(dict.fromkeys(model for model, _, _ in cells))
    pairs_list = (args.num_pairs, 2 * args.num_pairs)
    colours = {NONE: "black", "stable_mask": "tab:blue", "ms_poe": "tab:orange",
               "attention_calibration": "tab:green", "positional_scaling": "tab:red"}
    figure, axes = plt.subplots(len(pairs_list), len(models), figsize=(5.5 * len(models), 4.2 * len(pairs_list)),
                                squeeze=False, sharey=True)
    for column, model in enumerate(models):
        for row_index, pairs in enumerate(pairs_list):
            axis = axes[row_index][column]
            labels = [label for m, label, n in cells if m == model and n == pairs]
            shade = {}
            for label in labels:
                accuracy, status = cells[model, label, pairs]
                if status != "ok":
                    continue
                keyword = label.split(" ")[0]
                shade[keyword] = shade.get(keyword, 0) + 1
                axis.plot(range(1, pairs + 1), accuracy, marker="o", markersize=3, label=label,
                          color=colours.get(keyword, "grey"), linewidth=2.5 if keyword == NONE else 1.2,
                          alpha=1.0 if keyword == NONE else 1.0 - 0.22 * (shade[keyword] - 1))
            axis.set_title(f"{model}\n{pairs} pairs" + (" (2x training)" if pairs != args.num_pairs else ""),
                           fontsize=9)
            axis.set_xlabel("gold slot")
            axis.set_xticks(range(1, pairs + 1))
            axis.set_ylim(-0.02, 1.02)
            axis.grid(True, alpha=0.3)
            if column == 0:
                axis.set_ylabel("exact-match accuracy")
    # one legend for all panels (a setting has the same colour everywhere), from the panel with the most lines
    handles, labels = max((axis.get_legend_handles_labels() for axis in axes.flat), key=lambda hl: len(hl[1]))
    figure.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.suptitle("Key-value retrieval accuracy by the gold pair's position")
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def plot_attention(attention_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in attention_rows))
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        mine = [r for r in attention_rows if r["model"] == model]
        groups = list(dict.fromkeys(r["group"] for r in mine))
        heads = list(dict.fromkeys((r["layer"], r["head"]) for r in mine))
        grid = torch.zeros(len(heads), len(groups))  # mean over seeds
        for r in mine:
            grid[heads.index((r["layer"], r["head"])), groups.index(r["group"])] += r["attention"]
        grid /= len({r["seed"] for r in mine})
        image = axis.imshow(grid.numpy(), aspect="auto", cmap="viridis")
        axis.set_xticks(range(len(groups)), groups, rotation=60, fontsize=7, ha="right")
        axis.set_yticks(range(len(heads)), [f"layer {layer} head {head}" for layer, head in heads], fontsize=7)
        axis.set_title(model, fontsize=9)
        figure.colorbar(image, ax=axis, fraction=0.04)
    figure.suptitle("A_G: last token's mean attention per key position in each group (no mitigation)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="the quick preset (a few minutes)")
    preset.add_argument("--tiny", action="store_true", help="the smoke preset (seconds; learns nothing)")
    parser.add_argument("--seeds", type=int, nargs="+", help="one full run per seed (default preset: 0 1)")
    parser.add_argument("--models", nargs="+", help="substrings of model names to keep, e.g. sepformer llama")
    parser.add_argument("--mitigations", nargs="+", choices=[m.keyword for m in MITIGATIONS] + [NONE],
                        help="mitigations to evaluate (default: all); 'none' alone: no mitigation")
    parser.add_argument("--num-pairs", type=int, help="key-value pairs per training list (evaluated at n and 2n)")
    parser.add_argument("--num-keys", type=int)
    parser.add_argument("--num-values", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--curriculum", type=float, help="fraction of the steps over which the pairs grow to n")
    parser.add_argument("--train-gamma", type=float, help="StableMask γ of the third model; 0: no such model")
    parser.add_argument("--eval-per-slot", type=int, help="evaluation prompts per gold slot")
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", default="outputs/position_bias")
    args = parser.parse_args(argv)
    for name, value in PRESETS["tiny" if args.tiny else "quick" if args.quick else "default"].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.mitigations = tuple(args.mitigations or [m.keyword for m in MITIGATIONS])
    if 2 * args.num_pairs > args.num_keys:
        raise SystemExit(f"--num-keys {args.num_keys}: twice {args.num_pairs} distinct keys are evaluated")
    return args


def main(argv=None):
    args = parse_args(argv)
    import matplotlib  # noqa: F401  (fail now, not after training, if the plot cannot be drawn)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    vocab = Vocabulary(args.num_keys, args.num_values)
    metric = evaluate.load(metric_path("accuracy_by_position"))
    print(f"task: {args.num_pairs} pairs (evaluated at {args.num_pairs} and {2 * args.num_pairs}), {args.num_keys} "
          f"keys, {args.num_values} values; models: d_model={args.hidden_size}, {args.num_layers} layers, "
          f"{args.num_heads} heads; {args.max_steps} steps of {args.batch_size}; seeds {args.seeds}")
    rows, attention_rows = [], []
    for seed in args.seeds:
        new_rows, new_attention = run_seed(seed, vocab, metric, args)
        rows += new_rows
        attention_rows += new_attention

    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    write_csv(rows, output_dir / "results.csv", RESULT_FIELDS)
    (output_dir / "results.md").write_text(table + "\n")
    write_csv(attention_rows, output_dir / "attention.csv", ["model", "seed", "layer", "head", "group", "attention"])
    plot_curves(rows, args, output_dir / "position_bias.png")
    plot_attention(attention_rows, output_dir / "attention_by_position.png")
    print(f"wrote results.csv, results.md, position_bias.png, attention.csv, attention_by_position.png under "
          f"{output_dir} in {(time.time() - started) / 60:.1f} min")
    return rows


if __name__ == "__main__":
    main()
