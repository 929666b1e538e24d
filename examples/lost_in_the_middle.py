"""Lost in the middle on a saved causal LM: accuracy by the gold document's slot, with and without each mitigation.

The two tasks of "Lost in the Middle" (Liu et al. 2023, arXiv 2307.03172), with the paper's prompts and metrics, on
any checkpoint that `from_pretrained` loads (a folder, or a Hub name already in the local cache), with its own
tokenizer, and its chat template if it has one (the prompt is the user's message, then the generation prompt):

- key-value retrieval (default): a JSON object of `--num-documents` pairs of random UUIDs (uuid4, from `--seed`); the
  prompt asks for the value of one key. Each object is asked once per slot, the gold key at every slot in turn.
  Correct when the value appears in the output (the paper's metric, case-insensitive).
- multi-document QA (`--qa-file`): JSON lines in the format of the paper's released data (`question`, `answers`,
  `ctxs` of `title` and `text`, exactly one with `isgold: true`): the gold document and the first
  `--num-documents - 1` others, the gold moved to every slot. Correct when a normalised answer appears in the
  normalised output (SQuAD's normalisation: the paper's `best_subspan_em`).

Each key-value pair (with its JSON punctuation: `{"k": "v",` and a newline, ` "k": "v",` ..., ` "k": "v"}`) or
search result (`Document [i](Title: ...) text` and its newline) is a document. Its token span in the final prompt,
counted from the first token, is what attention calibration, Parallel Context Windows and reordering take: the
text up to each document boundary is tokenised on its own, and the boundary is where that tokenisation stops
agreeing with the whole prompt's. So a span is exactly its document's tokens where the tokenizer starts a token at
the boundary; a token that crosses a boundary belongs to the later document.

Mitigations (`--mitigations`, default all), each at its paper's defaults, the option dataclasses' defaults:
StableMask (which has no default `γ`: 0.05, the value the README uses), MS-PoE (ratios 1.2 to 1.8), attention
calibration (`t` = 5e-5, `bias(k)` by dummy passes), positional scaling (factor 0; on SepFormer its positional
block, on another model the channels and factor `search_positional_scaling` picks on key-value prompts of another
seed than the test's: a model where it finds no channel refuses it), Parallel Context Windows (one window per
document), Attention Buckets with the bases of its paper's retrieval-augmented QA, and reordering by the model's
attention with strategy "ends". Accuracy is by the gold's slot before reordering. A SepFormer takes every option;
another model takes them through `sepformer.add_mitigations` where this copy of the package has it (only `none`
otherwise). Each is tried on the longest prompt before any evaluation: one the model refuses (e.g. bases on learned
absolute positions) stops a run that names it, and is left out of the default run, which says so and why.

Greedy decoding of `--max-new-tokens` (the paper: 100), `--batch-size` prompts at a time, left-padded. Writes under
`--output-dir`: `results.csv` (model, mitigation, slot, accuracy, n), `results.md` (the table, printed too) and
`lost_in_the_middle.png` (accuracy by slot, one line per mitigation).

    python examples/lost_in_the_middle.py --model path/to/checkpoint                      # 75 keys, every mitigation
    python examples/lost_in_the_middle.py --model path/to/checkpoint --mitigations none ms_poe --num-documents 20
    python examples/lost_in_the_middle.py --model path/to/checkpoint --qa-file nq-open-20_total_documents.jsonl
    python examples/lost_in_the_middle.py --model path/to/checkpoint --tiny               # a smoke run in seconds
"""

import argparse
import functools
import json
import random
import re
import statistics
import string
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import transformers
from cli_arguments import Distinct, existing_file, nonnegative_int, output_directory, positive_int, torch_device
from experiment_common import check_plotting, pyplot, save_figure, table_lines, write_csv
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import sepformer
from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    ReorderDocuments,
    StableMask,
)
from sepformer.positional_search import is_sepformer, search_positional_scaling

