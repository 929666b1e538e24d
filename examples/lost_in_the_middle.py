"""Lost in the middle on a saved causal LM: accuracy by the gold document's slot, with and without each mitigation.

The two tasks of "Lost in the Middle" (Liu et al. 2023) with the paper's prompts and metrics
(`lost_in_the_middle_task.py`), on any checkpoint that `from_pretrained` loads (a folder, a Hub name in the local
cache, or a `.gguf` file) with its own tokenizer and chat template: key-value retrieval (default; `--keys short` and
`--prompt completion` for small models) or multi-document QA (`--qa-file`, the paper's JSON lines). Each mitigation
(`--mitigations`, default all) runs at its paper's settings, and with `--tune` also at the settings its grid search
picks on validation prompts of another seed; one the model refuses stops a run that names it and is left out of the
default run. Greedy decoding, left-padded batches. Writes under `--output-dir`: `results.csv` (model, task, seed,
mitigation, settings, slot, accuracy, n, seconds per prompt), `outputs.csv` (each prompt's answer and output),
`results.md` (the table, printed too), `lost_in_the_middle.png` and with `--tune` `tuning.csv`; and each condition's
rows as it finishes, under `finished/`, which `--resume` reads back after a stop. In full:
docs/experiments/lost_in_the_middle.md.

    python examples/lost_in_the_middle.py --model path/to/checkpoint                      # 75 keys, every mitigation
    python examples/lost_in_the_middle.py --model path/to/checkpoint --mitigations none ms_poe --num-documents 20
    python examples/lost_in_the_middle.py --model path/to/checkpoint --qa-file nq-open-20_total_documents.jsonl
    python examples/lost_in_the_middle.py --model model.gguf --keys short --prompt completion --num-documents 10 --tune
    python examples/lost_in_the_middle.py --model path/to/checkpoint --tiny               # a smoke run in seconds
"""

import argparse
import hashlib
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import real_checkpoints
import torch
import transformers
from cli_arguments import Distinct, existing_file, nonnegative_int, output_directory, positive_int, torch_device
from experiment_common import check_plotting, pyplot, save_figure, table_lines, write_csv
from lost_in_the_middle_options import GRID, IN_PLACE_OF_PAPER, NONE, OPTION_CLASSES, PAPER, describe, make_option
from lost_in_the_middle_task import (
    KEYS,
    PROMPTS,
    Encoder,
    Example,
    Prompt,
    kv_correct,
    kv_examples,
    qa_correct,
    qa_examples,
    read_qa_file,
)
from tqdm.auto import tqdm
from transformers import AutoConfig

import sepformer
from sepformer.positional_search import is_sepformer, search_positional_scaling

