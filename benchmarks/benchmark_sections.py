"""The sections of `benchmark.py`: the comparison (training, prefill, generation), the position-bias mitigations'
overheads (each option timed back to back with none), extrapolation past the trained length, `--compile`, and the
FLOPs per token."""

import copy
import time
from collections.abc import Callable

import torch
from benchmark_measuring import Measurement, run_interleaved, synchronize, timed
from benchmark_models import MODELS, PEERS, Shape, build, generate, make_train_step, prefill, token_ids, with_table
from count_params_flops import forward_flops_per_token
from transformers import CompileConfig

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
    add_mitigations,
)

MITIGATED_LLAMA = "Llama + add_mitigations"  # the variant of a Llama given the mitigation keywords, with no option on


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
# SepFormer's `generate`. Each gives a measurement of its overhead: "SepFormer + <name>" timed against plain SepFormer
# back to back in each repetition (same prompt, same number of tokens), and the same on the mitigated Llama. Main
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
    # scales: a copy of every row per bucket by design, in one pass
    "attention_buckets_1": lambda batch, prompt: {"attention_buckets": AttentionBuckets(scales=(1.0,))},
    "attention_buckets_3": lambda batch, prompt: {"attention_buckets": AttentionBuckets(scales=(1.0, 0.9, 0.8))},
}


# Mitigations that do more work by design (a copy of every row per bucket): their target is per bucket.
PER_BUCKET = {"attention_buckets_3": 3}

# Mitigations measured on SepFormer alone, with why (the others are measured on the mitigated Llama too).
SEPFORMER_ONLY = {"attention_calibration_positional": "bias_estimate='positional' reads SepFormer's positional block"}


def why_not_on_llama(mitigation: str) -> str | None:
    """Why a `MITIGATIONS` entry is not measured on the mitigated Llama; None when it is."""
    return SEPFORMER_ONLY.get(mitigation)


# -------------------------------------------------------------------------------------------------------------- runners


def train_throughput(step: Callable[[], None], shape: Shape) -> Callable[[], float]:
    """A runner: tokens per second of `shape.train_steps` calls of a training step at the shape's batch and length."""
    tokens = shape.train_batch * shape.train_seq
    return lambda: tokens * shape.train_steps / timed(lambda: [step() for _ in range(shape.train_steps)])


def generate_throughput(model, batch: int, shape: Shape, seed: int, **kwargs) -> Callable[[], float]:
    """A runner: new tokens per second of one `generate` call at `batch` (the prompt's prefill inside the call)."""
    return lambda: (
        batch * shape.new_tokens / timed(lambda: generate(model, batch, shape.prompt, shape.new_tokens, seed, **kwargs))
    )


# ----------------------------------------------------------------------------------------------------------- comparison