NONE = "none"
STABLE_MASK_GAMMA = 0.05  # StableMask's dataclass has no default gamma
RAG_BASES = (10000, 13000, 16000, 19000, 22000, 25000, 28000)  # Attention Buckets' rotary bases for RAG
OPTIONS: dict[str, Callable] = {  # name -> the option, from the batch's document spans and the positional scaling
    "stable_mask": lambda spans, scaling: StableMask(gamma=STABLE_MASK_GAMMA),
    "ms_poe": lambda spans, scaling: MSPoE(),
    "attention_calibration": lambda spans, scaling: AttentionCalibration(spans=spans),
    "positional_scaling": lambda spans, scaling: scaling,
    "parallel_context_windows": lambda spans, scaling: ParallelContextWindows(spans=spans),
    "attention_buckets": lambda spans, scaling: AttentionBuckets(bases=RAG_BASES),
    "reorder_documents": lambda spans, scaling: ReorderDocuments(spans=spans, by="attention", strategy="ends"),
}
MITIGATIONS = (NONE, *OPTIONS)
DEFAULTS = {
    "key-value": dict(num_documents=75, examples_per_slot=10, max_new_tokens=100),  # the paper's 75 keys
    "qa": dict(num_documents=20, examples_per_slot=10, max_new_tokens=100),
}
TINY = dict(num_documents=3, examples_per_slot=2, max_new_tokens=4)
RESULT_FIELDS = ["model", "mitigation", "slot", "accuracy", "n"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------- the tasks


@dataclass(frozen=True)
class Example:
    """One prompt, `head + "".join(documents) + tail`, with its answers and the gold document's slot (0-based)."""

    head: str
    documents: tuple[str, ...]
    tail: str
    answers: tuple[str, ...]
    slot: int

    @property
    def text(self) -> str:
        return self.head + "".join(self.documents) + self.tail


KV_HEAD = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
QA_HEAD = (
    "Write a high-quality answer for the given question using only the provided search results (some of which "
    "might be irrelevant).\n\n"
)


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_records(pairs: list[tuple[str, str]]) -> tuple[str, ...]:
    """The paper's JSON object, one string per pair: `{"k": "v",\\n`, ` "k": "v",\\n`, ..., ` "k": "v"}`."""
    last = len(pairs) - 1
    return tuple(
        ("{" if i == 0 else " ") + f'"{key}": "{value}"' + (",\n" if i < last else "}")
        for i, (key, value) in enumerate(pairs)
    )


def kv_examples(rng: random.Random, count: int, num_documents: int) -> list[Example]:
    """`count` JSON objects of `num_documents` pairs, each asked for the key at every slot in turn."""
    examples = []
    for _ in range(count):
        pairs = [(random_uuid(rng), random_uuid(rng)) for _ in range(num_documents)]
        records = kv_records(pairs)
        examples += [
            Example(KV_HEAD, records, f'\n\nKey: "{key}"\nCorresponding value:', (value,), slot)
            for slot, (key, value) in enumerate(pairs)
        ]
    return examples


def qa_examples(records: list[dict], num_documents: int) -> list[Example]:
    """Each question with its gold document at every slot among the first `num_documents - 1` other documents."""
    examples = []
    for record in records:
        gold = next(ctx for ctx in record["ctxs"] if ctx.get("isgold") is True)
        others = [ctx for ctx in record["ctxs"] if ctx is not gold][: num_documents - 1]
        for slot in range(num_documents):
            ctxs = [*others[:slot], gold, *others[slot:]]
            documents = tuple(
                f"Document [{i + 1}](Title: {ctx['title']}) {ctx['text']}" + ("\n" if i < num_documents - 1 else "")
                for i, ctx in enumerate(ctxs)
            )
            examples.append(
                Example(
                    QA_HEAD, documents, f"\n\nQuestion: {record['question']}\nAnswer:", tuple(record["answers"]), slot
                )
            )
    return examples


def read_qa_file(path: str, count: int, num_documents: int) -> list[dict]:
    """The first `count` records of a JSON-lines file of the paper's format, each checked; a bad one stops the run,
    with its line number."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if len(records) == count:
                break
            if line.strip():
                records.append(checked_qa_record(line, f"--qa-file {path} line {number}", num_documents))
    if len(records) < count:
        raise SystemExit(
            f"--qa-file {path} has {len(records)} questions: --examples-per-slot {count} needs as many; "
            "give a smaller --examples-per-slot"
        )
    return records


def strings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(text, str) for text in value)


def checked_qa_record(line: str, where: str, num_documents: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SystemExit(f"{where} is not JSON: {error}") from None
    record = record if isinstance(record, dict) else {}
    answers, ctxs = record.get("answers"), record.get("ctxs")
    if not (
        isinstance(record.get("question"), str)
        and strings(answers)
        and isinstance(ctxs, list)
        and all(isinstance(ctx, dict) and strings([ctx.get("title"), ctx.get("text")]) for ctx in ctxs)
    ):
        raise SystemExit(
            f"{where}: a record is an object with question (a string), answers (strings) and ctxs "
            "(objects with title and text, one with isgold: true), as the paper's released data"
        )
    golds = sum(ctx.get("isgold") is True for ctx in ctxs)
    if golds != 1:
        raise SystemExit(f"{where} has {golds} documents with isgold: true; give exactly one")
    if len(ctxs) < num_documents:
        raise SystemExit(
            f"{where} has {len(ctxs)} documents: --num-documents {num_documents} needs as many; give a "
            "smaller --num-documents"
        )
    return record


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as the paper's QA metric: lower case, no punctuation, no articles, single spaces."""
    text = "".join(char for char in text.lower() if char not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def kv_correct(output: str, answers: tuple[str, ...]) -> bool:
    """The paper's key-value metric: the value appears in the output, case-insensitive."""
    return any(answer.lower() in output.lower() for answer in answers)


def qa_correct(output: str, answers: tuple[str, ...]) -> bool:
    """The paper's `best_subspan_em`: a normalised answer appears in the normalised output."""
    return any(normalize_answer(answer) in normalize_answer(output) for answer in answers)


# ------------------------------------------------------------------------------------------------- tokenisation


@dataclass(frozen=True)
class Prompt:
    """An example's token ids (after the chat template) and its documents' (start, end) token spans in them."""

    example: Example
    input_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]


class Encoder:
    """Token ids and document spans of examples, through the tokenizer's chat template when it has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.ids = functools.lru_cache(maxsize=1024)(self._ids)  # the text before each boundary, once per object

    def _ids(self, text: str) -> tuple[int, ...]:
        # a chat template writes its special tokens itself; a plain prompt gets the tokenizer's (e.g. <bos>)
        return tuple(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])

    def framed(self, prompt: str) -> tuple[str, int]:
        """The text the model reads and where `prompt` starts in it: the chat template's user turn and generation
        prompt around it, or the prompt as it is."""
        if not self.chat:
            return prompt, 0
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        if (start := text.find(prompt)) < 0:
            raise ValueError(
                "the tokenizer's chat template changes the user's message, so the documents cannot be "
                f"found in its text: {text!r}"
            )
        return text, start

    def tokens_before(self, text: str, end: int, ids: tuple[int, ...]) -> int:
        """How many of `ids` (all of `text`) lie before character `end`: where the tokenisation of `text[:end]` stops
        agreeing with that of the whole text."""
        prefix = self.ids(text[:end])
        if ids[: len(prefix)] == prefix:
            return len(prefix)
        return next(i for i, (mine, whole) in enumerate(zip(prefix, ids, strict=False)) if mine != whole)

    def __call__(self, example: Example) -> Prompt:
        text, start = self.framed(example.text)
        ids = self.ids(text)
        boundaries = accumulate(map(len, example.documents), initial=start + len(example.head))
        starts = [self.tokens_before(text, boundary, ids) for boundary in boundaries]
        spans = tuple(zip(starts[:-1], starts[1:], strict=True))
        if empty := [k for k, (first, end) in enumerate(spans) if end <= first]:
            raise ValueError(
                f"document {empty[0]} of {example.text!r} has no token of its own: a token of this "
                "tokenizer crosses both of its boundaries"
            )
        return Prompt(example, ids, spans)


# ----------------------------------------------------------------------------------------------------- the model


def load_tokenizer(args):
    """The checkpoint's tokenizer, padding on the left, with a pad token (eos where it has none)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {args.model}: no tokenizer to load ({error})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise SystemExit(f"--model {args.model}: its tokenizer has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args, tokenizer):
    """The model, in eval mode on `--device` in `--dtype`, with the mitigations as `generate` keywords
    (`sepformer.add_mitigations` on a model other than SepFormer)."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).to(args.device).eval()
    if model.config.pad_token_id is None:  # calibration's default dummy document is pad_token_id repeated
        model.config.pad_token_id = tokenizer.pad_token_id
    if not is_sepformer(model) and args.mitigations != (NONE,):
        try:
            model = sepformer.add_mitigations(model)
        except (ValueError, TypeError) as error:
            for mitigation in [name for name in args.mitigations if name != NONE]:
                refuse(mitigation, f"add_mitigations does not take it ({error})", args)
    return model


def refuse(mitigation: str, why: str, args) -> None:
    """A mitigation this model does not take: named in --mitigations, it stops the run (before any evaluation); taken
    by default, it is left out, and the output says so and why."""
    message = f"--mitigations {mitigation}: refused for --model {args.model}: {why}"
    if args.named_mitigations:
        raise SystemExit(message)
    print(f"left out: {message}")
    args.left_out[mitigation] = why
    args.mitigations = tuple(name for name in args.mitigations if name != mitigation)


def check_vocabulary(model, tokenizer, prompts: list[Prompt], args) -> None:
    """Every prompt id and the pad id have a row of the model's embedding (an id past it fails deep inside, a device
    assert on a GPU)."""
    rows = model.get_input_embeddings().num_embeddings
    largest = max(max(prompt.input_ids) for prompt in prompts)
    if max(largest, tokenizer.pad_token_id) >= rows:
        raise SystemExit(
            f"--model {args.model}: its tokenizer gives ids up to {max(largest, tokenizer.pad_token_id)} "
            f"(the largest prompt id {largest}, the pad id {tokenizer.pad_token_id}), past the model's "
            f"{rows} embedding rows"
        )


def check_mitigations(model, tokenizer, prompts: list[Prompt], args) -> None:
    """The longest prompt, so that what the model refuses stops the run now, not after hours of evaluation: without
    mitigation, to the last new token (a model whose positions end before it stops the run); then each mitigation for
    the prompt and a decoding step (positional scaling with a placeholder channel on a model other than SepFormer: its
    search comes after)."""
    longest = max(prompts, key=lambda prompt: len(prompt.input_ids))
    try:
        generate(model, tokenizer, [longest], NONE, None, args.max_new_tokens)
    except (ValueError, TypeError, IndexError) as error:
        raise SystemExit(
            f"--model {args.model} cannot generate {args.max_new_tokens} tokens after the longest prompt "
            f"({len(longest.input_ids)} tokens): {type(error).__name__}: {error}"
        ) from None
    scaling = PositionalScaling() if is_sepformer(model) else PositionalScaling(channels=(0,))
    for mitigation in [name for name in args.mitigations if name != NONE]:
        try:
            generate(model, tokenizer, [longest], mitigation, scaling, max_new_tokens=min(2, args.max_new_tokens))
        except (ValueError, TypeError) as error:
            refuse(mitigation, str(error), args)


def positional_scaling(model, encoder: Encoder, args) -> PositionalScaling | None:
    """SepFormer: the option's defaults (its positional block). Another model: the channels and factor that
    `search_positional_scaling` picks on one key-value object of another seed, its key at every slot."""
    if "positional_scaling" not in args.mitigations:
        return None
    if is_sepformer(model):
        return PositionalScaling()
    rng = random.Random(f"{args.seed}:validation")  # a stream apart from the test's
    batches = [validation_batch(encoder, example, model.device) for example in kv_examples(rng, 1, args.num_documents)]
    try:
        return search_positional_scaling(model, batches).option
    except ValueError as error:  # no positional channel, or attention the search cannot hook
        refuse("positional_scaling", f"the channel search does not run on it ({error})", args)
        return None


def validation_batch(encoder: Encoder, example: Example, device) -> dict:
    """One prompt and its answer, only the answer labelled (a plain prompt ends in a colon: a space, then it)."""
    prompt = encoder(example).input_ids
    answer = encoder.tokenizer(("" if encoder.chat else " ") + example.answers[0], add_special_tokens=False)
    ids = torch.tensor([[*prompt, *answer["input_ids"]]], device=device)
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    return {"input_ids": ids, "labels": labels, "gold_position": torch.tensor([example.slot])}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], mitigation: str, scaling, max_new_tokens: int) -> list[str]:
    """The greedy continuations of `prompts` (left-padded together) under `mitigation`."""
    batch = tokenizer.pad({"input_ids": [list(prompt.input_ids) for prompt in prompts]}, return_tensors="pt")
    batch = batch.to(model.device)
    options = (
        {} if mitigation == NONE else {mitigation: OPTIONS[mitigation]([prompt.spans for prompt in prompts], scaling)}
    )
    output = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )
    return tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(model, tokenizer, prompts: list[Prompt], correct, scaling, args) -> list[dict]:
    """Accuracy by slot under every mitigation: one row per (mitigation, slot)."""
    rows = []
    with tqdm(total=len(args.mitigations) * len(prompts), desc="prompts", dynamic_ncols=True) as bar:
        for mitigation in args.mitigations:
            scores = {}
            for first in range(0, len(prompts), args.batch_size):
                batch = prompts[first : first + args.batch_size]
                bar.set_postfix(mitigation=mitigation)
                outputs = generate(model, tokenizer, batch, mitigation, scaling, args.max_new_tokens)
                for prompt, output in zip(batch, outputs, strict=True):
                    scores.setdefault(prompt.example.slot, []).append(correct(output, prompt.example.answers))
                bar.update(len(batch))
            rows += [
                {
                    "model": args.model,
                    "mitigation": mitigation,
                    "slot": slot + 1,
                    "accuracy": statistics.fmean(hits),
                    "n": len(hits),
                }
                for slot, hits in sorted(scores.items())
            ]
    return rows


# ----------------------------------------------------------------------------------------------- table and plot


def markdown_table(rows: list[dict], args) -> str:
    slots = range(1, args.num_documents + 1)
    header = ["mitigation", *(f"slot {slot}" for slot in slots), "mean"]
    lines = []
    for mitigation in args.mitigations:
        accuracy = {row["slot"]: row["accuracy"] for row in rows if row["mitigation"] == mitigation}
        lines.append(
            [mitigation, *(f"{accuracy[slot]:.3f}" for slot in slots), f"{statistics.mean(accuracy.values()):.3f}"]
        )
    task = "multi-document QA" if args.qa_file else "key-value retrieval"
    title = (
        f"{task}, {args.model}: accuracy by the gold document's slot ({args.num_documents} documents, "
        f"{args.examples_per_slot} examples per slot)"
    )
    left_out = [f"left out: {mitigation} ({why})" for mitigation, why in args.left_out.items()]
    return "\n".join([title, "", *table_lines(header, lines, left=1), *([""] if left_out else []), *left_out])


def plot(rows: list[dict], args, path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mitigation in args.mitigations:
        mine = [row for row in rows if row["mitigation"] == mitigation]
        axes.plot([row["slot"] for row in mine], [row["accuracy"] for row in mine], marker="o", label=mitigation)
    axes.set(
        xlabel="slot of the gold document",
        ylabel="accuracy",
        ylim=(-0.02, 1.02),
        title=f"Lost in the middle: {Path(args.model).name}",
    )
    axes.legend(fontsize="small")
    save_figure(figure, path, dpi=120, bbox_inches="tight")


# ------------------------------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint folder or a Hub name in the local cache")
    parser.add_argument(
        "--qa-file",
        type=existing_file,
        help="multi-document QA from this JSON-lines file (the paper's format) instead of key-value retrieval",
    )
    parser.add_argument("--mitigations", nargs="+", choices=MITIGATIONS, action=Distinct, help="default: all of them")
    parser.add_argument(
        "--num-documents",
        type=positive_int,
        help="key-value pairs (default 75) or search results (default 20) in every prompt",
    )
    parser.add_argument(
        "--examples-per-slot",
        type=positive_int,
        help="JSON objects or questions, each asked with its gold at every slot (default 10)",
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="the UUIDs' random stream")
    parser.add_argument("--max-new-tokens", type=positive_int, help="greedy tokens per answer (default 100)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="prompts per generate call")
    parser.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the model's weights and compute")
    parser.add_argument("--output-dir", type=output_directory, default="outputs/lost_in_the_middle")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"a smoke run: {TINY['num_documents']} documents, {TINY['examples_per_slot']} examples "
        f"per slot, {TINY['max_new_tokens']} new tokens (flags given still win)",
    )
    args = parser.parse_args(argv)
    preset = TINY if args.tiny else DEFAULTS["qa" if args.qa_file else "key-value"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.named_mitigations, args.left_out = args.mitigations is not None, {}
    args.mitigations = tuple(args.mitigations or MITIGATIONS)
    config = model_config(args.model)
    if config.model_type != "sepformer" and getattr(sepformer, "add_mitigations", None) is None:
        for mitigation in [name for name in args.mitigations if name != NONE]:
            refuse(
                mitigation,
                "this copy of sepformer has no add_mitigations, which gives a model other than SepFormer the options",
                args,
            )
    args.qa_records = read_qa_file(args.qa_file, args.examples_per_slot, args.num_documents) if args.qa_file else None
    return args


def model_config(name: str):
    """The checkpoint's config: read before the weights, so that a bad name or a refused option costs no loading."""
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {name}: no config to load ({error})") from None


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_plotting()
    transformers.logging.set_verbosity_error()
    started = time.time()
    tokenizer = load_tokenizer(args)
    encoder = Encoder(tokenizer)
    if args.qa_records is None:
        examples = kv_examples(random.Random(args.seed), args.examples_per_slot, args.num_documents)
    else:
        examples = qa_examples(args.qa_records, args.num_documents)
    correct = kv_correct if args.qa_records is None else qa_correct
    try:
        prompts = [encoder(example) for example in examples]
    except ValueError as error:  # the documents cannot be found in the prompt's tokens
        raise SystemExit(f"--model {args.model}: {error}") from None
    model = load_model(args, tokenizer)
    check_vocabulary(model, tokenizer, prompts, args)
    check_mitigations(model, tokenizer, prompts, args)
    scaling = positional_scaling(model, encoder, args)
    rows = evaluate(model, tokenizer, prompts, correct, scaling, args)

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, output_dir / "results.csv", RESULT_FIELDS, float_fields=("accuracy",))
    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    (output_dir / "results.md").write_text(table + "\n")
    plot(rows, args, output_dir / "lost_in_the_middle.png")
    print(
        f"wrote results.csv, results.md, lost_in_the_middle.png under {output_dir} in "
        f"{(time.time() - started) / 60:.1f} min"
    )
    return rows


if __name__ == "__main__":
    main()
