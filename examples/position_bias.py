"""Lost in the middle, one command: key-value retrieval accuracy by the gold document's position, per mitigation.

The synthetic task of "Lost in the Middle" (arXiv 2307.03172), scaled down to one-token documents: each document
is a single token that stands for a (key, value) pair, the query is the key's own query token and the answer its
value token:

    <bos> d(k1,v1) d(k2,v2) ... d(kn,vn) <sep> q(k_gold)  ->  v_gold

Why one token per document: with two-token documents (`k v`) the model must first bind each value to the key before
it (a previous-token head, then an induction head), and Llama and GPT-2 of this size sat on that plateau for
thousands of steps (loss at the value-elimination shortcut, first-query accuracy near chance); one-token documents
need only a content lookup, which all three models learned (1.00 at every slot, 8 documents) in 2000 steps.

Where position bias comes from here: in training, the answer sits in the first or last `--end-slots` slots with
probability `--gold-at-ends` (default: always), as in text the relevant passage is mostly at the top or next to
the question; every slot still holds a distractor. Each training list is followed by `--num-pairs` queries drawn
with replacement, each followed by its value (every value labelled). The test asks one query right after the list,
with the gold document at every slot, `--eval-per-slot` prompts per slot, at the training number of documents: the
middle slots are at a length the models were trained for, they were only never (or rarely) the answer.

Models, same data, width, depth, heads, steps, optimiser and seed (MLP widths as each model's own convention:
SepFormer 4x per subspace, Llama 8/3x, GPT-2 4x). Two heads of 32 dimensions: with four heads of 16, Llama learned
on some seeds only within the budget (mean 0.21 over three seeds, best slot 0.51), and with two it learns on every
seed:

- SepFormer (learned positional table of L = 3n + 2 rows, the training length);
- Hugging Face's `LlamaForCausalLM` (rotary);
- Hugging Face's `GPT2LMHeadModel` (learned absolute positions added to the tokens: SepFormer's nearest relative).

Mitigations, each over a small sweep of its main parameter, as the option keywords of `forward` on every model:
SepFormer's own, and on Llama and GPT-2 those `sepformer.add_mitigations` gives a Hugging Face decoder. The rows of a
setting are built once and evaluated on every model that runs it; a model that refuses a setting (its option check
raises, before any work: MS-PoE and Attention Buckets on GPT-2, which has no rotary; Attention Buckets' rotary bases
on SepFormer's learned table; the positional block's estimates on Llama and GPT-2) gets no row, and the run prints
which and the model's reason. Positional scaling sweeps SepFormer's positional block, and on the other models the
channels its search finds; it also runs at the setting its search picks (`search_positional_scaling`: lowest loss
averaged over gold slots on validation prompts that are not the test prompts). Exact match of the greedy next token
is scored by the package's `accuracy_by_position` metric. Also the last token's attention to each group of key
positions, `A_G = (1/|G|) Σ_{j∈G} a_{l,j}` (groups: <bos>, each document, the <sep> and the query), per layer and
head.

IN2 ("Make Your LLM Fully Utilize the Context"), on every model: a copy of the trained model fine-tuned on lists of
this task with the answer at every slot uniformly (the training's generator with `gold_at_ends` 0, its own data
stream), through the same `Trainer` recipe with the same learning rate, batch size and weight decay (a fresh
optimiser, warm-up and cosine decay), for `--in2-fractions` of the training steps (default 5% and 20%: 75 and 300 of
1500), then evaluated with no other mitigation. The fine-tuned copies are not saved: with `--reuse-models` they are
fine-tuned again from the saved model.

Reordering by relevance, on every model: each test prompt's documents reordered with strategy "ends" (the most
relevant first, the second last, ...) by the model's own attention, attention sorting (3 rounds), calibrated
attention (the calibration rows' dummy document) and, on SepFormer, position-free attention, scored in eager
attention; the model then predicts on the reordered prompt. Accuracy is by the gold's slot before reordering (a flat
curve: the method found the gold), and `gold_at_end` is the fraction of prompts whose gold landed in the first or
last `--end-slots` slots.

Writes under `--output-dir`: `results.csv` (columns `model, mitigation, setting, seed, num_pairs, slot, accuracy`,
then the run's details: `gold_at_end` on reordering's rows, the fine-tune's `finetune_*` on IN2's), `results.md`
(the tables, printed too), `position_bias.png` (accuracy by slot with 95% intervals over seeds, one panel per model),
`attention.csv` and `attention_by_position.png` (the A_G heatmaps),
and each trained model under `--models-dir` (default `models/` there), in `<model>-seed<seed>/` (`save_pretrained`,
with `training.json`: its training settings, every config field, final loss and training time). `--reuse-models`
evaluates those again without training them (other mitigations, more test prompts); a model saved under other
settings or config (in `training.json` or `config.json`), or whose weights do not load, have another dtype or are not
finite, is refused before anything trains, and so is a `--models-dir` that holds none of the run's models.

    python examples/position_bias.py                    # default preset: seeds 0, 1, 2
    python examples/position_bias.py --quick            # one seed, fewer prompts
    python examples/position_bias.py --tiny             # a smoke run in seconds: learns nothing (what the test runs)
    python examples/position_bias.py --num-pairs 32 --num-keys 64   # twice the documents (and the steps: 3000)
    python examples/position_bias.py --reuse-models --models-dir outputs/position_bias/models \
        --output-dir outputs/ms_poe --mitigations none ms_poe        # the default run's models, evaluated again
    torchrun --nproc_per_node 2 examples/position_bias.py --tiny  # data parallel: the same table, within noise

Training runs through transformers' `Trainer` (see `experiment_common.py`): `torchrun` and `accelerate launch` run
it data-parallel unchanged, `--bf16`/`--fp16` train in mixed precision, `--save-steps` and `--resume` save and
continue checkpoints under `OUTPUT_DIR/checkpoints`.
"""

