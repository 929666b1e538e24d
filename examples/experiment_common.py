"""What the experiments (`extrapolation.py`, `position_bias.py`) share: the contenders' models of one shape, training
through transformers' `Trainer`, mean and spread over seeds, CSV, markdown tables and plots.

Training runs through `Trainer`, so that an experiment runs data-parallel unchanged under `torchrun` or
`accelerate launch`: the global batch is split over the processes (each takes `batch_size / world_size` rows of
every step, in the data's own order), so 2 processes train as 1 does. Every process evaluates; only the main one
prints and writes files.
"""

import argparse
import contextlib
import csv
import math
import os
import re
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

# examples/ is on the path of every script that imports this module
from cli_arguments import DISTINCT, nonnegative_int, positive_float, positive_int, trainer_device
from tqdm.auto import tqdm
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
)
from transformers.trainer_utils import get_last_checkpoint

from sepformer import SepFormerConfig, SepFormerForCausalLM

# ------------------------------------------------------------------------------------------------------- models


def model_config(
    name: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, max_length: int, **config
):
    """The config of `name` (sepformer, llama, gpt2, bloom) at this width, depth, heads and training length; `config`
    adds or overrides fields. Peers get GPT-2's 4·d_model MLP (Llama's gated MLP 8/3·d_model: as many weights);
    Bloom (ALiBi) has no length."""
    d = hidden_size
    if name == "sepformer":
        return SepFormerConfig(
            vocab_size=vocab_size,
            hidden_size=d,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            max_position_embeddings=max_length,
            **config,
        )
    if name == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=d,
            intermediate_size=round(8 * d / 3),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_length,
            **config,
        )
    if name == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=d, n_layer=num_layers, n_head=num_heads, n_positions=max_length, **config
        )
    if name == "bloom":
        return BloomConfig(vocab_size=vocab_size, hidden_size=d, n_layer=num_layers, n_head=num_heads, **config)
    raise ValueError(f"model {name!r} is not one of {', '.join(MODEL_CLASSES)}")


MODEL_CLASSES = {
    "sepformer": SepFormerForCausalLM,
    "llama": LlamaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "bloom": BloomForCausalLM,
}


def build_model(name: str, *shape, **config) -> torch.nn.Module:
    """A freshly initialised model: `model_config(name, *shape, **config)`."""
    config = model_config(name, *shape, **config)  # an unknown name: its ValueError says which names there are
    return MODEL_CLASSES[name](config)


