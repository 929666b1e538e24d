"""Length extrapolation, one command: train every position scheme at length L, evaluate at L, 2L, 4L, 8L.

Every model gets the same data, byte-level tokenizer, width, depth, heads, steps, batches, learning-rate schedule
and seed:

- SepFormer with a learned positional table, evaluated with every method of `sepformer.EXTRAPOLATION_METHODS`
  (`none` cannot run past L: it is reported as such), and the same trained without a target for position L-1
  (whose table row then never trains), evaluated with `clamp`;
- SepFormer with a learned table of 8L rows trained by random offsets or by randomized positions;
- SepFormer with a sinusoidal map and with a B-spline map, each also trained with randomized positions from [0, 8L),
  with one range for every sequence and with a range drawn per sequence;
- SepFormer with `d_pos = 0` (no positions at all);
- Hugging Face's own `GPT2LMHeadModel` (learned additive positions: cannot run past `n_positions = L`),
  `LlamaForCausalLM` (rotary) and `BloomForCausalLM` (ALiBi), built from configs.

Training blocks have L + 1 tokens: the model reads the first L and predicts the last L, so that every position,
L-1 included, has a target.

The score is bits per byte (the tokenizer is byte-level) on held-out text, cut into windows of n tokens for each
evaluation length n: the same validation tokens at every length, every token after the first of each window scored.
Prints a markdown table (mean ± std over seeds) and writes `results.csv`, `results.md` and `extrapolation.png`
under `--output-dir`. No downloads: the default text is the Python standard library's own source, split by file
into train and validation; `--text docs` takes the Python documentation's topics instead (English prose from
`pydoc_data.topics`, shipped with every Python), split by topic.

    python examples/extrapolation.py                      # default preset, seeds 0, 1, 2
    python examples/extrapolation.py --text docs          # the same on documentation prose
    python examples/extrapolation.py --quick              # one seed of smaller models (a few minutes)
    python examples/extrapolation.py --tiny               # a smoke run in seconds (what the test runs)
    python examples/extrapolation.py --quick --max-steps 3 --models sepformer llama --methods clamp fourier
    python examples/extrapolation.py --train-file a.txt --validation-file b.txt --seeds 0 1 2
    python examples/extrapolation.py --dataset-name Salesforce/wikitext --dataset-config wikitext-2-raw-v1  # Hub
    torchrun --nproc_per_node 2 examples/extrapolation.py --tiny    # data parallel: the same table, within noise

Training runs through transformers' `Trainer` (see `experiment_common.py`): `torchrun` and `accelerate launch` run
it data-parallel unchanged, `--bf16`/`--fp16` train in mixed precision, `--save-steps` and `--resume` save and
continue checkpoints under `OUTPUT_DIR/checkpoints`.
"""

import csv
import math
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm

import sepformer
from sepformer import SepFormerConfig, SepFormerTokenizer

# The demo's data helpers. Imported after transformers and datasets, so that the demo's offline defaults do not stop
# `--dataset-name` from reaching the Hub.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_arguments import (  # noqa: E402
    Distinct,
    existing_file,
    given_flags,
    int_at_least,
    output_directory,
    positive_int,
    refuse_beside,
)
from demo import byte_blocks, stdlib_sources  # noqa: E402
from experiment_common import (  # noqa: E402
    apply_preset,
    build_model,
    check_plotting,
    check_resumable,
    checkpoint_dir,
    chosen,
    every_seed,
    experiment_parser,
    is_main_process,
    main_process_prints,
    mean_and_std,
    model_config,
    pyplot,
    save_figure,
    table_lines,
    tail_mean,
    world_size,
    write_csv,
)
from experiment_common import train as train_with_trainer  # noqa: E402

PRESETS = {
    # three seeds of fourteen models: about 10 minutes on 2 idle CPU cores (18 CPU-minutes)
    "default": dict(
        block_size=32,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        batch_size=16,
        max_steps=1000,
        learning_rate=3e-3,
        eval_tokens=8192,
        max_bytes=1_000_000,
        seeds=[0, 1, 2],
    ),
    # one seed, 400 steps, half the validation tokens: about 2 CPU-minutes
    "quick": dict(
        block_size=32,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        batch_size=16,
        max_steps=400,
        learning_rate=3e-3,
        eval_tokens=4096,
        max_bytes=1_000_000,
        seeds=[0],
    ),
    # seconds: checks the plumbing, learns nothing (the test and CI run this)
    "tiny": dict(
        block_size=16,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        batch_size=4,
        max_steps=3,
        learning_rate=3e-3,
        eval_tokens=1024,
        max_bytes=300_000,
        seeds=[0],
    ),
}
MULTIPLIERS = (1, 2, 4, 8)
NATIVE = "-"  # the method column of models that have no extrapolation method to choose


