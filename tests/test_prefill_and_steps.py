"""`benchmarks/prefill_and_steps.py`: a generation's prefill and decoding steps timed apart, in pairs."""

import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_and_steps.py"
sys.path.insert(0, str(SCRIPT.parent))
import prefill_and_steps  # noqa: E402  (after the path)

# made-up seconds per repetition: (prefill, step) without the option and with it; the per-repetition ratios of the
# steps are 2/3, 1 and 1/4 (median 2/3), where the ratio of the two medians would be 1/2
NONE = [(0.010, 0.002), (0.020, 0.004), (0.010, 0.001)]
OPTION = [(0.050, 0.003), (0.060, 0.004), (0.050, 0.004)]


def test_each_ratio_is_taken_within_a_repetition_then_its_median(monkeypatch):
    calls = []

    def made_up_seconds(model, batch, prompt, new_tokens, options):
        repetition = len(calls) // 4  # each times both variants' short generations, then both long ones
        calls.append((batch, prompt, new_tokens, tuple(options)))
        prefill, step = (OPTION if options else NONE)[repetition]
        return prefill + (new_tokens - 1) * step

    warmed_up = []
    monkeypatch.setattr(prefill_and_steps, "seconds", made_up_seconds)
    monkeypatch.setattr(prefill_and_steps, "generate", lambda *args, **options: warmed_up.append(len(calls)))
    arguments = ["--tiny", "--options", "attention_calibration", "--batch", "2", "--tokens", "11", "--reps", "3"]
    (row,) = prefill_and_steps.main(arguments)
    assert warmed_up == [0, 0]  # both variants warmed up before anything is timed
    prompt = prefill_and_steps.TINY.prompt
    none, option = (2, prompt, 1, ()), (2, prompt, 1, ("attention_calibration",))
    long_none, long_option = (2, prompt, 11, ()), (2, prompt, 11, ("attention_calibration",))
    # the short generations of both variants, then the long ones, which variant first alternating
    assert calls[:8] == [none, option, long_none, long_option, option, none, long_option, long_none]
    assert row["option"] == "attention_calibration" and row["batch"] == 2
    assert row["steps"][1] == pytest.approx(2 / 3)
    assert row["prefill"] == pytest.approx((0.010, 0.050)) and row["step"] == pytest.approx((0.002, 0.004))
    wholes = sorted((n + 10 * s) / (o + 10 * t) for (n, s), (o, t) in zip(NONE, OPTION, strict=True))
    assert row["whole"][1] == pytest.approx(wholes[1])


def test_a_tiny_run_times_every_batch_and_option_asked_for():
    arguments = ["--tiny", "--options", "stable_mask", "attention_calibration", "--batch", "1", "2", "--tokens", "3"]
    rows = prefill_and_steps.main([*arguments, "--reps", "1"])
    assert [(row["option"], row["batch"]) for row in rows] == [
        (option, batch) for batch in (1, 2) for option in ("stable_mask", "attention_calibration")
    ]
    # a step is a difference of two timings: its sign at 3 tokens is the machine's noise, only its being a number is not
    assert all(min(row["prefill"]) > 0 and all(map(math.isfinite, (*row["step"], *row["steps"]))) for row in rows)


def test_an_option_the_model_is_not_measured_with_is_refused(capsys):
    with pytest.raises(SystemExit):
        prefill_and_steps.main(["--options", "attention_calibration_positional"])
    assert "['attention_calibration_positional'] are not measured on Llama" in capsys.readouterr().err


def test_sepformer_and_the_thread_count_are_taken_as_asked(monkeypatch, capsys):
    threads = []
    monkeypatch.setattr(prefill_and_steps.torch, "set_num_threads", threads.append)
    monkeypatch.setattr(prefill_and_steps.torch, "get_num_threads", lambda: threads[-1])
    arguments = ["--tiny", "--model", "SepFormer", "--options", "attention_calibration_positional", "--threads", "1"]
    (row,) = prefill_and_steps.main([*arguments, "--tokens", "3", "--reps", "1"])
    assert threads == [1] and row["option"] == "attention_calibration_positional"  # an option of SepFormer only
    prompt = prefill_and_steps.TINY.prompt
    assert capsys.readouterr().out.startswith(f"SepFormer, prompt {prompt}, 3 new tokens, 1 threads")
