"""Peak extra memory of each model's workloads, measured in fresh subprocesses (`benchmark.py --memory-worker`): the
resident set's high-water mark on the CPU, torch's allocator on CUDA (see `benchmark.py`'s docstring)."""

import ctypes
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from benchmark_measuring import Measurement, synchronize
from benchmark_models import MODELS, Shape, build, generate, make_train_step, prefill

COMMAND = Path(__file__).with_name("benchmark.py")  # its hidden --memory-worker flag runs `memory_worker`


def read_status(field: str) -> int:
    """`VmRSS`, `VmHWM`, ... of this process in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_memory(fn: Callable[[], object]) -> int:
    """Peak resident memory above the level at the call, in bytes (see the module docstring). Freed heap memory is
    given back first (`malloc_trim`): glibc serves an allocation from its free chunks before it maps new pages, so a
    call after another would reuse its memory without raising the high-water mark."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current VmRSS
    start = read_status("VmRSS")
    result = fn()
    peak = read_status("VmHWM")
    del result
    return max(0, peak - start)  # a few KiB of noise (the high-water mark is kept per page table update) can go below


def peak_extra_cuda_memory(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated above the level at the call, in bytes (torch's allocator, its peak reset here)."""
    gc.collect()
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    result = fn()
    synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak - start


def memory_workloads(name: str, shape: Shape, seed: int) -> dict[str, Callable[[], object]]:
    model = build(name, shape, seed)
    step = make_train_step(model, shape, seed)
    step(1, 8)  # optimiser state exists before the measured step, as it does in training
    for length in (8, 16):
        prefill(model, length, seed)  # lazy initialisation (kernels, thread pools) before the first measurement
    generate(model, 1, 4, 2, seed)
    workloads = {"train_step": step}
    for length in shape.prefill_lengths:
        workloads[f"prefill_{length}"] = lambda length=length: prefill(model, length, seed)
    batch = max(shape.generate_batches)
    workloads[f"generate_b{batch}"] = lambda: generate(model, batch, shape.prompt, shape.new_tokens, seed)
    return workloads


def memory_worker(names: list[str], shape: Shape, seed: int, reps: int) -> None:
    """Runs in a fresh subprocess: prints `{model: {workload: [peak extra bytes per repetition]}}` as JSON."""
    torch.set_num_threads(1)  # workers may run side by side; peak memory does not depend on threads here
    measure = peak_extra_cuda_memory if shape.device == "cuda" else peak_extra_memory
    result = {}
    for name in names:
        workloads = memory_workloads(name, shape, seed)
        result[name] = {key: [measure(fn) for _ in range(reps)] for key, fn in workloads.items()}
        del workloads
    print(json.dumps(result))


def run_memory_workers(shape: Shape, seed: int, reps: int, log, together: bool) -> dict:
    """`{model: {workload: [peak extra bytes per repetition]}}` of every model, from `memory_worker` subprocesses."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    # One fresh process per model, side by side; `together` puts all models in one process (one import instead of
    # three: the tiny preset), measured one after the other.
    groups = [list(MODELS)] if together else [[name] for name in MODELS]
    processes = []
    for names in groups:
        log(f"memory worker {', '.join(names)}")
        command = [
            sys.executable,
            str(COMMAND),
            "--memory-worker",
            ",".join(names),
            "--shape-json",
            json.dumps(dataclasses.asdict(shape)),
            "--seed",
            str(seed),
            "--reps",
            str(reps),
            "--device",
            shape.device,
            "--dtype",
            shape.dtype,
        ]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = {}
    for names, process in zip(groups, processes, strict=True):
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"memory worker {names} failed:\n{stderr[-3000:]}")
        results.update(json.loads(stdout.strip().splitlines()[-1]))
    return results


def workload_label(key: str, shape: Shape) -> str:
    """What a key of `memory_workloads` measures, in words."""
    if key.startswith("prefill_"):
        return f"prefill {key.split('_')[1]} tokens"
    if key.startswith("generate_b"):
        return f"generate {shape.new_tokens} tokens, batch {key[len('generate_b') :]}"
    return {"train_step": f"training step, batch {shape.train_batch} x {shape.train_seq}"}.get(key, key)


def prefill_memory_growth(results: dict, shape: Shape) -> Measurement:
    """Linear in sequence length: the peak at the longest prefill over the peak at the shortest, per model. A
    (heads x n x n) score matrix would make it grow like the square of the length ratio."""
    short, long = min(shape.prefill_lengths), max(shape.prefill_lengths)
    growth = Measurement(
        key="prefill_memory_growth",
        label=f"prefill peak memory {long} / {short} tokens (linear: {long / short:g}, "
        f"quadratic: {(long / short) ** 2:g})",
        unit="x",
        higher_is_better=False,
        runners={},
        section="memory",
        target=f"SepFormer linear (about {long / short:g}x)",
    )
    for name in MODELS:
        pairs = zip(results[name][f"prefill_{short}"], results[name][f"prefill_{long}"], strict=True)
        growth.samples[name] = [b / a if a > 0 else math.nan for a, b in pairs]
    return growth


def measure_memory(shape: Shape, seed: int, reps: int, log, together: bool = False) -> list[Measurement]:
    """A measurement per workload (in MiB), then the prefill's growth with its length."""
    results = run_memory_workers(shape, seed, reps, log, together)
    memory = "CUDA memory allocated" if shape.device == "cuda" else "memory"
    measurements = []
    for key in results["SepFormer"]:
        m = Measurement(
            key=f"peak_memory_{key}",
            label=f"peak extra {memory}: {workload_label(key, shape)}",
            unit="MiB",
            higher_is_better=False,
            runners={},
            section="memory",
        )
        m.samples = {name: [v / 2**20 for v in results[name][key]] for name in MODELS}
        measurements.append(m)
    measurements.append(prefill_memory_growth(results, shape))
    return measurements