@dataclass
class Contender:
    """One model to train: `build(vocab_size)` makes it, `methods` are the ways it is evaluated."""

    name: str
    build: Callable
    methods: tuple[str, ...] = (NATIVE,)
    max_length: int | None = None  # longer inputs are not even tried (GPT-2: an index error, a device assert on GPU)
    last_position_target: bool = True  # False: position L-1 has no target, as when training on blocks of L tokens


def shape(args, vocab_size: int) -> tuple[int, ...]:
    return vocab_size, args.hidden_size, args.num_layers, args.num_heads, args.block_size


def sepformer_config(args, vocab_size: int, **overrides) -> SepFormerConfig:
    return model_config("sepformer", *shape(args, vocab_size), **overrides)


SPECIAL_TOKENS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258, tie_word_embeddings=False)


def contenders(args) -> list[Contender]:
    """The models, all of one shape (`experiment_common.model_config`)."""
    longest = MULTIPLIERS[-1] * args.block_size  # 8L: every position evaluated is trained by the 8L rows

    def sepformer_model(**overrides):
        return lambda v: build_model("sepformer", *shape(args, v), **overrides)

    def peer(name, **config):
        return lambda v: build_model(name, *shape(args, v), **SPECIAL_TOKENS, **config)

    randomized = dict(position_table_size=longest, randomized_positions=True)
    spline = dict(positional_map="bspline", spline_control_points=args.spline_control_points)
    randomized_spline = dict(spline, spline_control_points=args.spline_randomized_control_points, **randomized)
    every = [
        Contender("SepFormer learned", sepformer_model(), args.methods),
        Contender("SepFormer learned, last row untrained", sepformer_model(), ("clamp",), last_position_target=False),
        # Half the training sequences shifted by a random offset: all 8L rows trained, no extrapolation up to 8L.
        Contender(
            "SepFormer learned, random offsets (8L table)",
            sepformer_model(position_table_size=longest, random_position_offsets=True),
        ),
        Contender("SepFormer learned, randomized positions (8L table)", sepformer_model(**randomized)),
        Contender("SepFormer sinusoidal", sepformer_model(positional_map="sinusoidal")),
        Contender(
            "SepFormer sinusoidal, randomized positions (8L)",
            sepformer_model(positional_map="sinusoidal", **randomized),
        ),
        Contender(f"SepFormer B-spline (n={args.spline_control_points})", sepformer_model(**spline)),
        Contender(
            f"SepFormer B-spline (n={args.spline_randomized_control_points}), randomized positions (8L)",
            sepformer_model(**randomized_spline),
        ),
        # Each sequence draws its own range first: gaps from none (as at inference) to 8L / L.
        Contender(
            "SepFormer sinusoidal, randomized positions, range per sequence (8L)",
            sepformer_model(positional_map="sinusoidal", randomized_range="per_sequence", **randomized),
        ),
        Contender(
            f"SepFormer B-spline (n={args.spline_randomized_control_points}), randomized positions, range per "
            "sequence (8L)",
            sepformer_model(randomized_range="per_sequence", **randomized_spline),
        ),
        Contender("SepFormer d_pos=0", sepformer_model(position_size=0)),
        Contender(
            "GPT-2 (learned, additive)",
            peer("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            max_length=args.block_size,
        ),
        Contender("Llama (rotary)", peer("llama")),
        Contender("Bloom (ALiBi)", peer("bloom")),
    ]
    return chosen(every, args.models, lambda word, c: word.lower() in c.name.lower(), ", ".join(c.name for c in every))


def check_models(args, vocab_size: int) -> None:
    """Every contender built once before any data is read: sizes that a model refuses stop the run now, not after the
    models before it have trained."""
    for contender in contenders(args):
        try:
            contender.build(vocab_size)
        except ValueError as error:
            raise SystemExit(f"{contender.name} cannot be built with these flags: {error}") from None


# ----------------------------------------------------------------------------------------------------------- data


def load_texts(args) -> tuple[list[str], list[str]]:
    """Train and validation documents: files, a Hub data set, or (default) the standard library's source."""
    if args.train_file:

        def read(paths):
            return [Path(path).read_text(encoding="utf-8", errors="replace") for path in paths]

        return read(args.train_file), read(args.validation_file)
    if args.dataset_name:
        from datasets import load_dataset

        dataset = load_dataset(args.dataset_name, args.dataset_config)
        validation_split = next((s for s in ("validation", "test") if s in dataset), None)
        if "train" not in dataset or validation_split is None:
            raise SystemExit(
                f"{args.dataset_name} needs a 'train' and a 'validation' (or 'test') split; it has {list(dataset)}"
            )

        def take(split):
            return first_bytes(dataset[split][args.text_column], args.max_bytes)

        return take("train"), take(validation_split)
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


# ------------------------------------------------------------------------------------------------ train, evaluate


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
        learning_rate=args.learning_rate,
        batch_size=order.shape[1],
        seed=seed,
        output_dir=checkpoints,
        device=args.device,
        bf16=args.bf16,
        fp16=args.fp16,
        save_steps=args.save_steps,
        resume_from_checkpoint=args.resume,
        description=description,
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
        kwargs = {} if method == NATIVE else {"position_extrapolation": method}
        scored = len(stream) - len(stream) // length  # the first token of each window has no prediction
        row = dict(
            model=contender.name,
            method=method,
            length=length,
            tokens_scored=scored,
            bits_per_byte=float("nan"),
            bits_per_byte_beyond_L=float("nan"),
        )
        if contender.max_length is not None and length > contender.max_length:
            row["status"] = f"cannot run: its position table has {contender.max_length} rows (n_positions = L)"
        else:
            try:
                total, beyond = bits_per_byte(model, stream, length, args, **kwargs)
                row.update(bits_per_byte=total, bits_per_byte_beyond_L=beyond, status="ok")
            except (ValueError, IndexError, RuntimeError) as error:  # e.g. a learned table asked for a row it lacks
                message = str(error).splitlines()[0] if str(error) else ""
                row["status"] = f"cannot run: {type(error).__name__}: {message[:200]}"
        rows.append(row)
    return rows


def run_seed(seed: int, train_blocks: torch.Tensor, stream: torch.Tensor, vocab_size: int, args) -> list[dict]:
    order = batch_order(len(train_blocks), args, seed)
    rows = []
    for contender in contenders(args):
        torch.manual_seed(seed)
        model = contender.build(vocab_size)
        started = time.time()
        train_bpb = train(
            model,
            train_blocks,
            order,
            args,
            f"seed {seed} · train {contender.name}",
            contender.last_position_target,
            seed,
            checkpoint_dir(args, contender.name, seed),
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


# --------------------------------------------------------------------------------------------------------- report


def summarise(rows: list[dict], args) -> tuple[list[tuple[str, str]], dict]:
    """(model, method) in run order, and {(model, method, length): (mean, std, reason or None)}."""
    keys, cells = [], {}
    for row in rows:
        key = (row["model"], row["method"])
        if key not in keys:
            keys.append(key)
    for model, method in keys:
        for multiplier in MULTIPLIERS:
            length = args.block_size * multiplier
            same = [r for r in rows if (r["model"], r["method"], r["length"]) == (model, method, length)]
            values = [r["bits_per_byte"] for r in same if r["status"] == "ok"]
            failures = [r["status"] for r in same if r["status"] != "ok"]
            if failures:
                cells[model, method, length] = (float("nan"), float("nan"), failures[0])
            else:
                cells[model, method, length] = (*mean_and_std(values), None)
    return keys, cells


def markdown_table(rows: list[dict], args) -> str:
    keys, cells = summarise(rows, args)
    lengths = [args.block_size * m for m in MULTIPLIERS]
    seeds = sorted({r["seed"] for r in rows})
    parameters = {(r["model"], r["method"]): r["parameters"] for r in rows}
    header = ["model", "method", "params"] + [f"{args.block_size * m} ({m}L)" for m in MULTIPLIERS]
    table, reasons = [], []  # one footnote per row that cannot run somewhere: its first error
    for model, method in keys:
        out = [model, method, f"{parameters[model, method] / 1e6:.3f}M"]
        for length in lengths:
            mean, std, reason = cells[model, method, length]
            if reason is not None:
                if not reasons or reasons[-1][0] != (model, method):
                    reasons.append(((model, method), f"{model} / {method} at {length}: {reason}"))
                out.append(f"n/a [{len(reasons)}]")
            else:
                out.append(f"{mean:.3f}" + (f" ± {std:.3f}" if len(seeds) > 1 else ""))
        table.append(out)
    lines = table_lines(header, table, left=3)
    lines += [
        "",
        "Bits per byte on held-out text (lower is better): the same "
        f"{args.eval_tokens_used} validation tokens at every length n, cut into windows of n, every token but "
        "the first of each window scored. Trained at "
        f"L = {args.block_size} for {args.max_steps} steps of {args.batch_size} sequences; "
        + (f"mean ± std over seeds {seeds}." if len(seeds) > 1 else f"seed {seeds[0]}."),
    ]
    lines += [f"[{i}] {reason}" for i, (_, reason) in enumerate(reasons, 1)]
    return "\n".join(lines)


RESULT_FIELDS = [
    "model",
    "method",
    "seed",
    "train_length",
    "length",
    "bits_per_byte",
    "bits_per_byte_beyond_L",
    "tokens_scored",
    "status",
    "parameters",
    "train_steps",
    "train_bits_per_byte",
    "train_seconds",
]


def read_csv(paths: list[str], args) -> list[dict]:
    """The rows of earlier runs' `results.csv` (e.g. one run per seed, run side by side), typed as a run makes them.
    The preset's flags must be those of the runs: the table's caption and lengths come from them. A file that lacks a
    column or a value, or a cell (model, method, seed, length) that two files (or one) hold twice, is refused: the
    table would count it twice."""
    rows, origin = [], {}
    for path in paths:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            if missing := [name for name in RESULT_FIELDS if name not in (reader.fieldnames or ())]:
                raise SystemExit(
                    f"--from-csv {path} has no column {', '.join(missing)}: give the results.csv that "
                    "an extrapolation run wrote"
                )
            for row in reader:
                try:
                    typed(row, ("seed", "train_length", "length", "tokens_scored", "parameters", "train_steps"), int)
                    typed(row, ("bits_per_byte", "bits_per_byte_beyond_L"), float)
                except ValueError as error:
                    raise SystemExit(f"--from-csv {path}, line {reader.line_num}: {error}") from None
                cell = (row["model"], row["method"], row["seed"], row["length"])
                if cell in origin:
                    raise SystemExit(
                        f"--from-csv {origin[cell]} and {path} both hold {row['model']} / "
                        f"{row['method']}, seed {row['seed']}, length {row['length']}: give each run's "
                        "results once"
                    )
                origin[cell] = path
                rows.append(row)
    if not rows:
        raise SystemExit(f"--from-csv {' '.join(paths)}: no rows; give the results.csv that an extrapolation run wrote")
    if {row["train_length"] for row in rows} != {args.block_size} or {row["train_steps"] for row in rows} != {
        args.max_steps
    }:
        raise SystemExit(
            f"--from-csv rows were trained at L={sorted({r['train_length'] for r in rows})} for "
            f"{sorted({r['train_steps'] for r in rows})} steps; give the runs' preset flags "
            f"(now L={args.block_size}, {args.max_steps} steps)"
        )
    first = next(row for row in rows if row["length"] == args.block_size)
    args.eval_tokens_used = first["tokens_scored"] * args.block_size // (args.block_size - 1)
    return rows


def typed(row: dict, names, kind) -> None:
    """`row[name]` as `kind` (int or float) for each of `names`; a ValueError that names the column and value."""
    for name in names:
        try:
            row[name] = kind(row[name])
        except (TypeError, ValueError):  # TypeError: a row shorter than the header (None)
            raise ValueError(
                f"column {name} holds {row[name]!r}, not {'an integer' if kind is int else 'a number'}"
            ) from None


def plot(rows: list[dict], args, path: Path) -> None:
    plt = pyplot()
    keys, cells = summarise(rows, args)
    lengths = [args.block_size * m for m in MULTIPLIERS]
    figure, axes = plt.subplots(figsize=(11, 5.5))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours; markers tell apart rows that share one
    for index, (model, method) in enumerate(keys):
        points = [(n, *cells[model, method, n][:2]) for n in lengths if cells[model, method, n][2] is None]
        label = model if method == NATIVE else f"{model} / {method}"
        if len(points) < len(lengths):
            label += " (cannot run past " + str(points[-1][0] if points else 0) + ")"
        if not points:
            continue
        x, mean, std = zip(*points, strict=True)
        style = "-" if model.startswith("SepFormer") else "--"
        axes.errorbar(
            x,
            mean,
            yerr=[0 if math.isnan(s) else s for s in std],
            fmt=style + "osD^v"[index // 20 % 5],
            color=colors[index % 20],
            capsize=3,
            markersize=4,
            label=label,
        )
    axes.axvline(args.block_size, color="grey", linestyle=":", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [f"{args.block_size * m}\n({m}L)" for m in MULTIPLIERS])
    at_l = [cells[k][0] for k in cells if k[2] == args.block_size and cells[k][2] is None]
    if at_l:  # keep the interesting range readable; the table has every number
        axes.set_ylim(min(at_l) * 0.9, max(at_l) * 2.0)
    axes.set_xlabel("evaluation length (tokens)")
    axes.set_ylabel("bits per byte (validation)")
    axes.set_title(f"Length extrapolation, trained at L = {args.block_size}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    save_figure(figure, path, dpi=130)


# ----------------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = experiment_parser(__doc__, quick="a few minutes")
    parser.add_argument("--models", nargs="+", help="substrings of model names to keep, e.g. sepformer llama")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=sepformer.EXTRAPOLATION_METHODS,
        action=Distinct,
        help="extrapolation methods for the learned SepFormer (default: all)",
    )
    # L >= 2: a window of L tokens scores L - 1 of them
    parser.add_argument("--block-size", type=int_at_least(2), help="training length L")
    parser.add_argument("--max-steps", type=positive_int)
    parser.add_argument("--eval-tokens", type=positive_int, help="validation tokens scored at each length")
    parser.add_argument("--eval-batch-size", type=positive_int, default=8)
    parser.add_argument("--max-bytes", type=positive_int, help="how much text to read (train and validation)")
    parser.add_argument(
        "--spline-control-points", type=positive_int, default=16, help="control points of the B-spline map over [0, L)"
    )
    parser.add_argument(
        "--spline-randomized-control-points",
        type=positive_int,
        default=32,
        help="control points of the B-spline map over [0, 8L) trained with randomized positions",
    )
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
    check_flags_given(parser, given_flags(parser, argv))
    apply_preset(parser, args, PRESETS)
    args.methods = tuple(args.methods or sepformer.EXTRAPOLATION_METHODS)
    return args


# What a table made --from-csv reads: the rest (seeds, models, data, training) is the runs' that wrote the CSV.
FROM_CSV_READS = {"--from-csv", "--output-dir", "--quick", "--tiny", "--block-size", "--max-steps", "--batch-size"}


def check_flags_given(parser, given: set[str]) -> None:
    """Refuse flags that the run would not read: beside --from-csv all but the table's, and all but one source of
    text (the files, a Hub data set or --text)."""
    refuse_beside(
        parser,
        given,
        "--from-csv",
        given - FROM_CSV_READS,
        "the table is made from the CSV's rows, their seeds, models and methods; give only the preset flags "
        "of the runs that wrote them",
    )
    refuse_beside(
        parser,
        given,
        "--train-file",
        ["--dataset-name", "--dataset-config", "--text-column", "--text"],
        "the text is the files'",
    )
    refuse_beside(parser, given, "--dataset-name", ["--text"], "the text is the data set's")
    for flag, needed in (
        ("--train-file", "--validation-file"),
        ("--validation-file", "--train-file"),
        ("--dataset-config", "--dataset-name"),
        ("--text-column", "--dataset-name"),
    ):
        if flag in given and needed not in given:
            parser.error(f"argument {flag}: read only with {needed}: give both or neither")


def main(argv=None):
    args = parse_args(argv)
    with main_process_prints():
        return run(args)


def run(args) -> list[dict]:
    check_plotting()
    transformers.logging.set_verbosity_error()  # config chatter of the peers (e.g. GPT-2's default loss_type)
    datasets.disable_progress_bars()  # the bars that matter are training's and evaluation's
    output_dir = Path(args.output_dir)
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
    if not is_main_process():
        return rows
    output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, output_dir / "results.csv", RESULT_FIELDS, float_fields=("bits_per_byte", "bits_per_byte_beyond_L"))
    (output_dir / "results.md").write_text(table + "\n")
    plot(rows, args, output_dir / "extrapolation.png")
    print(
        f"wrote {output_dir / 'results.csv'}, {output_dir / 'results.md'}, {output_dir / 'extrapolation.png'} "
        f"in {(time.time() - started) / 60:.1f} min"
    )
    return rows


if __name__ == "__main__":
    main()
