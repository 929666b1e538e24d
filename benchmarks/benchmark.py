"""Speed and memory of SepFormer against Hugging Face's GPT-2 and Llama of the same shape, in one command.

    python benchmarks/benchmark.py                 # the full run (about 4-10 min on 2 CPU cores)
    python benchmarks/benchmark.py --compile       # plus torch.compile speed-ups (about 17 min in all)
    python benchmarks/benchmark.py --tiny          # a smoke run: a tiny shape, checks that everything runs (~1 min)
    python benchmarks/benchmark.py --device cuda --dtype bfloat16 --sections generation mitigations
                                                   # on a GPU, generation and mitigations only (a few minutes)

Prints a markdown table and writes `benchmark.md` and `benchmark.csv` under `--output-dir`.

What is compared. `SepFormerForCausalLM`, `GPT2LMHeadModel` and `LlamaForCausalLM` built from configs with the same
hidden size, depth, heads and vocabulary (259), all in one precision (`--dtype`, fp32 by default; bf16 and fp16 train
in that precision, without an fp32 copy of the weights) on one device (`--device`, the CPU by default),
`attn_implementation="sdpa"`, dropout 0, the same batch and sequence lengths. GPT-2 uses the same tanh-GELU kernel as
SepFormer (`gelu_pytorch_tanh`; its default `gelu_new` is the same function written as several elementwise ops);
Llama keeps its gated SiLU MLP with `intermediate_size = 8/3 d` rounded up to a multiple of 64 (about GPT-2's MLP
parameter count). SepFormer's positional table has as many rows as the longest sequence measured, so no measurement of
the comparison extrapolates; the extrapolation section uses the same weights with a shorter table.

How it is measured. Every measurement is repeated `--reps` times; within each repetition every model is measured in
turn (the order rotates between repetitions), so drifts in machine load hit all models alike. Reported: the median
and the interquartile range [q1, q3] of the repetitions; ratios are SepFormer / peer, the median of the per-repetition
ratios (paired: same repetition) with their IQR. For throughputs a ratio above 1 means SepFormer is faster; for
latencies and memory a ratio below 1 means SepFormer is cheaper.

- training step: forward, backward, `AdamW(fused=True).step()` (Trainer's default optimiser), tokens per second;
- prefill: one forward pass at batch 1 building the KV cache, logits of the last token only (as `generate` does);
- cached generation: `generate` greedy with `min_new_tokens = max_new_tokens`, so every model produces the same number
  of tokens; tokens per second counts generated tokens (the short prompt's prefill is inside the timed call);
  SepFormer decodes as `generate` does by default, with its fused decoding layers (`FusedLayer`) and in-place
  cache appends (`GrowingLayer`);
- on CUDA, every timer is read after `torch.cuda.synchronize()` (kernels run asynchronously);
- peak memory: each model in a fresh subprocess (the three run side by side; memory does not depend on timing). glibc
  is told to map allocations above 64 KiB with mmap (`MALLOC_MMAP_THRESHOLD_`) and, before each measurement, to give
  its freed heap back (`malloc_trim`: it would serve a request from free chunks before mapping new pages), so freed
  tensors leave the resident set; then the kernel's resident high-water mark is reset (`/proc/self/clear_refs`), and
  the reported number is `VmHWM - VmRSS` at the start: the peak extra resident memory the call needed (activations,
  KV cache, gradients, temporaries; not the weights or optimiser state, which exist before); on CUDA, the same
  difference read from torch's allocator, `torch.cuda.max_memory_allocated() - memory_allocated()` at the start,
  after `reset_peak_memory_stats()` before each measurement;
- FLOPs per token: `torch.utils.flop_counter` on one forward pass (`count_params_flops.forward_flops_per_token`),
  attention on torch's math backend (its two matmuls over every query-key pair: the counter has no formula for the
  CPU's fused kernel);
- mitigations: `generate` with each position-bias mitigation on (`MITIGATIONS`); the overhead row is tokens/s with /
  without, the two timed back to back in each repetition, in turn first (machine drift over a repetition is larger
  than the overheads; attention calibration's four dummy passes per row at prefill are inside the timed call). The
  same on Llama given the options by `sepformer.add_mitigations` (a second Llama with the plain one's weights): first
  its cost with no option (mitigated / plain Llama), then each option against none on it; options that read
  SepFormer's own positions (`SEPFORMER_ONLY`) are listed as skipped;
- extrapolation: SepFormer trained length `L` = `max_position_embeddings`; the same weights generate the same number of
  tokens from the same prompt once with a table long enough (plain, within L) and once with a table of `L` rows that
  every new token walks past (`position_extrapolation="fourier"` and `"clamp"`); whole `generate` calls, and, finer,
  single decoding steps with the three variants alternating step by step (thousands of paired samples);
- `--compile`: each model's training step under `torch.compile(model)` and its generation with
  `cache_implementation="static"` and `compile_config=CompileConfig(fullgraph=True)` (transformers' fast path: the
  decoding steps' forward compiled, the prefill eager), interleaved with
  the eager ones (default dynamic cache, and static cache) in the same repetitions; compilation is done before timing
  and its wall time reported (it depends on inductor's on-disk cache).

`--sections` picks what is measured (all by default).

Noise: on a shared 2-core virtual machine single samples vary by 10-30 %; compare medians and paired ratios, and
re-run when an interquartile range straddles a target.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_measuring import Measurement, run_interleaved, summary_rows  # noqa: E402
from benchmark_memory import measure_memory, memory_worker  # noqa: E402
from benchmark_models import FULL, MODELS, TINY, Shape, build  # noqa: E402
from benchmark_report import header, markdown, write_outputs  # noqa: E402
from benchmark_sections import (  # noqa: E402
    comparison_measurements,
    compile_measurements,
    extrapolation_measurements,
    insert_flops_rows,
    mitigated_models,
    skipped_mitigations,
)
from cli_arguments import Distinct, nonnegative_int, output_directory, positive_int  # noqa: E402

SECTIONS = ("training", "prefill", "generation", "mitigations", "extrapolation", "memory")
DTYPES = ("float32", "bfloat16", "float16")


def model_names(text: str) -> list[str]:
    """--memory-worker: a comma-separated list of `MODELS`."""
    names = text.split(",")
    if unknown := [name for name in names if name not in MODELS]:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown))} in {text!r}: give a comma-separated list of {', '.join(MODELS)}"
        )
    return names


def shape_json(text: str) -> Shape:
    """--shape-json: a JSON object of `Shape` fields, each a positive integer (a list of them for a tuple field)."""
    try:
        fields = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None
    defaults = dataclasses.asdict(Shape())
    if not isinstance(fields, dict) or set(fields) - set(defaults):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of Shape fields ({', '.join(defaults)})")

    def positive(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    def fits(name, value) -> bool:
        if isinstance(defaults[name], str):
            return isinstance(value, str)
        if isinstance(defaults[name], tuple):
            return isinstance(value, list) and len(value) > 0 and all(map(positive, value))
        return positive(value)

    if wrong := [name for name, value in fields.items() if not fits(name, value)]:
        raise argparse.ArgumentTypeError(
            f"{', '.join(wrong)} in {text!r}: each field is a positive integer (a list "
            "of them for prefill_lengths and generate_batches; a string for device and "
            "dtype)"
        )
    return Shape(**{name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()})


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the smoke preset (tiny shape, 3 repetitions)")
    parser.add_argument("--reps", type=positive_int, help="repetitions (default 7, 3 with --tiny)")
    parser.add_argument("--output-dir", type=output_directory, default="outputs/benchmark")
    parser.add_argument("--compile", action="store_true", help="add the torch.compile section")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--memory-worker", type=model_names, help=argparse.SUPPRESS)  # what measure_memory runs
    parser.add_argument("--shape-json", type=shape_json, help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run (default cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the models' precision (default float32)")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        action=Distinct,
        help="what to measure (default: all)",
    )
    return parser


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
    """The flags, and the sections to measure in `SECTIONS`' order; flags that contradict each other or the machine
    are refused here, before any work."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "argument --device: cuda given, but torch finds no CUDA GPU here (torch.cuda.is_available() is "
            "False); give --device cpu"
        )
    sections = [name for name in SECTIONS if name in args.sections and not (name == "memory" and args.no_memory)]
    if not sections and not args.compile:
        parser.error("argument --sections: only memory given, and --no-memory skips it: nothing to measure")
    return args, sections


