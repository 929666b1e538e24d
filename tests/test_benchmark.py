"""`benchmarks/benchmark.py`: the speed and memory comparison, run end to end at its `--tiny` preset."""

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "benchmark.py"
sys.path.insert(0, str(SCRIPT.parent))
import benchmark  # noqa: E402  (after the path)
import benchmark_sections  # noqa: E402  (the mitigations, where the generation section reads them)

MODELS = ("SepFormer", "GPT-2", "Llama")
# On one worker: the end-to-end run (`run`) would otherwise run once in each.
pytestmark = pytest.mark.xdist_group("benchmark")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command as a user types it, tiny preset, two repetitions, one thread (CI runs tests side by side)."""
    output_dir = tmp_path_factory.mktemp("benchmark")
    stdout, rows = run_script(
        SCRIPT, "--tiny", "--reps", "2", "--threads", "1", output_dir=output_dir, csv_name="benchmark.csv"
    )
    return stdout, rows, output_dir


def test_the_group_of_this_module_reaches_the_scheduler(request):
    """Under `--dist loadgroup` (`make test`) this module's tests carry their group in their node id (conftest.py), so
    that one worker runs them all and `run` once."""
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@benchmark"), request.node.nodeid


@pytest.mark.slow
def test_table_and_files_are_written(run):
    stdout, _, output_dir = run
    table = (output_dir / "benchmark.md").read_text()
    assert stdout.strip() == table.strip()
    columns = "| measurement | unit | SepFormer | GPT-2 | Llama | SepFormer / GPT-2 | SepFormer / Llama | target |"
    assert columns in table
    assert "### Extrapolation past the trained length" in table
    assert "### Position-bias mitigations" in table


@pytest.mark.slow
def test_every_measurement_has_every_model_and_finite_ratios(run):
    _, rows, _ = run
    by_metric = {}
    for row in rows:
        by_metric.setdefault(row["metric"], {})[row["variant"]] = row
    speed = [
        "train_tokens_per_s",
        "prefill_64_ms",
        "prefill_256_ms",
        "generate_b1_tokens_per_s",
        "generate_b2_tokens_per_s",
        "forward_flops_per_token",
    ]
    for metric in speed:
        variants = by_metric[metric]
        for model in MODELS:
            value = float(variants[model]["median"])
            assert math.isfinite(value) and value > 0, (metric, model, value)
        for peer in ("GPT-2", "Llama"):
            ratio = variants[f"SepFormer / {peer}"]
            assert ratio["unit"] == "ratio"
            for field in ("median", "q1", "q3", "min", "max"):
                assert math.isfinite(float(ratio[field])) and float(ratio[field]) > 0, (metric, peer, ratio)
    extrapolation = by_metric["extrapolation_generate_ms"]
    for method in ("fourier", "clamp"):
        ratio = float(extrapolation[f"past L, {method} / within L"]["median"])
        assert math.isfinite(ratio) and ratio > 0
    for row in rows:
        if row["metric"].startswith("peak_memory_") and row["unit"] == "MiB":
            assert float(row["median"]) >= 0 and int(row["n"]) == 2, row
    assert {row["n"] for row in rows if row["metric"] == "train_tokens_per_s"} == {"2"}


def finite_ratio(row: dict, n: str = "2") -> bool:
    return math.isfinite(float(row["median"])) and float(row["median"]) > 0 and row["n"] == n


@pytest.mark.slow
def test_every_mitigation_is_timed_against_plain_sepformer_and_on_llama(run):
    """SepFormer: every option; Llama after add_mitigations: against plain Llama, then every option it defines, the
    others named as skipped under the table."""
    _, rows, output_dir = run
    overhead = {(row["metric"], row["variant"]): row for row in rows if row["unit"] == "ratio"}
    llama = benchmark_sections.MITIGATED_LLAMA
    table = (output_dir / "benchmark.md").read_text()
    for batch in (1, 2):
        assert finite_ratio(overhead[(f"generate_b{batch}_add_mitigations", f"{llama} / Llama")])
        for mitigation in benchmark_sections.MITIGATIONS:
            key = f"generate_b{batch}_mitigation_{mitigation}"
            assert finite_ratio(overhead[(key, f"SepFormer + {mitigation} / SepFormer")])
            on_llama = overhead.get((key, f"{llama} + {mitigation} / {llama}"))
            why = benchmark_sections.why_not_on_llama(mitigation)
            assert (on_llama is None) == (why is not None), (mitigation, why)
            assert why is None or f"- {llama} + {mitigation}: skipped, {why}." in table
            assert on_llama is None or finite_ratio(on_llama)
    assert set(benchmark_sections.measured_on(llama)) >= {"stable_mask", "ms_poe", "attention_calibration"}


def test_llama_measures_every_option_but_those_that_read_sepformers_positions():
    llama = benchmark_sections.MITIGATED_LLAMA
    assert benchmark_sections.measured_on(llama) == [
        m for m in benchmark_sections.MITIGATIONS if m not in benchmark_sections.SEPFORMER_ONLY
    ]
    assert benchmark_sections.measured_on("SepFormer") == list(benchmark_sections.MITIGATIONS)
    assert benchmark_sections.skipped_mitigations() == [
        f"- {llama} + {mitigation}: skipped, {why}." for mitigation, why in benchmark_sections.SEPFORMER_ONLY.items()
    ]


@pytest.mark.parametrize("sections", [["generation", "mitigations"], ["mitigations"]])
def test_bfloat16_generation_and_mitigations_only(sections, tmp_path, monkeypatch):
    """The GPU run's flags on the CPU: --dtype bfloat16, --sections generation mitigations (a smaller shape, two
    mitigations: one measured on Llama, one not); the mitigations alone time their own variants."""
    shape = dict(prompt=8, new_tokens=2, generate_batches=[1], hidden_size=32, layers=1, heads=2)
    two = ("stable_mask", "attention_calibration_positional")
    monkeypatch.setattr(benchmark_sections, "MITIGATIONS", {name: benchmark_sections.MITIGATIONS[name] for name in two})
    benchmark.main(
        [
            "--shape-json",
            json.dumps(shape),
            "--reps",
            "1",
            "--dtype",
            "bfloat16",
            "--sections",
            *sections,
            "--output-dir",
            str(tmp_path),
        ]
    )
    table = (tmp_path / "benchmark.md").read_text()
    assert "bfloat16 on cpu" in table and f"sections: {', '.join(sections)}" in table
    with open(tmp_path / "benchmark.csv") as handle:
        rows = list(csv.DictReader(handle))
    generation = {"generate_b1_tokens_per_s"} if "generation" in sections else set()
    assert {row["metric"].split("_mitigation_")[0] for row in rows} == {
        *generation,
        "generate_b1_add_mitigations",
        "generate_b1",
    }
    llama = benchmark_sections.MITIGATED_LLAMA
    ratios = [row for row in rows if row["unit"] == "ratio" and row["variant"].startswith(llama)]
    assert [row["variant"] for row in ratios] == [f"{llama} / Llama", f"{llama} + stable_mask / {llama}"]
    assert all(finite_ratio(row, "1") for row in ratios)
    assert f"- {llama} + attention_calibration_positional: skipped" in table


def test_each_overhead_is_timed_back_to_back_and_the_comparison_in_turn():
    """An overhead's two variants run next to each other, in turn first; variants compared to several others rotate."""
    from benchmark_measuring import Measurement, repetition_order

    def measurement(names, ratios):
        return Measurement("key", "label", "tokens/s", True, dict.fromkeys(names, None), ratios)

    overheads = measurement(("S", "S + m", "L", "L + m"), (("S + m", "S"), ("L + m", "L")))
    assert repetition_order(overheads, 0) == ["S", "S + m", "L", "L + m"]
    assert repetition_order(overheads, 1) == ["S + m", "S", "L + m", "L"]
    comparison = measurement(("S", "G", "L"), (("S", "G"), ("S", "L")))
    assert [repetition_order(comparison, rep) for rep in range(3)] == [
        ["S", "G", "L"],
        ["G", "L", "S"],
        ["L", "S", "G"],
    ]


