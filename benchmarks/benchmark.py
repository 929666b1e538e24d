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
  is told to serve every allocation above 64 KiB with mmap (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the
  resident set; before each measurement the kernel's resident high-water mark is reset (`/proc/self/clear_refs`), and
  the reported number is `VmHWM - VmRSS` at the start: the peak extra resident memory the call needed (activations,
  KV cache, gradients, temporaries; not the weights or optimiser state, which exist before); on CUDA, the same
  difference read from torch's allocator, `torch.cuda.max_memory_allocated() - memory_allocated()` at the start,
  after `reset_peak_memory_stats()` before each measurement;
- FLOPs per token: `torch.utils.flop_counter` on one forward pass (`count_params_flops.forward_flops_per_token`);
- mitigations: `generate` with each position-bias mitigation on (`MITIGATIONS`), in the generation measurements'
  repetitions; the overhead row is tokens/s with / without (attention calibration's four dummy passes per row at
  prefill are inside the timed call). The same on Llama given the options by `sepformer.add_mitigations` (a second
  Llama with the plain one's weights): first its cost with no option (mitigated / plain Llama), then each option against
  none on it; options that read SepFormer's own positions (`SEPFORMER_ONLY`) are listed as skipped;
- extrapolation: SepFormer trained length `L` = `max_position_embeddings`; the same weights generate the same number of
  tokens from the same prompt once with a table long enough (plain, within L) and once with a table of `L` rows that
  every new token walks past (`position_extrapolation="fourier"` and `"clamp"`); whole `generate` calls, and, finer,
  single decoding steps with the three variants alternating step by step (thousands of paired samples);
- `--compile`: each model's training step under `torch.compile(model)` and its generation with
  `cache_implementation="static"` and `compile_config=CompileConfig(fullgraph=True)` (transformers' fast path: the
  decoding steps' forward compiled, the prefill eager), interleaved with
  the eager ones (default dynamic cache, and static cache) in the same repetitions; compilation is done before timing
  and its wall time reported (it depends on inductor's on-disk cache).

`--sections` picks what is measured (all by default; `mitigations` needs `generation`, whose repetitions time them).

Noise: on a shared 2-core virtual machine single samples vary by 10-30 %; compare medians and paired ratios, and
re-run when an interquartile range straddles a target.
"""

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, CompileConfig, GPT2Config, LlamaConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from cli_arguments import Distinct, nonnegative_int, output_directory, positive_int  # noqa: E402
from count_params_flops import forward_flops_per_token  # noqa: E402

import sepformer  # noqa: E402,F401  (registers the Auto classes)
from sepformer import (  # noqa: E402
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    SepFormerConfig,
    StableMask,
    add_mitigations,
)

PAD, BOS, EOS = 256, 257, 258
MODELS = ("SepFormer", "GPT-2", "Llama")
PEERS = ("GPT-2", "Llama")
MITIGATED_LLAMA = "Llama + add_mitigations"  # the variant of a Llama given the mitigation keywords, with no option on
SECTIONS = ("training", "prefill", "generation", "mitigations", "extrapolation", "memory")
DTYPES = ("float32", "bfloat16", "float16")


def calibration_over_quarters(batch: int, prompt: int, bias_estimate: str = "dummy_passes") -> dict:
    """Calibration over four equal documents covering the prompt (with dummy passes: four more per row at prefill)."""
    quarter = prompt // 4
    spans = tuple((k * quarter, (k + 1) * quarter) for k in range(4))
    return {"attention_calibration": AttentionCalibration(spans=(spans,) * batch, bias_estimate=bias_estimate)}


def windows_over_quarters(batch: int, prompt: int) -> dict:
    """Parallel context windows: four windows after the first token (shared, as <bos>), covering the prompt."""
    quarter = (prompt - 1) // 4
    spans = tuple((1 + k * quarter, 1 + (k + 1) * quarter) for k in range(4))
    return {"parallel_context_windows": ParallelContextWindows(spans=(spans,) * batch)}


# Position-bias mitigations: a name -> (batch, prompt length) -> the keyword arguments that switch it on in
# SepFormer's `generate`. Each adds a variant "SepFormer + <name>" to the generation measurements, timed against plain
# SepFormer in the same repetitions (same prompt, same number of tokens), and a row of overhead ratios. Main
# parameters as in the papers; their values do not change the work done.
MITIGATIONS: dict[str, Callable[[int, int], dict]] = {
    "stable_mask": lambda batch, prompt: {"stable_mask": StableMask(gamma=0.05)},
    "ms_poe": lambda batch, prompt: {"ms_poe": MSPoE()},
    # one channel, given: a Llama has no positional block to default to (the work does not depend on which)
    "positional_scaling": lambda batch, prompt: {"positional_scaling": PositionalScaling(factor=0.0, channels=(0,))},
    "attention_calibration": calibration_over_quarters,
    "attention_calibration_positional": lambda batch, prompt: calibration_over_quarters(batch, prompt, "positional"),
    "parallel_context_windows": windows_over_quarters,
    # one bucket (the model's own reading: what the machinery costs), then three reading the learned table at three
    # scales: a pass of the model per bucket by design
    "attention_buckets_1": lambda batch, prompt: {"attention_buckets": AttentionBuckets(scales=(1.0,))},
    "attention_buckets_3": lambda batch, prompt: {"attention_buckets": AttentionBuckets(scales=(1.0, 0.9, 0.8))},
}


# Mitigations that do more work by design (one pass of the model per bucket): their target is per bucket.
PER_BUCKET = {"attention_buckets_3": 3}

# Mitigations measured on SepFormer alone, with why (the others are measured on the mitigated Llama too).
SEPFORMER_ONLY = {"attention_calibration_positional": "bias_estimate='positional' reads SepFormer's positional block"}


def why_not_on_llama(mitigation: str) -> str | None:
    """Why a `MITIGATIONS` entry is not measured on the mitigated Llama; None when it is."""
    return SEPFORMER_ONLY.get(mitigation)


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    vocab_size: int = 259
    train_batch: int = 8
    train_seq: int = 512
    train_steps: int = 2  # steps per timed sample
    prefill_lengths: tuple[int, ...] = (512, 2048)
    prompt: int = 64  # prompt of the generation measurements
    new_tokens: int = 256
    generate_batches: tuple[int, ...] = (1, 8)
    extrapolation_length: int = 256  # L of the extrapolation section: the prompt, so every new token is past L
    reps: int = 7
    device: str = "cpu"  # where every model runs, and its precision (`--device`, `--dtype`)
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def extrapolation_reps(self) -> int:
        return 3 * self.reps

    @property
    def max_length(self) -> int:
        return max(
            *self.prefill_lengths,
            self.train_seq,
            self.prompt + self.new_tokens,
            self.extrapolation_length + self.new_tokens,
        )

    @property
    def llama_intermediate(self) -> int:
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)


FULL = Shape()
TINY = Shape(
    hidden_size=64,
    layers=2,
    heads=4,
    train_batch=2,
    train_seq=64,
    train_steps=1,
    prefill_lengths=(64, 256),
    prompt=8,
    new_tokens=12,
    generate_batches=(1, 2),
    extrapolation_length=16,
    reps=3,
)


# ----------------------------------------------------------------------------------------------------------- models


def build(name: str, shape: Shape, seed: int = 0, max_length: int | None = None):
    """One of `MODELS` at `shape` (on its device, in its dtype), sdpa, dropout 0, deterministic weights for a seed."""
    max_length = max_length or shape.max_length
    common = dict(vocab_size=shape.vocab_size, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if name == "SepFormer":
        config = SepFormerConfig(
            hidden_size=shape.hidden_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            max_position_embeddings=max_length,
            **common,
        )
    elif name == "GPT-2":
        config = GPT2Config(
            n_embd=shape.hidden_size,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_positions=max_length,
            activation_function="gelu_pytorch_tanh",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    elif name == "Llama":
        config = LlamaConfig(
            hidden_size=shape.hidden_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads,
            intermediate_size=shape.llama_intermediate,
            max_position_embeddings=max_length,
            tie_word_embeddings=False,
            **common,
        )
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {MODELS}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=shape.torch_dtype)
    model.generation_config.pad_token_id = PAD
    return model.to(shape.device).eval()


def with_table(model, rows: int):
    """The same SepFormer weights with a positional table of `rows` rows (`L = rows`)."""
    config = SepFormerConfig(**{**model.config.to_dict(), "max_position_embeddings": rows, "position_table_size": rows})
    state = dict(model.state_dict())
    key = "model.embed_positions.weight"
    table = state[key]
    if rows <= table.shape[0]:
        state[key] = table[:rows].clone()
    else:
        state[key] = torch.cat((table, table[-1:].expand(rows - table.shape[0], -1)), 0)
    shorter = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=model.dtype)
    shorter.load_state_dict(state)
    shorter.generation_config.pad_token_id = PAD
    return shorter.to(model.device).eval()


def token_ids(batch: int, length: int, seed: int, device: torch.device) -> torch.LongTensor:
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


# ----------------------------------------------------------------------------------------------------------- workloads


def make_train_step(model, shape: Shape, seed: int) -> Callable[[int, int], None]:
    """`step(batch, seq)`: forward, backward, AdamW step; batch and sequence default to the shape's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: int = shape.train_batch, seq: int = shape.train_seq):
        model.train()
        ids = token_ids(batch, seq, seed, model.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def prefill(model, length: int, seed: int):
    model.eval()
    with torch.no_grad():
        return model(input_ids=token_ids(1, length, seed, model.device), use_cache=True, logits_to_keep=1).logits


def generate(model, batch: int, prompt: int, new_tokens: int, seed: int, **kwargs):
    model.eval()
    ids = token_ids(batch, prompt, seed, model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=PAD,
        **kwargs,
    )
    if out.shape != (batch, prompt + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {(batch, prompt + new_tokens)}")
    return out


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


# ----------------------------------------------------------------------------------------------------------- measuring


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
    source: str = ""  # the key of the measurement whose samples the ratios read (timed there)
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def run_interleaved(measurements: list[Measurement], reps: int, log) -> None:
    """Warm up every runner once, then `reps` repetitions; in each, every measurement runs every variant in turn."""
    for m in measurements:
        for name, runner in m.runners.items():
            log(f"warm-up {m.key} {name}")
            runner()
            m.samples[name] = []
    for rep in range(reps):
        log(f"repetition {rep + 1}/{reps}")
        for m in measurements:
            names = list(m.runners)
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                m.samples[name].append(m.runners[name]())


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def summary_rows(m: Measurement) -> list[dict]:
    rows = []
    for name, values in m.samples.items():
        q1, median, q3 = quartiles(values)
        rows.append(
            dict(
                section=m.section,
                metric=m.key,
                label=m.label,
                variant=name,
                unit=m.unit,
                median=median,
                q1=q1,
                q3=q3,
                min=min(values),
                max=max(values),
                n=len(values),
                higher_is_better=m.higher_is_better,
                target=m.target,
            )
        )
    for numerator, denominator in m.ratios:
        if numerator not in m.samples or denominator not in m.samples:
            continue
        ratios = [a / b if b else math.nan for a, b in zip(m.samples[numerator], m.samples[denominator], strict=True)]
        q1, median, q3 = quartiles(ratios)
        rows.append(
            dict(
                section=m.section,
                metric=m.key,
                label=m.label,
                variant=f"{numerator} / {denominator}",
                unit="ratio",
                median=median,
                q1=q1,
                q3=q3,
                min=min(ratios),
                max=max(ratios),
                n=len(ratios),
                higher_is_better=m.higher_is_better,
                target=m.target,
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------------------- memory


def read_status(field: str) -> int:
    """`VmRSS`, `VmHWM`, ... of this process in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_memory(fn: Callable[[], object]) -> int:
    """Peak resident memory above the level at the call, in bytes (see the module docstring)."""
    gc.collect()
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


def measure_memory(shape: Shape, seed: int, reps: int, log, together: bool = False) -> list[Measurement]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    # One fresh process per model, side by side; `together` puts all models in one process (one import instead of
    # three: the tiny preset), measured one after the other.
    groups = [list(MODELS)] if together else [[name] for name in MODELS]
    processes = []
    for names in groups:
        log(f"memory worker {', '.join(names)}")
        command = [
            sys.executable,
            __file__,
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
    measurements = []
    for key in results["SepFormer"]:
        label = {"train_step": f"training step, batch {shape.train_batch} x {shape.train_seq}"}.get(key, key)
        if key.startswith("prefill_"):
            label = f"prefill {key.split('_')[1]} tokens"
        elif key.startswith("generate_b"):
            label = f"generate {shape.new_tokens} tokens, batch {key[len('generate_b') :]}"
        memory = "CUDA memory allocated" if shape.device == "cuda" else "memory"
        m = Measurement(
            key=f"peak_memory_{key}",
            label=f"peak extra {memory}: {label}",
            unit="MiB",
            higher_is_better=False,
            runners={},
            section="memory",
        )
        m.samples = {name: [v / 2**20 for v in results[name][key]] for name in MODELS}
        measurements.append(m)
    # Linear in sequence length: the peak at the longest prefill over the peak at the shortest, per model. A
    # (heads x n x n) score matrix would make it grow like the square of the length ratio.
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
    growth.samples = {}
    for name in MODELS:
        pairs = zip(results[name][f"prefill_{short}"], results[name][f"prefill_{long}"], strict=True)
        growth.samples[name] = [b / a if a > 0 else math.nan for a, b in pairs]
    measurements.append(growth)
    return measurements


# ----------------------------------------------------------------------------------------------------------- sections


def comparison_measurements(models: dict, mitigated: dict, shape: Shape, seed: int, sections) -> list[Measurement]:
    """The measurements of `sections` timed by `run_interleaved`; the mitigations on the `mitigated` models."""
    measurements = []
    if "training" in sections:
        steps = {name: make_train_step(model, shape, seed) for name, model in models.items()}
        tokens = shape.train_batch * shape.train_seq

        def train_runner(name):
            return lambda: tokens * shape.train_steps / timed(lambda: [steps[name]() for _ in range(shape.train_steps)])

        measurements.append(
            Measurement(
                key="train_tokens_per_s",
                label=f"training step (fwd+bwd+AdamW), batch {shape.train_batch} x {shape.train_seq}",
                unit="tokens/s",
                higher_is_better=True,
                runners={name: train_runner(name) for name in models},
                target="SepFormer/GPT-2 >= 1.10",
            )
        )
    for length in shape.prefill_lengths if "prefill" in sections else ():
        measurements.append(
            Measurement(
                key=f"prefill_{length}_ms",
                label=f"prefill latency, {length} tokens, batch 1",
                unit="ms",
                higher_is_better=False,
                runners={
                    name: (lambda model=model, length=length: 1000 * timed(lambda: prefill(model, length, seed)))
                    for name, model in models.items()
                },
            )
        )
    for batch in shape.generate_batches if "generation" in sections else ():
        measurements += generation_measurements(models, mitigated, shape, seed, batch)
    return measurements


def mitigated_models(models: dict, shape: Shape, seed: int) -> dict:
    """The models the mitigations are measured on, by their variant's name with no option on: SepFormer, and a second
    Llama with the plain one's weights, given SepFormer's mitigation keywords by `add_mitigations`."""
    return {"SepFormer": models["SepFormer"], MITIGATED_LLAMA: add_mitigations(build("Llama", shape, seed))}


def measured_on(base: str) -> list[str]:
    """The `MITIGATIONS` entries measured on the mitigated model of variant `base`."""
    return [mitigation for mitigation in MITIGATIONS if base == "SepFormer" or why_not_on_llama(mitigation) is None]


def skipped_mitigations() -> list[str]:
    """A line for each `MITIGATIONS` entry not measured on the mitigated Llama, saying why."""
    return [
        f"- {MITIGATED_LLAMA} + {mitigation}: skipped, {why}."
        for mitigation in MITIGATIONS
        if (why := why_not_on_llama(mitigation))
    ]


def generation_measurements(models: dict, mitigated: dict, shape: Shape, seed: int, batch: int) -> list[Measurement]:
    """Cached generation at `batch`, every model and every mitigation timed in it, and the mitigations' overheads."""

    def runner(model, **kwargs):
        return lambda: (
            batch
            * shape.new_tokens
            / timed(lambda: generate(model, batch, shape.prompt, shape.new_tokens, seed, **kwargs))
        )

    runners = {name: runner(model) for name, model in {**models, **mitigated}.items()}
    for base, model in mitigated.items():  # see MITIGATIONS: each model with each one switched on
        for mitigation in measured_on(base):
            runners[f"{base} + {mitigation}"] = runner(model, **MITIGATIONS[mitigation](batch, shape.prompt))
    key = f"generate_b{batch}_tokens_per_s"
    measurements = [
        Measurement(
            key=key,
            label=f"cached generation, {shape.new_tokens} new tokens, batch {batch} (prompt {shape.prompt})",
            unit="tokens/s",
            higher_is_better=True,
            runners=runners,
            target="SepFormer/GPT-2 >= 1.05, /Llama >= 1.0" if batch == 1 else "SepFormer/GPT-2 and /Llama >= 1.0",
        )
    ]
    if not mitigated:
        return measurements
    measurements.append(
        Measurement(
            key=f"generate_b{batch}_add_mitigations",
            label=f"Llama generation after add_mitigations, no option, batch {batch}",
            unit="tokens/s",
            higher_is_better=True,
            runners={},
            ratios=((MITIGATED_LLAMA, "Llama"),),
            section="mitigations",
            source=key,
            target="mitigated / plain >= 0.95",
        )
    )
    for mitigation in MITIGATIONS:
        measurements.append(
            Measurement(
                key=f"generate_b{batch}_mitigation_{mitigation}",
                label=f"generation with {mitigation}, batch {batch}",
                unit="tokens/s",
                higher_is_better=True,
                runners={},
                ratios=tuple((f"{base} + {mitigation}", base) for base in mitigated if mitigation in measured_on(base)),
                section="mitigations",
                source=key,
                target=f"with / without >= 0.87 / {PER_BUCKET[mitigation]} ({PER_BUCKET[mitigation]} buckets)"
                if mitigation in PER_BUCKET
                else "with / without >= 0.87 (<= 15% more time)",
            )
        )
    return measurements


def link_mitigation_samples(measurements: list[Measurement]) -> None:
    """Mitigation variants are timed inside the generation measurements; their overhead rows reuse those samples."""
    by_key = {m.key: m for m in measurements}
    for m in measurements:
        if m.source:
            m.samples = {name: by_key[m.source].samples[name] for pair in m.ratios for name in pair}


def extrapolation_measurement(sepformer_model, shape: Shape, seed: int) -> Measurement:
    """Same weights, same prompt, same number of new tokens; only whether the positions run past the table differs."""
    length = shape.extrapolation_length
    within = with_table(sepformer_model, length + shape.new_tokens)  # plain: every position inside the table
    past = {method: with_table(sepformer_model, length) for method in ("fourier", "clamp")}  # one instance each, so
    # each keeps its own extended-table cache as a user generating with one method would

    def runner(model, **kwargs):
        return lambda: 1000 * timed(lambda: generate(model, 1, length, shape.new_tokens, seed, **kwargs))

    runners = {"within L": runner(within)}
    for method, model in past.items():
        runners[f"past L, {method}"] = runner(model, position_extrapolation=method)
    return Measurement(
        key="extrapolation_generate_ms",
        label=f"SepFormer generate, batch 1, prompt {length} tokens = L, "
        f"{shape.new_tokens} new tokens all past L; 'within L': same weights, table of {length + shape.new_tokens} "
        "rows",
        unit="ms",
        higher_is_better=False,
        runners=runners,
        ratios=tuple((f"past L, {method}", "within L") for method in past),
        section="extrapolation",
        target="past / within <= 1.05",
    )


def extrapolation_step_measurement(sepformer_model, shape: Shape, seed: int, rounds: int = 2) -> Measurement:
    """The same comparison one decoding step at a time: the three variants alternate at every step (the order rotates),
    so each step's times are a pair taken within milliseconds of each other; `rounds` passes over the new tokens.

    Each step is what `generate` runs per token: a forward of one token with the KV cache, the position and the 2D
    attention mask, logits of that token only; the time of `generate`'s own per-token work is left out.
    """
    length = shape.extrapolation_length
    variants = {"within L": (with_table(sepformer_model, length + shape.new_tokens), {})}
    for method in ("fourier", "clamp"):
        variants[f"past L, {method}"] = (with_table(sepformer_model, length), {"position_extrapolation": method})
    samples = {name: [] for name in variants}
    ids = token_ids(1, length, seed, sepformer_model.device)
    with torch.no_grad():
        for _ in range(rounds):
            caches = {
                name: model(input_ids=ids, use_cache=True, **kwargs).past_key_values
                for name, (model, kwargs) in variants.items()
            }
            token = ids[:, -1:]
            for step in range(shape.new_tokens):
                position = torch.tensor([[length + step]], device=ids.device)
                mask = torch.ones(1, length + step + 1, dtype=torch.long, device=ids.device)
                names = list(variants)
                for name in names[step % 3 :] + names[: step % 3]:
                    model, kwargs = variants[name]
                    synchronize()
                    start = time.perf_counter()
                    model(
                        input_ids=token,
                        attention_mask=mask,
                        position_ids=position,
                        past_key_values=caches[name],
                        use_cache=True,
                        logits_to_keep=1,
                        **kwargs,
                    )
                    synchronize()
                    samples[name].append(1e6 * (time.perf_counter() - start))
    measurement = Measurement(
        key="extrapolation_decode_step_us",
        label=f"SepFormer decoding step, batch 1, positions {length}.."
        f"{length + shape.new_tokens - 1} (past L={length}), variants alternating step by step, {rounds} passes",
        unit="us",
        higher_is_better=False,
        runners={},
        ratios=tuple((name, "within L") for name in variants if name != "within L"),
        section="extrapolation",
        target="past / within <= 1.05",
    )
    measurement.samples = samples
    return measurement


def fullgraph_compile_config() -> CompileConfig:
    """transformers' fast path for generation: with a static cache, `generate` compiles the decoding steps' forward
    (`fullgraph`) and runs the prefill eagerly. It does so on accelerators only unless told to on CPUs too."""
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    return config


def compile_measurements(shape: Shape, seed: int, log) -> list[Measurement]:
    """Eager against `torch.compile`: the training step, and generation with a static cache and a compiled forward."""
    # transformers' forward decorators share one code object between the three models (and the prefill/decode shapes
    # of each), so their compiled graphs count against one recompile limit: raise it, or the third model fails.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    measurements = []
    train_runners, generate_runners, compile_seconds = {}, {}, {}
    tokens = shape.train_batch * shape.train_seq
    batch = min(shape.generate_batches)
    for name in MODELS:
        eager = build(name, shape, seed)
        compiled = build(name, shape, seed)
        eager_step = make_train_step(eager, shape, seed)
        compiled_step = make_train_step(torch.compile(compiled), shape, seed)
        seconds = timed(lambda step=compiled_step: [step(), step()])
        compile_seconds[f"{name} training (first 2 steps)"] = [seconds]
        log(f"compiled {name} training step in {seconds:.1f}s")
        for label, step in (("eager", eager_step), ("compiled", compiled_step)):
            train_runners[f"{name} {label}"] = lambda step=step: (
                tokens * shape.train_steps / timed(lambda: [step() for _ in range(shape.train_steps)])
            )

        generator = build(name, shape, seed)
        static = {"cache_implementation": "static"}
        compiled_static = dict(static, compile_config=fullgraph_compile_config())
        seconds = timed(
            lambda model=generator, kwargs=compiled_static: generate(
                model, batch, shape.prompt, shape.new_tokens, seed, **kwargs
            )
        )
        compile_seconds[f"{name} generation (first call)"] = [seconds]
        log(f"compiled {name} static-cache generation in {seconds:.1f}s")
        for label, model, kwargs in (
            ("eager", eager, {}),
            ("eager static cache", eager, static),
            ("compiled static cache", generator, compiled_static),
        ):
            generate_runners[f"{name} {label}"] = lambda model=model, kwargs=kwargs: (
                batch
                * shape.new_tokens
                / timed(lambda: generate(model, batch, shape.prompt, shape.new_tokens, seed, **kwargs))
            )
    speedups = tuple((f"{name} compiled", f"{name} eager") for name in MODELS)
    across = tuple((f"SepFormer {label}", f"{peer} {label}") for label in ("eager", "compiled") for peer in PEERS)
    measurements.append(
        Measurement(
            key="compile_train_tokens_per_s",
            label=f"training step, batch {shape.train_batch} x {shape.train_seq}: torch.compile(model) vs eager",
            unit="tokens/s",
            higher_is_better=True,
            runners=train_runners,
            ratios=speedups + across,
            section="compile",
        )
    )
    speedups = tuple(
        (f"{name} compiled static cache", f"{name} {label}")
        for name in MODELS
        for label in ("eager", "eager static cache")
    )
    across = tuple(
        (f"SepFormer {label}", f"{peer} {label}") for label in ("eager", "compiled static cache") for peer in PEERS
    )
    measurements.append(
        Measurement(
            key="compile_generate_tokens_per_s",
            label=f"generation, batch {batch}, {shape.new_tokens} new tokens: "
            "forward compiled (fullgraph) with a static cache vs eager",
            unit="tokens/s",
            higher_is_better=True,
            runners=generate_runners,
            ratios=speedups + across,
            section="compile",
        )
    )
    compile_time = Measurement(
        key="compile_seconds",
        label="compilation: wall time of the first compiled calls",
        unit="s",
        higher_is_better=False,
        runners={},
        ratios=(),
        section="compile",
    )
    compile_time.samples = compile_seconds
    measurements.append(compile_time)
    return measurements


def flops_rows(models: dict, shape: Shape, train_ratio: dict) -> list[dict]:
    flops = {name: forward_flops_per_token(model.eval(), shape.train_seq) for name, model in models.items()}
    rows = [
        dict(
            section="comparison",
            metric="forward_flops_per_token",
            label=f"forward FLOPs per token (flop_counter, {shape.train_seq} tokens)",
            variant=name,
            unit="MFLOP",
            median=value / 1e6,
            q1=value / 1e6,
            q3=value / 1e6,
            min=value / 1e6,
            max=value / 1e6,
            n=1,
            higher_is_better=False,
            target="",
        )
        for name, value in flops.items()
    ]
    for peer in PEERS:
        ratio = flops["SepFormer"] / flops[peer]
        rows.append(
            dict(
                rows[0],
                variant=f"SepFormer / {peer}",
                unit="ratio",
                median=ratio,
                q1=ratio,
                q3=ratio,
                min=ratio,
                max=ratio,
            )
        )
        # measured time per token, for comparison with the FLOP ratio: 1 / throughput ratio
        q1, median, q3 = (1 / train_ratio[peer][2], 1 / train_ratio[peer][1], 1 / train_ratio[peer][0])
        rows.append(
            dict(
                section="comparison",
                metric="train_time_per_token",
                label="training time per token (1 / throughput ratio, beside the FLOP ratio)",
                variant=f"SepFormer / {peer}",
                unit="ratio",
                median=median,
                q1=q1,
                q3=q3,
                min=q1,
                max=q3,
                n=1,
                higher_is_better=False,
                target="",
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------------------- report


def fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["n"] == 1 or row["q1"] == row["q3"]:
        return fmt(row["median"])
    return f"{fmt(row['median'])} [{fmt(row['q1'])}, {fmt(row['q3'])}]"


def markdown(rows: list[dict], header: str, notes: dict[str, list[str]]) -> str:
    """The tables of `rows` under `header`; `notes`: lines printed under a section's table, by section."""
    lines = [header, ""]
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["metric"], []).append(row)
    sections = {}
    for group in grouped.values():
        sections.setdefault(group[0]["section"], []).append(group)

    def find(group, variant):
        return next((r for r in group if r["variant"] == variant), None)

    comparison = sections.get("comparison", []) + sections.get("memory", [])
    if comparison:
        lines += [
            "| measurement | unit | SepFormer | GPT-2 | Llama | SepFormer / GPT-2 | SepFormer / Llama | target |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for group in comparison:
            first = group[0]
            unit = next((r["unit"] for r in group if r["unit"] != "ratio"), "ratio")
            direction = " (higher is better)" if first["higher_is_better"] else ""
            lines.append(
                f"| {first['label']} | {unit}{direction} | "
                + " | ".join(
                    cell(find(group, v))
                    for v in ("SepFormer", "GPT-2", "Llama", "SepFormer / GPT-2", "SepFormer / Llama")
                )
                + f" | {first['target']} |"
            )
        lines.append("")
    for section, title in (
        ("extrapolation", "Extrapolation past the trained length"),
        ("mitigations", "Position-bias mitigations"),
        ("compile", "torch.compile"),
    ):
        if section not in sections:
            continue
        lines += [f"### {title}", "", "| measurement | variant | median [q1, q3] | target |", "|---|---|---:|---|"]
        for group in sections[section]:
            for i, row in enumerate(group):
                label = group[0]["label"] if i == 0 else ""
                unit = "" if row["unit"] == "ratio" else " " + row["unit"]
                lines.append(
                    f"| {label} | {row['variant']} | {cell(row)}{unit} | "
                    f"{row['target'] if row['unit'] == 'ratio' else ''} |"
                )
        lines += ["", *notes.get(section, ()), *([""] if notes.get(section) else ())]
    return "\n".join(lines)


def write_outputs(table: str, rows: list[dict], output_dir: Path, stem: str) -> None:
    """`<stem>.md` (the table) and `<stem>.csv` (the rows) under `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{stem}.md").write_text(table + "\n")
    with open(output_dir / f"{stem}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def header(shape: Shape, args, sections: list[str], load_before: float, elapsed: float) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if shape.device == "cuda":
        cpu = f"{torch.cuda.get_device_name()} (host: {cpu})"
    d_pos = shape.hidden_size // shape.heads
    text = (
        f"## SepFormer benchmark{' (tiny preset)' if args.tiny else ''}\n\n"
        f"d_model={shape.hidden_size}, layers={shape.layers}, heads={shape.heads} (SepFormer d_pos = head_dim = "
        f"{d_pos}), vocab={shape.vocab_size}, {shape.dtype} on {shape.device}, sdpa, Llama intermediate="
        f"{shape.llama_intermediate}; sections: {', '.join(sections)}; "
        f"{shape.reps} repetitions, models interleaved; cells are median [q1, q3], ratios the median of "
        f"per-repetition SepFormer / peer ratios.\n"
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"{cpu}, {os.cpu_count()} CPUs, 1-min load average at start {load_before:.2f}, wall time "
        f"{elapsed / 60:.1f} min."
    )
    return text


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


def main(argv=None):
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
        help="what to measure (default: all); mitigations are timed in generation's repetitions",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "argument --device: cuda given, but torch finds no CUDA GPU here (torch.cuda.is_available() is "
            "False); give --device cpu"
        )
    if "mitigations" in args.sections and "generation" not in args.sections:
        parser.error(
            f"argument --sections: mitigations are timed in the repetitions of generation; give generation "
            f"with them (given: {' '.join(args.sections)})"
        )
    sections = [name for name in SECTIONS if name in args.sections and not (name == "memory" and args.no_memory)]
    if not sections and not args.compile:
        parser.error("argument --sections: only memory given, and --no-memory skips it: nothing to measure")
    transformers.logging.set_verbosity_error()

    shape = args.shape_json or (TINY if args.tiny else FULL)
    shape = dataclasses.replace(shape, device=args.device, dtype=args.dtype)
    if args.reps is not None:
        shape = dataclasses.replace(shape, reps=args.reps)
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
    mitigated = mitigated_models(models, shape, args.seed) if "mitigations" in sections else {}
    notes = {"mitigations": skipped_mitigations()} if mitigated else {}
    for line in notes.get("mitigations", ()):
        log(line[2:])
    measurements = comparison_measurements(models, mitigated, shape, args.seed, sections)
    run_interleaved([m for m in measurements if m.runners], shape.reps, log)
    link_mitigation_samples(measurements)
    if "extrapolation" in sections:
        # The effect looked for is a few percent of a generate call, below this machine's sample-to-sample noise:
        # three times the repetitions (each a paired comparison with the same model generating inside its table).
        extrapolation = extrapolation_measurement(models["SepFormer"], shape, args.seed)
        run_interleaved([extrapolation], shape.extrapolation_reps, log)
        measurements.append(extrapolation)
        log("extrapolation, step by step")
        measurements.append(extrapolation_step_measurement(models["SepFormer"], shape, args.seed))
    if "memory" in sections:
        measurements += measure_memory(shape, args.seed, shape.reps, log, together=args.tiny)
    if args.compile:
        compiled = compile_measurements(shape, args.seed, log)
        run_interleaved([m for m in compiled if m.runners], shape.reps, log)
        measurements += compiled

    rows = [row for m in measurements for row in summary_rows(m)]
    if "training" in sections:  # FLOPs per token beside the training throughput
        train = {
            r["variant"].split(" / ")[1]: (r["q1"], r["median"], r["q3"])
            for r in rows
            if r["metric"] == "train_tokens_per_s" and r["unit"] == "ratio"
        }
        after_train = max(i for i, r in enumerate(rows) if r["metric"] == "train_tokens_per_s") + 1
        rows[after_train:after_train] = flops_rows(models, shape, train)

    elapsed = time.perf_counter() - start
    title = header(shape, args, sections, load_before, elapsed)
    table = markdown(rows, title, notes)
    print(table)
    write_outputs(table, rows, Path(args.output_dir), "benchmark")
    log(f"wrote {args.output_dir}/benchmark.md and benchmark.csv")


if __name__ == "__main__":
    main()
