"""`examples/demo.py`, the main job, end to end at a small budget: train, validate, sample, save, reload."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


@pytest.mark.slow
def test_demo_runs_to_its_reload_check(tmp_path):
    """Its own last step compares the reloaded checkpoint's logits with the trained model's. L = 32: the sample is
    cut to the training length (200 new tokens at the default L)."""
    command = [
        sys.executable,
        str(SCRIPT),
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--block-size",
        "32",
        "--max-bytes",
        "300000",
        "--output-dir",
        str(tmp_path),
    ]
    completed = subprocess.run(
        command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    assert "trained 2 steps" in completed.stdout and "\nsample:\n" in completed.stdout
    assert "reloaded logits identical" in completed.stdout
    assert (tmp_path / "checkpoint" / "modeling_sepformer.py").exists()
