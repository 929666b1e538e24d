"""`benchmarks/count_kernels.py`: aten calls per decoding step, at the tiny shape."""

import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "count_kernels.py"
sys.path.insert(0, str(SCRIPT.parent))
import benchmark  # noqa: E402  (after the path)
import count_kernels  # noqa: E402


def test_a_step_costs_the_same_whatever_the_number_of_steps_counted():
    """The prefill cancels out: per-step counts over 2 and over 3 steps agree (a wrong normalisation would not)."""
    model = benchmark.build("SepFormer", benchmark.TINY)
    two, three = (sum(count_kernels.calls_per_step(model, 2, 8, tokens).values()) for tokens in (2, 3))
    assert two == three > 50


def test_every_model_and_mitigation_has_a_row(capsys):
    rows = count_kernels.main(["--tiny", "--tokens", "2"])
    labels = {row["model"] for row in rows}
    assert labels == {*benchmark.MODELS, *(f"SepFormer + {name}" for name in benchmark.MITIGATIONS)}
    assert len(rows) == len(labels) * len(benchmark.TINY.generate_batches)
    calls = {(row["model"], row["batch"]): row["calls"] for row in rows}
    # three buckets run the model three times per step
    assert calls[("SepFormer + attention_buckets_3", 1)] > 2.5 * calls[("SepFormer", 1)]
    assert "| SepFormer + ms_poe | 2 |" in capsys.readouterr().out
