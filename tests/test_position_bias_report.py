"""`examples/position_bias_report.py`: accuracy by slot summarised over seeds."""

import math
import statistics
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


def test_a_curve_of_fewer_seeds_is_compared_on_its_own_seeds_and_says_so():
    """The search's rows exist only for seeds where it found a channel: their change is against the baseline on those
    seeds, and the table names them instead of a ± over one seed."""

    def rows(mitigation, curves):
        return [
            dict(model="m", mitigation=mitigation, setting="-", num_pairs=2, slot=slot, seed=seed, accuracy=accuracy)
            | {"status": "ok"}
            for seed, curve in curves.items()
            for slot, accuracy in zip((1, 2), curve, strict=True)
        ]

    curves = position_bias_report.curves(
        rows("none", {0: (1.0, 0.6), 1: (0.2, 0.2)}) + rows("positional_scaling", {0: (1.0, 0.6)})
    )
    baseline = {"m": {0: 0.8, 1: 0.2}}
    row = position_bias_report.table_row(curves[1], baseline, [0, 1])
    assert row[3] == "**0.800** (seeds [0] of [0, 1])" and row[6] == "+0.000"
    assert position_bias_report.table_row(curves[0], baseline, [0, 1])[3].startswith("**0.500** ± ")


def test_the_change_against_no_mitigation_has_the_interval_of_the_paired_per_seed_changes():
    """Seeds far apart (0.9 and 0.3) and a method that adds 0.10 and 0.12: the change is +0.110 ± the t interval of
    (0.10, 0.12), not of the means' spread."""

    def rows(mitigation, curves):
        return [
            dict(model="m", mitigation=mitigation, setting="-", num_pairs=1, slot=1, seed=seed, accuracy=accuracy)
            | {"status": "ok"}
            for seed, accuracy in curves.items()
        ]

    curves = position_bias_report.curves(rows("none", {0: 0.9, 1: 0.3}) + rows("x", {0: 1.0, 1: 0.42}))
    row = position_bias_report.table_row(curves[1], {"m": {0: 0.9, 1: 0.3}}, [0, 1])
    half_width = 12.706 * statistics.stdev([0.10, 0.12]) / math.sqrt(2)
    assert row[6] == f"+0.110 ± {half_width:.3f}"
