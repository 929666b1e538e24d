"""The command lines of the examples and benchmarks refuse a bad value before any work, naming the flag and value."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
import benchmark  # noqa: E402  (after the path)
import count_kernels  # noqa: E402
import count_params_flops  # noqa: E402
import demo  # noqa: E402
import extrapolation  # noqa: E402
import position_bias  # noqa: E402

# The function that parses each command line; the benchmarks parse first thing in `main`.
PARSERS = {
    "demo": demo.parse_args,
    "extrapolation": extrapolation.parse_args,
    "position_bias": position_bias.parse_args,
    "benchmark": benchmark.main,
    "count_kernels": count_kernels.main,
    "count_params_flops": count_params_flops.main,
}

AT_LEAST_1 = "is not allowed: give an integer >= 1"
AT_LEAST_0 = "is not allowed: give an integer >= 0"
POSITIVE = "is not allowed: give a finite number > 0"
EXPERIMENTS = ("extrapolation", "position_bias")
REFUSED = [
    ("demo", ["--max-steps", "0"], f"--max-steps: 0 {AT_LEAST_1}"),
    ("demo", ["--max-steps", "1.5"], "--max-steps: '1.5' is not an integer; give an integer >= 1"),
    ("demo", ["--batch-size", "0"], f"--batch-size: 0 {AT_LEAST_1}"),
    ("demo", ["--block-size", "5"], "--block-size: 5 is not allowed: give an integer >= 6"),  # <s>def + 1 token
    ("demo", ["--max-bytes", "-1"], f"--max-bytes: -1 {AT_LEAST_1}"),
    ("demo", ["--seed", "-1"], f"--seed: -1 {AT_LEAST_0}"),
    ("extrapolation", ["--eval-batch-size", "0"], f"--eval-batch-size: 0 {AT_LEAST_1}"),
    ("extrapolation", ["--seeds", "0", "0"], "--seeds: 0 given more than once in 0 0; give each value once"),
    ("extrapolation", ["--seeds", "-2"], f"--seeds: -2 {AT_LEAST_0}"),
    ("extrapolation", ["--methods", "clamp", "fourier", "clamp"], "--methods: clamp given more than once"),
    ("extrapolation", ["--block-size", "1"], "--block-size: 1 is not allowed: give an integer >= 2"),
    *[
        ("extrapolation", [flag, "0"], f"{flag}: 0 {AT_LEAST_1}")
        for flag in (
            "--hidden-size",
            "--num-layers",
            "--num-heads",
            "--batch-size",
            "--max-steps",
            "--eval-tokens",
            "--max-bytes",
            "--spline-control-points",
            "--spline-randomized-control-points",
        )
    ],
    ("extrapolation", ["--learning-rate", "0"], f"--learning-rate: 0 {POSITIVE}"),
    ("extrapolation", ["--learning-rate", "nan"], f"--learning-rate: nan {POSITIVE}"),
    (
        "extrapolation",
        ["--train-file", "missing.txt", "--validation-file", "README.md"],
        "--train-file: 'missing.txt' is not a file",
    ),
    ("extrapolation", ["--from-csv", "missing.csv"], "--from-csv: 'missing.csv' is not a file"),
    # flags that the run would not read beside another: refused, not silently dropped
    *[
        (
            "extrapolation",
            ["--train-file", "README.md", "--validation-file", "README.md", *other],
            f"--train-file: not allowed with {other[0]}: the text is the files'",
        )
        for other in (["--dataset-name", "x"], ["--text", "source"], ["--text", "docs"])
    ],
    (
        "extrapolation",
        [
            "--train-file",
            "README.md",
            "--validation-file",
            "README.md",
            "--dataset-config",
            "c",
            "--text-column",
            "body",
        ],
        "--train-file: not allowed with --dataset-config, --text-column",
    ),
    ("extrapolation", ["--dataset-name", "x", "--text", "docs"], "--dataset-name: not allowed with --text"),
    ("extrapolation", ["--train-file", "README.md"], "--train-file: read only with --validation-file"),
    ("extrapolation", ["--validation-file", "README.md"], "--validation-file: read only with --train-file"),
    ("extrapolation", ["--dataset-config", "c"], "--dataset-config: read only with --dataset-name"),
    ("extrapolation", ["--text-column", "body"], "--text-column: read only with --dataset-name"),
    (
        "extrapolation",
        ["--from-csv", "README.md", "--seeds", "0", "1"],
        "--from-csv: not allowed with --seeds: the table is made from the CSV's rows",
    ),
    (
        "extrapolation",
        ["--tiny", "--from-csv", "README.md", "--models", "llama", "--methods", "clamp", "--device", "cpu"],
        "--from-csv: not allowed with --device, --methods, --models",
    ),
    ("extrapolation", ["--from-csv", "README.md", "README.md"], "--from-csv: README.md given more than once"),
    ("position_bias", ["--seeds", "1", "0", "1"], "--seeds: 1 given more than once in 1 0 1"),
    ("position_bias", ["--eval-pairs", "2", "2"], "--eval-pairs: 2 given more than once"),
    ("position_bias", ["--mitigations", "none", "none"], "--mitigations: none given more than once"),
    *[
        ("position_bias", [flag, "0"], f"{flag}: 0 {AT_LEAST_1}")
        for flag in (
            "--num-pairs",
            "--eval-pairs",
            "--num-keys",
            "--num-values",
            "--hidden-size",
            "--num-layers",
            "--num-heads",
            "--batch-size",
            "--max-steps",
            "--end-slots",
            "--eval-per-slot",
            "--validation-per-slot",
            "--eval-batch-size",
        )
    ],
    ("position_bias", ["--learning-rate", "-0.1"], f"--learning-rate: -0.1 {POSITIVE}"),
    ("position_bias", ["--weight-decay", "-0.1"], "--weight-decay: -0.1 is not allowed: give a finite number >= 0"),
    (
        "position_bias",
        ["--gold-at-ends", "nan"],
        "--gold-at-ends: nan is not allowed: give a finite number >= 0 and <= 1",
    ),
    ("benchmark", ["--reps", "0"], f"--reps: 0 {AT_LEAST_1}"),
    ("benchmark", ["--threads", "0"], f"--threads: 0 {AT_LEAST_1}"),
    ("benchmark", ["--seed", "-1"], f"--seed: -1 {AT_LEAST_0}"),
    # the memory workers' own flags: argparse's error, not a traceback from the run
    (
        "benchmark",
        ["--memory-worker", "SepFormer,Bloom"],
        "--memory-worker: 'Bloom' in 'SepFormer,Bloom': give a comma-separated list of SepFormer, GPT-2, Llama",
    ),
    ("benchmark", ["--shape-json", "{"], "--shape-json: '{' is not JSON (Expecting property name"),
    ("benchmark", ["--shape-json", "[1]"], "--shape-json: '[1]' is not a JSON object of Shape fields (hidden_size, "),
    ("benchmark", ["--shape-json", '{"width": 8}'], """--shape-json: '{"width": 8}' is not a JSON object of Shape"""),
    (
        "benchmark",
        ["--shape-json", '{"prefill_lengths": 64, "reps": 0, "layers": 2}'],
        "--shape-json: prefill_lengths, reps in '{",
    ),
    ("count_kernels", ["--tokens", "0"], f"--tokens: 0 {AT_LEAST_1}"),
    ("count_kernels", ["--top", "-1"], f"--top: -1 {AT_LEAST_1}"),
    *[
        ("count_params_flops", [flag, "0"], f"{flag}: 0 {AT_LEAST_1}")
        for flag in ("--hidden-size", "--layers", "--heads", "--seq-len")
    ],
    ("count_params_flops", ["--vocab-size", "255"], "--vocab-size: 255 is not allowed: give an integer >= 256"),
    *[(script, ["--save-steps", "0"], f"--save-steps: 0 {AT_LEAST_1}") for script in EXPERIMENTS],
    *[
        (
            script,
            ["--fp16", "--device", "cpu"],
            "--fp16: not allowed with --device cpu: fp16 mixed precision needs a CUDA GPU; give --bf16 instead",
        )
        for script in EXPERIMENTS
    ],
    (
        "extrapolation",
        ["--device", "cuda:1"],
        "--device: cuda:1 is not allowed: Trainer places the model on each process's own device; give cuda",
    ),
    ("position_bias", ["--bf16", "--fp16"], "--fp16: not allowed with argument --bf16"),
]


def refusal(script: str, argv: list[str], capsys) -> str:
    """What the command line says when it refuses `argv` (argparse's exit status 2, before any work)."""
    with pytest.raises(SystemExit) as stopped:
        PARSERS[script](argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "script, argv, message", REFUSED, ids=lambda value: " ".join(value) if isinstance(value, list) else None
)
def test_a_bad_value_is_refused_naming_flag_and_value(script, argv, message, capsys):
    assert f"argument {message}" in refusal(script, argv, capsys)


@pytest.mark.parametrize(
    "script, flag",
    [
        ("demo", "--output-dir"),
        ("extrapolation", "--output-dir"),
        ("position_bias", "--output-dir"),
        ("position_bias", "--models-dir"),
        ("benchmark", "--output-dir"),
    ],
)
def test_an_output_folder_that_cannot_be_made_is_refused_before_the_run(script, flag, tmp_path, capsys):
    """A file where the folder would be: refused at once, not after the run when the results are written."""
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file", tmp_path / "file" / "below"):
        message = refusal(script, [flag, str(path)], capsys)
        assert f"argument {flag}: '{path}' cannot be an output directory: '{tmp_path / 'file'}' is a file" in message


@pytest.mark.parametrize("script", PARSERS)
def test_no_numeric_argument_is_a_bare_int_or_float(script, monkeypatch):
    """Every number a command line takes has a range (a bare `type=int` lets 0 or -1 through to the run)."""

    class Parsed(Exception):
        pass

    def capture(parser, *args, **kwargs):
        raise Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed) as parsed:
        PARSERS[script]([])
    actions = parsed.value.args[0]._actions
    assert any(action.type is not None for action in actions)  # the capture saw this script's own parser
    assert [action.dest for action in actions if action.type in (int, float)] == []


