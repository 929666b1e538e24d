"""The README's code and commands run as written: each test takes its block from README.md, so the two cannot drift.

The LoRA example runs in tests/test_peft.py (`test_readme_lora_example_runs`).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def block(language: str, containing: str) -> str:
    return next(text for text in re.findall(rf"```{language}\n(.*?)```", README, flags=re.S) if containing in text)


def commands(text: str, *extra: str) -> list[str]:
    """The shell commands of a block, continuation lines joined and comments dropped, each with `extra` appended."""
    lines = [re.sub(r"(^|\s)#.*", "", line).strip() for line in text.replace("\\\n", " ").splitlines()]
    return [" ".join([line, *extra]) for line in lines if line]


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as typed in a shell at `cwd`: `python` and the tools are this environment's, `sepformer` this
    checkout's."""
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    completed = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, f"{command}\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}"
    return completed


@pytest.fixture
def repository_root(tmp_path):
    """A folder to run the README's commands in, as from the repository root: its `examples` and `eval`, and an
    `outputs` of its own."""
    for name in ("examples", "eval"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart, run in a folder of its own; its namespace. It saves `outputs/quickstart/model` there."""
    folder = tmp_path_factory.mktemp("quickstart")
    namespace = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        exec(compile(block("python", "Trainer("), "README.md quickstart", "exec"), namespace)
    return folder, namespace


@pytest.mark.xdist_group("lm_eval")  # with the lm-eval test, which reads its model
def test_quickstart_runs(quickstart):
    folder, namespace = quickstart
    assert (folder / "outputs/quickstart/model/modeling_sepformer.py").exists()
    assert type(namespace["reloaded"]).__name__ == "SepFormerForCausalLM"


@pytest.mark.slow
@pytest.mark.xdist_group("lm_eval")  # one at a time: the harness's runs share the data set cache
def test_lm_eval_command_scores_the_quickstart_model(quickstart):
    pytest.importorskip("lm_eval")  # the `eval` extra; `make test` installs it
    folder, _ = quickstart
    (folder / "eval").symlink_to(ROOT / "eval")  # run "from the repository root": the task's data path is relative
    (command,) = commands(block("bash", "lm_eval --model hf"))
    completed = shell(command, folder)
    assert re.search(r"\|sepformer_heldout\|.*\|bits_per_byte +\|", completed.stdout), completed.stdout[-2000:]


def test_position_bias_example_runs():
    exec(compile(block("python", "StableMask("), "README.md position bias", "exec"), {})


def test_methods_outside_generate_example_runs():
    """The block continuing the position-bias one: reordering, relevance and the positional search by themselves."""
    namespace = {}
    exec(compile(block("python", "StableMask("), "README.md position bias", "exec"), namespace)
    exec(compile(block("python", "search_positional_scaling("), "README.md outside generate", "exec"), namespace)
    ids, order = namespace["ids"], namespace["order"]
    assert ids.shape == namespace["batch"]["input_ids"].shape and sorted(order[0].tolist()) == [0, 1]
    assert namespace["result"].candidates and isinstance(namespace["result"].improves, bool)


def test_metrics_example_runs(capsys):
    exec(compile(block("python", "metric_path("), "README.md metrics", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert float(printed[0]) == pytest.approx(8.0)
    assert "'accuracy_by_position': {0: 1.0, 1: 0.0, 2: 1.0}" in printed[1]


def test_any_decoder_example_runs():
    exec(compile(block("python", "add_mitigations("), "README.md any decoder", "exec"), {})


@pytest.mark.slow
def test_extrapolation_command_runs_with_tiny(repository_root):
    """`make extrapolation` (`python examples/extrapolation.py`) with the smoke preset, writing where it says."""
    command = re.search(r"`make extrapolation` \(`([^`]+)`\)", README).group(1)
    assert f"$(BIN)/{command}\n" in (ROOT / "Makefile").read_text()
    shell(f"{command} --tiny", repository_root)
    for name in ("results.csv", "results.md", "extrapolation.png"):
        assert (repository_root / "outputs/extrapolation" / name).stat().st_size > 0


@pytest.mark.slow
def test_position_bias_commands_run_with_tiny(repository_root):
    """The block that trains and saves the models, then evaluates them again without training: the second command
    loads every model the first saved."""
    first, second = commands(block("bash", "examples/position_bias.py"), "--tiny")
    shell(first, repository_root)
    reused = shell(second, repository_root)
    assert reused.stdout.count(": loaded from outputs/position_bias/models/") == 3, reused.stdout[-2000:]
    assert (repository_root / "outputs/position_bias_all/results.csv").stat().st_size > 0
