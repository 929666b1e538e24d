"""Aten calls and Python calls per cached decoding step: SepFormer and a Llama given `add_mitigations` (plain and with
each position-bias mitigation), and their peers.

At the benchmark's size a CPU decoding step is bound by the number of kernels and the Python between them (with the
bytes of weights it reads and the copies of its cache), not by FLOPs, so these counts explain much of the generation
rows of `benchmark.py`, without its timing noise. Aten calls are counted by a `TorchDispatchMode` (every aten call that
reaches a kernel, views included), Python calls by `cProfile` (functions and builtins), each as the difference between
generating `--tokens` and `2 × --tokens` new tokens, so the prefill and the first step cancel out.

    python benchmarks/count_kernels.py            # batch 1 and 8, the benchmark's shape
    python benchmarks/count_kernels.py --tiny     # the tiny shape (seconds)
"""

import argparse
import collections
import cProfile
import pstats
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_models import FULL, MODELS, TINY, build, generate  # noqa: E402
from benchmark_sections import MITIGATED_LLAMA, MITIGATIONS, measured_on  # noqa: E402
from cli_arguments import positive_int  # noqa: E402

from sepformer import add_mitigations  # noqa: E402


class AtenCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def calls_per_step(model, batch: int, prompt: int, tokens: int, **options) -> collections.Counter[str]:
    """Aten calls of one decoding step, by name: (calls for 2 × tokens - calls for tokens) / tokens, after a warm-up
    (constants made once per shape are not a step's cost; what each generation makes once, as its fused weights,
    cancels in the difference)."""
    generate(model, batch, prompt, 2 * tokens, 0, **options)
    counts = []
    for new_tokens in (tokens, 2 * tokens):
        with AtenCalls() as mode:
            generate(model, batch, prompt, new_tokens, 0, **options)
        counts.append(mode.calls)
    difference = counts[1].copy()
    difference.subtract(counts[0])
    fewer = {name: count for name, count in difference.items() if count < 0}
    assert not fewer, f"more steps made fewer calls of {fewer}: the steps are not alike"
    return collections.Counter({name: count / tokens for name, count in difference.items() if count})


def python_calls_per_step(model, batch: int, prompt: int, tokens: int, **options) -> float:
    """Python calls (functions and builtins, as `cProfile` counts them) of one decoding step, by the same difference
    as `calls_per_step`."""
    generate(model, batch, prompt, 2 * tokens, 0, **options)
    totals = []
    for new_tokens in (tokens, 2 * tokens):
        profile = cProfile.Profile()
        profile.runcall(generate, model, batch, prompt, new_tokens, 0, **options)
        totals.append(sum(calls for _, calls, *_ in pstats.Stats(profile).stats.values()))
    return (totals[1] - totals[0]) / tokens


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape")
    parser.add_argument("--tokens", type=positive_int, default=16, help="decoding steps counted")
    parser.add_argument("--top", type=positive_int, default=6, help="the most frequent calls listed per row")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else FULL
    rows = []
    models = {name: build(name, shape) for name in MODELS}
    models[MITIGATED_LLAMA] = add_mitigations(build("Llama", shape))
    variants = [(name, None) for name in models] + [
        (base, mitigation) for base in ("SepFormer", MITIGATED_LLAMA) for mitigation in measured_on(base)
    ]
    print(f"calls per decoding step, prompt {shape.prompt}, d_model={shape.hidden_size}, {shape.layers} layers")
    print("| model | batch | aten calls | vs no option | Python calls | vs no option | most frequent aten calls |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for batch in shape.generate_batches:
        plain = {}  # per model, (aten calls, Python calls) of its step without an option
        for name, mitigation in variants:
            options = MITIGATIONS[mitigation](batch, shape.prompt) if mitigation else {}
            calls = calls_per_step(models[name], batch, shape.prompt, args.tokens, **options)
            total = sum(calls.values())
            python = python_calls_per_step(models[name], batch, shape.prompt, args.tokens, **options)
            if mitigation is None:
                plain[name] = total, python
            aten_more, python_more = (
                f"{count - base:+.0f}" if mitigation else ""
                for count, base in zip((total, python), plain[name], strict=True)
            )
            label = f"{name} + {mitigation}" if mitigation else name
            frequent = ", ".join(f"{call} {count:g}" for call, count in calls.most_common(args.top))
            print(f"| {label} | {batch} | {total:.0f} | {aten_more} | {python:.0f} | {python_more} | {frequent} |")
            rows.append(dict(model=label, batch=batch, calls=total, python_calls=python))
    return rows


if __name__ == "__main__":
    main()
