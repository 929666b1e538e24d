"""`examples/position_bias.py`: trained models saved with their record, and evaluated again with `--reuse-models`
(refused, before any training, where they cannot be)."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import position_bias  # noqa: E402  (after the path)


def no_training(*args, **kwargs):
    raise AssertionError("a model was trained")


@pytest.mark.slow
def test_saved_models_are_evaluated_again_without_training(monkeypatch, tmp_path):
    """Each trained model is saved with its training record; `--reuse-models` loads it (no training) and evaluates
    it to the same rows, here into another output folder, which leaves the first run's results as they were."""
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--tiny", "--models", "gpt", "sep", "--mitigations", "none", "parallel_context_windows"]
    trained = position_bias.main([*argv, "--output-dir", str(first)])
    for slug in ("sepformer", "gpt2"):
        folder = first / "models" / f"{slug}-seed0"
        record = json.loads((folder / "training.json").read_text())
        assert record["settings"]["seed"] == 0 and record["settings"]["max_steps"] == 20, record
        assert record["config"]["vocab_size"] > 0 and "dtype" not in record["config"]
        assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    first_results = (first / "results.csv").read_text()

    monkeypatch.setattr(position_bias, "train", no_training)
    reused = position_bias.main(
        [*argv[:-1], "--output-dir", str(second), "--models-dir", str(first / "models"), "--reuse-models"]
    )
    assert [(r["model"], r["slot"], r["accuracy"], r["train_loss"]) for r in reused] == [
        (r["model"], r["slot"], r["accuracy"], r["train_loss"]) for r in trained if r["mitigation"] == "none"
    ]
    assert (first / "results.csv").read_text() == first_results
    assert not (second / "models").exists()


def spoil_settings(folder):
    record = json.loads((folder / "training.json").read_text())
    record["settings"]["max_steps"] = 21
    (folder / "training.json").write_text(json.dumps(record))


def spoil_config(folder):
    record = json.loads((folder / "training.json").read_text())
    record["config"]["n_inner"] = 7  # as if a default had changed since
    (folder / "training.json").write_text(json.dumps(record))


def spoil_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def spoil_record(folder):
    (folder / "training.json").write_text("{")


def spoil_record_key(folder):
    record = json.loads((folder / "training.json").read_text())
    del record["train_loss"]
    record["train_seconds"] = "1.5"
    (folder / "training.json").write_text(json.dumps(record))


def spoil_config_json(folder):
    config = json.loads((folder / "config.json").read_text())
    config["n_inner"] = 7  # the record left as it was
    (folder / "config.json").write_text(json.dumps(config))


def spoil_tensors(change):
    def spoil(folder):
        weights = load_file(folder / "model.safetensors")
        save_file(
            {name: change(tensor) for name, tensor in weights.items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )

    return spoil


GPT2_ONLY = ["--tiny", "--models", "gpt", "--mitigations", "none"]


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    """The output folder of a run that trained and saved GPT-2, seeds 0 and 1 (each test changes a copy)."""
    output_dir = tmp_path_factory.mktemp("saved_gpt2")
    position_bias.main([*GPT2_ONLY, "--seeds", "0", "1", "--output-dir", str(output_dir)])
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "spoil, message",
    [
        (spoil_settings, r"was trained with other settings \(max_steps 21 there, 20 here\)"),
        (spoil_config, r"holds a model of another config \(n_inner 7 there, None here\)"),
        (spoil_weights, r"has weights that do not load \(SafetensorError"),
        (spoil_record, r"has a training.json that does not read \(JSONDecodeError"),
        (spoil_record_key, r"has a training.json where train_loss is missing, train_seconds is a str \(a record "),
        (spoil_config_json, r"has a config.json of another model \(n_inner 7 there, None here\)"),
        (
            spoil_tensors(torch.Tensor.half),
            r"has weights of another dtype \(\S+ torch.float16 there, torch.float32 here",
        ),
        (spoil_tensors(lambda tensor: torch.full_like(tensor, math.nan)), r"has weights that are not finite \(\S+, "),
    ],
    ids=["settings", "config", "weights", "record", "record key", "config.json", "fp16", "nan"],
)
def test_a_saved_model_that_cannot_be_reused_is_refused_before_any_training(
    monkeypatch, tmp_path, saved_gpt2, spoil, message
):
    """Checked for every seed before the first trains: seed 1 has no saved model and would be trained first."""
    shutil.copytree(saved_gpt2, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "models" / "gpt2-seed1")
    argv = [*GPT2_ONLY, "--output-dir", str(tmp_path)]
    folder = tmp_path / "models" / "gpt2-seed0"
    spoil(folder)
    monkeypatch.setattr(position_bias, "train", no_training)
    with pytest.raises(SystemExit, match=f"{folder} {message}"):
        position_bias.main([*argv, "--reuse-models", "--seeds", "1", "0"])


@pytest.mark.slow
def test_a_folder_without_its_record_is_trained_again(monkeypatch, tmp_path, saved_gpt2):
    """A run stopped while saving leaves weights without `training.json`: that model is trained again, the other
    seed's is reused."""
    shutil.copytree(saved_gpt2, tmp_path, dirs_exist_ok=True)
    argv = [*GPT2_ONLY, "--seeds", "0", "1", "--output-dir", str(tmp_path)]
    (tmp_path / "models" / "gpt2-seed0" / "training.json").unlink()
    trainings = []
    train = position_bias.train
    monkeypatch.setattr(position_bias, "train", lambda *args: trainings.append(args[3]) or train(*args))
    position_bias.main([*argv, "--reuse-models"])
    assert trainings == ["seed 0 · train GPT-2 (learned absolute)"]
    assert (tmp_path / "models" / "gpt2-seed0" / "training.json").exists()


@pytest.mark.parametrize("folder", ["mistyped", "empty"])
def test_reusing_models_from_a_folder_without_them_is_refused(folder, monkeypatch, tmp_path):
    """Not every model trained again, silently: `--reuse-models` needs at least one of the run's saved models."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(position_bias, "train", no_training)
    where = "does not exist" if folder == "mistyped" else "holds none of this run's models (gpt2-seed0, gpt2-seed1)"
    with pytest.raises(SystemExit, match=re.escape(f"--reuse-models: --models-dir {tmp_path / folder} {where}; ")):
        position_bias.main(
            [
                "--tiny",
                "--models",
                "gpt",
                "--seeds",
                "0",
                "1",
                "--mitigations",
                "none",
                "--reuse-models",
                "--models-dir",
                str(tmp_path / folder),
                "--output-dir",
                str(tmp_path / "results"),
            ]
        )


@pytest.mark.slow
@pytest.mark.parametrize("flag", [["--save-steps", "5"], ["--resume"]])
def test_training_flags_are_refused_when_every_model_is_reused(flag, monkeypatch, tmp_path, saved_gpt2):
    """Nothing trains: a flag that acts on training would be silently unused."""
    shutil.copytree(saved_gpt2, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr(position_bias, "train", no_training)
    with pytest.raises(SystemExit, match=r"--save-steps and --resume act on training.*drop them"):
        position_bias.main([*GPT2_ONLY, "--seeds", "0", "1", "--output-dir", str(tmp_path), "--reuse-models", *flag])