import argparse
import copy
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import datasets
import evaluate
import torch
import transformers
from cli_arguments import (
    Distinct,
    nonnegative_float,
    output_directory,
    positive_float,
    positive_int,
    probability,
)
from experiment_common import (
    apply_preset,
    build_model,
    check_plotting,
    check_resumable,
    checkpoint_dir,
    chosen,
    every_seed,
    experiment_parser,
    interval95,
    is_main_process,
    main_process_prints,
    preset_name,
    pyplot,
    save_figure,
    table_lines,
    tail_mean,
    world_size,
    write_csv,
)
from experiment_common import train as train_with_trainer
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm.auto import tqdm

from sepformer import ReorderDocuments, SepFormerCache, add_mitigations, reorder_documents
from sepformer.metrics import metric_path
from sepformer.positional_search import NoPositionalChannelError, is_sepformer, search_positional_scaling
from sepformer.reordering import eager_attention

PRESETS = {
    # 12.5 minutes for the three seeds on 2 CPU cores
    "default": dict(
        num_pairs=16,
        num_keys=32,
        num_values=16,
        end_slots=2,
        gold_at_ends=1.0,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        batch_size=32,
        max_steps=1500,
        learning_rate=3e-3,
        weight_decay=0.1,
        eval_per_slot=100,
        validation_per_slot=25,
        seeds=[0, 1, 2],
    ),
    # the default's task and training, one seed, half the evaluation prompts
    "quick": dict(
        num_pairs=16,
        num_keys=32,
        num_values=16,
        end_slots=2,
        gold_at_ends=1.0,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        batch_size=32,
        max_steps=1500,
        learning_rate=3e-3,
        weight_decay=0.1,
        eval_per_slot=50,
        validation_per_slot=25,
        seeds=[0],
    ),
    # seconds: checks the plumbing, learns nothing (the test and CI run this)
    "tiny": dict(
        num_pairs=4,
        num_keys=8,
        num_values=8,
        end_slots=1,
        gold_at_ends=1.0,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        batch_size=16,
        max_steps=20,
        learning_rate=3e-3,
        weight_decay=0.1,
        eval_per_slot=6,
        validation_per_slot=4,
        seeds=[0],
    ),
}
NONE = "none"
IN2, REORDER = "in2", "reorder"
IN2_FRACTIONS = (0.05, 0.2)  # the IN2 fine-tune's budgets, as fractions of the training steps
SEARCH_PICK = "search's pick"  # the setting of positional scaling at the search's channels and factor


# ----------------------------------------------------------------------------------------------------------- task


@dataclass(frozen=True)
class Vocabulary:
    """Our own ids, no tokenizer: one document token per (key, value), then the query keys, the values, the specials."""

    num_keys: int
    num_values: int

    def document(self, key, value):
        return key * self.num_values + value

    def query(self, key):
        return self.num_keys * self.num_values + key

    def value(self, value):
        return self.num_keys * self.num_values + self.num_keys + value

    @property
    def bos(self):
        return self.value(self.num_values)

    @property
    def sep(self):
        return self.bos + 1

    @property
    def pad(self):
        return self.bos + 2

    @property
    def dummy_document(self) -> tuple[int]:
        """A reserved document id, never in training data, never queried: the calibration's dummy."""
        return (self.bos + 3,)

    def __len__(self):
        return self.bos + 4


def random_lists(generator: torch.Generator, count: int, num_pairs: int, vocab: Vocabulary):
    """`count` lists of `num_pairs` documents, `<bos> d1 ... dn <sep>`: distinct keys within a list, values drawn
    with replacement. Returns the ids (count, n + 2), the keys and the values (count, n)."""
    keys = torch.rand(count, vocab.num_keys, generator=generator).argsort(-1)[:, :num_pairs]
    values = torch.randint(0, vocab.num_values, (count, num_pairs), generator=generator)
    prefix = torch.cat(
        [torch.full((count, 1), vocab.bos), vocab.document(keys, values), torch.full((count, 1), vocab.sep)], 1
    )
    return prefix, keys, values


def training_slots(generator: torch.Generator, shape: tuple[int, int], num_pairs: int, args) -> torch.Tensor:
    """Gold slots of training queries: with probability `gold_at_ends` one of the first or last `end_slots`,
    otherwise any slot, uniformly."""
    anywhere = torch.randint(0, num_pairs, shape, generator=generator)
    end = torch.randint(0, 2 * args.end_slots, shape, generator=generator)
    end = torch.where(end < args.end_slots, end, num_pairs - 2 * args.end_slots + end)  # 0..e-1, n-e..n-1
    return torch.where(torch.rand(shape, generator=generator) < args.gold_at_ends, end, anywhere)


def training_examples(generator: torch.Generator, count: int, vocab: Vocabulary, args) -> dict:
    """The list, <sep>, then `num_pairs` queries (drawn with replacement, see `training_slots`), each followed by its
    value; only the values are labelled."""
    prefix, keys, values = random_lists(generator, count, args.num_pairs, vocab)
    slots = training_slots(generator, (count, args.num_pairs), args.num_pairs, args)
    queries = torch.stack([vocab.query(keys.gather(1, slots)), vocab.value(values.gather(1, slots))], -1)
    input_ids = torch.cat([prefix, queries.view(count, -1)], 1)
    labels = torch.full_like(input_ids, -100)
    answers = slice(prefix.shape[1] + 1, None, 2)  # the value after each query
    labels[:, answers] = input_ids[:, answers]
    return {"input_ids": input_ids.tolist(), "labels": labels.tolist()}


def training_set(seed: int, vocab: Vocabulary, args) -> datasets.Dataset:
    """Every step's batch, in order."""
    generator = torch.Generator().manual_seed(seed)
    columns = {"input_ids": [], "labels": []}
    for _ in range(args.max_steps):
        for name, rows in training_examples(generator, args.batch_size, vocab, args).items():
            columns[name] += rows
    return datasets.Dataset.from_dict(columns).with_format("torch")


