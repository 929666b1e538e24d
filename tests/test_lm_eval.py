"""lm-evaluation-harness on a saved SepFormer checkpoint, offline, on the held-out text task shipped in `eval/`:
its bits per byte equal the model's own log-likelihoods over the harness's rolling windows, within `L` and past it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from sepformer import SepFormerTokenizer, prepare_for_hub

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra; `make test` installs it

ROOT = Path(__file__).resolve().parent.parent
TASK = "sepformer_heldout"
L = 32  # the checkpoint's max_position_embeddings: every document (73-111 bytes) is longer
pytestmark = pytest.mark.xdist_group("lm_eval")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny SepFormer with `L = 32`, saved as Hub custom code with its tokenizer."""
    folder = tmp_path_factory.mktemp("checkpoint")
    tokenizer = SepFormerTokenizer()
    prepare_for_hub(tiny_model(seed=0, max_position_embeddings=L), tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def documents() -> list[str]:
    with open(ROOT / "eval/heldout_text/heldout.jsonl") as handle:
        return [json.loads(line)["text"] for line in handle]


def expected_bits_per_byte(window: int, **call) -> float:
    """Bits per byte written out: each document is `<s>` + its bytes, scored in disjoint windows of `window`
    predicted tokens; a window's input is the `window` tokens before its last target (the first starts at `<s>`), with
    positions from 0, as the harness's rolling windows with a context of one token."""
    model = tiny_model(seed=0, max_position_embeddings=L)
    tokenizer = SepFormerTokenizer()
    total_log_likelihood, total_bytes = 0.0, 0
    for text in documents():
        targets = tokenizer(text)["input_ids"]
        sequence = [tokenizer.bos_token_id, *targets]  # sequence[j] precedes target j
        for start in range(0, len(targets), window):
            end = min(start + window, len(targets))
            inputs = torch.tensor([sequence[max(0, end - window) : end]])
            with torch.no_grad():
                log_probs = model(input_ids=inputs, **call).logits[0].log_softmax(-1)
            predicted = log_probs[-(end - start) :]  # the last end - start positions predict targets start..end-1
            total_log_likelihood += predicted.gather(-1, torch.tensor(targets[start:end])[:, None]).sum().item()
        total_bytes += len(text.encode("utf-8"))
    return -total_log_likelihood / total_bytes / math.log(2)


@pytest.mark.slow
def test_python_api_scores_windows_of_L(checkpoint, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data file is relative to the repository root
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="hf",
        model_args=f"pretrained={checkpoint},trust_remote_code=True",
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(ROOT / "eval")),
        device="cpu",
        batch_size=4,
    )
    assert results["config"]["model_args"]  # the run is recorded
    got = results["results"][TASK]["bits_per_byte,none"]
    # max_length falls back to max_position_embeddings: windows of L tokens, every position inside the table
    assert got == pytest.approx(expected_bits_per_byte(L), rel=1e-5)


@pytest.mark.slow
def test_cli_past_L_with_interpolation(checkpoint, tmp_path):
    """The README's command: windows of 128 > L tokens, the table read with `interpolate` compressed for 128."""
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
        f"pretrained={checkpoint},trust_remote_code=True,max_length=128,position_extrapolation=interpolate,"
        "interpolation_length=128",
        "--include_path", "eval", "--tasks", TASK, "--batch_size", "4", "--device", "cpu",
        "--output_path", str(tmp_path / "results"),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    got = json.loads(results_file.read_text())["results"][TASK]["bits_per_byte,none"]
    # Every document fits one window: one pass over <s> + its bytes, positions 0..n compressed by 31/127.
    expected = expected_bits_per_byte(128, position_extrapolation={"method": "interpolate", "length": 128})
    assert got == pytest.approx(expected, rel=1e-5)
    # Not the windows of L (a near-uniform tiny model: the two differ in the fourth digit).
    assert abs(got - expected_bits_per_byte(L)) > 1e-4


@pytest.mark.slow
def test_past_L_without_a_method_is_refused(checkpoint, monkeypatch):
    monkeypatch.chdir(ROOT)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with pytest.raises(ValueError, match="past the learned positional table"):
        simple_evaluate(
            model="hf",
            model_args=f"pretrained={checkpoint},trust_remote_code=True,max_length=128",
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(ROOT / "eval")),
            device="cpu",
            batch_size=4,
            limit=1,
        )
