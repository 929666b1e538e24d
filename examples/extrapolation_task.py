"""The extrapolation experiment's task: the text (files, a Hub data set, the standard library's source or the Python
documentation), its training blocks of L + 1 tokens, the validation tokens scored at every length, the batches."""

import math
import zlib
from pathlib import Path

import datasets  # before the demo: its offline defaults must not stop `--dataset-name` from reaching the Hub
import torch
from cli_arguments import existing_file, positive_int, refuse_beside
from demo import byte_blocks, stdlib_sources

MULTIPLIERS = (1, 2, 4, 8)  # the evaluation lengths, in multiples of the training length L


def add_text_arguments(parser) -> None:
    """The flags that choose the text: one source of the files, a Hub data set or `--text` (`check_text_flags`)."""
    parser.add_argument("--max-bytes", type=positive_int, help="how much text to read (train and validation)")
    parser.add_argument(
        "--text",
        choices=("source", "docs"),
        default="source",
        help="the text to train and evaluate on: the standard library's source (split by file) or "
        "the Python documentation's topics (pydoc_data, split by topic)",
    )
    parser.add_argument("--train-file", type=existing_file, nargs="+", help="text files, one document each")
    parser.add_argument("--validation-file", type=existing_file, nargs="+")
    parser.add_argument("--dataset-name", help="a Hub data set with train and validation (or test) splits")
    parser.add_argument("--dataset-config")
    parser.add_argument("--text-column", default="text")


def check_text_flags(parser, given: set[str]) -> None:
    """Refuse the flags of a second source of text, and a flag given without the one it goes with."""
    others = ["--dataset-name", "--dataset-config", "--text-column", "--text"]
    refuse_beside(parser, given, "--train-file", others, "the text is the files'")
    refuse_beside(parser, given, "--dataset-name", ["--text"], "the text is the data set's")
    for flag, needed in (
        ("--train-file", "--validation-file"),
        ("--validation-file", "--train-file"),
        ("--dataset-config", "--dataset-name"),
        ("--text-column", "--dataset-name"),
    ):
        if flag in given and needed not in given:
            parser.error(f"argument {flag}: read only with {needed}: give both or neither")


def load_texts(args) -> tuple[list[str], list[str]]:
    """Train and validation documents: files, a Hub data set, or (default) the standard library's source."""
    if args.train_file:

        def read(paths):
            return [Path(path).read_text(encoding="utf-8", errors="replace") for path in paths]

        return read(args.train_file), read(args.validation_file)
    if args.dataset_name:
        dataset = datasets.load_dataset(args.dataset_name, args.dataset_config)
        validation_split = next((s for s in ("validation", "test") if s in dataset), None)
        if "train" not in dataset or validation_split is None:
            raise SystemExit(
                f"{args.dataset_name} needs a 'train' and a 'validation' (or 'test') split; it has {list(dataset)}"
            )
        return tuple(
            first_bytes(dataset[split][args.text_column], args.max_bytes) for split in ("train", validation_split)
        )
    if args.text == "docs":
        return documentation_topics(args.max_bytes, validation_fraction=0.1)
    return stdlib_sources(args.max_bytes, validation_fraction=0.05)


def documentation_topics(max_bytes: int, validation_fraction: float) -> tuple[list[str], list[str]]:
    """The Python documentation's topics (`pydoc_data.topics`: the language reference's prose, about 0.5 MB, shipped
    with every Python for `help()`), assigned to train or validation by a hash of the topic's name; validation without
    the paragraphs that a training topic also has."""
    from pydoc_data.topics import topics

    train, validation, total = [], [], 0
    for name in sorted(topics):
        bucket = zlib.crc32(name.encode()) % 1000
        (validation if bucket < validation_fraction * 1000 else train).append(topics[name])
        total += len(topics[name])
        if total >= max_bytes:
            break
    # topics repeat one another (`augassign` is inside `assignment`): validation keeps the paragraphs training lacks
    seen = {paragraph for text in train for paragraph in text.split("\n\n")}
    validation = ["\n\n".join(p for p in text.split("\n\n") if p not in seen) for text in validation]
    return train, [text for text in validation if text.strip()]


def first_bytes(texts, max_bytes: int) -> list[str]:
    """The first documents, up to about `max_bytes` characters (a Hub split may be far larger than we need)."""
    kept, total = [], 0
    for text in texts:
        if total >= max_bytes:
            break
        kept.append(text)
        total += len(text)
    return kept


def token_data(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Training blocks (n, L + 1): the model reads the first L tokens and predicts the last L, so that position L-1
    has a target too (blocks of L tokens would leave its output, and its row of a learned table, untrained). And the
    validation tokens: windows of the longest length, evenly spread over the validation text, concatenated (so that
    every shorter length cuts the very same tokens into shorter windows)."""
    train_texts, validation_texts = load_texts(args)
    train = torch.tensor(byte_blocks(train_texts, tokenizer, args.block_size + 1)["input_ids"])
    longest = args.block_size * max(MULTIPLIERS)
    windows = torch.tensor(byte_blocks(validation_texts, tokenizer, longest)["input_ids"])  # (n, longest)
    count = min(args.eval_tokens // longest, len(windows))
    if count == 0:
        raise SystemExit(
            f"--eval-tokens {args.eval_tokens} and the validation text ({windows.numel()} tokens) must "
            f"hold at least one window of 8L = {longest} tokens"
        )
    if len(train) < args.batch_size:
        raise SystemExit(f"training text makes {len(train)} blocks of {args.block_size}: fewer than one batch")
    stream = windows[torch.linspace(0, len(windows) - 1, count).long()].flatten()
    print(
        f"data: {len(train_texts)} train documents -> {len(train)} blocks of {args.block_size + 1} tokens; "
        f"{len(validation_texts)} validation documents -> {len(stream)} tokens scored at each length"
    )
    return train, stream


def batch_order(num_blocks: int, args, seed: int) -> torch.Tensor:
    """Block indices of every step, shared by all models of a seed: (max_steps, batch_size)."""
    generator = torch.Generator().manual_seed(seed)
    needed = args.max_steps * args.batch_size
    epochs = [torch.randperm(num_blocks, generator=generator) for _ in range(math.ceil(needed / num_blocks))]
    return torch.cat(epochs)[:needed].view(args.max_steps, args.batch_size)