def prompts_by_slot(generator: torch.Generator, per_slot: int, num_pairs: int, vocab: Vocabulary) -> dict:
    """`per_slot` prompts per gold slot: the list, <sep>, the gold key's query; the answer is the gold value."""
    columns = {"input_ids": [], "answer": [], "gold_slot": []}
    for slot in range(num_pairs):
        prefix, keys, values = random_lists(generator, per_slot, num_pairs, vocab)
        columns["input_ids"].append(torch.cat([prefix, vocab.query(keys[:, slot : slot + 1])], 1))
        columns["answer"].append(vocab.value(values[:, slot]))
        columns["gold_slot"].append(torch.full((per_slot,), slot))
    return {name: torch.cat(parts) for name, parts in columns.items()}


def evaluation_set(seed: int, num_pairs: int, vocab: Vocabulary, args) -> dict:
    """The test prompts of a seed: {"input_ids": (N, n + 3), "answer": (N,), "gold_slot": (N,)}."""
    return prompts_by_slot(torch.Generator().manual_seed(10_000 + seed), args.eval_per_slot, num_pairs, vocab)


def validation_batches(seed: int, num_pairs: int, vocab: Vocabulary, args) -> list[dict]:
    """Prompts for the positional-dimension search, from a stream that is neither training nor test: the prompt and
    its answer as one sequence, only the answer labelled."""
    prompts = prompts_by_slot(torch.Generator().manual_seed(20_000 + seed), args.validation_per_slot, num_pairs, vocab)
    input_ids = torch.cat([prompts["input_ids"], prompts["answer"][:, None]], 1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -1] = input_ids[:, -1]
    return [
        {"input_ids": ids, "labels": lab, "gold_position": gold}
        for ids, lab, gold in zip(
            input_ids.split(args.eval_batch_size),
            labels.split(args.eval_batch_size),
            prompts["gold_slot"].split(args.eval_batch_size),
            strict=True,
        )
    ]


def document_spans(num_pairs: int) -> tuple[tuple[int, int], ...]:
    """Each document is one token, after <bos>."""
    return tuple((1 + k, 2 + k) for k in range(num_pairs))


def train_length(num_pairs: int) -> int:
    return 3 * num_pairs + 2  # <bos>, n documents, <sep>, n (query, value) pairs


# ------------------------------------------------------------------------------------------------- the conditions


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
    conditions += [
        keyword(
            "attention_calibration",
            f"temperature={t}, dummy passes",
            lambda b, t=t: {"spans": [spans] * b, "temperature": t, "dummy_document": vocab.dummy_document},
        )
        for t in (5e-5, 1e-3, 1e-2)
    ]
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
    sweep = (
        []
        if is_sepformer(model)
        else [
            keyword(
                "positional_scaling",
                f"searched channels, factor={factor}",
                lambda b, f=factor: replace(result.option, factor=f),
                f"channels={list(best.channels)}",
            )
            for factor in (0.5, 0.0, -0.5, -1.0)
        ]
    )
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

    return [
        keyword(
            "attention_calibration",
            f"temperature={t}, positional bias(k)",
            lambda b, t=t: {"spans": [spans] * b, "temperature": t, "bias_estimate": "positional"},
            agreement,
        )
        for t in (5e-5, 1e-3, 1e-2)
    ]


# ------------------------------------------------------------------------------------------------------- models


@dataclass
class Contender:
    name: str
    slug: str  # its folder under `models/`
    build: Callable
    notes: list = field(default_factory=list)


def contenders(args, vocab: Vocabulary) -> list[Contender]:
    """The models, all of one shape (`experiment_common.model_config`), with positions up to the training length."""
    shape = (len(vocab), args.hidden_size, args.num_layers, args.num_heads, train_length(args.num_pairs))
    special = dict(pad_token_id=vocab.pad, bos_token_id=vocab.bos, eos_token_id=vocab.sep, tie_word_embeddings=False)

    def sepformer():
        return build_model("sepformer", *shape, **special)

    def llama():
        return build_model("llama", *shape, **special)

    def gpt2():
        return build_model("gpt2", *shape, **special)

    every = [
        Contender("SepFormer", "sepformer", sepformer),
        Contender("Llama (rotary)", "llama", llama),
        Contender("GPT-2 (learned absolute)", "gpt2", gpt2),
    ]

    def matches(word, contender):
        return word.lower() in contender.name.lower() or word.lower() == contender.slug

    return chosen(
        every,
        args.models,
        matches,
        f"{', '.join(c.name for c in every)} (nor the folder names {', '.join(c.slug for c in every)})",
    )


# ------------------------------------------------------------------------------------------------ train, evaluate


def train(
    model, data: datasets.Dataset, args, description: str, seed: int = 0, checkpoints: Path | None = None
) -> float:
    """`experiment_common.train` on `data` (every step's batch, in order); returns the mean loss of the last 10% of
    the steps. `seed` seeds what is random in training (dropout); `checkpoints`: where `--save-steps` saves and
    `--resume` continues."""
    losses = train_with_trainer(
        model,
        data,
        steps=args.max_steps,
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        seed=seed,
        output_dir=checkpoints,
        weight_decay=args.weight_decay,
        device=args.device,
        bf16=args.bf16,
        fp16=args.fp16,
        save_steps=args.save_steps,
        resume_from_checkpoint=args.resume,
        description=description,
    )
    return tail_mean(losses)


# What a trained model depends on, besides the model and the seed: a saved model is reused only under the same.
TRAINING_SETTINGS = (
    "num_pairs",
    "num_keys",
    "num_values",
    "end_slots",
    "gold_at_ends",
    "hidden_size",
    "num_layers",
    "num_heads",
    "batch_size",
    "max_steps",
    "learning_rate",
    "weight_decay",
)


# What a config records besides the model: the dtype and class names it was saved with, the library's version.
UNRECORDED_CONFIG = ("dtype", "architectures", "transformers_version", "_name_or_path")