DEFAULTS = {
    "key-value": dict(num_documents=75, examples_per_slot=10, max_new_tokens=100),  # the paper's 75 keys
    "qa": dict(num_documents=20, examples_per_slot=10, max_new_tokens=100),
}
TINY = dict(num_documents=3, examples_per_slot=2, max_new_tokens=4, tune_examples=1)
RESULT_FIELDS = [
    "model",
    "keys",
    "prompt",
    "num_documents",
    "seed",
    "mitigation",
    "choice",
    "settings",
    "slot",
    "accuracy",
    "n",
    "seconds_per_prompt",
]
OUTPUT_FIELDS = ["mitigation", "choice", "slot", "answer", "output", "correct"]
TUNING_FIELDS = ["model", "keys", "prompt", "num_documents", "seed", "mitigation", "settings", "mean", "worst", "n"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MITIGATIONS = (NONE, *OPTION_CLASSES)
SCALING = "positional_scaling"
REORDER = "reorder_documents"
# How answers are scored and conditions run, in the digest of the rows `--resume` reads back: 2 scores QA on the first
# line and writes reordered prompts anew. Raise it with any change of either.
EVALUATION = 2


@dataclass(frozen=True)
class Condition:
    """A mitigation (or none) with its settings: the paper's (`choice="paper"`) or those `--tune` picked."""

    mitigation: str
    settings: dict = field(default_factory=dict, hash=False)
    choice: str = "paper"

    @property
    def label(self) -> str:
        return self.mitigation if self.mitigation == NONE or self.choice == "paper" else f"{self.mitigation} (tuned)"


# ----------------------------------------------------------------------------------------------------- the model


def load_tokenizer(args):
    """The checkpoint's tokenizer, padding on the left, with a pad token (eos where it has none)."""
    try:
        tokenizer = real_checkpoints.load_tokenizer(args.model)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {args.model}: no tokenizer to load ({error})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise SystemExit(f"--model {args.model}: its tokenizer has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args):
    """The model, in eval mode on `--device` in `--dtype`, with the mitigations as `generate` keywords
    (`sepformer.add_mitigations` on a model other than SepFormer)."""
    model = real_checkpoints.load_model(args.model, DTYPES[args.dtype]).to(args.device)
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
    mitigation, to the last new token (a model whose positions end before it stops the run); then each mitigation at
    its paper's settings for the prompt and a decoding step (positional scaling with a placeholder channel on a model
    other than SepFormer: its search comes after). With `--tune`, every setting of its grid too: `args.grids` keeps
    those the model takes, and the output names the others and why. Where the model refuses the paper's settings,
    `--tune` tries the settings of `IN_PLACE_OF_PAPER` instead (`args.paper_refused` says why: the method has a
    tuned row only); without them, or without `--tune`, the method is refused."""
    longest = max(prompts, key=lambda prompt: len(prompt.input_ids))
    try:
        generate(model, tokenizer, [longest], Condition(NONE), args.max_new_tokens)
    except (ValueError, TypeError, IndexError) as error:
        raise SystemExit(
            f"--model {args.model} cannot generate {args.max_new_tokens} tokens after the longest prompt "
            f"({len(longest.input_ids)} tokens): {type(error).__name__}: {error}"
        ) from None
    placeholder = {} if is_sepformer(model) else {"channels": (0,)}

    def tried(mitigation: str, settings: dict) -> str | None:
        """Why the model refuses `mitigation` at `settings` on the longest prompt (None: it takes them)."""
        condition = Condition(mitigation, {**settings, **placeholder} if mitigation == SCALING else settings)
        try:
            generate(model, tokenizer, [longest], condition, max_new_tokens=min(2, args.max_new_tokens))
        except (ValueError, TypeError) as error:
            return str(error)
        return None

    args.grids, args.paper_refused = {}, {}
    for mitigation in [name for name in args.mitigations if name != NONE]:
        paper_refused = tried(mitigation, PAPER[mitigation])
        grid = GRID[mitigation] if paper_refused is None else IN_PLACE_OF_PAPER.get(mitigation, [])
        args.grids[mitigation] = []
        for settings in grid if args.tune else ():
            if (why := tried(mitigation, settings)) is None:
                args.grids[mitigation].append(settings)
            else:
                print(f"tuning grid of {mitigation}: left out {describe(settings)} ({why})")
        if paper_refused is not None and not args.grids[mitigation]:
            del args.grids[mitigation]
            refuse(mitigation, paper_refused, args)
        elif paper_refused is not None:
            args.paper_refused[mitigation] = paper_refused
            print(
                f"{mitigation}: its paper settings are refused ({paper_refused}); --tune tries its grid in their place"
            )


def scaling_channels(model, encoder: Encoder, args) -> dict:
    """Positional scaling's settings on this model. SepFormer: none (its positional block). Another model: the channels
    and factor that `search_positional_scaling` picks on one key-value object of another seed, its key at every
    slot."""
    if SCALING not in args.mitigations or is_sepformer(model):
        return {}
    rng = random.Random(f"{args.seed}:validation")  # a stream apart from the test's
    examples = kv_examples(rng, 1, args.num_documents, args.keys, args.prompt)
    batches = [validation_batch(encoder, example, model.device) for example in examples]
    try:
        option = search_positional_scaling(model, batches).option
    except ValueError as error:  # no positional channel, or attention the search cannot hook
        refuse(SCALING, f"the channel search does not run on it ({error})", args)
        return {}
    return {"channels": option.channels, "factor": option.factor}


def validation_batch(encoder: Encoder, example: Example, device) -> dict:
    """One prompt and its answer, only the answer labelled: a plain prompt ends in a colon (a space, then the answer),
    a completion prompt in the answer's opening quote, a chat template in its generation prompt (the answer alone)."""
    prompt = encoder(example).input_ids
    space = "" if encoder.chat or example.tail.endswith('"') else " "
    answer = encoder.tokenizer(space + example.answers[0], add_special_tokens=False)
    ids = torch.tensor([[*prompt, *answer["input_ids"]]], device=device)
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    return {"input_ids": ids, "labels": labels, "gold_position": torch.tensor([example.slot])}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], condition: Condition, max_new_tokens: int) -> list[str]:
    """The greedy continuations of `prompts` (left-padded together) under `condition`."""
    if condition.mitigation == REORDER:
        prompts, condition = reordered(model, tokenizer, prompts, condition), Condition(NONE)
    batch = padded(tokenizer, prompts, model.device)
    options = {}
    if condition.mitigation != NONE:
        spans = tuple(prompt.spans for prompt in prompts)
        options[condition.mitigation] = make_option(condition.mitigation, condition.settings, spans, model.config)
    greedy = dict(do_sample=False, num_beams=1, pad_token_id=tokenizer.pad_token_id)
    output = model.generate(**batch, max_new_tokens=max_new_tokens, **greedy, **options)
    return tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def padded(tokenizer, prompts: list[Prompt], device) -> dict:
    return tokenizer.pad({"input_ids": [list(prompt.input_ids) for prompt in prompts]}, return_tensors="pt").to(device)


