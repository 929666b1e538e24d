"""Trained models saved with their training record, and loaded again (`--reuse-models`) only where they are what the
run would train: the same training settings, config, dtype and finite weights; anything else is refused, naming the
folder and what differs, before any training."""

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
from experiment_common import first_line, is_main_process
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm.auto import tqdm

# What a config records besides the model: the dtype and class names it was saved with, the library's version.
UNRECORDED_CONFIG = ("dtype", "architectures", "transformers_version", "_name_or_path")

# What `training.json` holds (`trained_model` writes it), and the type of each.
TRAINING_RECORD = {"settings": dict, "config": dict, "train_loss": float | int, "train_seconds": float | int}


def full_config(config) -> dict:
    """Every config field, defaults included: a default changed since the model was saved shows here."""
    fields = json.loads(config.to_json_string(use_diff=False))
    return {name: value for name, value in fields.items() if name not in UNRECORDED_CONFIG}


def differences(saved: dict, wanted: dict) -> str:
    return ", ".join(
        f"{name} {saved.get(name)!r} there, {value!r} here"
        for name, value in wanted.items()
        if saved.get(name) != value
    )


def listed(items: list[str], shown: int = 2) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def refuse(folder: Path, why: str) -> NoReturn:
    raise SystemExit(f"--reuse-models: {folder} {why}; give another --models-dir or remove that folder to train again")


def read_record(folder: Path) -> dict:
    """`training.json`; refused where it does not read or lacks a field of `TRAINING_RECORD`."""
    try:
        record = json.loads((folder / "training.json").read_text())
    except ValueError as error:
        refuse(folder, f"has a training.json that does not read ({type(error).__name__}: {error})")
    if not isinstance(record, dict):
        refuse(folder, f"has a training.json that holds a {type(record).__name__}, not an object")
    if wrong := [
        f"{key} is {'missing' if key not in record else 'a ' + type(record[key]).__name__}"
        for key, kind in TRAINING_RECORD.items()
        if not isinstance(record.get(key), kind)
    ]:
        refuse(
            folder,
            f"has a training.json where {', '.join(wrong)} (a record holds the objects settings and config and the "
            "numbers train_loss and train_seconds)",
        )
    return record


def check_config(model, folder: Path, record: dict) -> None:
    """The record's config and `config.json` are the config `model` was built with, field by field."""
    if differing := differences(record["config"], full_config(model.config)):
        refuse(folder, f"holds a model of another config ({differing})")
    try:
        saved_config = type(model.config).from_pretrained(folder)
    except (OSError, ValueError, TypeError) as error:
        refuse(folder, f"has a config.json that does not load ({type(error).__name__}: {first_line(error)})")
    if differing := differences(full_config(saved_config), full_config(model.config)):
        refuse(folder, f"has a config.json of another model ({differing})")


def load_weights(model, folder: Path) -> None:
    """The saved weights into `model`; refused where they do not load, have another dtype or are not finite."""
    try:
        weights = load_file(folder / "model.safetensors")
        own = model.state_dict()
        if other := [
            f"{name} {tensor.dtype} there, {own[name].dtype} here"
            for name, tensor in weights.items()
            if name in own and tensor.dtype != own[name].dtype
        ]:
            refuse(folder, f"has weights of another dtype ({listed(other)})")
        if not_finite := [name for name, tensor in weights.items() if not tensor.isfinite().all()]:
            refuse(folder, f"has weights that are not finite ({listed(not_finite)})")
        model.load_state_dict(weights)
    except (OSError, RuntimeError, SafetensorError) as error:
        refuse(folder, f"has weights that do not load ({type(error).__name__}: {first_line(error)})")


def saved_model(folder: Path, settings: dict, build: Callable, device) -> tuple[torch.nn.Module, dict] | None:
    """The model saved in `folder` (`build()` loaded with its weights, on `device`) and its training record; `None`
    where the folder has no record. Refused, naming the folder and what is wrong, where the record was trained with
    other `settings` or is not `build()`'s model (reusing it would report another experiment)."""
    if not (folder / "training.json").exists():
        return None
    record = read_record(folder)
    if differing := differences(record["settings"], settings):
        refuse(folder, f"was trained with other settings ({differing})")
    model = build()
    check_config(model, folder, record)
    load_weights(model, folder)
    return model.to(device).eval(), record


def trained_model(
    folder: Path, settings: dict, build: Callable, train: Callable, device, reuse: bool, name: str
) -> tuple[torch.nn.Module, dict]:
    """`build()` trained by `train(model)` (its loss), or, with `reuse`, the one saved in `folder` (`saved_model`),
    and its training record. A model trained here is saved in `folder` (`save_pretrained`) with its record, which is
    written last: a folder left half-written by a stopped run has no record, and is trained again."""
    if reuse and (saved := saved_model(folder, settings, build, device)) is not None:
        tqdm.write(f"{name}: loaded from {folder} (trained to loss {saved[1]['train_loss']:.3f})")
        return saved
    model = build()
    started = time.time()
    train_loss = train(model)
    record = dict(
        settings=settings,
        config=full_config(model.config),
        train_loss=round(train_loss, 4),
        train_seconds=round(time.time() - started, 1),
    )
    if is_main_process():
        (folder / "training.json").unlink(missing_ok=True)
        model.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return model, record