# What `training.json` holds (`trained_model` writes it), and the type of each.
TRAINING_RECORD = {"settings": dict, "config": dict, "train_loss": float | int, "train_seconds": float | int}


def taking_options(model) -> torch.nn.Module:
    """The model with the mitigations as `forward` keywords: SepFormer's own, `add_mitigations`' on the others (applied
    after training, so that training runs the model's own attention)."""
    return model if is_sepformer(model) else add_mitigations(model)


def seeded_build(contender: Contender, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights for a given seed, trained here or rebuilt to load saved ones
    return contender.build()


def model_dir(args, contender: Contender, seed: int) -> Path:
    return Path(args.models_dir) / f"{contender.slug}-seed{seed}"


def training_settings(args, seed: int) -> dict:
    return {"seed": seed, **{name: getattr(args, name) for name in TRAINING_SETTINGS}}


def full_config(config) -> dict:
    """Every config field, defaults included: a default changed since the model was saved shows here."""
    fields = json.loads(config.to_json_string(use_diff=False))
    return {name: value for name, value in fields.items() if name not in UNRECORDED_CONFIG}


def differences(saved: dict, wanted: dict) -> str:
    return ", ".join(
        f"{name} {saved.get(name)!r} there, {value!r} here"
        for name, value in wanted.items()
        if saved.get(name) != value
    )


def saved_model(args, contender: Contender, seed: int) -> tuple[torch.nn.Module, dict] | None:
    """With `--reuse-models`, the model a run saved for this contender and seed, loaded, and its training record;
    `None` when there is none (or without the flag). Refuses, naming the folder and what is wrong, a record that does
    not read or lacks a field of `TRAINING_RECORD`, other training settings or config fields in the record or in
    `config.json` (reusing it would report another experiment), and weights that do not load, of another dtype than
    the model's or not finite."""
    folder = model_dir(args, contender, seed)
    if not args.reuse_models or not (folder / "training.json").exists():
        return None

    def refuse(why: str) -> NoReturn:
        raise SystemExit(
            f"--reuse-models: {folder} {why}; give another --models-dir or remove that folder to train again"
        )

    try:
        record = json.loads((folder / "training.json").read_text())
    except ValueError as error:
        refuse(f"has a training.json that does not read ({type(error).__name__}: {error})")
    if not isinstance(record, dict):
        refuse(f"has a training.json that holds a {type(record).__name__}, not an object")
    if wrong := [
        f"{key} is {'missing' if key not in record else 'a ' + type(record[key]).__name__}"
        for key, kind in TRAINING_RECORD.items()
        if not isinstance(record.get(key), kind)
    ]:
        refuse(
            f"has a training.json where {', '.join(wrong)} (a record holds the objects settings and config and the "
            "numbers train_loss and train_seconds)"
        )
    settings, config = record["settings"], record["config"]
    if differing := differences(settings, training_settings(args, seed)):
        refuse(f"was trained with other settings ({differing})")
    model = seeded_build(contender, seed)
    if differing := differences(config, full_config(model.config)):
        refuse(f"holds a model of another config ({differing})")
    try:
        saved_config = type(model.config).from_pretrained(folder)
    except (OSError, ValueError, TypeError) as error:
        refuse(f"has a config.json that does not load ({type(error).__name__}: {first_line(error)})")
    if differing := differences(full_config(saved_config), full_config(model.config)):
        refuse(f"has a config.json of another model ({differing})")
    try:
        weights = load_file(folder / "model.safetensors")
        own = model.state_dict()
        if other := [
            f"{name} {tensor.dtype} there, {own[name].dtype} here"
            for name, tensor in weights.items()
            if name in own and tensor.dtype != own[name].dtype
        ]:
            refuse(f"has weights of another dtype ({listed(other)})")
        if not_finite := [name for name, tensor in weights.items() if not tensor.isfinite().all()]:
            refuse(f"has weights that are not finite ({listed(not_finite)})")
        model.load_state_dict(weights)
    except (OSError, RuntimeError, SafetensorError) as error:
        refuse(f"has weights that do not load ({type(error).__name__}: {first_line(error)})")
    return model.to(args.device).eval(), record


def first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200] if str(error) else ""


def listed(items: list[str], shown: int = 2) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def trained_model(
    contender: Contender, seed: int, data: Callable[[], datasets.Dataset], args
) -> tuple[torch.nn.Module, dict]:
    """The contender trained on `data()` (or loaded, with `--reuse-models`, from the run that trained it), and its
    training record. A model trained here is saved under `--models-dir` (`save_pretrained`) with its record, which is
    written last: a folder left half-written by a stopped run has no record, and is trained again."""
    folder = model_dir(args, contender, seed)
    if (saved := saved_model(args, contender, seed)) is not None:
        model, record = saved
        tqdm.write(f"seed {seed} · {contender.name}: loaded from {folder} (trained to loss {record['train_loss']:.3f})")
        return model, record
    model = seeded_build(contender, seed)
    started = time.time()
    train_loss = train(
        model, data(), args, f"seed {seed} · train {contender.name}", seed, checkpoint_dir(args, contender.slug, seed)
    )
    record = dict(
        settings=training_settings(args, seed),
        config=full_config(model.config),
        train_loss=round(train_loss, 4),
        train_seconds=round(time.time() - started, 1),
    )
    if is_main_process():
        (folder / "training.json").unlink(missing_ok=True)
        model.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return model, record


def in2_steps(args, fraction: float) -> int:
    return round(fraction * args.max_steps)


def in2_arguments(args, fraction: float) -> argparse.Namespace:
    """The IN2 fine-tune's settings: the training's (same learning rate, batch size and weight decay; a fresh AdamW
    with its own warm-up and cosine decay), for `fraction` of its steps, on lists whose answers sit at every slot
    uniformly (`gold_at_ends` 0), without checkpoints (fine-tuned models are not saved)."""
    return argparse.Namespace(
        **{
            **vars(args),
            "max_steps": in2_steps(args, fraction),
            "gold_at_ends": 0.0,
            "save_steps": None,
            "resume": False,
        }
    )


