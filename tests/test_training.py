"""Training: `Trainer` lowers the loss, gradient accumulation with `num_items_in_batch` equals one big batch,
activation checkpointing leaves the gradients unchanged, and data parallel (torchrun, accelerate launch) trains, saves
and reloads."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from ddp_train_script import (
    REFERENCE_INPUT,
    STEPS,
    build_dataset,
    flat_parameters,
    training_arguments,
)
from transformers import AutoModelForCausalLM, PreTrainedModel, Trainer, default_data_collator

import sepformer  # noqa: F401  (registers the Auto classes)
from sepformer import SepFormerForCausalLM, SepFormerTokenizer

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def batch_of(dataset) -> dict[str, torch.Tensor]:
    return default_data_collator([dataset[i] for i in range(len(dataset))])


def gradients(model, **inputs) -> dict[str, torch.Tensor]:
    """Gradients of `model(**inputs).loss` (summed over calls if called again without zeroing)."""
    model(**inputs).loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def assert_gradients_close(actual, expected, atol=1e-6):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def max_gradient_difference(actual, expected) -> float:
    return max((actual[name] - expected[name]).abs().max().item() for name in expected)


# --- 1. Trainer lowers the loss -----------------------------------------------------------------------------------


def test_trainer_lowers_loss(tmp_folder):
    tokenizer = SepFormerTokenizer()
    texts = ["the cat sat on the mat. " * 2, "a b c d e f g h i j k l m ", "the dog sat on the log. " * 2] * 4
    encoded = [[tokenizer.bos_token_id, *tokenizer(text)["input_ids"], tokenizer.eos_token_id] for text in texts]
    length = max(map(len, encoded))
    dataset = build_dataset(texts, seq_len=length)
    model = tiny_model(seed=0)
    args = training_arguments(
        tmp_folder,
        optim="adamw_torch",
        learning_rate=1e-2,
        max_grad_norm=1.0,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=12,
        max_steps=25,
        logging_strategy="steps",
        logging_steps=5,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, eval_dataset=dataset, data_collator=default_data_collator
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]

    assert before == pytest.approx(torch.log(torch.tensor(259.0)).item(), abs=0.5)  # ~uniform at initialisation
    assert after < before - 1.0, (before, after)
    train_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(train_losses) == 5 and train_losses[-1] < train_losses[0], train_losses


# --- 2. Gradient accumulation and num_items_in_batch --------------------------------------------------------------


def test_num_items_in_batch_micro_batches_sum_to_full_batch():
    batch = batch_of(build_dataset())
    counts = (batch["labels"][:, 1:] != -100).sum(-1)
    assert counts.tolist() == [2, 4, 8, 16]  # different per example, so micro-batch means are not the global mean
    total = int(counts.sum())
    model = tiny_model(seed=0).train()

    full = gradients(model, **batch)
    model.zero_grad()
    for rows in (slice(0, 1), slice(1, 4)):  # uneven split: 2 and 28 label tokens
        micro = {key: value[rows] for key, value in batch.items()}
        accumulated = gradients(model, **micro, num_items_in_batch=torch.tensor(total))
    assert_gradients_close(accumulated, full)

    # The check can fail: without `num_items_in_batch` each micro-batch is a mean over its own tokens, and the
    # average of those means is a different gradient.
    model.zero_grad()
    for rows in (slice(0, 1), slice(1, 4)):
        micro = {key: value[rows] for key, value in batch.items()}
        (model(**micro).loss / 2).backward()
    naive = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    assert max_gradient_difference(naive, full) > 1e-4


def train_one_sgd_step(output_dir: str, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameters before and after one Trainer SGD step over the 4-example data set."""
    model = tiny_model(seed=0)
    before = flat_parameters(model).clone()
    args = training_arguments(output_dir, max_steps=1, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=build_dataset(), data_collator=default_data_collator)
    trainer.train()
    assert trainer.state.global_step == 1
    return before, flat_parameters(model)