def measured_shape(args) -> Shape:
    """The preset (or the memory worker's --shape-json) on the device, in the precision and repetitions given."""
    shape = args.shape_json or (TINY if args.tiny else FULL)
    shape = dataclasses.replace(shape, device=args.device, dtype=args.dtype)
    if args.reps is not None:
        shape = dataclasses.replace(shape, reps=args.reps)
    return shape


def measure(models: dict, shape: Shape, args, sections: list[str], log) -> tuple[list[Measurement], dict]:
    """Every measurement of `sections` (and of --compile), timed; and the notes under the sections' tables."""
    mitigated = mitigated_models(models, shape, args.seed) if "mitigations" in sections else {}
    notes = {"mitigations": skipped_mitigations()} if mitigated else {}
    for line in notes.get("mitigations", ()):
        log(line[2:])
    measurements = comparison_measurements(models, mitigated, shape, args.seed, sections)
    run_interleaved([m for m in measurements if m.runners], shape.reps, log)
    if "extrapolation" in sections:
        measurements += extrapolation_measurements(models["SepFormer"], shape, args.seed, log)
    if "memory" in sections:
        measurements += measure_memory(shape, args.seed, shape.reps, log, together=args.tiny)
    if args.compile:
        compiled = compile_measurements(shape, args.seed, log)
        run_interleaved([m for m in compiled if m.runners], shape.reps, log)
        measurements += compiled
    return measurements, notes


def main(argv=None):
    args, sections = parse_args(argv)
    transformers.logging.set_verbosity_error()
    shape = measured_shape(args)
    if args.memory_worker:
        memory_worker(args.memory_worker, shape, args.seed, shape.reps)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    models = {name: build(name, shape, args.seed) for name in MODELS}
    measurements, notes = measure(models, shape, args, sections, log)
    rows = [row for m in measurements for row in summary_rows(m)]
    if "training" in sections:  # FLOPs per token beside the training throughput
        insert_flops_rows(rows, models, shape)

    title = header(shape, args, sections, load_before, time.perf_counter() - start)
    table = markdown(rows, title, notes)
    print(table)
    write_outputs(table, rows, Path(args.output_dir), "benchmark")
    log(f"wrote {args.output_dir}/benchmark.md and benchmark.csv")


if __name__ == "__main__":
    main()
