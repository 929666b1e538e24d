"""How `benchmark.py` measures: timed calls, every variant in turn within each repetition (`run_interleaved`), and
the median and interquartile range of the samples and of the paired ratios (`summary_rows`)."""

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable

import torch


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a timer read next counts it (CUDA runs kernels asynchronously)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


@dataclasses.dataclass
class Measurement:
    """One quantity measured for several variants (models), each by a callable that returns one sample's value."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    runners: dict[str, Callable[[], float]]
    ratios: tuple[tuple[str, str], ...] = (("SepFormer", "GPT-2"), ("SepFormer", "Llama"))  # (numerator, denominator)
    section: str = "comparison"
    target: str = ""
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @classmethod
    def overhead(cls, key: str, label: str, runners: dict, ratios: tuple, section: str, target: str = ""):
        """Generation throughputs (tokens/s) whose `ratios` pair each variant with one other (with and without an
        option): `repetition_order` runs each pair back to back."""
        return cls(key, label, "tokens/s", True, runners, ratios, section, target)


def run_interleaved(measurements: list[Measurement], reps: int, log) -> None:
    """Warm up every runner once, then `reps` repetitions; in each, every measurement runs every variant in turn
    (`repetition_order`)."""
    for m in measurements:
        for name, runner in m.runners.items():
            log(f"warm-up {m.key} {name}")
            runner()
            m.samples[name] = []
    for rep in range(reps):
        log(f"repetition {rep + 1}/{reps}")
        for m in measurements:
            for name in repetition_order(m, rep):
                m.samples[name].append(m.runners[name]())


def repetition_order(m: Measurement, rep: int) -> list[str]:
    """The variants of `m` in repetition `rep`. Where its ratios pair each variant with exactly one other (an
    overhead: with and without an option), each pair runs back to back, the two in turn first: a ratio then compares
    samples timed a second apart, not across a whole repetition, over which a shared machine drifts by 10-30%.
    Otherwise every variant in turn, rotated by one each repetition, so that none is always first."""
    names = list(m.runners)
    paired = [name for pair in m.ratios for name in pair]
    if sorted(paired) == sorted(names):  # each variant in one pair
        return [name for pair in m.ratios for name in (pair if rep % 2 else pair[::-1])]
    shift = rep % len(names)
    return names[shift:] + names[:shift]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def summary_row(m: Measurement, variant: str, unit: str, values: list[float]) -> dict:
    """A row of the table and the CSV: the median, quartiles and range of `values`, one variant of `m`."""
    q1, median, q3 = quartiles(values)
    return dict(
        section=m.section,
        metric=m.key,
        label=m.label,
        variant=variant,
        unit=unit,
        median=median,
        q1=q1,
        q3=q3,
        min=min(values),
        max=max(values),
        n=len(values),
        higher_is_better=m.higher_is_better,
        target=m.target,
    )


def summary_rows(m: Measurement) -> list[dict]:
    """A row per variant, then a row per ratio of `m.ratios` whose variants both have samples (paired by repetition)."""
    rows = [summary_row(m, name, m.unit, values) for name, values in m.samples.items()]
    for numerator, denominator in m.ratios:
        if numerator not in m.samples or denominator not in m.samples:
            continue
        ratios = [a / b if b else math.nan for a, b in zip(m.samples[numerator], m.samples[denominator], strict=True)]
        rows.append(summary_row(m, f"{numerator} / {denominator}", "ratio", ratios))
    return rows