def test_each_overhead_times_its_option_against_the_same_model_without_it(monkeypatch):
    """The two runners of an overhead pair: the same model, the option's keywords on one, none on the other (and, for
    `add_mitigations` itself, the mitigated Llama against the plain one, neither with an option)."""
    timed = []

    def runner(model, batch, shape, seed, **options):
        timed.append((model, options))
        return len(timed) - 1

    monkeypatch.setattr(benchmark_sections, "generate_throughput", runner)
    llama = benchmark_sections.MITIGATED_LLAMA
    mitigated = {"SepFormer": "sepformer", llama: "mitigated llama"}
    plain, *overheads = benchmark_sections.mitigation_overheads({"Llama": "llama"}, mitigated, benchmark.TINY, 0, 2)
    assert [timed[plain.runners[name]] for name in plain.ratios[0]] == [("mitigated llama", {}), ("llama", {})]
    for m, (mitigation, options_of) in zip(overheads, benchmark_sections.MITIGATIONS.items(), strict=True):
        for with_name, without_name in m.ratios:
            assert timed[m.runners[with_name]] == (mitigated[without_name], options_of(2, benchmark.TINY.prompt))
            assert timed[m.runners[without_name]] == (mitigated[without_name], {})
            assert with_name == f"{without_name} + {mitigation}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sections", "memory", "--no-memory"], "nothing to measure"),
        (["--sections", "generation", "generation"], "generation given more than once"),
        (["--sections", "speed"], "invalid choice: 'speed'"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bad_flags_are_refused_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(benchmark, "build", None)  # any work would fail on it
    with pytest.raises(SystemExit):
        benchmark.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a CUDA GPU")
def test_cuda_is_refused_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(benchmark, "build", None)
    with pytest.raises(SystemExit):
        benchmark.main(["--tiny", "--device", "cuda"])
    assert "cuda given, but torch finds no CUDA GPU here" in capsys.readouterr().err


def test_the_memory_workers_shape_travels_as_json():
    """`measure_memory` hands each worker its shape as JSON: read back, it is the same shape."""
    for shape in (benchmark.TINY, benchmark.FULL):
        assert benchmark.shape_json(json.dumps(dataclasses.asdict(shape))) == shape
    assert benchmark.model_names("GPT-2,Llama") == ["GPT-2", "Llama"]


def test_forward_flops_count_attention_as_its_two_matmuls():
    """GPT-2's forward FLOPs per token written out: per layer `24 d²` (c_attn, c_proj, the 4d MLP) and `4 n d` for
    attention (q·k and the weighted values over all `n` keys), then `2 d V` for the head. The CPU's fused attention
    kernel has no formula in torch's counter: counted as is, attention would be 0."""
    from count_params_flops import forward_flops_per_token
    from transformers import GPT2Config, GPT2LMHeadModel

    d, layers, n, vocab = 32, 2, 16, 259
    config = GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=4, n_positions=n, attn_implementation="sdpa")
    per_token = forward_flops_per_token(GPT2LMHeadModel(config).eval(), n)
    assert per_token == layers * (24 * d * d + 4 * n * d) + 2 * d * vocab