def test_trainer_gradient_accumulation_matches_big_batch(tmp_folder):
    # One step consumes all 4 examples in both runs, so the (random) order of examples cannot change the result.
    before, big_batch = train_one_sgd_step(tmp_folder, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    _, accumulated = train_one_sgd_step(tmp_folder, per_device_train_batch_size=2, gradient_accumulation_steps=2)

    assert (big_batch - before).abs().max() > 1e-3  # the step really moved the parameters
    torch.testing.assert_close(accumulated, big_batch, atol=1e-6, rtol=0)


# --- 3. Activation checkpointing ----------------------------------------------------------------------------------


# transformers 5.23 renamed gradient checkpointing to activation checkpointing (the old names still work there, with a
# warning); earlier 5.x minors have only the old names.
RENAMED = hasattr(PreTrainedModel, "activation_checkpointing_enable")
CHECKPOINTING = "activation_checkpointing" if RENAMED else "gradient_checkpointing"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_same_gradients(use_reentrant):
    batch = batch_of(build_dataset())
    model = tiny_model(seed=0, hidden_dropout=0.0, attention_dropout=0.0).train()
    expected = gradients(model, **batch)

    model.zero_grad()
    getattr(model, f"{CHECKPOINTING}_enable")(**{f"{CHECKPOINTING}_kwargs": {"use_reentrant": use_reentrant}})
    assert getattr(model, f"is_{CHECKPOINTING}")
    calls = []
    # A pre-hook: non-reentrant recomputation stops early once the saved tensors are rebuilt, so post-hooks may not run.
    hooks = [layer.self_attn.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    outputs = model(**batch)
    assert len(calls) == len(model.model.layers)
    outputs.loss.backward()
    assert len(calls) == 2 * len(model.model.layers)  # each layer was recomputed in the backward pass: checkpointed
    for hook in hooks:
        hook.remove()
    checkpointed = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    assert_gradients_close(checkpointed, expected)
    getattr(model, f"{CHECKPOINTING}_disable")()
    assert not getattr(model, f"is_{CHECKPOINTING}")


def test_trainer_activation_checkpointing_same_step(tmp_folder):
    before, plain = train_one_sgd_step(tmp_folder, per_device_train_batch_size=4)
    _, checkpointed = train_one_sgd_step(tmp_folder, per_device_train_batch_size=4, **{CHECKPOINTING: True})
    assert (plain - before).abs().max() > 1e-3
    torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=0)


# --- 4. Data parallel: torchrun, accelerate launch --------------------------------------------------------------


ACCELERATE_CONFIG = os.path.join(os.path.dirname(TESTS_DIR), "examples", "accelerate", "cpu_2_processes.yaml")
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # the README's command, with the config file shipped in examples/accelerate
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ACCELERATE_CONFIG],
}


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun")
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_data_parallel_trains_saves_and_reloads(tmp_path, launcher):
    output_dir = tmp_path / "ddp"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, env.get("PYTHONPATH")]))
    command = [*LAUNCHERS[launcher], os.path.join(TESTS_DIR, "ddp_train_script.py"), str(output_dir)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    reference = torch.load(output_dir / "reference.pt")
    assert reference["world_size"] == 2 and reference["global_step"] == STEPS
    rank0, rank1 = (torch.load(output_dir / f"params_rank{rank}.pt") for rank in (0, 1))
    torch.testing.assert_close(rank1, rank0, atol=0, rtol=0)  # replicas stayed in sync

    reloaded = AutoModelForCausalLM.from_pretrained(output_dir / "model").eval()
    assert isinstance(reloaded, SepFormerForCausalLM)
    torch.testing.assert_close(flat_parameters(reloaded), rank0, atol=0, rtol=0)
    with torch.no_grad():
        logits = reloaded(torch.tensor(REFERENCE_INPUT)).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-6, rtol=0)

    # Two ranks with 2 examples each equal one process with all 4 (SGD, full-data steps): gradients are averaged
    # across ranks and the loss is normalised by the token count of the whole global batch.
    initial = flat_parameters(tiny_model(seed=0))
    assert (rank0 - initial).abs().max() > 1e-3
    single = tiny_model(seed=0)
    args = training_arguments(str(tmp_path / "single"), per_device_train_batch_size=4)
    Trainer(model=single, args=args, train_dataset=build_dataset(), data_collator=default_data_collator).train()
    torch.testing.assert_close(rank0, flat_parameters(single), atol=1e-6, rtol=0)