def in2_set(seed: int, vocab: Vocabulary, in2_args) -> datasets.Dataset:
    """The IN2 fine-tune's batches (`in2_arguments`), from a stream of their own: neither the training's, the test's
    nor the validation's."""
    return training_set(30_000 + seed, vocab, in2_args)


def in2_rows(model, contender: Contender, seed: int, vocab: Vocabulary, evaluation: dict, metric, args) -> list[dict]:
    """IN2 ("Make Your LLM Fully Utilize the Context", made by rule from the experiment's own task): for each of
    `--in2-fractions`, a copy of the trained model fine-tuned by `in2_arguments`, evaluated on the test prompts with no
    other mitigation; the rows record the fine-tune's steps, loss and time (`finetune_*`)."""
    rows = []
    for fraction in args.in2_fractions:
        in2_args = in2_arguments(args, fraction)
        tuned = copy.deepcopy(model)  # the base rows stay the trained model's
        started = time.time()
        loss = train(
            tuned, in2_set(seed, vocab, in2_args), in2_args, f"seed {seed} · IN2 {fraction:g} {contender.name}", seed
        )
        record = dict(
            finetune_steps=in2_args.max_steps,
            finetune_loss=round(loss, 4),
            finetune_seconds=round(time.time() - started, 1),
        )
        steps = f"{in2_args.max_steps} step" + "s" * (in2_args.max_steps != 1)
        condition = Condition(IN2, f"{fraction * 100:g}% of training steps ({steps})", plain_logits)
        for pairs, data in evaluation.items():
            rows += [
                {**row, **record} for row in evaluate_model(tuned, [condition], data, pairs, metric, args, contender)
            ]
        tqdm.write(
            f"seed {seed} · {contender.name}: IN2 fine-tune of {steps} in "
            f"{record['finetune_seconds']:.1f} s to loss {loss:.3f}"
        )
    return rows


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
    model, conditions: list[Condition], data: dict, num_pairs: int, metric, args, contender: Contender
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
            result = metric.compute(
                predictions=predictions.tolist(),
                references=data["answer"].tolist(),
                positions=data["gold_slot"].tolist(),
            )
            by_slot, counts = result["accuracy_by_position"], result["count_by_position"]
            if orders is not None:
                at_end = gold_at_an_end(orders, data["gold_slot"], args.end_slots)
        except NoPositionalChannelError as error:  # the search's pick where the search found no candidate
            status = f"not evaluated: {first_line(error)}"
            by_slot, counts = {slot: float("nan") for slot in range(num_pairs)}, {slot: 0 for slot in range(num_pairs)}
        rows += [
            dict(
                model=contender.name,
                mitigation=condition.mitigation,
                setting=condition.setting,
                num_pairs=num_pairs,
                slot=slot + 1,
                accuracy=by_slot[slot],
                examples=counts[slot],
                status=status,
                details=details,
                gold_at_end=None if at_end is None else at_end[data["gold_slot"] == slot].float().mean().item(),
            )
            for slot in range(num_pairs)
        ]
    return rows