def comparison_measurements(models: dict, mitigated: dict, shape: Shape, seed: int, sections) -> list[Measurement]:
    """The measurements of `sections` timed by `run_interleaved`; the mitigations on the `mitigated` models."""
    measurements = []
    if "training" in sections:
        measurements.append(
            Measurement(
                key="train_tokens_per_s",
                label=f"training step (fwd+bwd+AdamW), batch {shape.train_batch} x {shape.train_seq}",
                unit="tokens/s",
                higher_is_better=True,
                # on copies: the models the other rows time (and the mitigated Llama built with the plain one's
                # weights) keep their weights while these train
                runners={
                    name: train_throughput(make_train_step(copy.deepcopy(model), shape, seed), shape)
                    for name, model in models.items()
                },
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
    for batch in shape.generate_batches if mitigated else ():
        measurements += mitigation_overheads(models, mitigated, shape, seed, batch)
    return measurements


# ---------------------------------------------------------------------------------------------- generation, mitigations


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
    """Cached generation at `batch`: every model (and the mitigated ones with no option) timed in turn."""
    runners = {name: generate_throughput(model, batch, shape, seed) for name, model in {**models, **mitigated}.items()}
    return [
        Measurement(
            key=f"generate_b{batch}_tokens_per_s",
            label=f"cached generation, {shape.new_tokens} new tokens, batch {batch} (prompt {shape.prompt})",
            unit="tokens/s",
            higher_is_better=True,
            runners=runners,
            target="SepFormer/GPT-2 >= 1.05, /Llama >= 1.0" if batch == 1 else "SepFormer/GPT-2 and /Llama >= 1.0",
        )
    ]


def mitigation_overheads(models: dict, mitigated: dict, shape: Shape, seed: int, batch: int) -> list[Measurement]:
    """The overhead rows at `batch`: the mitigated Llama with no option against the plain one, then each mitigation
    against none on each model it is measured on. Each ratio's two variants are timed back to back
    (`repetition_order`)."""

    def overhead(key: str, label: str, pairs: dict, target: str) -> Measurement:
        """`pairs`: (with, without) -> (model, options) of each."""
        runners = {
            name: generate_throughput(model, batch, shape, seed, **options)
            for names, variants in pairs.items()
            for name, (model, options) in zip(names, variants, strict=True)
        }
        return Measurement.overhead(key, label, runners, tuple(pairs), "mitigations", target)

    plain = {(MITIGATED_LLAMA, "Llama"): ((mitigated[MITIGATED_LLAMA], {}), (models["Llama"], {}))}
    label = f"Llama generation after add_mitigations, no option, batch {batch}"
    overheads = [overhead(f"generate_b{batch}_add_mitigations", label, plain, "mitigated / plain >= 0.95")]
    for mitigation, options_of in MITIGATIONS.items():
        options = options_of(batch, shape.prompt)
        pairs = {
            (f"{base} + {mitigation}", base): ((model, options), (model, {}))
            for base, model in mitigated.items()
            if mitigation in measured_on(base)
        }
        buckets = PER_BUCKET.get(mitigation)
        target = (
            f"with / without >= 0.87 / {buckets} ({buckets} buckets)"
            if buckets
            else "with / without >= 0.87 (<= 15% more time)"
        )
        label = f"generation with {mitigation}, batch {batch}"
        overheads.append(overhead(f"generate_b{batch}_mitigation_{mitigation}", label, pairs, target))
    return overheads


# -------------------------------------------------------------------------------------------------------- extrapolation


def extrapolation_measurements(sepformer_model, shape: Shape, seed: int, log) -> list[Measurement]:
    """Both extrapolation measurements, timed: whole `generate` calls, then single decoding steps."""
    # The effect looked for is a few percent of a generate call, below this machine's sample-to-sample noise:
    # three times the repetitions (each a paired comparison with the same model generating inside its table).
    calls = extrapolation_measurement(sepformer_model, shape, seed)
    run_interleaved([calls], shape.extrapolation_reps, log)
    log("extrapolation, step by step")
    return [calls, extrapolation_step_measurement(sepformer_model, shape, seed)]


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
    attention mask, logits of that token only; the time of `generate`'s own per-token work is left out. A first pass,
    not timed, warms up the kernels; each pass's first step makes its cache's fused layers and rows past the table
    (once per generation, as `generate` does: one sample of each pass, which the median leaves out).
    """
    length = shape.extrapolation_length
    variants = {"within L": (with_table(sepformer_model, length + shape.new_tokens), {})}
    for method in ("fourier", "clamp"):
        variants[f"past L, {method}"] = (with_table(sepformer_model, length), {"position_extrapolation": method})
    samples = {name: [] for name in variants}
    ids = token_ids(1, length, seed, sepformer_model.device)
    with torch.no_grad():
        for done in range(rounds + 1):  # pass 0 warms up
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
                    if done:
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


# -------------------------------------------------------------------------------------------------------------- compile


def fullgraph_compile_config() -> CompileConfig:
    """transformers' fast path for generation: with a static cache, `generate` compiles the decoding steps' forward
    (`fullgraph`) and runs the prefill eagerly. It does so on accelerators only unless told to on CPUs too."""
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    return config


def compiled_variants(name: str, shape: Shape, seed: int, log) -> tuple[dict, dict, dict]:
    """One model eager and compiled: its training runners, its generation runners (eager with the default and with a
    static cache, compiled with a static cache) and the wall times of its first compiled calls."""
    eager = build(name, shape, seed)
    compiled = build(name, shape, seed)
    eager_step = make_train_step(eager, shape, seed)
    compiled_step = make_train_step(torch.compile(compiled), shape, seed)
    seconds = timed(lambda: [compiled_step(), compiled_step()])
    compile_seconds = {f"{name} training (first 2 steps)": [seconds]}
    log(f"compiled {name} training step in {seconds:.1f}s")
    train = {
        f"{name} eager": train_throughput(eager_step, shape),
        f"{name} compiled": train_throughput(compiled_step, shape),
    }

    generator = build(name, shape, seed)
    batch = min(shape.generate_batches)
    static = {"cache_implementation": "static"}
    compiled_static = dict(static, compile_config=fullgraph_compile_config())
    seconds = timed(lambda: generate(generator, batch, shape.prompt, shape.new_tokens, seed, **compiled_static))
    compile_seconds[f"{name} generation (first call)"] = [seconds]
    log(f"compiled {name} static-cache generation in {seconds:.1f}s")
    generation = {
        f"{name} {label}": generate_throughput(model, batch, shape, seed, **kwargs)
        for label, model, kwargs in (
            ("eager", eager, {}),
            ("eager static cache", eager, static),
            ("compiled static cache", generator, compiled_static),
        )
    }
    return train, generation, compile_seconds


def sepformer_against_peers(*labels: str) -> tuple[tuple[str, str], ...]:
    """The ratios of SepFormer to each peer in the same variant, for each variant `<model> <label>`."""
    return tuple((f"SepFormer {label}", f"{peer} {label}") for label in labels for peer in PEERS)


def compile_measurements(shape: Shape, seed: int, log) -> list[Measurement]:
    """Eager against `torch.compile`: the training step, and generation with a static cache and a compiled forward."""
    # transformers' forward decorators share one code object between the three models (and the prefill/decode shapes
    # of each), so their compiled graphs count against one recompile limit: raise it, or the third model fails.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    train_runners, generate_runners, compile_seconds = {}, {}, {}
    for name in MODELS:
        train, generation, seconds = compiled_variants(name, shape, seed, log)
        train_runners |= train
        generate_runners |= generation
        compile_seconds |= seconds
    generate_speedups = tuple(
        (f"{name} compiled static cache", f"{name} {label}")
        for name in MODELS
        for label in ("eager", "eager static cache")
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
    return [
        Measurement(
            key="compile_train_tokens_per_s",
            label=f"training step, batch {shape.train_batch} x {shape.train_seq}: torch.compile(model) vs eager",
            unit="tokens/s",
            higher_is_better=True,
            runners=train_runners,
            ratios=tuple((f"{name} compiled", f"{name} eager") for name in MODELS)
            + sepformer_against_peers("eager", "compiled"),
            section="compile",
        ),
        Measurement(
            key="compile_generate_tokens_per_s",
            label=f"generation, batch {min(shape.generate_batches)}, {shape.new_tokens} new tokens: "
            "forward compiled (fullgraph) with a static cache vs eager",
            unit="tokens/s",
            higher_is_better=True,
            runners=generate_runners,
            ratios=generate_speedups + sepformer_against_peers("eager", "compiled static cache"),
            section="compile",
        ),
        compile_time,
    ]


# ---------------------------------------------------------------------------------------------------------------- flops


def flops_rows(models: dict, shape: Shape, train_ratio: dict) -> list[dict]:
    """Forward FLOPs per token of each model and their ratios, and beside each ratio the measured training time per
    token (`train_ratio`: each peer's (q1, median, q3) training throughput ratio)."""
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


def insert_flops_rows(rows: list[dict], models: dict, shape: Shape) -> None:
    """`flops_rows` into `rows`, right after the training throughput's rows, whose ratios they are read beside."""
    train = {
        r["variant"].split(" / ")[1]: (r["q1"], r["median"], r["q3"])
        for r in rows
        if r["metric"] == "train_tokens_per_s" and r["unit"] == "ratio"
    }
    after_train = max(i for i, r in enumerate(rows) if r["metric"] == "train_tokens_per_s") + 1
    rows[after_train:after_train] = flops_rows(models, shape, train)