def slug(name: str) -> str:
    """A folder name for a model's display name: `SepFormer learned, 8L` -> `sepformer-learned-8l`."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def chosen(every: list, words: list[str] | None, matches, described: str) -> list:
    """The contenders that `--models` names (`matches(word, contender)`), in their own order; all without the flag. A
    word that matches none stops the run, even beside one that matches: a mistyped name would silently drop its
    model. `described`: what the words can name, for the message."""
    if unmatched := [word for word in words or () if not any(matches(word, c) for c in every)]:
        raise SystemExit(f"--models {' '.join(unmatched)} matches none of: {described}")
    return [c for c in every if any(matches(word, c) for word in words)] if words else every


# ------------------------------------------------------------------------------------------------- command line


def experiment_parser(description: str, quick: str) -> argparse.ArgumentParser:
    """The flags every experiment has: its presets (`quick`: what the quick one takes), seeds, the models' shape, the
    training (mixed precision, checkpoints) and where it runs; a flag not given takes the preset's value
    (`apply_preset`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help=f"the quick preset ({quick})")
    preset.add_argument("--tiny", action="store_true", help="the smoke preset (seconds; learns nothing)")
    parser.add_argument(
        "--seeds", type=nonnegative_int, **DISTINCT, help="one full run per seed (default preset: 0 1 2)"
    )
    for flag in ("--hidden-size", "--num-layers", "--num-heads"):
        parser.add_argument(flag, type=positive_int)
    parser.add_argument("--batch-size", type=positive_int, help="sequences per step, over all processes")
    parser.add_argument("--learning-rate", type=positive_float)
    parser.add_argument(
        "--device",
        type=trainer_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or this machine's accelerator (default: cuda where there is a GPU)",
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs that have it, or CPU)")
    precision.add_argument("--fp16", action="store_true", help="fp16 mixed precision (CUDA GPUs only)")
    parser.add_argument(
        "--save-steps",
        type=positive_int,
        help="save a checkpoint of each model every this many steps (and at the end), under "
        "OUTPUT_DIR/checkpoints/<model>-seed<seed>",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue each model from its last checkpoint under OUTPUT_DIR/checkpoints (a model "
        "without one trains from the start)",
    )
    return parser


def preset_name(args) -> str:
    return "tiny" if args.tiny else "quick" if args.quick else "default"


def apply_preset(parser: argparse.ArgumentParser, args, presets: dict) -> None:
    """Every flag not given takes the preset's value; then what training would refuse is refused, before any work."""
    for name, value in presets[preset_name(args)].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    check_training_arguments(parser, args)


# ----------------------------------------------------------------------------------------------------- training


def check_training_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse, before any work, what `Trainer` would refuse or silently change once a model is built."""
    if args.batch_size % world_size():
        parser.error(
            f"argument --batch-size: {args.batch_size} does not split over {world_size()} processes: give a "
            f"multiple of {world_size()} (each process takes an equal share of every step's batch)"
        )
    if args.fp16 and torch.device(args.device).type != "cuda":
        parser.error(
            f"argument --fp16: not allowed with --device {args.device}: fp16 mixed precision needs a CUDA "
            "GPU; give --bf16 instead"
        )


def checkpoint_dir(args, name: str, seed: int) -> Path:
    return Path(args.output_dir) / "checkpoints" / f"{slug(name)}-seed{seed}"


def last_checkpoint(folder: Path) -> str | None:
    return get_last_checkpoint(str(folder)) if Path(folder).is_dir() else None


def check_resumable(args, names_and_seeds) -> None:
    """`--resume` with no checkpoint for any model of the run: a mistyped or empty --output-dir would otherwise
    train everything again, silently."""
    if args.resume and not any(last_checkpoint(checkpoint_dir(args, name, seed)) for name, seed in names_and_seeds):
        raise SystemExit(
            f"--resume: {Path(args.output_dir) / 'checkpoints'} holds no checkpoint of this run's models; "
            "give the --output-dir of the run that saved them (with --save-steps)"
        )


def first_line(error: Exception) -> str:
    """The first line of an error's message, cut after a word within 200 characters (marked "..."): for a one-line
    refusal or row."""
    line = str(error).splitlines()[0] if str(error) else ""
    return line if len(line) <= 200 else line[:200].rsplit(" ", 1)[0] + " ..."


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def main_process_prints():
    """Only the main process prints (every process runs the same experiment)."""
    if is_main_process():
        yield
    else:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            yield


def next_token_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy of the tokens labelled, `labels[:, j + 1]` the target of position j (transformers' causal-LM
    convention): `labels` may be one token longer than the input, so that its last position has a target too.
    Summed and divided by the labelled tokens of the whole global batch (`Trainer` counts them over processes)."""
    targets = labels[:, 1:]
    logits = outputs.logits[:, : targets.shape[1]].float()
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else targets.ne(-100).sum())


class LossBar(TrainerCallback):
    """One progress bar per model, with its description and the last step's loss (instead of Trainer's log lines)."""

    def __init__(self, description: str, postfix):
        self.description, self.postfix, self.bar = description, postfix, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(
            total=state.max_steps,
            initial=state.global_step,
            desc=self.description,
            leave=False,
            dynamic_ncols=True,
            disable=not state.is_world_process_zero,
        )

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.set_postfix(self.postfix(logs["loss"]))

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def train(
    model,
    dataset,
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
    output_dir: Path | None,
    weight_decay: float = 0.1,
    device: str = "cpu",
    bf16: bool = False,
    fp16: bool = False,
    save_steps: int | None = None,
    resume_from_checkpoint: bool = False,
    description: str = "train",
    postfix=lambda loss: {"loss": f"{loss:.3f}"},
) -> list[float]:
    """Train `model` with `Trainer` on `dataset` (rows "input_ids" and "labels", see `next_token_loss`; `steps` x
    `batch_size` rows, taken in order: row i is in step i // batch_size). AdamW (betas 0.9, 0.95), linear warm-up over
    5% of the steps then cosine decay, gradient clipping at 1. Under `torchrun` each of the N processes takes
    `batch_size / N` rows of every step. `save_steps`: a checkpoint under `output_dir` every this many steps and at
    the end; `resume_from_checkpoint`: continue from the last one there, if any. Returns the loss of every step."""
    check_training(dataset, steps, batch_size, output_dir, save_steps or resume_from_checkpoint)
    with tempfile.TemporaryDirectory() as scratch:  # Trainer makes its output_dir even where it saves nothing
        arguments = training_arguments(
            model, output_dir if save_steps else scratch, steps, batch_size, seed, device, bf16, fp16, save_steps
        )
        model.to(arguments.device)  # before the optimizer is made: it holds the parameters where they train
        optimizer = torch.optim.AdamW(model.parameters(), learning_rate, betas=(0.9, 0.95), weight_decay=weight_decay)
        schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 20), steps)
        trainer = Trainer(
            model, arguments, train_dataset=dataset, optimizers=(optimizer, schedule), compute_loss_func=next_token_loss
        )
        for progress in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(progress)
        trainer.add_callback(LossBar(description, postfix))
        trainer.train(resume_from_checkpoint=last_checkpoint(output_dir) if resume_from_checkpoint else None)
    model.eval()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def check_training(dataset, steps: int, batch_size: int, output_dir: Path | None, checkpointing: bool) -> None:
    """Refuse, before any work, checkpoints without an `output_dir`, a batch that does not split over the processes,
    and a dataset that is not `steps` batches."""
    if checkpointing and output_dir is None:
        raise ValueError("save_steps and resume_from_checkpoint need an output_dir for the checkpoints")
    if batch_size % world_size():
        raise ValueError(
            f"batch size {batch_size} does not split over {world_size()} processes: give a multiple of {world_size()}"
        )
    if len(dataset) != steps * batch_size:
        raise ValueError(
            f"the dataset has {len(dataset)} rows; {steps} steps of {batch_size} need {steps * batch_size}"
        )


