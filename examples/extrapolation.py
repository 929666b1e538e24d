"""Length extrapolation, one command: train every position scheme at length L, score bits per byte at L, 2L, 4L, 8L.

The contenders (`extrapolation_conditions.py`: SepFormer's positional maps and extrapolation methods, GPT-2, Llama,
Bloom) share the data, byte-level tokenizer, shape, steps, batches and seed. The text (`extrapolation_task.py`) is the
standard library's source by default, split by file; the models read blocks of L tokens and predict the next L. Prints
the table (mean ± std over seeds) and writes `results.csv`, `results.md` and `extrapolation.png` under `--output-dir`
(`extrapolation_report.py`). The method and the full results: docs/experiments/extrapolation.md.

    python examples/extrapolation.py                      # default preset, seeds 0, 1, 2
    python examples/extrapolation.py --text docs          # the same on documentation prose
    python examples/extrapolation.py --quick              # one seed of smaller models (a few minutes)
    python examples/extrapolation.py --tiny               # a smoke run in seconds (what the test runs)
    python examples/extrapolation.py --train-file a.txt --validation-file b.txt --seeds 0 1 2
    python examples/extrapolation.py --dataset-name Salesforce/wikitext --dataset-config wikitext-2-raw-v1  # Hub
    torchrun --nproc_per_node 2 examples/extrapolation.py --tiny    # data parallel: the same table, within noise
"""

import math
import time
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
import transformers
from cli_arguments import (
    Distinct,
    existing_file,
    given_flags,
    int_at_least,
    output_directory,
    positive_int,
    refuse_beside,
)
from experiment_common import (
    apply_preset,
    check_plotting,
    check_resumable,
    checkpoint_dir,
    every_seed,
    experiment_parser,
    first_line,
    is_main_process,
    main_process_prints,
    tail_mean,
    training_options,
    world_size,
)
from experiment_common import train as train_with_trainer
from extrapolation_conditions import Contender, add_model_arguments, check_models, contenders
from extrapolation_report import markdown_table, read_csv, write_report
from extrapolation_task import MULTIPLIERS, add_text_arguments, batch_order, check_text_flags, token_data
from tqdm.auto import tqdm

import sepformer
from sepformer import SepFormerTokenizer

DEFAULT = dict(block_size=32, hidden_size=64, num_layers=2, num_heads=4, batch_size=16, max_steps=1000)
DEFAULT.update(learning_rate=3e-3, eval_tokens=8192, max_bytes=1_000_000, seeds=[0, 1, 2])
PRESETS = {
    "default": DEFAULT,  # three seeds of twenty models: about 25 minutes on 2 CPU cores (three one-thread processes)
    "quick": DEFAULT | dict(max_steps=400, eval_tokens=4096, seeds=[0]),  # about 2 CPU-minutes
    # seconds: checks the plumbing, learns nothing (the test and CI run this)
    "tiny": DEFAULT
    | dict(block_size=16, hidden_size=32, num_layers=1, num_heads=2, batch_size=4, max_steps=3, eval_tokens=1024)
    | dict(max_bytes=300_000, seeds=[0]),
}


def train(
    model,
    blocks: torch.Tensor,
    order: torch.Tensor,
    args,
    description: str,
    last_position_target: bool = True,
    seed: int = 0,
    checkpoints: Path | None = None,
) -> float:
    """`experiment_common.train` on the blocks of `order` (steps, batch); returns the mean loss of the last 10% of
    the steps in bits per byte. `seed` seeds what is random in training (e.g. randomized positions); `checkpoints`:
    where `--save-steps` saves and `--resume` continues.

    Each block of L + 1 tokens gives L inputs and their L next tokens; without `last_position_target` the target of
    position L-1 is dropped, which is exactly training on blocks of L tokens."""
    rows = blocks[order.flatten()]
    labels = rows.clone()
    labels[:, 0] = -100  # labels[:, j + 1] is the target of position j: the first token is none's
    if not last_position_target:
        labels[:, -1] = -100
    dataset = [{"input_ids": ids[:-1], "labels": targets} for ids, targets in zip(rows, labels, strict=True)]
    losses = train_with_trainer(
        model,
        dataset,
        steps=order.shape[0],
        batch_size=order.shape[1],
        seed=seed,
        output_dir=checkpoints,
        description=description,
        **training_options(args),
        postfix=lambda loss: {"bits_per_byte": f"{loss / math.log(2):.3f}"},
    )
    return tail_mean(losses) / math.log(2)


@torch.no_grad()
def bits_per_byte(model, stream: torch.Tensor, length: int, args, **forward_kwargs) -> tuple[float, float]:
    """Bits per byte over windows of `length` tokens: of every scored token, and of the tokens at positions >= L."""
    model.eval()
    windows = stream.view(-1, length)
    per_position = torch.zeros(length - 1, dtype=torch.float64)  # summed loss of the target at position j + 1
    for batch in windows.split(args.eval_batch_size):
        batch = batch.to(model.device)
        logits = model(input_ids=batch, **forward_kwargs).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (b, length - 1)
        per_position += nll.sum(0).double().cpu()
    nats = per_position.sum().item() / (len(windows) * (length - 1))
    beyond = per_position[args.block_size - 1 :]
    nats_beyond = beyond.sum().item() / (len(windows) * len(beyond)) if len(beyond) else float("nan")
    return nats / math.log(2), nats_beyond / math.log(2)


