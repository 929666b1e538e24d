"""Lost in the middle, one command: key-value retrieval accuracy by the gold document's position, per mitigation.

Trains SepFormer, Llama and GPT-2 alike on lists of one-token documents whose answers sit at the ends
(`position_bias_task.py`), then scores each model by gold slot with no mitigation, with every mitigation's sweep
that it accepts, IN2 fine-tunes and reordering by relevance (`position_bias_conditions.py`). The task, the models,
the conditions and the results: docs/experiments/position_bias.md.

    python examples/position_bias.py                    # default preset: seeds 0, 1, 2
    python examples/position_bias.py --quick            # one seed, fewer prompts
    python examples/position_bias.py --tiny             # a smoke run in seconds: learns nothing (what the test runs)
    python examples/position_bias.py --num-pairs 32 --num-keys 64   # twice the documents (and the steps: 3000)
    python examples/position_bias.py --reuse-models --models-dir outputs/position_bias/models \\
        --output-dir outputs/ms_poe --mitigations none ms_poe        # the default run's models, evaluated again
    torchrun --nproc_per_node 2 examples/position_bias.py --tiny  # data parallel: the same table, within noise

Writes under `--output-dir`: `results.csv` (one row per model, mitigation, setting, seed and gold slot), `results.md`
(the tables, printed too), `position_bias.png`, `attention.csv` and `attention_by_position.png`; each trained model
under `--models-dir` (default `OUTPUT_DIR/models`), in `<model>-seed<seed>/` with its `training.json`, which
`--reuse-models` evaluates again without training (`saved_models.py`).
"""

import copy
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import datasets
import evaluate
import experiment_common as common
import position_bias_conditions as conditions
import position_bias_task as task
import torch
import transformers
from cli_arguments import DISTINCT, nonnegative_float, output_directory, positive_float, positive_int, probability
from position_bias_conditions import IN2, MITIGATION_NAMES, NONE, Condition, plain_logits
from position_bias_report import markdown_table, write_report, write_results
from saved_models import saved_model, trained_model
from tqdm.auto import tqdm

from sepformer import add_mitigations
from sepformer.metrics import metric_path
from sepformer.positional_search import is_sepformer

# The default's task and training: what a trained model depends on, besides the model and the seed (a saved model is
# reused only under the same).
TRAINING = dict(num_pairs=16, num_keys=32, num_values=16, end_slots=2, gold_at_ends=1.0, hidden_size=64, num_layers=2)
TRAINING |= dict(num_heads=2, batch_size=32, max_steps=1500, learning_rate=3e-3, weight_decay=0.1)
PRESETS = {
    # 12.5 minutes for the three seeds on 2 CPU cores
    "default": {**TRAINING, "eval_per_slot": 100, "validation_per_slot": 25, "seeds": [0, 1, 2]},
    # the default's task and training, one seed, half the evaluation prompts
    "quick": {**TRAINING, "eval_per_slot": 50, "validation_per_slot": 25, "seeds": [0]},
    # seconds: checks the plumbing, learns nothing (the test and CI run this)
    "tiny": dict(TRAINING, num_pairs=4, num_keys=8, num_values=8, end_slots=1, hidden_size=32, batch_size=16)
    | dict(max_steps=20, eval_per_slot=6, validation_per_slot=4, seeds=[0]),
}
IN2_FRACTIONS = (0.05, 0.2)  # the IN2 fine-tune's budgets, as fractions of the training steps


class Contender(NamedTuple):
    name: str
    slug: str  # its folder under `models/`
    build: Callable


def contenders(args, vocab: task.Vocabulary) -> list[Contender]:
    """The models, all of one shape (`experiment_common.model_config`), with positions up to the training length."""
    shape = (len(vocab), args.hidden_size, args.num_layers, args.num_heads, task.train_length(args.num_pairs))
    special = dict(pad_token_id=vocab.pad, bos_token_id=vocab.bos, eos_token_id=vocab.sep, tie_word_embeddings=False)
    names = {"sepformer": "SepFormer", "llama": "Llama (rotary)", "gpt2": "GPT-2 (learned absolute)"}
    every = [
        Contender(name, slug, functools.partial(common.build_model, slug, *shape, **special))
        for slug, name in names.items()
    ]
    return common.chosen(
        every,
        args.models,
        lambda word, contender: word.lower() in contender.name.lower() or word.lower() == contender.slug,
        f"{', '.join(c.name for c in every)} (nor the folder names {', '.join(c.slug for c in every)})",
    )