@pytest.mark.parametrize("script", EXPERIMENTS)
def test_a_device_the_machine_lacks_is_refused(script, monkeypatch, capsys):
    """Not trained on the CPU instead, as Trainer does where `--device cuda` finds no GPU."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: None)
    message = refusal(script, ["--tiny", "--device", "cuda"], capsys)
    assert "argument --device: cuda is not available on this machine (it has cpu): give cpu" in message
    assert "argument --device: 'gpu' is not a torch device; give cpu" in refusal(script, ["--device", "gpu"], capsys)


def test_flags_read_together_are_accepted():
    args = extrapolation.parse_args(["--dataset-name", "x", "--dataset-config", "c", "--text-column", "body"])
    assert (args.dataset_name, args.dataset_config, args.text_column, args.text) == ("x", "c", "body", "source")
    args = extrapolation.parse_args(
        [
            "--tiny",
            "--from-csv",
            "README.md",
            "--block-size",
            "8",
            "--max-steps",
            "3",
            "--batch-size",
            "4",
            "--output-dir",
            "elsewhere",
        ]
    )
    assert (args.from_csv, args.block_size, args.seeds) == (["README.md"], 8, [0])


def test_the_limits_themselves_are_accepted(tmp_path):
    assert demo.parse_args(["--block-size", "6", "--seed", "0", "--max-steps", "1"]).block_size == 6
    args = extrapolation.parse_args(["--tiny", "--block-size", "2", "--seeds", "0", "3", "--methods", "clamp"])
    assert (args.block_size, args.seeds, args.methods) == (2, [0, 3], ("clamp",))
    args = position_bias.parse_args(
        ["--tiny", "--gold-at-ends", "0", "--weight-decay", "0", "--output-dir", str(tmp_path / "not" / "yet")]
    )
    assert (args.gold_at_ends, args.weight_decay) == (0.0, 0.0)
    assert not (tmp_path / "not").exists()  # checked, not made: the run makes it


@pytest.mark.parametrize("script", EXPERIMENTS)
def test_a_batch_that_does_not_split_over_the_processes_is_refused(script, monkeypatch, capsys):
    """Under torchrun each process takes an equal share of every step's batch: 2 processes and 3 rows cannot."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(script, ["--tiny", "--batch-size", "3"], capsys)
    assert "argument --batch-size: 3 does not split over 2 processes: give a multiple of 2" in message
