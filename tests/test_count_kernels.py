"""`benchmarks/count_kernels.py`: aten calls per decoding step, at the tiny shape."""

import sys
from pathlib import Path

import pytest
import torch

from sepformer import SepFormerCache

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "count_kernels.py"
sys.path.insert(0, str(SCRIPT.parent))
import benchmark_models  # noqa: E402  (after the path)
import benchmark_sections  # noqa: E402
import count_kernels  # noqa: E402


def test_a_step_costs_the_same_whatever_the_number_of_steps_counted():
    """The prefill cancels out: per-step counts over 2 and over 3 steps agree (a wrong normalisation would not)."""
    model = benchmark_models.build("SepFormer", benchmark_models.TINY)
    two, three = (sum(count_kernels.calls_per_step(model, 2, 8, tokens).values()) for tokens in (2, 3))
    assert two == three


def test_a_step_is_one_cached_forward_and_generate_s_bookkeeping():
    """Anchored to a decoding step counted by hand: the model's forward on one token is most of a step; `generate`
    adds its logits processing and stopping criteria (a few dozen calls), nothing like a second forward."""
    model = benchmark_models.build("SepFormer", benchmark_models.TINY).eval()
    ids = benchmark_models.token_ids(2, 8, 0, "cpu")
    with torch.no_grad():
        cache = SepFormerCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:, -1:], past_key_values=cache, use_cache=True)  # the first step makes what later steps reuse
        with count_kernels.AtenCalls() as mode:
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
    forward = sum(mode.calls.values())
    step = sum(count_kernels.calls_per_step(model, 2, 8, 3).values())
    assert forward <= step <= forward + 60


def test_an_option_s_python_calls_are_counted_per_step():
    """The plan a generation keeps and its hooks are Python calls of every step: a step with an option makes more than
    one without, and a step's count does not depend on how many steps are counted."""
    model = benchmark_sections.add_mitigations(benchmark_models.build("Llama", benchmark_models.TINY))
    options = benchmark_sections.MITIGATIONS["ms_poe"](2, 8)
    without = count_kernels.python_calls_per_step(model, 2, 8, 2)
    two, three = (count_kernels.python_calls_per_step(model, 2, 8, tokens, **options) for tokens in (2, 3))
    assert without + 50 < two == three


@pytest.mark.slow
def test_every_model_and_mitigation_has_a_row(capsys):
    rows = count_kernels.main(["--tiny", "--tokens", "2"])
    labels = {row["model"] for row in rows}
    llama = benchmark_sections.MITIGATED_LLAMA
    assert labels == {
        *benchmark_models.MODELS,
        llama,
        *(f"SepFormer + {name}" for name in benchmark_sections.MITIGATIONS),
        *(f"{llama} + {name}" for name in benchmark_sections.measured_on(llama)),
    }
    assert len(rows) == len(labels) * len(benchmark_models.TINY.generate_batches)
    calls = {(row["model"], row["batch"]): row["calls"] for row in rows}
    # three buckets run the model once per step, on three copies of each row (three forwards made 2.5 times the calls)
    assert calls[("SepFormer", 1)] < calls[("SepFormer + attention_buckets_3", 1)] < 1.5 * calls[("SepFormer", 1)]
    assert all(row["python_calls"] > 0 for row in rows)
    assert f"| {llama} + ms_poe | 2 |" in capsys.readouterr().out
