"""`benchmarks/benchmark.py`: the speed and memory comparison, run end to end at its `--tiny` preset."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import run_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "benchmark.py"
sys.path.insert(0, str(SCRIPT.parent))
import benchmark  # noqa: E402  (after the path)

MODELS = ("SepFormer", "GPT-2", "Llama")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The command as a user types it, tiny preset, two repetitions, one thread (CI runs tests side by side)."""
    output_dir = tmp_path_factory.mktemp("benchmark")
    stdout, rows = run_script(SCRIPT, "--tiny", "--reps", "2", "--threads", "1", output_dir=output_dir,
                              csv_name="benchmark.csv")
    return stdout, rows, output_dir


def test_table_and_files_are_written(run):
    stdout, _, output_dir = run
    table = (output_dir / "benchmark.md").read_text()
    assert stdout.strip() == table.strip()
    columns = "| measurement | unit | SepFormer | GPT-2 | Llama | SepFormer / GPT-2 | SepFormer / Llama | target |"
    assert columns in table
    assert "### Extrapolation past the trained length" in table
    assert "### Position-bias mitigations" in table


def test_every_measurement_has_every_model_and_finite_ratios(run):
    _, rows, _ = run
    by_metric = {}
    for row in rows:
        by_metric.setdefault(row["metric"], {})[row["variant"]] = row
    speed = ["train_tokens_per_s", "prefill_64_ms", "prefill_256_ms", "generate_b1_tokens_per_s",
             "generate_b2_tokens_per_s", "forward_flops_per_token"]
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


def test_every_mitigation_is_timed_against_plain_sepformer(run):
    _, rows, _ = run
    overhead = {(row["metric"], row["variant"]): row for row in rows if row["unit"] == "ratio"}
    for mitigation in benchmark.MITIGATIONS:
        for batch in (1, 2):
            row = overhead[(f"generate_b{batch}_mitigation_{mitigation}", f"SepFormer + {mitigation} / SepFormer")]
            assert math.isfinite(float(row["median"])) and float(row["median"]) > 0 and row["n"] == "2", row


def test_the_memory_workers_shape_travels_as_json():
    """`measure_memory` hands each worker its shape as JSON: read back, it is the same shape."""
    for shape in (benchmark.TINY, benchmark.FULL):
        assert benchmark.shape_json(json.dumps(dataclasses.asdict(shape))) == shape
    assert benchmark.model_names("GPT-2,Llama") == ["GPT-2", "Llama"]