def evaluate(model, contender: Contender, stream: torch.Tensor, args) -> list[dict]:
    """One row per method and length; a length a model cannot run at is a row with the error, not a gap."""
    rows = []
    cells = [(method, args.block_size * m) for method in contender.methods for m in MULTIPLIERS]
    for method, length in tqdm(cells, desc=f"  evaluate {contender.name}", leave=False, dynamic_ncols=True):
        scored = len(stream) - len(stream) // length  # the first token of each window has no prediction
        row = dict(
            model=contender.name,
            method=method,
            length=length,
            tokens_scored=scored,
            bits_per_byte=float("nan"),
            bits_per_byte_beyond_L=float("nan"),
        )
        try:
            with contender.reading(model, method, length, args.block_size) as kwargs:
                total, beyond = bits_per_byte(model, stream, length, args, **kwargs)
            row.update(bits_per_byte=total, bits_per_byte_beyond_L=beyond, status="ok")
        except (ValueError, IndexError, RuntimeError) as error:  # e.g. a learned table asked for a row it lacks
            row["status"] = f"cannot run: {type(error).__name__}: {first_line(error)}"
        rows.append(row)
    return rows


def run_seed(seed: int, train_blocks: torch.Tensor, stream: torch.Tensor, vocab_size: int, args) -> list[dict]:
    order = batch_order(len(train_blocks), args, seed)
    rows = []
    for contender in contenders(args):
        torch.manual_seed(seed)
        model = contender.build(args, vocab_size)
        started = time.time()
        description, checkpoints = f"seed {seed} · train {contender.name}", checkpoint_dir(args, contender.name, seed)
        train_bpb = train(
            model, train_blocks, order, args, description, contender.last_position_target, seed, checkpoints
        )
        train_seconds = time.time() - started
        new_rows = evaluate(model, contender, stream, args)
        for row in new_rows:
            row.update(
                seed=seed,
                train_length=args.block_size,
                parameters=model.num_parameters(),
                train_steps=args.max_steps,
                train_bits_per_byte=round(train_bpb, 4),
                train_seconds=round(train_seconds, 1),
            )
        at_l = min((r["bits_per_byte"] for r in new_rows if r["length"] == args.block_size), default=float("nan"))
        tqdm.write(
            f"seed {seed} · {contender.name:26s} {model.num_parameters() / 1e6:.3f}M params, trained in "
            f"{train_seconds:5.1f} s, train {train_bpb:.3f} / validation {at_l:.3f} bits per byte at L"
        )
        rows += new_rows
    return rows


# What a table made --from-csv reads: the rest (seeds, models, data, training) is the runs' that wrote the CSV.
FROM_CSV_READS = {"--from-csv", "--output-dir", "--quick", "--tiny", "--block-size", "--max-steps", "--batch-size"}


def parse_args(argv=None):
    parser = experiment_parser(__doc__, quick="a few minutes")
    add_model_arguments(parser)
    parser.add_argument("--block-size", type=int_at_least(2), help="training length L")  # a window of L scores L - 1
    parser.add_argument("--max-steps", type=positive_int)
    parser.add_argument("--eval-tokens", type=positive_int, help="validation tokens scored at each length")
    parser.add_argument("--eval-batch-size", type=positive_int, default=8)
    add_text_arguments(parser)
    parser.add_argument(
        "--from-csv",
        type=existing_file,
        nargs="+",
        action=Distinct,
        metavar="RESULTS_CSV",
        help="train nothing: make the table and plot from earlier runs' results.csv (e.g. one run per "
        "seed, side by side), with the preset flags those runs had",
    )
    parser.add_argument("--output-dir", type=output_directory, default="outputs/extrapolation")
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    why = "the table is made from the CSV's rows, their seeds, models and methods; give only the preset flags of the "
    refuse_beside(parser, given, "--from-csv", given - FROM_CSV_READS, why + "runs that wrote them")
    check_text_flags(parser, given)
    apply_preset(parser, args, PRESETS)
    args.methods = tuple(args.methods or sepformer.EXTRAPOLATION_METHODS)
    return args


def main(argv=None):
    args = parse_args(argv)
    with main_process_prints():
        return run(args)


def run(args) -> list[dict]:
    check_plotting()
    transformers.logging.set_verbosity_error()  # config chatter of the peers (e.g. GPT-2's default loss_type)
    datasets.disable_progress_bars()  # the bars that matter are training's and evaluation's
    started = time.time()
    if args.from_csv:
        rows = read_csv(args.from_csv, args)
    else:
        tokenizer = SepFormerTokenizer()
        check_models(args, len(tokenizer))
        check_resumable(args, [(contender.name, seed) for seed in args.seeds for contender in contenders(args)])
        train_blocks, stream = token_data(args, tokenizer)
        args.eval_tokens_used = len(stream)
        print(
            f"models: d_model={args.hidden_size}, {args.num_layers} layers, {args.num_heads} heads, "
            f"L={args.block_size}; {args.max_steps} steps of {args.batch_size}; seeds {args.seeds}; "
            f"SepFormer methods {list(args.methods)}"
            + (f"; data parallel over {world_size()} processes" if world_size() > 1 else "")
        )
        (rows,) = every_seed(args.seeds, lambda seed: (run_seed(seed, train_blocks, stream, len(tokenizer), args),))
    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    if is_main_process():
        paths = write_report(rows, table, args)
        print(f"wrote {', '.join(map(str, paths))} in {(time.time() - started) / 60:.1f} min")
    return rows


if __name__ == "__main__":
    main()
