"""`benchmarks/prefill_and_steps.py`: a generation's prefill and decoding steps timed apart."""

import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_and_steps.py"
sys.path.insert(0, str(SCRIPT.parent))
import prefill_and_steps  # noqa: E402  (after the path)


def test_the_step_is_the_difference_of_the_two_generations_and_the_prefill_the_short_one(monkeypatch):
    """With times made up (an option's prefill 5 times no option's, its steps 1.5 times), the rows read them back."""
    timed = []

    def made_up_seconds(model, batch, prompt, new_tokens, options):
        timed.append("option" if options else "none")
        prefill, step = (0.050, 0.003) if options else (0.010, 0.002)
        return prefill + (new_tokens - 1) * step

    monkeypatch.setattr(prefill_and_steps, "seconds", made_up_seconds)
    arguments = ["--tiny", "--options", "attention_calibration", "--tokens", "11", "--reps", "2"]
    (row,) = prefill_and_steps.main(arguments)
    assert row["option"] == "attention_calibration"
    assert row["prefill"] == pytest.approx((0.010, 0.050)) and row["step"] == pytest.approx((0.002, 0.003))
    assert row["steps"] == pytest.approx(2 / 3)
    assert row["whole"] == pytest.approx((0.010 + 10 * 0.002) / (0.050 + 10 * 0.003))
    # each repetition times both generations without the option and with it, back to back, in turn first
    assert timed == ["none"] * 2 + ["option"] * 2 + ["option"] * 2 + ["none"] * 2


def test_a_tiny_run_times_every_batch_and_option():
    arguments = ["--tiny", "--options", "stable_mask", "attention_calibration", "--batch", "1", "2", "--tokens", "3"]
    rows = prefill_and_steps.main([*arguments, "--reps", "1"])
    assert [(row["option"], row["batch"]) for row in rows] == [
        (option, batch) for batch in (1, 2) for option in ("stable_mask", "attention_calibration")
    ]
    assert all(min(row["prefill"] + row["step"]) > 0 for row in rows)


def test_an_option_the_model_is_not_measured_with_is_refused(capsys):
    with pytest.raises(SystemExit):
        prefill_and_steps.main(["--options", "attention_calibration_positional"])
    assert "['attention_calibration_positional'] are not measured on Llama" in capsys.readouterr().err