def training_arguments(model, output_dir, steps, batch_size, seed, device, bf16, fp16, save_steps) -> TrainingArguments:
    """`train`'s `Trainer` arguments: each process's share of the batch, the rows in order, the loss of every step."""
    cpu, processes = torch.device(device).type == "cpu", world_size()
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size // processes,
        train_sampling_strategy="sequential",
        max_grad_norm=1.0,
        seed=seed,
        bf16=bf16,
        fp16=fp16,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu and processes > 1 else None,
        ddp_find_unused_parameters=False,
        logging_steps=1,
        report_to="none",
        use_cache=model.config.use_cache,  # Trainer sets the config's to this: a saved model keeps its own
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
    )


def training_options(args) -> dict:
    """The keywords of `train` that `experiment_parser`'s flags give."""
    options = dict(learning_rate=args.learning_rate, device=args.device, bf16=args.bf16, fp16=args.fp16)
    return options | dict(save_steps=args.save_steps, resume_from_checkpoint=args.resume)


def tail_mean(losses: list[float]) -> float:
    """The mean of the last 10% of the steps' losses (at least one)."""
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


# -------------------------------------------------------------------------------------------------------- seeds


def every_seed(seeds, run_seed, after_each=lambda *tables: None) -> list[list[dict]]:
    """`run_seed(seed)` for every seed: its tables (a tuple of lists of rows), each concatenated over the seeds.
    `after_each(*tables so far)` runs after each seed (a long run writes what it did)."""
    tables = None
    for seed in seeds:
        new = run_seed(seed)
        tables = [old + more for old, more in zip(tables, new, strict=True)] if tables else list(new)
        after_each(*tables)
    return tables


# two-sided 95% quantiles of Student's t by degrees of freedom (the interval of a mean over a few seeds)
T_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """The mean and the standard deviation over seeds (NaN for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def interval95(values: list[float]) -> float:
    """Half-width of the 95% interval of the mean of `values` (t over seeds; 0 for one value)."""
    n = len(values)
    if n < 2:
        return 0.0
    t = T_975[max(df for df in T_975 if df <= n - 1)]  # the next smaller tabulated df: a slightly wider interval
    return t * statistics.stdev(values) / math.sqrt(n)


# ---------------------------------------------------------------------------------------------- CSV, tables, plots


def write_csv(rows: list[dict], path: Path, fields: list[str], float_fields=()) -> None:
    """`fields` of every row; the floats of `float_fields` with 5 decimals."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    k: (f"{v:.5f}" if isinstance(v, float) and k in float_fields else v)
                    for k, v in row.items()
                    if k in fields
                }
            )


def table_lines(header: list[str], rows: list[list[str]], left: int) -> list[str]:
    """A markdown table: the first `left` columns left-aligned, the others right-aligned (numbers)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * left + "---:|" * (len(header) - left)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def check_plotting() -> None:
    """Fail now, not after training, if the plots cannot be drawn."""
    import matplotlib  # noqa: F401


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path, **savefig) -> None:
    figure.savefig(path, **savefig)
    pyplot().close(figure)
