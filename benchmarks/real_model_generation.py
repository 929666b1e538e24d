"""Generation speed of each position-bias option on a real pretrained model (SmolLM2-135M-Instruct by default),
given the options by `sepformer.add_mitigations`, against the same model without option and the plain model.

    make real-models                                       # once: the checkpoint folders
    python benchmarks/real_model_generation.py             # batch 1 and 8, 7 repetitions (about 10 min on 2 cores)
    python benchmarks/real_model_generation.py --reps 2 --new-tokens 4 --batches 1   # a smoke run
    python benchmarks/real_model_generation.py --device cuda --dtype bfloat16

The prompts are the lost-in-the-middle key-value prompts of `--num-documents` pairs (short keys, completion prompt),
left-padded in a batch (the key of one object at slots 1, 2, ...: lengths a few tokens apart); every option at the
paper's settings of `examples/lost_in_the_middle.py` (positional scaling on two channels: which ones does not change
its cost), reading the prompts' document spans where it takes them; an option the model refuses is named, not timed.
`generate` is greedy with `min_new_tokens = max_new_tokens`. Measured as `benchmark.py` measures the overheads: each
ratio's two variants timed back to back in each repetition (with / without the option on the mitigated model;
mitigated without option / plain), in turn first, the median and interquartile range of tokens per second and of the
per-repetition ratios. Prints a
markdown table and writes `real_model_generation.md` and `.csv` under `--output-dir`.
"""

import argparse
import random
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_measuring import Measurement, run_interleaved, summary_rows, timed  # noqa: E402
from benchmark_report import cell, write_outputs  # noqa: E402
from cli_arguments import output_directory, positive_int, torch_device  # noqa: E402
from lost_in_the_middle_options import PAPER, RAG_BASES, make_option  # noqa: E402
from lost_in_the_middle_task import Encoder, kv_examples  # noqa: E402
from real_checkpoints import CheckpointError, load_checkpoint  # noqa: E402

import sepformer  # noqa: E402

PLAIN, MITIGATED = "plain", "add_mitigations"
# Every option of lost_in_the_middle.py at its paper's settings; positional scaling on two channels of the attention
# input (which channels does not change its cost: it scales them and recomputes the prompt's last row).
OPTIONS = {name: settings for name, settings in PAPER.items() if name != "reorder_documents"}
OPTIONS["positional_scaling"] = {**OPTIONS["positional_scaling"], "channels": (0, 1)}
TARGETS = {
    "attention_calibration": "with / without >= 0.87 / (documents + 1): one dummy pass per document at prefill",
    "attention_buckets": f"with / without >= 0.87 / {len(RAG_BASES)} ({len(RAG_BASES)} buckets)",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompt_batch(tokenizer, batch: int, num_documents: int, device) -> tuple[dict, tuple]:
    """`batch` key-value prompts (the gold at slots 0, 1, ...), left-padded, and their document spans."""
    encoder = Encoder(tokenizer, chat=False)
    examples = kv_examples(random.Random(0), -(-batch // num_documents), num_documents, "short", "completion")
    prompts = [encoder(example) for example in examples[:batch]]
    padded = tokenizer.pad({"input_ids": [list(prompt.input_ids) for prompt in prompts]}, return_tensors="pt")
    return padded.to(device), tuple(prompt.spans for prompt in prompts)


def measurements(plain, mitigated, tokenizer, batch: int, args) -> list[Measurement]:
    inputs, spans = prompt_batch(tokenizer, batch, args.num_documents, plain.device)
    greedy = dict(
        do_sample=False,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )

    def runner(model, **options):
        return lambda: batch * args.new_tokens / timed(lambda: model.generate(**inputs, **greedy, **options))

    label = f"{args.model_name}, cached generation of {args.new_tokens} tokens, batch {batch}"

    def pair(key: str, runners: dict) -> Measurement:
        """A ratio's two variants, with first: a measurement of their own, so they run back to back."""
        return Measurement.overhead(key, label, runners, (tuple(runners),), "real model")

    measured = [pair(f"real_generate_b{batch}", {MITIGATED: runner(mitigated), PLAIN: runner(plain)})]
    for name, settings in OPTIONS.items():
        option = {name: make_option(name, settings, spans, mitigated.config)}
        try:  # one token first: an option the model refuses is reported, not timed
            mitigated.generate(**inputs, **{**greedy, "max_new_tokens": 1, "min_new_tokens": 1}, **option)
        except (ValueError, TypeError) as error:
            print(f"{name}: refused by {args.model_name} ({error})", file=sys.stderr)
            continue
        measured.append(
            pair(f"real_generate_b{batch}_{name}", {name: runner(mitigated, **option), MITIGATED: runner(mitigated)})
        )
    return measured


def target(variant: str) -> str:
    if variant == f"{MITIGATED} / {PLAIN}":
        return "mitigated / plain >= 0.95"
    name = variant.split(" / ")[0]
    return TARGETS.get(name, "with / without >= 0.87") if " / " in variant else ""


def markdown(rows: list[dict]) -> str:
    lines = ["| measurement | variant | median [q1, q3] | target |", "|---|---|---:|---|"]
    for index, row in enumerate(rows):
        label = row["label"] if index == 0 or rows[index - 1]["label"] != row["label"] else ""
        unit = "" if row["unit"] == "ratio" else " " + row["unit"]
        lines.append(f"| {label} | {row['variant']} | {cell(row)}{unit} | {target(row['variant'])} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/real_models/smollm2-135m-instruct", help="a folder or .gguf file")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=positive_int, default=7)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument("--num-documents", type=positive_int, default=10, help="key-value pairs per prompt")
    parser.add_argument("--device", type=torch_device, default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--output-dir", type=output_directory, default="outputs/benchmark")
    args = parser.parse_args(argv)
    args.model_name = Path(args.model).name
    transformers.logging.set_verbosity_error()
    try:
        plain, tokenizer = load_checkpoint(args.model, DTYPES[args.dtype])
        mitigated, _ = load_checkpoint(args.model, DTYPES[args.dtype])
    except (OSError, CheckpointError) as error:
        raise SystemExit(f"--model {args.model}: {error} (make real-models writes the default folder)") from None
    plain, mitigated = plain.to(args.device), sepformer.add_mitigations(mitigated.to(args.device))
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    measured = [m for batch in args.batches for m in measurements(plain, mitigated, tokenizer, batch, args)]
    run_interleaved(measured, args.reps, log=lambda line: print(line, file=sys.stderr, flush=True))
    rows = [row for m in measured for row in summary_rows(m)]
    table = markdown(rows)
    print(table)
    write_outputs(table, rows, Path(args.output_dir), "real_model_generation")
    return rows


if __name__ == "__main__":
    main()
