"""Aten calls per cached decoding step: SepFormer (plain and with each position-bias mitigation) and its peers.

At the benchmark's size a CPU decoding step is bound by the number of kernels (with the bytes of weights it reads and
the copies of its cache), not by FLOPs, so this count explains much of the generation rows of `benchmark.py`, without
its timing noise. Counted by a `TorchDispatchMode` (every aten call
that reaches a kernel, views included) as the difference between generating `--tokens` and `2 × --tokens` new tokens,
so the prefill and the first step cancel out.

    python benchmarks/count_kernels.py            # batch 1 and 8, the benchmark's shape
    python benchmarks/count_kernels.py --tiny     # the tiny shape (seconds)
"""

import argparse
import collections
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_models import FULL, MODELS, TINY, build, generate  # noqa: E402
from benchmark_sections import MITIGATIONS  # noqa: E402
from cli_arguments import positive_int  # noqa: E402


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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape")
    parser.add_argument("--tokens", type=positive_int, default=16, help="decoding steps counted")
    parser.add_argument("--top", type=positive_int, default=6, help="the most frequent calls listed per row")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else FULL
    rows = []
    variants = [(name, None) for name in MODELS] + [("SepFormer", mitigation) for mitigation in MITIGATIONS]
    models = {name: build(name, shape) for name in MODELS}
    print(f"aten calls per decoding step, prompt {shape.prompt}, d_model={shape.hidden_size}, {shape.layers} layers")
    print("| model | batch | calls | vs plain SepFormer | most frequent |")
    print("|---|---:|---:|---:|---|")
    for batch in shape.generate_batches:
        plain = None
        for name, mitigation in variants:
            options = MITIGATIONS[mitigation](batch, shape.prompt) if mitigation else {}
            calls = calls_per_step(models[name], batch, shape.prompt, args.tokens, **options)
            total = sum(calls.values())
            if name == "SepFormer" and mitigation is None:
                plain = total
            label = f"{name} + {mitigation}" if mitigation else name
            versus = f"{total - plain:+.0f}" if plain is not None and name == "SepFormer" and mitigation else ""
            frequent = ", ".join(f"{call} {count:g}" for call, count in calls.most_common(args.top))
            print(f"| {label} | {batch} | {total:.0f} | {versus} | {frequent} |")
            rows.append(dict(model=label, batch=batch, calls=total))
    return rows


if __name__ == "__main__":
    main()
