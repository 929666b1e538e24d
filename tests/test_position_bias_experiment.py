"""`examples/position_bias.py`: the lost-in-the-middle experiment, run end to end at its tiny preset."""

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import position_bias  # noqa: E402  (after the path)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("position_bias")
    stdout, rows = run_script(EXAMPLES / "position_bias.py", "--tiny", output_dir=output_dir, csv_name="results.csv")
    return stdout, rows, output_dir


def test_every_slot_of_every_setting_has_a_row(run):
    _, rows, _ = run
    pairs = position_bias.PRESETS["tiny"]["num_pairs"]  # evaluated at n and 2n
    models = {row["model"] for row in rows}
    assert "SepFormer" in models and "Llama (rotary)" in models
    for model in models:
        settings = {(r["mitigation"], r["value"]) for r in rows if r["model"] == model}
        assert ("none", "-") in settings
        for mitigation, value in settings:
            for eval_pairs in (pairs, 2 * pairs):
                slots = [int(r["gold_slot"]) for r in rows if (r["model"], r["mitigation"], r["value"],
                                                               r["eval_pairs"]) == (model, mitigation, value,
                                                                                    str(eval_pairs))]
                assert sorted(slots) == list(range(1, eval_pairs + 1)), (model, mitigation, value, eval_pairs)
    llama = {r["mitigation"] for r in rows if r["model"] == "Llama (rotary)"}
    assert llama == {"none", "ms_poe"}


def test_accuracy_is_a_fraction_or_the_combination_is_refused(run):
    _, rows, _ = run
    for row in rows:
        if row["status"] == "ok":
            assert 0.0 <= float(row["accuracy"]) <= 1.0, row
            assert int(row["examples"]) == position_bias.PRESETS["tiny"]["eval_per_slot"]
        else:
            assert row["status"].startswith("refused: stable_mask and attention_calibration cannot be combined"), row
            assert math.isnan(float(row["accuracy"]))
    assert all(row["status"] == "ok" for row in rows if row["mitigation"] == "none")


def test_tables_and_plots(run):
    stdout, _, output_dir = run
    assert "| model | mitigation | mean | 1 | 2 | 3 | 4 |" in stdout
    assert (output_dir / "results.md").read_text().strip() in stdout
    for name in ("position_bias.png", "attention_by_position.png"):
        assert (output_dir / name).read_bytes()[:8] == PNG
    attention = (output_dir / "attention.csv").read_text().splitlines()
    assert attention[0] == "model,seed,layer,head,group,attention"
    assert any(",slot 1," in line for line in attention)


def test_training_data_is_mqar_with_every_answer_labelled():
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    example = position_bias.training_examples(torch.Generator().manual_seed(0), 1, 3, vocab)
    ids, labels = example["input_ids"][0], example["labels"][0]
    assert ids[0] == vocab.bos and ids[7] == vocab.sep and len(ids) == position_bias.train_length(3)
    stored = dict(zip(ids[1:7:2], ids[2:7:2], strict=True))
    queries = ids[8::2]
    assert sorted(queries) == sorted(stored)  # every key queried once
    assert ids[9::2] == [stored[key] for key in queries]  # followed by its value
    assert [label for label in labels if label != -100] == ids[9::2]  # only the answers are labelled


def test_evaluation_prompts_end_with_the_gold_key():
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    data = position_bias.evaluation_set(0, 4, vocab, args)[:]
    for ids, answer, slot in zip(data["input_ids"], data["answer"], data["gold_slot"], strict=True):
        assert ids[-1] == ids[1 + 2 * slot] and answer == ids[2 + 2 * slot]


def test_llama_ms_poe_with_ratios_one_is_the_model_and_otherwise_acts():
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    llama = next(c for c in position_bias.contenders(args, vocab) if c.name.startswith("Llama"))
    torch.manual_seed(0)
    model = llama.build().eval()
    ids = position_bias.evaluation_set(0, 4, vocab, args)[:]["input_ids"][:5]
    with torch.no_grad():
        base = model(input_ids=ids).logits
        same = model(input_ids=ids, ms_poe={"r_min": 1.0, "r_max": 1.0}).logits
        scaled = model(input_ids=ids, ms_poe={"r_min": 1.2, "r_max": 1.8}).logits
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    assert not torch.allclose(scaled[:, -1], base[:, -1])


def test_presets_mean_what_they_say():
    """`--quick` is the default run reduced (one seed, fewer models and prompts) with the training that learns the task;
    `--tiny` is the smoke run; the two cannot be combined."""
    default, quick, tiny = (position_bias.PRESETS[name] for name in ("default", "quick", "tiny"))
    learning = ("num_pairs", "num_keys", "num_values", "hidden_size", "num_layers", "num_heads", "batch_size",
                "max_steps", "learning_rate", "curriculum")
    assert {key: quick[key] for key in learning} == {key: default[key] for key in learning}
    assert len(quick["seeds"]) == 1 and quick["eval_per_slot"] < default["eval_per_slot"]
    assert tiny["max_steps"] < quick["max_steps"] // 10
    assert position_bias.parse_args(["--quick"]).max_steps == quick["max_steps"]
    assert position_bias.parse_args(["--tiny"]).max_steps == tiny["max_steps"]
    with pytest.raises(SystemExit):
        position_bias.parse_args(["--quick", "--tiny"])
