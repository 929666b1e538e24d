"""Lost in the middle on a saved causal LM: accuracy by the gold document's slot, with and without each mitigation.

The two tasks of "Lost in the Middle" (Liu et al. 2023) with the paper's prompts and metrics
(`lost_in_the_middle_task.py`), on any checkpoint that `from_pretrained` loads (a folder, or a Hub name in the local
cache) with its own tokenizer and chat template: key-value retrieval (default) or multi-document QA (`--qa-file`, the
paper's JSON lines). Each mitigation (`--mitigations`, default all) runs at its paper's defaults; one the model refuses
stops a run that names it and is left out of the default run. Greedy decoding, left-padded batches. Writes
`results.csv` (model, mitigation, slot, accuracy, n), `results.md` (the table, printed too) and
`lost_in_the_middle.png` under `--output-dir`. In full: docs/experiments/lost_in_the_middle.md.

    python examples/lost_in_the_middle.py --model path/to/checkpoint                      # 75 keys, every mitigation
    python examples/lost_in_the_middle.py --model path/to/checkpoint --mitigations none ms_poe --num-documents 20
    python examples/lost_in_the_middle.py --model path/to/checkpoint --qa-file nq-open-20_total_documents.jsonl
    python examples/lost_in_the_middle.py --model path/to/checkpoint --tiny               # a smoke run in seconds
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from cli_arguments import Distinct, existing_file, nonnegative_int, output_directory, positive_int, torch_device
from experiment_common import check_plotting, pyplot, save_figure, table_lines, write_csv
from lost_in_the_middle_task import (
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
    spans = [prompt.spans for prompt in prompts]
    options = {} if mitigation == NONE else {mitigation: OPTIONS[mitigation](spans, scaling)}
    greedy = dict(do_sample=False, num_beams=1, pad_token_id=tokenizer.pad_token_id)
    output = model.generate(**batch, max_new_tokens=max_new_tokens, **greedy, **options)
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
                dict(
                    model=args.model, mitigation=mitigation, slot=slot + 1, accuracy=statistics.fmean(hits), n=len(hits)
                )
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
    return checked(parser.parse_args(argv))


def checked(args):
    """The preset's values for the flags not given, and what the model or this copy of sepformer refuses."""
    preset = TINY if args.tiny else DEFAULTS["qa" if args.qa_file else "key-value"]
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
    """The checkpoint's config: read before the weights, so that a bad name or a refused option costs no loading."""
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--model {name}: no config to load ({error})") from None


def prompts_and_metric(encoder: Encoder, args) -> tuple[list[Prompt], Callable]:
    """The task's prompts, tokenised with their documents' spans, and the paper's metric for it."""
    if args.qa_records is None:
        examples = kv_examples(random.Random(args.seed), args.examples_per_slot, args.num_documents)
    else:
        examples = qa_examples(args.qa_records, args.num_documents)
    try:
        prompts = [encoder(example) for example in examples]
    except ValueError as error:  # the documents cannot be found in the prompt's tokens
        raise SystemExit(f"--model {args.model}: {error}") from None
    return prompts, kv_correct if args.qa_records is None else qa_correct


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_plotting()
    transformers.logging.set_verbosity_error()
    started = time.time()
    tokenizer = load_tokenizer(args)
    encoder = Encoder(tokenizer)
    prompts, correct = prompts_and_metric(encoder, args)
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
