"""The prefill and the decoding steps of a generation, timed apart: the Llama given `add_mitigations` (or SepFormer) at
the benchmark's shape, without option and with each position-bias option.

The generation rows of `benchmark.py` time whole generations, prefill included, so an option's work at prefill
(calibration's dummy passes: one more forward pass per document) weighs in them beside its work per step. Here each
repetition times, without the option and with it (back to back, in turn first), a generation of 1 new token (the
prefill and the first token) and one of `--tokens`: their difference over `--tokens - 1` is a decoding step. Medians
of `--reps` repetitions; the ratios are no option's time over the option's (above 1: the option is faster).

    python benchmarks/prefill_and_steps.py --options attention_calibration --batch 8     # about a minute
    python benchmarks/prefill_and_steps.py --batch 1 8                                   # every option, 6 min
    python benchmarks/prefill_and_steps.py --model SepFormer --batch 1 8
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_models import FULL, TINY, build, generate  # noqa: E402
from benchmark_sections import MITIGATED_LLAMA, MITIGATIONS, measured_on  # noqa: E402
from cli_arguments import int_at_least, positive_int  # noqa: E402

from sepformer import add_mitigations  # noqa: E402

NO_OPTION = "no option"
BASES = {"Llama": MITIGATED_LLAMA, "SepFormer": "SepFormer"}  # --model: the variant of `measured_on`


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(BASES), default="Llama")
    parser.add_argument("--options", nargs="+", choices=list(MITIGATIONS), default=None, help="default: every one")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[1], help="prompts generated together")
    parser.add_argument("--tokens", type=int_at_least(2), default=256, help="new tokens of the longer generation")
    parser.add_argument("--reps", type=positive_int, default=7)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke run)")
    args = parser.parse_args(argv)
    measured = measured_on(BASES[args.model])
    if not_measured := [option for option in args.options or () if option not in measured]:
        parser.error(f"argument --options: {not_measured} are not measured on {args.model}")
    args.options = args.options or measured
    return args


def seconds(model, batch: int, prompt: int, new_tokens: int, options: dict) -> float:
    start = time.perf_counter()
    generate(model, batch, prompt, new_tokens, 0, **options)
    return time.perf_counter() - start


def prefill_and_step(model, options: dict, batch: int, prompt: int, tokens: int, reps: int) -> dict:
    """The medians of (prefill and first token, one decoding step), in seconds, without the option and with it
    (`options`), the two timed back to back in each repetition, in turn first (this machine drifts by 10-30% over a
    minute: only what is timed close together compares)."""
    variants = {NO_OPTION: {}, "option": options}
    for given in variants.values():  # warm-up
        generate(model, batch, prompt, 2, 0, **given)
    times = {name: ([], []) for name in variants}
    for repetition in range(reps):
        for name in list(variants)[:: 1 if repetition % 2 == 0 else -1]:
            first = seconds(model, batch, prompt, 1, variants[name])
            whole = seconds(model, batch, prompt, tokens, variants[name])
            times[name][0].append(first)
            times[name][1].append((whole - first) / (tokens - 1))
    return {name: (statistics.median(prefills), statistics.median(steps)) for name, (prefills, steps) in times.items()}


def main(argv=None) -> list[dict]:
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    shape = TINY if args.tiny else FULL
    model = build(args.model, shape)
    model = add_mitigations(model) if args.model == "Llama" else model
    print(f"{BASES[args.model]}, prompt {shape.prompt}, {args.tokens} new tokens, medians of {args.reps} repetitions")
    print("| option | batch | prefill and first token, none / option | decoding step, none / option | steps | whole |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for batch in args.batch:
        for option in args.options:
            given = MITIGATIONS[option](batch, shape.prompt)
            times = prefill_and_step(model, given, batch, shape.prompt, args.tokens, args.reps)
            (none_prefill, none_step), (prefill, step) = times[NO_OPTION], times["option"]
            whole = (none_prefill + (args.tokens - 1) * none_step) / (prefill + (args.tokens - 1) * step)
            row = dict(option=option, batch=batch, prefill=(none_prefill, prefill), step=(none_step, step))
            rows.append(row | dict(steps=none_step / step, whole=whole))
            timings = (
                f"{1000 * none_prefill:.1f} / {1000 * prefill:.1f} ms | {1000 * none_step:.2f} / {1000 * step:.2f} ms"
            )
            print(f"| {option} | {batch} | {timings} | {none_step / step:.3f} | {whole:.3f} |")
    return rows


if __name__ == "__main__":
    main()
