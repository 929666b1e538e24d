"""`examples/position_bias_report.py`: accuracy by slot summarised over seeds."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import position_bias_report  # noqa: E402  (after the path)


def test_curves_summarise_per_slot_over_seeds():
    rows = [
        dict(
            model="m", mitigation="none", setting="-", num_pairs=2, slot=slot, seed=seed, accuracy=accuracy, status="ok"
        )
        for seed, curve in ((0, (1.0, 0.5)), (1, (0.8, 0.3)))
        for slot, accuracy in zip((1, 2), curve, strict=True)
    ]
    (curve,) = position_bias_report.curves(rows)
    assert curve.mean_by_slot == pytest.approx([0.9, 0.4])
    assert curve.seed_means == pytest.approx([0.75, 0.55])
    assert curve.worst_over_best == pytest.approx(0.4 / 0.9)
