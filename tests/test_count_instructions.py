"""`benchmarks/count_instructions.py`: callgrind's dumps read back into instructions per decoding step (the run under
valgrind itself takes minutes, and is the benchmark's, not the tests')."""

import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "count_instructions.py"
sys.path.insert(0, str(SCRIPT.parent))
import count_instructions  # noqa: E402  (after the path)


def callgrind_dump(label: str, instructions: int, trigger: str = "dump") -> str:
    """A dump as callgrind 3.19 writes one (header, then per-function costs, then the totals)."""
    return (
        "# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 7\ncmd:  python script.py\npart: 2\n\n\n"
        f"desc: I1 cache: \ndesc: Timerange: Basic block 1 - 2\ndesc: Trigger: {trigger} {label}\n\n"
        f"positions: line\nevents: Ir\nsummary: {instructions}\n\n\nfn=(1) main\n0 {instructions}\n\n"
        f"totals: {instructions}\n"
    )


def test_the_dumps_are_read_by_label_and_the_prefill_cancels_out(tmp_path):
    counts = {"no option/warm-up": 999, "no option/2": 1_000, "no option/10": 1_800, "stable_mask/2": 1_100}
    counts["stable_mask/10"] = 1_100 + 8 * 115  # 8 more steps of 115 instructions
    for index, (label, instructions) in enumerate(counts.items()):
        (tmp_path / f"steps.7.{index + 1}").write_text(callgrind_dump(label, instructions))
    (tmp_path / "steps.7").write_text(callgrind_dump("", 5, trigger="Program termination"))  # the exit's dump
    (tmp_path / "valgrind.log").write_text("==7== Callgrind, a call-graph generating cache profiler\n")
    assert count_instructions.read_dumps(tmp_path) == counts
    steps = count_instructions.per_step(counts, ["no option", "stable_mask"], tokens=2)
    assert steps == {"no option": 100.0, "stable_mask": 115.0}


def test_without_valgrind_the_count_says_what_is_missing(monkeypatch):
    monkeypatch.delenv(count_instructions.DUMPS, raising=False)
    monkeypatch.setattr(count_instructions.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match="valgrind and callgrind_control not found"):
        count_instructions.main(["--options", "stable_mask"])


def test_an_option_the_llama_is_not_measured_with_is_refused(capsys):
    with pytest.raises(SystemExit):
        count_instructions.main(["--options", "attention_calibration_positional"])
    assert "invalid choice: 'attention_calibration_positional'" in capsys.readouterr().err


def test_the_counted_generations_have_the_batch_asked_for(monkeypatch, tmp_path):
    import benchmark_models

    calls = []
    monkeypatch.setattr(benchmark_models, "build", lambda *args: object())
    monkeypatch.setattr(count_instructions, "dump", lambda label, folder: calls.append(label))
    monkeypatch.setattr("sepformer.add_mitigations", lambda model: model)
    monkeypatch.setattr(
        benchmark_models, "generate", lambda model, batch, prompt, new, seed, **given: calls.append((batch, given))
    )
    monkeypatch.setenv(count_instructions.DUMPS, str(tmp_path))
    count_instructions.main(["--batch", "3", "--tokens", "2", "--options", "attention_calibration"])
    generations = [call for call in calls if isinstance(call, tuple)]
    assert [batch for batch, _ in generations] == [3] * 6  # a warm-up, then 2 and 10 tokens, for each variant
    spans = generations[-1][1]["attention_calibration"].spans
    assert len(spans) == 3  # the option's spans, one row per prompt
    assert [call for call in calls if isinstance(call, str)][-3:] == [
        "attention_calibration/warm-up",
        "attention_calibration/2",
        "attention_calibration/10",
    ]


def test_the_table_names_the_batch(monkeypatch, capsys):
    monkeypatch.delenv(count_instructions.DUMPS, raising=False)
    monkeypatch.setattr(count_instructions.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    runs = []
    monkeypatch.setattr(count_instructions.subprocess, "run", lambda command, **kwargs: runs.append(command))
    counts = {"no option/8": 1_000, "no option/40": 33_000, "stable_mask/8": 1_000, "stable_mask/40": 34_600}
    monkeypatch.setattr(count_instructions, "read_dumps", lambda folder: counts)
    steps = count_instructions.main(["--batch", "3", "--options", "stable_mask"])
    assert steps == {"no option": 1_000.0, "stable_mask": 1_050.0}
    assert runs[0][-4:] == ["--batch", "3", "--options", "stable_mask"]  # the run under valgrind counts the same
    assert "| Llama + add_mitigations, batch 3 |" in capsys.readouterr().out