def train(
    model, data: datasets.Dataset, args, description: str, seed: int = 0, checkpoints: Path | None = None
) -> float:
    """`experiment_common.train` on `data` (every step's batch, in order); returns the mean loss of the last 10% of
    the steps. `seed` seeds what is random in training (dropout); `checkpoints`: where `--save-steps` saves and
    `--resume` continues."""
    options = dict(weight_decay=args.weight_decay, seed=seed, output_dir=checkpoints, description=description)
    losses = common.train(
        model, data, steps=args.max_steps, batch_size=args.batch_size, **options, **common.training_options(args)
    )
    return common.tail_mean(losses)


def taking_options(model) -> torch.nn.Module:
    """The model with the mitigations as `forward` keywords: SepFormer's own, `add_mitigations`' on the others (applied
    after training, so that training runs the model's own attention)."""
    return model if is_sepformer(model) else add_mitigations(model)


def seeded_build(contender: Contender, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights for a given seed, trained here or rebuilt to load saved ones
    return contender.build()


def storage(args, contender: Contender, seed: int) -> tuple[Path, dict, Callable]:
    """Where the contender's model of `seed` is saved, the settings it is trained with, and how it is built."""
    folder = Path(args.models_dir) / f"{contender.slug}-seed{seed}"
    settings = {"seed": seed, **{name: getattr(args, name) for name in TRAINING}}
    return folder, settings, functools.partial(seeded_build, contender, seed)


def trained(
    contender: Contender, seed: int, data: Callable[[], datasets.Dataset], args
) -> tuple[torch.nn.Module, dict]:
    """The contender trained on `data()`, or with `--reuse-models` loaded from the run that trained it."""
    checkpoints = common.checkpoint_dir(args, contender.slug, seed)
    description = f"seed {seed} · train {contender.name}"
    return trained_model(
        *storage(args, contender, seed),
        lambda model: train(model, data(), args, description, seed, checkpoints),
        args.device,
        args.reuse_models,
        f"seed {seed} · {contender.name}",
    )


def in2_rows(
    model, contender: Contender, seed: int, vocab: task.Vocabulary, evaluation: dict, metric, args
) -> list[dict]:
    """IN2 ("Make Your LLM Fully Utilize the Context", made by rule from the experiment's own task): for each of
    `--in2-fractions`, a copy of the trained model fine-tuned by `in2_arguments`, evaluated on the test prompts with no
    other mitigation; the rows record the fine-tune's steps, loss and time (`finetune_*`)."""
    rows = []
    for fraction in args.in2_fractions:
        in2_args = task.in2_arguments(args, fraction)
        tuned = copy.deepcopy(model)  # the base rows stay the trained model's
        started = time.time()
        description = f"seed {seed} · IN2 {fraction:g} {contender.name}"
        loss = train(tuned, task.in2_set(seed, vocab, in2_args), in2_args, description, seed)
        seconds = round(time.time() - started, 1)
        record = dict(finetune_steps=in2_args.max_steps, finetune_loss=round(loss, 4), finetune_seconds=seconds)
        steps = f"{in2_args.max_steps} step" + "s" * (in2_args.max_steps != 1)
        condition = Condition(IN2, f"{fraction * 100:g}% of training steps ({steps})", plain_logits)
        for pairs, data in evaluation.items():
            rows += [
                {**row, **record}
                for row in conditions.evaluate_model(tuned, [condition], data, pairs, metric, args, contender)
            ]
        tqdm.write(f"seed {seed} · {contender.name}: IN2 fine-tune of {steps} in {seconds:.1f} s to loss {loss:.3f}")
    return rows


def condition_rows(model, contender: Contender, seed: int, vocab, evaluation: dict, validation, metric, args):
    """The rows of every condition of `--mitigations` that the model accepts, at each evaluated number of pairs."""
    rows = []
    for pairs, data in evaluation.items():
        spans = task.document_spans(pairs)
        kept = conditions.mitigation_conditions(spans, vocab)
        kept += conditions.every_layer_conditions(spans, vocab, args.num_layers)
        if pairs == args.num_pairs and "positional_scaling" in args.mitigations:
            kept += conditions.searched_scaling(model, validation)
        kept += conditions.calibration_without_dummy_passes(data["input_ids"], spans, vocab)
        kept = [c for c in kept if c.mitigation in args.mitigations]
        name = f"seed {seed} · {contender.name}, {pairs} pairs"
        kept = conditions.accepted(model, kept, data["input_ids"][:1].to(model.device), name)
        rows += conditions.evaluate_model(model, kept, data, pairs, metric, args, contender)
    if IN2 in args.mitigations:
        rows += in2_rows(model, contender, seed, vocab, evaluation, metric, args)
    return rows


def run_seed(seed: int, vocab: task.Vocabulary, metric, args) -> tuple[list[dict], list[dict]]:
    data = functools.cache(lambda: task.training_set(seed, vocab, args))  # made only if a model is trained
    evaluation = {pairs: task.evaluation_set(seed, pairs, vocab, args) for pairs in args.eval_pairs}
    validation = task.validation_batches(seed, args.num_pairs, vocab, args)
    rows, attention = [], []
    for contender in contenders(args, vocab):
        model, record = trained(contender, seed, data, args)
        model = taking_options(model)
        train_loss, train_seconds = record["train_loss"], record["train_seconds"]
        summary = dict(seed=seed, train_pairs=args.num_pairs, parameters=model.num_parameters())
        summary |= dict(train_steps=args.max_steps, train_loss=train_loss, train_seconds=train_seconds)
        new_rows = condition_rows(model, contender, seed, vocab, evaluation, validation, metric, args)
        rows += [{**row, **summary} for row in new_rows]
        at_n = [r["accuracy"] for r in new_rows if r["mitigation"] == NONE and r["num_pairs"] == args.num_pairs]
        tqdm.write(
            f"seed {seed} · {contender.name:26s} {model.num_parameters() / 1e6:.3f}M params, trained in "
            f"{train_seconds:5.1f} s to loss {train_loss:.3f}; accuracy at {args.num_pairs} pairs "
            f"{statistics.fmean(at_n):.3f}, by slot " + " ".join(f"{a:.2f}" for a in at_n)
        )
        prompts = evaluation[args.num_pairs]["input_ids"]
        attention += conditions.attention_rows(model, contender.name, seed, prompts, args.num_pairs, args)
    return rows, attention


def add_task_flags(parser) -> None:
    """The task's flags, its training's and its prompts'."""
    add = parser.add_argument
    add("--num-pairs", type=positive_int, help="key-value pairs per training list")
    add(
        "--eval-pairs",
        type=positive_int,
        **DISTINCT,
        help="numbers of pairs evaluated, at most --num-pairs (default: the training's)",
    )
    add("--num-keys", type=positive_int)
    add("--num-values", type=positive_int)
    add(
        "--max-steps",
        type=positive_int,
        help="training steps (default: the preset's steps per pair times --num-pairs, e.g. 1500 at 16 pairs and "
        "3000 at 32)",
    )
    add("--weight-decay", type=nonnegative_float)
    add("--end-slots", type=positive_int, help="training answers sit in the first or last this many slots")
    add(
        "--gold-at-ends",
        type=probability,
        help="probability that a training answer sits in an end slot (otherwise: any slot)",
    )
    add("--eval-per-slot", type=positive_int, help="test prompts per gold slot")
    add("--validation-per-slot", type=positive_int, help="validation prompts per gold slot (the search's)")


def parse_args(argv=None):
    parser = common.experiment_parser(__doc__, quick="about 10 minutes")
    add = parser.add_argument
    add(
        "--models",
        nargs="+",
        help="models to keep: substrings of their names, or their folder names (sepformer llama gpt2)",
    )
    add(
        "--mitigations",
        choices=MITIGATION_NAMES,
        **DISTINCT,
        help="mitigations to evaluate (default: all), always beside 'none', the models as they are, that every "
        "mitigation is compared with; 'none' alone: no mitigation",
    )
    add(
        "--in2-fractions",
        type=positive_float,
        **DISTINCT,
        help="IN2 fine-tunes' budgets as fractions of --max-steps, one row each (default: "
        f"{' '.join(map(str, IN2_FRACTIONS))}); needs 'in2' in --mitigations",
    )
    add_task_flags(parser)
    add("--eval-batch-size", type=positive_int, default=256)
    add("--output-dir", type=output_directory, default="outputs/position_bias")
    add(
        "--models-dir",
        type=output_directory,
        help="where trained models are saved and, with --reuse-models, read (default: OUTPUT_DIR/models)",
    )
    add(
        "--reuse-models",
        action="store_true",
        help="load the models an earlier run saved under --models-dir instead of training them again; one saved with "
        "other training settings or config is refused, with what differs, and so is a --models-dir without any of "
        "the run's models",
    )
    return checked(parser, parser.parse_args(argv))


def checked(parser, args):
    """The preset's values of the flags not given, the defaults that depend on other flags, and what the flags cannot
    mean together, refused before any work."""
    if args.max_steps is None and args.num_pairs is not None:
        # At the preset's budget Llama does not learn twice the documents; at the same steps per pair it does.
        preset = PRESETS[common.preset_name(args)]
        args.max_steps = preset["max_steps"] * args.num_pairs // preset["num_pairs"]
    common.apply_preset(parser, args, PRESETS)
    args.models_dir = args.models_dir or str(Path(args.output_dir) / "models")
    args.mitigations = tuple(dict.fromkeys((NONE, *(args.mitigations or MITIGATION_NAMES))))  # the baseline first
    args.in2_fractions = in2_fractions(args)
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


def in2_fractions(args) -> tuple[float, ...]:
    """`--in2-fractions` (default `IN2_FRACTIONS`), refused without IN2's rows or where one is no fine-tuning step."""
    if args.in2_fractions is not None and IN2 not in args.mitigations:
        raise SystemExit(
            f"--in2-fractions {' '.join(map(str, args.in2_fractions))}: read only by the IN2 rows, and "
            f"--mitigations {' '.join(args.mitigations)} has no '{IN2}': add it or drop the flag"
        )
    fractions = tuple(args.in2_fractions or IN2_FRACTIONS)
    if IN2 in args.mitigations and (none_steps := [f for f in fractions if task.in2_steps(args, f) < 1]):
        raise SystemExit(
            f"--in2-fractions {' '.join(map(str, none_steps))}: of --max-steps {args.max_steps} "
            "rounds to 0 fine-tuning steps; give fractions that round to at least one step"
        )
    return fractions


def check_saved_models(args, vocab: task.Vocabulary) -> None:
    """Before any training: a saved model that cannot be reused fails now, not after hours of training; so do
    training flags where nothing trains, and a --models-dir without any of the run's models."""
    runs = [(contender, seed) for seed in args.seeds for contender in contenders(args, vocab)]
    reused = [saved_model(*storage(args, *run), args.device) is not None for run in runs] if args.reuse_models else []
    if reused and all(reused) and (args.save_steps or args.resume):
        raise SystemExit(
            "--save-steps and --resume act on training, and --reuse-models reuses every model of this "
            "run: nothing trains, so drop them"
        )
    if args.reuse_models and not any(reused):
        # an empty or mistyped folder would otherwise train everything again, silently
        folders = ", ".join(storage(args, *run)[0].name for run in runs)
        where = f"holds none of this run's models ({folders})" if Path(args.models_dir).is_dir() else "does not exist"
        raise SystemExit(
            f"--reuse-models: --models-dir {args.models_dir} {where}; give the --models-dir of the run "
            "that trained them"
        )
    common.check_resumable(args, [(contender.slug, seed) for contender, seed in runs])


def main(argv=None):
    args = parse_args(argv)
    with common.main_process_prints():
        return run(args)


def run(args) -> list[dict]:
    common.check_plotting()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    metric = evaluate.load(metric_path("accuracy_by_position"))
    print(
        f"task: {args.num_pairs} pairs (evaluated at {', '.join(map(str, args.eval_pairs))}), {args.num_keys} keys, "
        f"{args.num_values} values; models: d_model={args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_heads} heads; {args.max_steps} steps of {args.batch_size}; seeds {args.seeds}"
        + (f"; data parallel over {common.world_size()} processes" if common.world_size() > 1 else "")
    )
    check_saved_models(args, vocab)

    def after_each_seed(rows, attention):  # a long run keeps what it did
        if common.is_main_process():
            write_results(rows, output_dir)

    rows, attention = common.every_seed(args.seeds, lambda seed: run_seed(seed, vocab, metric, args), after_each_seed)
    table = markdown_table(rows, args)
    print("\n" + table + "\n")
    if common.is_main_process():
        write_report(rows, attention, table, args, output_dir)
        print(
            f"wrote results.csv, results.md, position_bias.png, attention.csv, attention_by_position.png under "
            f"{output_dir} in {(time.time() - started) / 60:.1f} min"
        )
    return rows


if __name__ == "__main__":
    main()