def reordered(model, tokenizer, prompts: list[Prompt], condition: Condition) -> list[Prompt]:
    """`prompts` with their documents in the order `reorder_documents` gives them (`sepformer.document_relevance` and
    `relevance_order`, its `rounds` each on the prompts the last made), written anew at their places: the JSON object's
    punctuation and the results' numbers stay where they are, as the paper writes a prompt in any order (moving the
    documents' tokens would move them too)."""
    options = make_option(REORDER, condition.settings, tuple(prompt.spans for prompt in prompts), model.config)
    for done in range(1, options.rounds + 1):
        batch = padded(tokenizer, prompts, model.device)
        spans = tuple(prompt.spans for prompt in prompts)
        scores = sepformer.document_relevance(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            spans,
            options.by,
            options.layers,
            options.dummy_document,
        )
        order = sepformer.relevance_order(scores, options.strategy if done == options.rounds else "last")
        rows = zip(prompts, order.tolist(), strict=True)
        prompts = [prompt.encoder(prompt.example.reordered(row)) for prompt, row in rows]
    return prompts


def model_digest(model) -> str:
    """A digest of the model as loaded (its weights, its config) and of the code that runs it: the rows kept under one
    checkpoint path are not read back for other weights or settings saved there since, or after an upgrade. Reads every
    weight once (seconds for a small model; a copy to the CPU for one on a GPU)."""
    digest = hashlib.sha256(model.config.to_json_string().encode())
    digest.update(f"{sepformer.__version__} {transformers.__version__} {torch.__version__}".encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def finished_path(prompts: list[Prompt], condition: Condition, args) -> Path:
    """Where one condition's rows on `prompts` are kept once run (`--output-dir`/finished/): named by a digest of what
    they depend on (the weights, how they run, the prompts, the condition; the batch size too, which the seconds per
    prompt do; and `EVALUATION`, the version of how answers are scored and conditions run), so that `--resume` reads
    back only the very same work (greedy decoding is deterministic)."""
    work = [EVALUATION, args.model, args.model_digest, args.dtype, str(args.device), args.batch_size]
    work += [args.max_new_tokens]
    work += [args.keys, args.prompt_read, args.num_documents, args.seed]  # written in the rows
    work += [condition.mitigation, condition.choice, describe(condition.settings)]
    work += [(list(prompt.input_ids), prompt.spans, prompt.example.slot, prompt.example.answers) for prompt in prompts]
    digest = hashlib.sha256(json.dumps(work, default=str).encode()).hexdigest()[:16]
    return Path(args.output_dir) / "finished" / f"{condition.mitigation}-{condition.choice}-{digest}.json"


def read_finished(path: Path) -> dict | None:
    """The rows kept at `path`, or `None` where there are none, or none that can be read (then run again)."""
    if not path.exists():
        return None
    try:
        kept = json.loads(path.read_text())
        return {"rows": list(kept["rows"]), "answers": list(kept["answers"])}
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        print(f"--resume: {path} cannot be read ({type(error).__name__}: {error}); running its condition again")
        return None


def evaluate(model, tokenizer, prompts: list[Prompt], correct, conditions: list[Condition], args):
    """Accuracy by slot under every condition: one row per (condition, slot), with the seconds per prompt; and one row
    per (condition, prompt) with the answer and what the model wrote. Each condition's rows are kept as it finishes
    (`finished_path`); with `--resume`, a condition kept so is read back rather than run again."""
    rows, answers = [], []
    with tqdm(total=len(conditions) * len(prompts), desc="prompts", dynamic_ncols=True, leave=False) as bar:
        for condition in conditions:
            finished = finished_path(prompts, condition, args)
            kept = read_finished(finished) if args.resume else None
            if kept is not None:
                rows, answers = rows + kept["rows"], answers + kept["answers"]
                bar.update(len(prompts))
                continue
            scores, started, first_row, first_answer = {}, time.perf_counter(), len(rows), len(answers)
            bar.set_postfix(mitigation=condition.label)
            for first in range(0, len(prompts), args.batch_size):
                batch = prompts[first : first + args.batch_size]
                outputs = generate(model, tokenizer, batch, condition, args.max_new_tokens)
                for prompt, output in zip(batch, outputs, strict=True):
                    hit = correct(output, prompt.example.answers)
                    scores.setdefault(prompt.example.slot, []).append(hit)
                    answers.append(
                        dict(
                            mitigation=condition.mitigation,
                            choice=condition.choice,
                            slot=prompt.example.slot + 1,
                            answer=" | ".join(prompt.example.answers),
                            output=output,
                            correct=int(hit),
                        )
                    )
                bar.update(len(batch))
            seconds = (time.perf_counter() - started) / len(prompts)
            rows += [
                dict(
                    model=args.model,
                    keys=args.keys if args.qa_records is None else "qa",
                    prompt=args.prompt_read,
                    num_documents=args.num_documents,
                    seed=args.seed,
                    mitigation=condition.mitigation,
                    choice=condition.choice,
                    settings=describe(condition.settings),
                    slot=slot + 1,
                    accuracy=statistics.fmean(hits),
                    n=len(hits),
                    seconds_per_prompt=seconds,
                )
                for slot, hits in sorted(scores.items())
            ]
            finished.parent.mkdir(parents=True, exist_ok=True)
            kept = {"rows": rows[first_row:], "answers": answers[first_answer:]}
            partial = finished.with_suffix(".partial")  # then renamed: a run stopped while writing leaves no file
            partial.write_text(json.dumps(kept))
            partial.replace(finished)
    return rows, answers


def summary(rows: list[dict]) -> tuple[float, float]:
    """The mean accuracy over slots and the worst slot's."""
    accuracies = [row["accuracy"] for row in rows]
    return statistics.fmean(accuracies), min(accuracies)


def tune(model, tokenizer, encoder: Encoder, correct, paper: dict, args) -> tuple[dict, list[dict]]:
    """Each mitigation's settings with the best `worst slot + mean accuracy` on validation prompts (`--tune-examples`
    objects of another seed than the test's, never the test prompts), its grid and its paper settings tried (the
    paper's win ties), or where the model refuses the paper's settings, the grid that replaces them. Returns the choice
    per mitigation and a row per tried setting (and one of no mitigation)."""
    rng = random.Random(f"{args.seed}:tuning")
    examples = kv_examples(rng, args.tune_examples, args.num_documents, args.keys, args.prompt)
    prompts = [encoder(example) for example in examples]
    chosen, tried = {}, []

    def scored(condition: Condition) -> float:
        rows, _ = evaluate(model, tokenizer, prompts, correct, [condition], args)
        mean, worst = summary(rows)
        tried.append({**rows[0], "settings": describe(condition.settings), "mean": mean, "worst": worst})
        tried[-1]["n"] = len(prompts)
        return worst + mean

    scored(Condition(NONE))  # the model without mitigation on the same prompts, for reference
    for mitigation in [name for name in args.mitigations if name != NONE]:
        grid = args.grids[mitigation]
        candidates = [paper[mitigation], *(settings for settings in grid if settings != PAPER[mitigation])]
        if mitigation == SCALING:  # the searched channels, at each factor and layers of the grid
            candidates = [paper[mitigation], *({**paper[mitigation], **settings} for settings in grid)]
        if mitigation in args.paper_refused:  # the grid of IN_PLACE_OF_PAPER
            candidates = grid
        scores = [scored(Condition(mitigation, settings)) for settings in candidates]
        chosen[mitigation] = candidates[scores.index(max(scores))]  # the first of equal scores: the paper's
        print(f"tuned {mitigation}: {describe(chosen[mitigation])}")
    return chosen, tried


# ----------------------------------------------------------------------------------------------- table and plot


def by_condition(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """The rows of each (mitigation, choice, settings), in their order."""
    grouped = {}
    for row in rows:
        grouped.setdefault((row["mitigation"], row["choice"], row["settings"]), []).append(row)
    return grouped


def markdown_table(rows: list[dict], args) -> str:
    slots = range(1, args.num_documents + 1)
    header = ["mitigation", "settings", *(f"slot {slot}" for slot in slots), "mean", "worst", "s/prompt"]
    lines = []
    for (mitigation, choice, settings), mine in by_condition(rows).items():
        accuracy = {row["slot"]: row["accuracy"] for row in mine}
        mean, worst = summary(mine)
        label = Condition(mitigation, choice=choice).label
        cells = [f"{accuracy[slot]:.2f}" for slot in slots]
        lines.append([label, settings, *cells, f"{mean:.3f}", f"{worst:.2f}", f"{mine[0]['seconds_per_prompt']:.2f}"])
    task = "multi-document QA" if args.qa_file else f"key-value retrieval ({args.keys} keys, {args.prompt_read} prompt)"
    title = (
        f"{task}, {args.model}, seed {args.seed}: accuracy by the gold document's slot ({args.num_documents} "
        f"documents, {args.examples_per_slot} examples per slot)"
    )
    left_out = [f"left out: {mitigation} ({why})" for mitigation, why in args.left_out.items()]
    left_out += [
        f"left out: {mitigation} at its paper settings ({why})" for mitigation, why in args.paper_refused.items()
    ]
    return "\n".join([title, "", *table_lines(header, lines, left=2), *([""] if left_out else []), *left_out])


def plot(rows: list[dict], args, path: Path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for (mitigation, choice, _), mine in by_condition(rows).items():
        label = Condition(mitigation, choice=choice).label
        axes.plot([row["slot"] for row in mine], [row["accuracy"] for row in mine], marker="o", label=label)
    axes.set(
        xlabel="slot of the gold document",
        ylabel="accuracy",
        ylim=(-0.02, 1.02),
        title=f"Lost in the middle: {Path(args.model).name}",
    )
    axes.legend(fontsize="small")
    save_figure(figure, path, dpi=120, bbox_inches="tight")


# ------------------------------------------------------------------------------------------------- command line


def add_task_arguments(parser) -> None:
    """The flags that say what is asked: the model, the task, its prompts and the mitigations."""
    parser.add_argument(
        "--model", required=True, help="a checkpoint folder, a Hub name in the local cache, or a .gguf file"
    )
    parser.add_argument(
        "--qa-file",
        type=existing_file,
        help="multi-document QA from this JSON-lines file (the paper's format) instead of key-value retrieval",
    )
    parser.add_argument("--mitigations", nargs="+", choices=MITIGATIONS, action=Distinct, help="default: all of them")
    parser.add_argument(
        "--keys",
        choices=KEYS,
        default="uuid",
        help="key-value pairs: two UUIDs (the paper's, default) or 6 lowercase letters to a 4-digit number (short)",
    )
    parser.add_argument(
        "--prompt",
        choices=PROMPTS,
        default="chat",
        help="chat: the paper's prompt, through the chat template where the tokenizer has one (default); "
        "completion: the text alone, ending in the answer's opening quote",
    )
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(parser)
    parser.add_argument(
        "--seed",
        type=nonnegative_int,
        default=0,
        help="the keys' random stream (with --qa-file the questions are the file's: it draws only the key-value "
        "prompts of positional scaling's channel search on a model other than SepFormer)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help="greedy tokens per answer (default 100; a completion prompt: the longest value's tokens + 2)",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="also pick each mitigation's settings from its grid on validation prompts of another seed, then "
        "evaluate the choice beside the paper's settings (alone where the model refuses those) (key-value only)",
    )
    parser.add_argument(
        "--tune-examples", type=positive_int, help="objects per slot of the validation prompts of --tune (default 2)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="read back each condition (and each setting --tune tried) that a run stopped part-way finished under "
        "--output-dir with the same model, task, seed and settings, rather than run it again",
    )
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
    return checked(parser, parser.parse_args(argv))


def checked(parser, args):
    """The preset's values for the flags not given, and what the model or this copy of sepformer refuses."""
    if args.qa_file and (args.keys != "uuid" or args.tune or args.prompt != "chat"):
        parser.error("--keys, --prompt completion and --tune are for key-value retrieval, not --qa-file")
    if args.tune_examples is not None and not args.tune:
        parser.error("--tune-examples is read only with --tune")
    preset = {"tune_examples": 2, **(TINY if args.tiny else DEFAULTS["qa" if args.qa_file else "key-value"])}
    if args.prompt == "completion" and not args.tiny:
        preset["max_new_tokens"] = None  # from the answers, once they are tokenised
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.named_mitigations, args.left_out = args.mitigations is not None, {}
    args.mitigations = tuple(args.mitigations or MITIGATIONS)
    if model_config(args.model).model_type != "sepformer" and getattr(sepformer, "add_mitigations", None) is None:
        why = "this copy of sepformer has no add_mitigations, which gives a model other than SepFormer the options"
        for mitigation in [name for name in args.mitigations if name != NONE]:
            refuse(mitigation, why, args)
    args.qa_records = read_qa_file(args.qa_file, args.examples_per_slot, args.num_documents) if args.qa_file else None
    return args


def model_config(name: str):
    """The checkpoint's config: read before the weights, so that a bad name, a bad GGUF file or a refused option costs
    no loading."""
    try:
        where = real_checkpoints.gguf_location(name)
        return AutoConfig.from_pretrained(name) if where is None else AutoConfig.from_pretrained(**where)
    except (OSError, ValueError) as error:
        prefix = "" if isinstance(error, real_checkpoints.CheckpointError) else "no config to load: "
        raise SystemExit(f"--model {name}: {prefix}{error}") from None


def prompts_and_metric(encoder: Encoder, args) -> tuple[list[Prompt], Callable]:
    """The task's prompts, tokenised with their documents' spans, and the paper's metric for it."""
    if args.qa_records is None:
        rng = random.Random(args.seed)
        examples = kv_examples(rng, args.examples_per_slot, args.num_documents, args.keys, args.prompt)
    else:
        examples = qa_examples(args.qa_records, args.num_documents)
    try:
        prompts = [encoder(example) for example in examples]
    except ValueError as error:  # the documents cannot be found in the prompt's tokens
        raise SystemExit(f"--model {args.model}: {error}") from None
    if args.max_new_tokens is None:
        tokenizer = encoder.tokenizer
        answers = {answer for example in examples for answer in example.answers}
        args.max_new_tokens = (
            max(len(tokenizer(answer, add_special_tokens=False)["input_ids"]) for answer in answers) + 2
        )
    return prompts, kv_correct if args.qa_records is None else qa_correct


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_plotting()
    transformers.logging.set_verbosity_error()
    started = time.time()
    tokenizer = load_tokenizer(args)
    encoder = Encoder(tokenizer, chat=args.prompt == "chat")
    args.prompt_read = "plain (no chat template)" if args.prompt == "chat" and not encoder.chat else args.prompt
    prompts, correct = prompts_and_metric(encoder, args)
    model = load_model(args)
    args.model_digest = model_digest(model)
    check_vocabulary(model, tokenizer, prompts, args)
    check_mitigations(model, tokenizer, prompts, args)
    paper = {**PAPER, SCALING: scaling_channels(model, encoder, args)}
    conditions = [
        Condition(mitigation, paper[mitigation] if mitigation != NONE else {})
        for mitigation in args.mitigations
        if mitigation not in args.paper_refused
    ]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    chosen = {}
    if args.tune:
        chosen, tried = tune(model, tokenizer, encoder, correct, paper, args)
        write_csv(tried, output_dir / "tuning.csv", TUNING_FIELDS, float_fields=("mean", "worst"))
    as_paper = [name for name, settings in chosen.items() if settings == paper[name]]
    conditions += [Condition(name, settings, "tuned") for name, settings in chosen.items() if name not in as_paper]
    rows, answers = evaluate(model, tokenizer, prompts, correct, conditions, args)
    # a tuned choice equal to the paper's settings has the paper's rows, not a second run
    rows += [{**row, "choice": "tuned"} for row in rows if row["choice"] == "paper" and row["mitigation"] in as_paper]

    float_fields = ("accuracy", "seconds_per_prompt")
    write_csv(rows, output_dir / "results.csv", RESULT_FIELDS, float_fields=float_fields)
    write_csv(answers, output_dir / "outputs.csv", OUTPUT_FIELDS)
    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    (output_dir / "results.md").write_text(table + "\n")
    plot(rows, args, output_dir / "lost_in_the_middle.png")
    written = "results.csv, outputs.csv, results.md, lost_in_the_middle.png" + (", tuning.csv" if args.tune else "")
    print(f"wrote {written} under {output_dir} in {(time.time() - started) / 60:.1f} min")
    return rows


if __name__ == "__main__":
    main()