@torch.no_grad()
def attention_by_group(model, prompts: torch.Tensor, num_pairs: int, args) -> tuple[list[str], torch.Tensor]:
    """A_G = (1/|G|) Σ_{j∈G} a_{l,j}: the last token's attention to each group of key positions, per layer and head,
    averaged over up to `eval_batch_size` prompts spread evenly over the gold slots. Groups: <bos>, each slot's key and
    value, <sep> with the query. (layers, heads, groups).
    """
    groups = [("<bos>", (0, 1))] + [(f"slot {k + 1}", span) for k, span in enumerate(document_spans(num_pairs))]
    groups.append(("<sep> query", (1 + num_pairs, 3 + num_pairs)))
    batch = prompts[:: max(1, len(prompts) // args.eval_batch_size)][: args.eval_batch_size].to(model.device)
    with eager_attention(model):
        attentions = model(input_ids=batch, use_cache=False, output_attentions=True).attentions
    last = torch.stack([layer[:, :, -1].float() for layer in attentions], 1).mean(0)  # (layers, heads, keys)
    return [name for name, _ in groups], torch.stack([last[..., a:b].mean(-1) for _, (a, b) in groups], -1).cpu()


def run_seed(seed: int, vocab: Vocabulary, metric, args) -> tuple[list[dict], list[dict]]:
    data = functools.cache(lambda: training_set(seed, vocab, args))  # made only if a model is trained
    evaluation = {pairs: evaluation_set(seed, pairs, vocab, args) for pairs in args.eval_pairs}
    validation = validation_batches(seed, args.num_pairs, vocab, args)
    spans = {pairs: document_spans(pairs) for pairs in args.eval_pairs}
    rows, attention_rows = [], []
    for contender in contenders(args, vocab):
        model, record = trained_model(contender, seed, data, args)
        model = taking_options(model)
        train_loss, train_seconds = record["train_loss"], record["train_seconds"]
        new_rows = []
        for pairs in args.eval_pairs:
            conditions = mitigation_conditions(spans[pairs], vocab)
            if pairs == args.num_pairs:
                conditions += searched_scaling(model, validation) if "positional_scaling" in args.mitigations else []
            conditions += calibration_without_dummy_passes(evaluation[pairs]["input_ids"], spans[pairs], vocab)
            conditions = [c for c in conditions if c.mitigation in args.mitigations]
            conditions = accepted(
                model,
                conditions,
                evaluation[pairs]["input_ids"][:1].to(model.device),
                f"seed {seed} · {contender.name}, {pairs} pairs",
            )
            new_rows += evaluate_model(model, conditions, evaluation[pairs], pairs, metric, args, contender)
        if IN2 in args.mitigations:
            new_rows += in2_rows(model, contender, seed, vocab, evaluation, metric, args)
        for row in new_rows:
            row.update(
                seed=seed,
                train_pairs=args.num_pairs,
                parameters=model.num_parameters(),
                train_steps=args.max_steps,
                train_loss=train_loss,
                train_seconds=train_seconds,
            )
        at_n = [r["accuracy"] for r in new_rows if r["mitigation"] == NONE and r["num_pairs"] == args.num_pairs]
        tqdm.write(
            f"seed {seed} · {contender.name:26s} {model.num_parameters() / 1e6:.3f}M params, trained in "
            f"{train_seconds:5.1f} s to loss {train_loss:.3f}; accuracy at {args.num_pairs} pairs "
            f"{statistics.fmean(at_n):.3f}, by slot " + " ".join(f"{a:.2f}" for a in at_n)
        )
        rows += new_rows

        names, groups = attention_by_group(model, evaluation[args.num_pairs]["input_ids"], args.num_pairs, args)
        for layer in range(groups.shape[0]):
            for head in range(groups.shape[1]):
                attention_rows += [
                    dict(
                        model=contender.name,
                        seed=seed,
                        layer=layer,
                        head=head,
                        group=name,
                        attention=groups[layer, head, g].item(),
                    )
                    for g, name in enumerate(names)
                ]
    return rows, attention_rows


# --------------------------------------------------------------------------------------------------------- report


@dataclass
class Curve:
    """A (model, mitigation, setting, num_pairs) cell over seeds: per-slot mean and 95% half-width, and summaries."""

    model: str
    mitigation: str
    setting: str
    num_pairs: int
    status: str
    per_seed: dict  # {seed: [accuracy by slot]}
    gold_at_end: list = field(default_factory=list)  # reordering's rows: each slot's and seed's fraction

    @property
    def mean_by_slot(self) -> list[float]:
        return [statistics.fmean(slot) for slot in zip(*self.per_seed.values(), strict=True)]

    @property
    def interval_by_slot(self) -> list[float]:
        return [interval95(list(slot)) for slot in zip(*self.per_seed.values(), strict=True)]

    @property
    def seed_means(self) -> list[float]:
        return [statistics.fmean(curve) for curve in self.per_seed.values()]

    @property
    def worst_over_best(self) -> float:
        means = self.mean_by_slot
        return min(means) / max(means) if max(means) > 0 else float("nan")


def curves(rows: list[dict]) -> list[Curve]:
    cells = {}
    for row in rows:
        key = (row["model"], row["mitigation"], row["setting"], row["num_pairs"])
        cell = cells.setdefault(key, Curve(*key, row["status"], {}))
        if row["status"] != "ok":  # not evaluated on one seed: the cell says why
            cell.status = row["status"]
        cell.per_seed.setdefault(row["seed"], []).append(row["accuracy"])  # rows come slot by slot
        if row.get("gold_at_end") is not None:  # reordering's rows
            cell.gold_at_end.append(row["gold_at_end"])
    return list(cells.values())


def markdown_table(rows: list[dict], args) -> str:
    every = curves(rows)
    seeds = sorted({r["seed"] for r in rows})
    lines = []
    for pairs in args.eval_pairs:
        header = ["model", "mitigation", "setting", "mean ± 95%", "worst slot", "worst/best", "Δ mean"]
        header += [str(slot) for slot in range(1, pairs + 1)]
        title = "the training length" if pairs == args.num_pairs else f"trained at {args.num_pairs}"
        table = []
        baseline = {
            c.model: statistics.fmean(c.mean_by_slot) for c in every if c.num_pairs == pairs and c.mitigation == NONE
        }
        for curve in every:
            if curve.num_pairs != pairs:
                continue
            if curve.status != "ok":
                table.append([curve.model, curve.mitigation, curve.setting, curve.status] + [""] * (pairs + 3))
                continue
            means, seed_means = curve.mean_by_slot, curve.seed_means
            mean = statistics.fmean(seed_means)
            worst = min(range(pairs), key=means.__getitem__)
            delta = "" if curve.mitigation == NONE else f"{mean - baseline.get(curve.model, float('nan')):+.3f}"
            table.append(
                [
                    curve.model,
                    curve.mitigation,
                    curve.setting,
                    f"**{mean:.3f}** ± {interval95(seed_means):.3f}",
                    f"{means[worst]:.2f} (slot {worst + 1})",
                    f"{curve.worst_over_best:.2f}",
                    delta,
                    *(f"{a:.2f}" for a in means),
                ]
            )
        lines += [
            f"**{pairs} pairs ({title})**: exact-match accuracy by gold slot, mean over seeds",
            "",
            *table_lines(header, table, left=3),
            "",
        ]
        if reordered_curves := [c for c in every if c.num_pairs == pairs and c.gold_at_end]:
            lines += [
                f"Gold at an end after reordering ({pairs} pairs): the fraction of test prompts whose gold "
                f"document the reordering put in the first or last {args.end_slots} slots (the trained end "
                "slots); the table's slots are the gold's before reordering.",
                "",
            ]
            lines += [f"- {c.model}, {c.setting}: {statistics.fmean(c.gold_at_end):.3f}" for c in reordered_curves]
            lines.append("")
    picks = [
        f"{r['model']}, seed {r['seed']}: {r['details']}"
        for r in rows
        if r["setting"] == SEARCH_PICK and r["slot"] == 1 and r["num_pairs"] == args.num_pairs
    ]
    if picks:
        lines += ["The positional-dimension search's pick (on validation prompts):", ""]
        lines += [f"- {pick}" for pick in picks] + [""]
    lines.append(
        f"Trained on lists of {args.num_pairs} documents ({args.num_keys} keys, {args.num_values} values), the "
        f"answer in the first or last {args.end_slots} slots with probability {args.gold_at_ends:g} and anywhere "
        f"otherwise, {args.max_steps} steps of {args.batch_size}; {args.eval_per_slot} test prompts per gold slot; "
        + (
            f"mean over seeds {seeds}, ± the 95% interval of the mean over seeds. "
            if len(seeds) > 1
            else f"seed {seeds[0]}. "
        )
        + "Δ mean: against the same model with no mitigation."
        + (
            f" IN2: a copy of each trained model fine-tuned for the stated fraction of its {args.max_steps} steps on "
            "lists of the same task with the answer at every slot uniformly (its own data stream; the same learning "
            f"rate {args.learning_rate:g}, batch size {args.batch_size} and weight decay, a fresh optimiser and "
            "schedule), evaluated with no other mitigation."
            if IN2 in args.mitigations
            else ""
        )
    )
    return "\n".join(lines)


RESULT_FIELDS = [
    "model",
    "mitigation",
    "setting",
    "seed",
    "num_pairs",
    "slot",
    "accuracy",
    "examples",
    "status",
    "details",
    "gold_at_end",
    "train_pairs",
    "parameters",
    "train_steps",
    "train_loss",
    "train_seconds",
    "finetune_steps",
    "finetune_loss",
    "finetune_seconds",
]
COLOURS = {
    NONE: "black",
    "stable_mask": "tab:blue",
    "ms_poe": "tab:orange",
    "attention_calibration": "tab:green",
    "positional_scaling": "tab:red",
    "attention_buckets": "tab:purple",
    "parallel_context_windows": "tab:brown",
    IN2: "tab:pink",
    REORDER: "tab:olive",
}


def plot_curves(rows: list[dict], args, path: Path) -> None:
    """One panel per model at the training length: no mitigation, positional scaling at the search's pick and each
    other mitigation at its setting with the highest mean test accuracy, each with its 95% band over seeds."""
    plt = pyplot()
    every = [c for c in curves(rows) if c.num_pairs == args.num_pairs and c.status == "ok"]
    models = list(dict.fromkeys(c.model for c in every))
    figure, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False, sharey=True)
    slots = range(1, args.num_pairs + 1)
    for axis, model in zip(axes[0], models, strict=True):
        mine = [c for c in every if c.model == model]
        best = {}
        for curve in mine:
            if curve.setting == SEARCH_PICK:  # the search's pick, not one picked on the test prompts
                best[curve.mitigation] = curve
            elif best.get(curve.mitigation, curve).setting != SEARCH_PICK and (
                curve.mitigation not in best
                or statistics.fmean(curve.mean_by_slot) > statistics.fmean(best[curve.mitigation].mean_by_slot)
            ):
                best[curve.mitigation] = curve
        for mitigation, curve in best.items():
            means, half = torch.tensor(curve.mean_by_slot), torch.tensor(curve.interval_by_slot)
            colour = COLOURS.get(mitigation, "grey")
            label = NONE if mitigation == NONE else f"{mitigation} {curve.setting}"
            axis.plot(
                slots,
                means,
                marker="o",
                markersize=3,
                color=colour,
                label=label,
                linewidth=2.5 if mitigation == NONE else 1.2,
            )
            axis.fill_between(slots, (means - half).clamp(min=0), (means + half).clamp(max=1), color=colour, alpha=0.15)
        axis.set_title(f"{model}, {args.num_pairs} pairs", fontsize=9)
        axis.set_xlabel("gold slot")
        axis.set_xticks(list(slots)[:: max(1, len(slots) // 16)])  # at most ~16 labels: 64 slots would overlap
        axis.set_ylim(-0.02, 1.02)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15))  # below: the curves stay visible
    axes[0][0].set_ylabel("exact-match accuracy")
    seeds = sorted({r["seed"] for r in rows})
    figure.suptitle(
        f"Key-value retrieval accuracy by the gold pair's position (seeds {seeds}, 95% bands; "
        "positional scaling at the search's pick, the others at their best setting)",
        fontsize=10,
    )
    figure.tight_layout()
    save_figure(figure, path, dpi=120, bbox_inches="tight")


def plot_attention(attention_rows: list[dict], path: Path) -> None:
    plt = pyplot()
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
    save_figure(figure, path, dpi=120)


# ----------------------------------------------------------------------------------------------------------- main

MITIGATION_NAMES = (
    NONE,
    "stable_mask",
    "ms_poe",
    "attention_calibration",
    "positional_scaling",
    "attention_buckets",
    "parallel_context_windows",
    IN2,
    REORDER,
)


def parse_args(argv=None):
    parser = experiment_parser(__doc__, quick="about 10 minutes")
    parser.add_argument(
        "--models",
        nargs="+",
        help="models to keep: substrings of their names, or their folder names (sepformer llama gpt2)",
    )
    parser.add_argument(
        "--mitigations",
        nargs="+",
        choices=MITIGATION_NAMES,
        action=Distinct,
        help="mitigations to evaluate (default: all), always beside 'none', the models as they "
        "are, that every mitigation is compared with; 'none' alone: no mitigation",
    )
    parser.add_argument(
        "--in2-fractions",
        type=positive_float,
        nargs="+",
        action=Distinct,
        help="IN2 fine-tunes' budgets as fractions of --max-steps, one row each (default: "
        f"{' '.join(map(str, IN2_FRACTIONS))}); needs 'in2' in --mitigations",
    )
    parser.add_argument("--num-pairs", type=positive_int, help="key-value pairs per training list")
    parser.add_argument(
        "--eval-pairs",
        type=positive_int,
        nargs="+",
        action=Distinct,
        help="numbers of pairs evaluated, at most --num-pairs (default: the training's)",
    )
    parser.add_argument("--num-keys", type=positive_int)
    parser.add_argument("--num-values", type=positive_int)
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        help="training steps (default: the preset's steps per pair times --num-pairs, e.g. 1500 at "
        "16 pairs and 3000 at 32)",
    )
    parser.add_argument("--weight-decay", type=nonnegative_float)
    parser.add_argument(
        "--end-slots", type=positive_int, help="training answers sit in the first or last this many slots"
    )
    parser.add_argument(
        "--gold-at-ends",
        type=probability,
        help="probability that a training answer sits in an end slot (otherwise: any slot)",
    )
    parser.add_argument("--eval-per-slot", type=positive_int, help="test prompts per gold slot")
    parser.add_argument(
        "--validation-per-slot", type=positive_int, help="validation prompts per gold slot (the search's)"
    )
    parser.add_argument("--eval-batch-size", type=positive_int, default=256)
    parser.add_argument("--output-dir", type=output_directory, default="outputs/position_bias")
    parser.add_argument(
        "--models-dir",
        type=output_directory,
        help="where trained models are saved and, with --reuse-models, read (default: OUTPUT_DIR/models)",
    )
    parser.add_argument(
        "--reuse-models",
        action="store_true",
        help="load the models an earlier run saved under --models-dir instead of training them again; "
        "one saved with other training settings or config is refused, with what differs, and so "
        "is a --models-dir without any of the run's models",
    )
    args = parser.parse_args(argv)
    if args.max_steps is None and args.num_pairs is not None:
        # At the preset's budget Llama does not learn twice the documents; at the same steps per pair it does.
        preset = PRESETS[preset_name(args)]
        args.max_steps = preset["max_steps"] * args.num_pairs // preset["num_pairs"]
    apply_preset(parser, args, PRESETS)
    args.models_dir = args.models_dir or str(Path(args.output_dir) / "models")
    args.mitigations = tuple(dict.fromkeys((NONE, *(args.mitigations or MITIGATION_NAMES))))  # the baseline first
    if args.in2_fractions is not None and IN2 not in args.mitigations:
        raise SystemExit(
            f"--in2-fractions {' '.join(map(str, args.in2_fractions))}: read only by the IN2 rows, and "
            f"--mitigations {' '.join(args.mitigations)} has no '{IN2}': add it or drop the flag"
        )
    args.in2_fractions = tuple(args.in2_fractions or IN2_FRACTIONS)
    if IN2 in args.mitigations and (none_steps := [f for f in args.in2_fractions if in2_steps(args, f) < 1]):
        raise SystemExit(
            f"--in2-fractions {' '.join(map(str, none_steps))}: of --max-steps {args.max_steps} "
            "rounds to 0 fine-tuning steps; give fractions that round to at least one step"
        )
    args.eval_pairs = tuple(args.eval_pairs or [args.num_pairs])
    if not 1 <= 2 * args.end_slots <= args.num_pairs:
        raise SystemExit(
            f"--end-slots {args.end_slots}: the first and the last {args.end_slots} slots must fit in "
            f"--num-pairs {args.num_pairs} (1 <= 2 x end slots <= pairs)"
        )
    if args.hidden_size % args.num_heads:
        raise SystemExit(
            f"--hidden-size {args.hidden_size} is not a multiple of --num-heads {args.num_heads}: every "
            "model splits its width into heads of equal size"
        )
    if not all(1 <= pairs <= args.num_pairs for pairs in args.eval_pairs):
        raise SystemExit(
            f"--eval-pairs {list(args.eval_pairs)}: each must be between 1 and --num-pairs "
            f"{args.num_pairs} (the models' positions end at the training length)"
        )
    if args.num_pairs > args.num_keys:
        raise SystemExit(f"--num-keys {args.num_keys}: a list has {args.num_pairs} distinct keys")
    if args.num_pairs not in args.eval_pairs:
        args.eval_pairs = (args.num_pairs, *args.eval_pairs)  # the search and the summaries need the training length
    return args


def main(argv=None):
    args = parse_args(argv)
    with main_process_prints():
        return run(args)


def run(args) -> list[dict]:
    check_plotting()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    vocab = Vocabulary(args.num_keys, args.num_values)
    metric = evaluate.load(metric_path("accuracy_by_position"))
    print(
        f"task: {args.num_pairs} pairs (evaluated at {', '.join(map(str, args.eval_pairs))}), {args.num_keys} keys, "
        f"{args.num_values} values; models: d_model={args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_heads} heads; {args.max_steps} steps of {args.batch_size}; seeds {args.seeds}"
        + (f"; data parallel over {world_size()} processes" if world_size() > 1 else "")
    )
    # a saved model that cannot be reused fails now, not after hours of training
    runs = [(contender, seed) for seed in args.seeds for contender in contenders(args, vocab)]
    reused = [saved_model(args, contender, seed) is not None for contender, seed in runs] if args.reuse_models else []
    if reused and all(reused) and (args.save_steps or args.resume):
        raise SystemExit(
            "--save-steps and --resume act on training, and --reuse-models reuses every model of this "
            "run: nothing trains, so drop them"
        )
    if args.reuse_models and not any(reused):
        # an empty or mistyped folder would otherwise train everything again, silently
        folders = ", ".join(model_dir(args, contender, seed).name for contender, seed in runs)
        where = f"holds none of this run's models ({folders})" if Path(args.models_dir).is_dir() else "does not exist"
        raise SystemExit(
            f"--reuse-models: --models-dir {args.models_dir} {where}; give the --models-dir of the run "
            "that trained them"
        )
    check_resumable(args, [(contender.slug, seed) for contender, seed in runs])

    def write_results(rows, attention_rows):  # after each seed: a long run keeps what it did
        if is_main_process():
            write_csv(rows, output_dir / "results.csv", RESULT_FIELDS, float_fields=("accuracy", "gold_at_end"))

    rows, attention_rows = every_seed(args.seeds, lambda seed: run_seed(seed, vocab, metric, args), write_results)
    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    if not is_main_process():
        return rows
    (output_dir / "results.md").write_text(table + "\n")
    write_csv(
        attention_rows,
        output_dir / "attention.csv",
        ["model", "seed", "layer", "head", "group", "attention"],
        float_fields=("attention",),
    )
    plot_curves(rows, args, output_dir / "position_bias.png")
    plot_attention(attention_rows, output_dir / "attention_by_position.png")
    print(
        f"wrote results.csv, results.md, position_bias.png, attention.csv, attention_by_position.png under "
        f"{output_dir} in {(time.time() - started) / 60:.1f} min"
    )
    return rows


if __name__ == "__main__":
    main()
