"""Argument types shared by the command lines of the examples and the benchmarks, and checks of flags given together.

Each type is an argparse `type=` (or `action=`): a bad value stops the command before any work, with argparse's usage
line and `argument --flag: <what was given and what is allowed>`; so do flags that a run would not read beside another
(`refuse_beside`). The benchmarks import this module from `examples/`.
"""

import argparse
import math
import os
from pathlib import Path

import torch


def int_at_least(minimum: int):
    """An integer `>= minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: give an integer >= {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def float_in(low: float, high: float = math.inf, low_inclusive: bool = False):
    """A finite float above `low` (or at it, with `low_inclusive`) and at most `high`."""
    allowed = f"a finite number {'>=' if low_inclusive else '>'} {low:g}" + (
        f" and <= {high:g}" if high < math.inf else ""
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {allowed}") from None
        if not (math.isfinite(value) and (value >= low if low_inclusive else value > low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text} is not allowed: give {allowed}")
        return value

    return parse


positive_float = float_in(0.0)
nonnegative_float = float_in(0.0, low_inclusive=True)
probability = float_in(0.0, 1.0, low_inclusive=True)


def output_directory(text: str) -> str:
    """A directory that exists or can be made: the deepest existing part of the path is a writable directory."""
    path = Path(text)
    existing = next(part for part in (path, *path.parents) if part.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be an output directory: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be an output directory: {str(existing)!r} is not writable")
    return text


def torch_device(text: str) -> str:
    """A device this machine has: `cpu`, or its accelerator (`torch.accelerator`: `cuda`, `cuda:N`, `mps`, ...).
    Anything else is refused where torch or Trainer would fail later or silently run on the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    available = ["cpu"] + ([accelerator.type] if accelerator is not None else [])
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; give {' or '.join(available)}") from None
    if device.type not in available:
        raise argparse.ArgumentTypeError(
            f"{text} is not available on this machine (it has {' and '.join(available)}): give {' or '.join(available)}"
        )
    count = torch.accelerator.device_count() if device.type != "cpu" else 1
    if (device.index or 0) >= count:
        raise argparse.ArgumentTypeError(
            f"{text} is not allowed: this machine has {count} {device.type} devices "
            f"({device.type}:0 to {device.type}:{count - 1})"
        )
    return text


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return text


def trainer_device(text: str) -> str:
    """A device type that `Trainer` trains on (`torch_device`), without an index: Trainer places the model on each
    process's own device."""
    kind, index = text.partition(":")[::2]
    if index:
        raise argparse.ArgumentTypeError(
            f"{text} is not allowed: Trainer places the model on each process's own "
            f"device; give {kind} (and choose GPUs with CUDA_VISIBLE_DEVICES)"
        )
    return torch_device(text)


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The flags that `argv` gives (each by its first option string), whatever their values: a flag given its default
    counts. Argparse leaves alone what the namespace it fills already holds, so a marker left in place is a flag not
    given."""
    unset = object()
    namespace = parser.parse_args(argv, argparse.Namespace(**{action.dest: unset for action in parser._actions}))
    return {
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and getattr(namespace, action.dest) is not unset
    }


def refuse_beside(parser: argparse.ArgumentParser, given: set[str], flag: str, others, why: str) -> None:
    """`flag`, given, beside any of `others` (flags that a run with `flag` would not read): argparse's error, naming
    them, rather than a silently ignored flag."""
    if flag in given and (unread := sorted(set(others) & given)):
        parser.error(f"argument {flag}: not allowed with {', '.join(unread)}: {why}")


class Distinct(argparse.Action):
    """`nargs="+"` values given at most once each (a seed given twice would be averaged as two seeds)."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            parser.error(
                f"argument {option_string}: {' '.join(map(str, repeated))} given more than once in "
                f"{' '.join(map(str, values))}; give each value once"
            )
        setattr(namespace, self.dest, values)


DISTINCT = dict(nargs="+", action=Distinct)  # the keywords of a flag that takes one or more values, each once
