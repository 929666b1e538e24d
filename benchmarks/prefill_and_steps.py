"""The prefill and the decoding steps of a generation, timed apart: the Llama given `add_mitigations` (or SepFormer) at
the benchmark's shape, without option and with each position-bias option.

The generation rows of `benchmark.py` time whole generations, prefill included, so an option's work at prefill
(calibration's dummy passes: one more forward pass per document) weighs in them beside its work per step. Here each
repetition times a generation of 1 new token (the prefill and the first token) without the option and with it, then
one of `--tokens` new tokens without and with it (which of the two goes first alternates): a step is the difference
of a variant's two generations over `--tokens - 1`. Each ratio (no option's time over the option's; above 1, the
option is faster) is taken within a repetition, then its median [q1, q3] over `--reps` repetitions, as `benchmark.py`
does: this machine drifts by 10-30% over a minute, and only what is timed close together compares.

    python benchmarks/prefill_and_steps.py --options attention_calibration --batch 8     # about a minute
    python benchmarks/prefill_and_steps.py --batch 1 8                                   # every option, 7 min
    python benchmarks/prefill_and_steps.py --model SepFormer --batch 1 8
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_measuring import quartiles, timed  # noqa: E402
from benchmark_models import FULL, TINY, build, generate  # noqa: E402
from benchmark_sections import MITIGATED_LLAMA, MITIGATIONS, measured_on  # noqa: E402
from cli_arguments import int_at_least, positive_int  # noqa: E402

from sepformer import add_mitigations  # noqa: E402

BASES = {"Llama": MITIGATED_LLAMA, "SepFormer": "SepFormer"}  # --model: the variant of `measured_on`


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(BASES), default="Llama")
    parser.add_argument("--options", nargs="+", choices=list(MITIGATIONS), default=None, help="default: every one")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[1], help="prompts generated together")
    parser.add_argument("--tokens", type=int_at_least(2), default=256, help="new tokens of the longer generation")
    parser.add_argument("--reps", type=positive_int, default=8, help="even: each variant first as often")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (a smoke run)")
    args = parser.parse_args(argv)
    measured = measured_on(BASES[args.model])
    if not_measured := [option for option in args.options or () if option not in measured]:
        parser.error(f"argument --options: {not_measured} are not measured on {args.model}")
    args.options = args.options or measured
    return args


def seconds(model, batch: int, prompt: int, new_tokens: int, options: dict) -> float:
    return timed(lambda: generate(model, batch, prompt, new_tokens, 0, **options))


def paired_ratios(model, options: dict, batch: int, prompt: int, tokens: int, reps: int) -> list[dict]:
    """Per repetition: the prefill and first token and the step, in seconds, of no option and of the option
    (`options`), and the ratios none / option of the steps and of the whole `tokens`-token generations."""
    variants = ({}, options)  # no option, the option
    for given in variants:  # warm-up
        generate(model, batch, prompt, 2, 0, **given)
    repetitions = []
    for repetition in range(reps):
        order = (0, 1) if repetition % 2 == 0 else (1, 0)
        first, whole = (
            {index: seconds(model, batch, prompt, new, variants[index]) for index in order} for new in (1, tokens)
        )
        step = {index: (whole[index] - first[index]) / (tokens - 1) for index in order}
        ratios = dict(steps=step[0] / step[1], whole=whole[0] / whole[1])
        repetitions.append(dict(prefill=(first[0], first[1]), step=(step[0], step[1]), **ratios))
    return repetitions


def main(argv=None) -> list[dict]:
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else FULL
    model = build(args.model, shape)
    model = add_mitigations(model) if args.model == "Llama" else model
    print(
        f"{BASES[args.model]}, prompt {shape.prompt}, {args.tokens} new tokens, {torch.get_num_threads()} threads, "
        f"medians [q1, q3] of {args.reps} repetitions"
    )
    print("| option | batch | prefill and first token, none / option | decoding step, none / option | steps | whole |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for batch in args.batch:
        for option in args.options:
            given = MITIGATIONS[option](batch, shape.prompt)
            repetitions = paired_ratios(model, given, batch, shape.prompt, args.tokens, args.reps)
            times = {  # (no option's median, the option's) of each time
                key: tuple(statistics.median(repetition[key][side] for repetition in repetitions) for side in (0, 1))
                for key in ("prefill", "step")
            }
            spread = {key: quartiles([repetition[key] for repetition in repetitions]) for key in ("steps", "whole")}
            rows.append(dict(option=option, batch=batch, **times, **spread))
            (none_prefill, prefill), (none_step, step) = times["prefill"], times["step"]
            cells = [
                f"{1000 * none_prefill:.1f} / {1000 * prefill:.1f} ms",
                f"{1000 * none_step:.2f} / {1000 * step:.2f} ms",
            ]
            cells += [f"{middle:.3f} [{q1:.3f}, {q3:.3f}]" for q1, middle, q3 in spread.values()]
            print(f"| {option} | {batch} | {' | '.join(cells)} |")
    return rows


if __name__ == "__main__":
    main()
