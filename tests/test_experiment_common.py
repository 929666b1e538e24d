"""`examples/experiment_common.py`: the experiments' training through `Trainer` (checkpoint resume), their loss."""

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import experiment_common  # noqa: E402  (after the path)
import extrapolation  # noqa: E402

STEPS, BATCH = 4, 4


def dataset():
    """Rows whose labels are one token longer than the inputs: every position has a target."""
    return [{"input_ids": ids[:-1], "labels": ids} for ids in random_ids(STEPS * BATCH, 9)]


def flat(model):
    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def train(model, output_dir, **kwargs):
    return experiment_common.train(
        model,
        dataset(),
        steps=STEPS,
        learning_rate=1e-2,
        batch_size=BATCH,
        seed=0,
        output_dir=output_dir,
        save_steps=STEPS // 2,
        **kwargs,
    )


def test_resume_continues_from_the_last_checkpoint_as_if_never_stopped(tmp_path):
    """A run stopped after its middle checkpoint, resumed into a model of other weights, ends where the run that
    never stopped ends: weights, optimizer, schedule and logged losses all come from the checkpoint."""
    straight = tiny_model(seed=0)
    before = flat(straight)
    losses = train(straight, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert (flat(straight) - before).abs().max() > 1e-3

    for file in (tmp_path / "checkpoint-4").iterdir():  # as if stopped before the last checkpoint
        file.unlink()
    (tmp_path / "checkpoint-4").rmdir()
    resumed = tiny_model(seed=1)
    resumed_losses = train(resumed, tmp_path, resume_from_checkpoint=True)
    torch.testing.assert_close(flat(resumed), flat(straight), atol=1e-6, rtol=0)
    assert resumed_losses == pytest.approx(losses, abs=1e-6) and len(losses) == STEPS

    fresh = tiny_model(seed=1)  # without resume: trained from its own start, not the checkpoint's weights
    train(fresh, tmp_path / "fresh")
    assert (flat(fresh) - flat(straight)).abs().max() > 1e-3


def test_training_leaves_the_config_as_it_was(tmp_path):
    """A model saved after training (`position_bias.py` saves and reloads them) has the config it was built with,
    but for what `save_pretrained` records anyway: its class and dtype."""
    model = tiny_model(seed=0)

    def fields():
        return {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "dtype")}

    before = fields()
    assert before["use_cache"]  # what Trainer would set to its own default, False
    train(model, tmp_path)
    assert fields() == before


def test_the_loss_is_the_mean_over_every_labelled_token():
    """`labels[:, j + 1]` is the target of position j, over the whole batch (not a mean of per-row means)."""
    model = tiny_model(seed=0)
    ids = random_ids(2, 9)
    labels = ids.clone()
    labels[0, 3:] = -100  # rows of 2 and 8 targets
    logits = model(ids[:, :-1]).logits
    loss = experiment_common.next_token_loss(model(ids[:, :-1]), labels)
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)
    torch.testing.assert_close(loss, expected)


def no_data(*args, **kwargs):
    raise AssertionError("the data was read")


def test_resume_without_any_checkpoint_is_refused_before_the_data_is_read(monkeypatch, tmp_path):
    monkeypatch.setattr(extrapolation, "token_data", no_data)
    with pytest.raises(SystemExit, match=f"--resume: {tmp_path / 'checkpoints'} holds no checkpoint of this run's"):
        extrapolation.main(["--tiny", "--resume", "--output-dir", str(tmp_path)])


def test_models_of_one_shape_are_built_by_name_and_an_unknown_name_is_refused():
    shape = (259, 32, 2, 4, 16)
    sizes = {
        name: experiment_common.build_model(name, *shape).config.hidden_size
        for name in ("sepformer", "llama", "gpt2", "bloom")
    }
    assert sizes == {"sepformer": 32, "llama": 32, "gpt2": 32, "bloom": 32}
    with pytest.raises(ValueError, match="model 'mamba' is not one of sepformer, llama, gpt2, bloom"):
        experiment_common.build_model("mamba", *shape)


def test_interval_is_students_t_over_seeds():
    assert experiment_common.interval95([0.5]) == 0.0
    # n = 2: t(1) = 12.706, stdev([0, 1]) = 1/sqrt(2), so 12.706 * (1/sqrt(2)) / sqrt(2) = 6.353
    assert experiment_common.interval95([0.0, 1.0]) == pytest.approx(6.353)
    # n = 3: t(2) = 4.303, stdev([0.8, 0.9, 1.0]) = 0.1
    assert experiment_common.interval95([0.8, 0.9, 1.0]) == pytest.approx(4.303 * 0.1 / math.sqrt(3))


def test_a_long_error_is_cut_after_a_word():
    long = ValueError("abcdefgh " * 40 + "\nsecond line")  # character 200 falls inside a word
    line = experiment_common.first_line(long)
    assert len(line) <= 204 and line.endswith(" abcdefgh ...") and "second" not in line
    assert experiment_common.first_line(ValueError("short\nmore")) == "short"
