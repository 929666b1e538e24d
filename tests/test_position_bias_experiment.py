"""`examples/position_bias.py`: the lost-in-the-middle experiment, run end to end at its tiny preset."""

import csv
import math
import re
import sys
from pathlib import Path

import evaluate
import pytest
import torch
from conftest import run_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# On one worker: the end-to-end run (`run`) would otherwise run once in each.
pytestmark = pytest.mark.xdist_group("position_bias_experiment")
sys.path.insert(0, str(EXAMPLES))
import position_bias  # noqa: E402  (after the path)
import position_bias_conditions  # noqa: E402
import position_bias_task as task  # noqa: E402
from test_position_bias_conditions import oracle, untrained  # noqa: E402

from sepformer.metrics import metric_path  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("position_bias")
    stdout, rows = run_script(EXAMPLES / "position_bias.py", "--tiny", output_dir=output_dir, csv_name="results.csv")
    return stdout, rows, output_dir


EVERY_MITIGATION = {
    "none",
    "stable_mask",
    "ms_poe",
    "attention_calibration",
    "positional_scaling",
    "attention_buckets",
    "parallel_context_windows",
    "in2",
    "reorder",
}


EXPECTED_MITIGATIONS = {
    "SepFormer": EVERY_MITIGATION,
    "Llama (rotary)": EVERY_MITIGATION,
    "GPT-2 (learned absolute)": EVERY_MITIGATION - {"ms_poe", "attention_buckets"},
}


REFUSED = {
    ("SepFormer", "attention_buckets"): "bases=[10000.0, 17500.0, 25000.0] mean nothing for this model: it has no "
    "rotary",
    ("Llama (rotary)", "positional_scaling"): "factor=0.5; factor=0.0; factor=-0.5; factor=-1.0: refused: "
    "positional_scaling on LlamaForCausalLM needs channels",
    ("Llama (rotary)", "attention_calibration"): "bias_estimate='positional' reads the positional block, but Llama",
    ("Llama (rotary)", "reorder"): "by='position_free' zeroes SepFormer's positional block",
    ("GPT-2 (learned absolute)", "ms_poe"): "r_max=2.4; r_max=1.5, every layer; r_max=1.8, every layer; "
    "r_max=2.4, every layer: refused: ms_poe rescales the rotary "
    "positions of each head, but GPT2LMHeadModel",
    ("GPT-2 (learned absolute)", "attention_buckets"): "attention_buckets reads positions with other rotary bases or "
    "scales, but GPT2LMHeadModel",
    ("GPT-2 (learned absolute)", "positional_scaling"): "positional_scaling on GPT2LMHeadModel needs channels",
    ("GPT-2 (learned absolute)", "attention_calibration"): "bias_estimate='positional' reads the positional block",
    ("GPT-2 (learned absolute)", "reorder"): "by='position_free' zeroes SepFormer's positional block",
}


REORDER_SETTINGS = {"by attention", "attention sorting, 3 rounds", "by calibrated attention"}


@pytest.mark.slow
def test_every_slot_of_every_setting_has_a_row(run):
    _, rows, _ = run
    pairs = position_bias.PRESETS["tiny"]["num_pairs"]
    assert list(rows[0])[:7] == ["model", "mitigation", "setting", "seed", "num_pairs", "slot", "accuracy"]
    assert {row["model"]: None for row in rows}.keys() == EXPECTED_MITIGATIONS.keys()
    for model, expected in EXPECTED_MITIGATIONS.items():
        mine = [r for r in rows if r["model"] == model]
        assert {r["mitigation"] for r in mine} == expected, model
        for setting in {(r["mitigation"], r["setting"]) for r in mine}:
            slots = [int(r["slot"]) for r in mine if (r["mitigation"], r["setting"]) == setting]
            assert sorted(slots) == list(range(1, pairs + 1)), (model, setting)
        searched = [r["setting"] for r in mine if r["mitigation"] == "positional_scaling"]
        assert position_bias_conditions.SEARCH_PICK in searched, model
        picks = {r["details"] for r in mine if r["setting"] == position_bias_conditions.SEARCH_PICK}
        assert len(picks) == 1 and next(iter(picks)).startswith("channels="), (model, picks)
    for model in EXPECTED_MITIGATIONS:
        calibrations = {
            r["setting"]: r["details"]
            for r in rows
            if r["model"] == model and r["mitigation"] == "attention_calibration"
        }
        positional = [setting for setting in calibrations if ", positional bias(k)" in setting]
        assert len(calibrations) == 6 + len(positional) and len(positional) == 3 * (model == "SepFormer"), model
        assert all(calibrations[s].startswith("bias(k) vs the dummy passes': Pearson r ") for s in positional)


@pytest.mark.slow
def test_each_setting_has_a_row_on_every_model_that_runs_it_and_the_run_says_why_the_others_refuse(run):
    """The rows of a mitigation are built once: Llama and GPT-2 get StableMask and calibration, Llama MS-PoE and
    Attention Buckets (the sweeps of scales and of rotary bases); a model that refuses a setting has no row for it,
    and the run prints which, with the model's own reason."""
    stdout, rows, _ = run
    settings = {}
    for row in rows:
        settings.setdefault((row["model"], row["mitigation"]), set()).add(row["setting"])
    sepformer = "SepFormer"
    for model in EXPECTED_MITIGATIONS:
        for mitigation in ("stable_mask", "attention_calibration", "parallel_context_windows"):
            dummy_passes = {s for s in settings[(sepformer, mitigation)] if "positional" not in s}
            assert dummy_passes <= settings[(model, mitigation)], (model, mitigation)
    llama = "Llama (rotary)"
    ratios = {f"r_max={r}{where}" for r in (1.5, 1.8, 2.4) for where in ("", ", every layer")}
    assert settings[(llama, "ms_poe")] == settings[(sepformer, "ms_poe")] == ratios
    calibrations = {
        f"temperature={t}, dummy passes{where}" for t in (5e-5, 1e-3, 1e-2) for where in ("", ", every layer")
    }
    assert {s for s in settings[(llama, "attention_calibration")] if "dummy" in s} == calibrations
    scales = {"scales=[1.0, 0.9, 0.8]", "scales=[1.0, 0.75, 0.5]"}
    bases = {"bases=[10000, 17500, 25000]", "bases=[10000, 13000, 16000, 19000, 22000, 25000, 28000]"}
    assert settings[(llama, "attention_buckets")] == scales | bases
    assert settings[(sepformer, "attention_buckets")] == scales
    refusals = [line for line in stdout.splitlines() if ": refused: " in line]
    for (model, mitigation), reason in REFUSED.items():
        assert any(f"{model}, 4 pairs: no {mitigation} row for " in line and reason in line for line in refusals), (
            model,
            mitigation,
        )
    refused = {re.search(r"· (.+), 4 pairs: no (\S+) row for ", line).groups() for line in refusals}
    assert refused == set(REFUSED), refusals  # a line per refusal reason: one per setting where each names its own


@pytest.mark.slow
def test_in2_and_reorder_rows_of_every_model(run):
    """IN2 at 5% and 20% of the tiny preset's 20 steps (1 and 4 steps), with the fine-tune's record; reordering by
    each relevance source the model has, with the gold-at-an-end fraction; both columns empty on the other rows."""
    _, rows, _ = run
    for model in EXPECTED_MITIGATIONS:
        mine = [r for r in rows if r["model"] == model]
        in2 = {(r["setting"], r["finetune_steps"]) for r in mine if r["mitigation"] == "in2"}
        assert in2 == {("5% of training steps (1 step)", "1"), ("20% of training steps (4 steps)", "4")}, model
        assert all(
            float(r["finetune_loss"]) > 0 and float(r["finetune_seconds"]) >= 0
            for r in mine
            if r["mitigation"] == "in2"
        )
        reorder = {r["setting"] for r in mine if r["mitigation"] == "reorder"}
        extra = {"position-free attention (SepFormer)"} if model == "SepFormer" else set()
        assert reorder == REORDER_SETTINGS | extra, model
        for row in mine:
            assert (row["gold_at_end"] != "") == (row["mitigation"] == "reorder"), row
            assert (row["finetune_steps"] != "") == (row["mitigation"] == "in2"), row
            if row["mitigation"] == "reorder":
                assert 0 <= float(row["gold_at_end"]) <= 1


@pytest.mark.slow
def test_in2_rows_leave_the_base_rows_unchanged(tmp_path):
    """The fine-tunes train copies: the base model's rows and its attention (measured after the fine-tunes) are the
    same with and without IN2."""
    argv = ["--tiny", "--mitigations", "none"]
    base = position_bias.main([*argv, "--output-dir", str(tmp_path / "base")])
    with_in2 = position_bias.main([*argv, "in2", "--in2-fractions", "0.5", "--output-dir", str(tmp_path / "in2")])

    def timeless(rows):
        return [{key: value for key, value in row.items() if key != "train_seconds"} for row in rows]

    assert timeless(r for r in with_in2 if r["mitigation"] == "none") == timeless(base)
    assert {r["setting"] for r in with_in2 if r["mitigation"] == "in2"} == {"50% of training steps (10 steps)"}
    attention = [(tmp_path / run / "attention.csv").read_text() for run in ("base", "in2")]
    assert attention[0] == attention[1]


def test_in2_rows_evaluate_the_fine_tuned_copy(monkeypatch):
    """The fine-tune (here replaced by one that makes the copy answer every prompt right) is what the IN2 rows
    evaluate: evaluating the base model instead would give its own accuracy, not 1 at every slot."""
    args, vocab, contender, model = untrained("gpt2")
    args.in2_fractions = (0.05,)

    def perfect(module, inputs, kwargs, output):
        ids = kwargs["input_ids"]
        documents = ids[torch.arange(len(ids)), 1 + oracle(ids, vocab).argmax(-1)]  # the gold document of each
        answers = vocab.value(documents % vocab.num_values)
        output.logits = torch.nn.functional.one_hot(answers, len(vocab)).float()[:, None]
        return output

    tuned = []

    def fine_tune(copy, data, in2_args, description, seed):
        assert copy is not model and in2_args.max_steps == 1 and "IN2 0.05" in description
        tuned.append(copy.register_forward_hook(perfect, with_kwargs=True))
        return 0.5

    monkeypatch.setattr(position_bias, "train", fine_tune)
    evaluation = {args.num_pairs: task.evaluation_set(0, args.num_pairs, vocab, args)}
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias.in2_rows(model, contender, 0, vocab, evaluation, metric, args)
    assert len(tuned) == 1 and [r["accuracy"] for r in rows] == [1.0] * args.num_pairs
    assert {(r["mitigation"], r["finetune_steps"], r["finetune_loss"]) for r in rows} == {("in2", 1, 0.5)}
    none = position_bias_conditions.mitigation_conditions(task.document_spans(4), vocab)[:1]
    base = position_bias_conditions.evaluate_model(
        model, none, evaluation[args.num_pairs], args.num_pairs, metric, args, contender
    )
    assert [r["accuracy"] for r in base] != [1.0] * args.num_pairs  # the base model, left as it was


def test_mitigations_without_none_run_beside_it(tmp_path, capsys):
    """Every mitigation row is compared with the model as it is (Δ mean, the progress line): 'none' is evaluated
    even where --mitigations leaves it out."""
    rows = position_bias.main(
        [
            "--tiny",
            "--max-steps",
            "2",
            "--models",
            "gpt",
            "--mitigations",
            "parallel_context_windows",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert [mitigation for mitigation in dict.fromkeys(r["mitigation"] for r in rows)] == [
        "none",
        "parallel_context_windows",
    ]
    table = (tmp_path / "results.md").read_text()
    assert table.count("| parallel_context_windows |") == 2 and "nan" not in table


def test_in2_fractions_are_checked():
    assert position_bias.parse_args(["--tiny"]).in2_fractions == (0.05, 0.2)
    with pytest.raises(SystemExit, match="--in2-fractions 0.5: read only by the IN2 rows"):
        position_bias.parse_args(["--tiny", "--mitigations", "none", "--in2-fractions", "0.5"])
    with pytest.raises(SystemExit, match="--in2-fractions 0.01: of --max-steps 20 rounds to 0 fine-tuning steps"):
        position_bias.parse_args(["--tiny", "--in2-fractions", "0.01", "0.5"])
    with pytest.raises(SystemExit):
        position_bias.parse_args(["--tiny", "--in2-fractions", "0"])


def test_finished_seeds_are_written_before_the_next_starts(monkeypatch, tmp_path):
    """A long run that stops at seed 1 keeps seed 0's rows in results.csv."""
    run_seed = position_bias.run_seed

    def crash_at_seed_1(seed, *args):
        if seed == 1:
            raise RuntimeError("stopped")
        return run_seed(seed, *args)

    monkeypatch.setattr(position_bias, "run_seed", crash_at_seed_1)
    with pytest.raises(RuntimeError, match="stopped"):
        position_bias.main(
            ["--tiny", "--models", "gpt", "--mitigations", "none", "--seeds", "0", "1", "--output-dir", str(tmp_path)]
        )
    with open(tmp_path / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["seed"] for row in rows} == {"0"} and len(rows) == position_bias.PRESETS["tiny"]["num_pairs"]


@pytest.mark.slow
def test_accuracy_is_a_fraction_and_every_condition_runs(run):
    _, rows, _ = run
    for row in rows:
        assert row["status"] == "ok", row
        assert 0.0 <= float(row["accuracy"]) <= 1.0, row
        assert int(row["examples"]) == position_bias.PRESETS["tiny"]["eval_per_slot"]


@pytest.mark.slow
def test_tables_and_plots(run):
    stdout, _, output_dir = run
    assert "| model | mitigation | setting | mean ± 95% | worst slot | worst/best | Δ mean | 1 | 2 | 3 | 4 |" in stdout
    assert (output_dir / "results.md").read_text().strip() in stdout
    for name in ("position_bias.png", "attention_by_position.png"):
        assert (output_dir / name).read_bytes()[:8] == PNG
    attention = (output_dir / "attention.csv").read_text().splitlines()
    assert attention[0] == "model,seed,layer,head,group,attention"
    assert any(",slot 1," in line for line in attention)
    assert all(math.isfinite(float(line.rsplit(",", 1)[1])) for line in attention[1:])  # no group's span is empty


@pytest.mark.parametrize(
    "models, kept",
    [
        (["gpt2"], ["gpt2"]),
        (["GPT", "sep"], ["sepformer", "gpt2"]),
        (["rotary"], ["llama"]),
        (None, ["sepformer", "llama", "gpt2"]),
    ],
)
def test_models_are_chosen_by_name_or_folder_name(models, kept):
    args = position_bias.parse_args(["--tiny", *(["--models", *models] if models else [])])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    assert [c.slug for c in position_bias.contenders(args, vocab)] == kept


def test_models_that_match_nothing_stop_the_run():
    """Even beside one that matches: a mistyped name would silently drop its model."""
    args = position_bias.parse_args(["--tiny", "--models", "gpt2", "mamba"])
    with pytest.raises(
        SystemExit, match="--models mamba matches none of: SepFormer.*folder names sepformer, llama, gpt2"
    ):
        position_bias.contenders(args, task.Vocabulary(args.num_keys, args.num_values))


def test_presets_mean_what_they_say():
    """`--quick` is the default run reduced (one seed, fewer prompts) with the default's task and training;
    `--tiny` is the smoke run; the two cannot be combined."""
    default, quick, tiny = (position_bias.PRESETS[name] for name in ("default", "quick", "tiny"))
    learning = (
        "num_pairs",
        "num_keys",
        "num_values",
        "end_slots",
        "gold_at_ends",
        "hidden_size",
        "num_layers",
        "num_heads",
        "batch_size",
        "max_steps",
        "learning_rate",
        "weight_decay",
    )
    assert {key: quick[key] for key in learning} == {key: default[key] for key in learning}
    assert len(quick["seeds"]) == 1 and quick["eval_per_slot"] < default["eval_per_slot"]
    assert tiny["max_steps"] < quick["max_steps"] // 10
    assert position_bias.parse_args(["--quick"]).max_steps == quick["max_steps"]
    assert position_bias.parse_args(["--tiny"]).max_steps == tiny["max_steps"]
    with pytest.raises(SystemExit):
        position_bias.parse_args(["--quick", "--tiny"])


def test_steps_scale_with_the_pairs_unless_given():
    """Twice the documents train twice as long (the same steps per pair); an explicit --max-steps is kept."""
    default = position_bias.PRESETS["default"]
    twice = ["--num-pairs", str(2 * default["num_pairs"]), "--num-keys", str(4 * default["num_pairs"])]
    assert position_bias.parse_args(twice).max_steps == 2 * default["max_steps"]
    assert position_bias.parse_args([*twice, "--max-steps", "700"]).max_steps == 700
    assert position_bias.parse_args(["--num-pairs", str(default["num_pairs"])]).max_steps == default["max_steps"]
    tiny = position_bias.PRESETS["tiny"]
    three_times = ["--tiny", "--num-pairs", str(3 * tiny["num_pairs"]), "--num-keys", str(3 * tiny["num_pairs"])]
    assert position_bias.parse_args(three_times).max_steps == 3 * tiny["max_steps"]  # the chosen preset's rate


def test_evaluated_pairs_stay_within_the_training_length():
    with pytest.raises(SystemExit):
        position_bias.parse_args(["--tiny", "--eval-pairs", "8"])
    assert position_bias.parse_args(["--tiny", "--eval-pairs", "2"]).eval_pairs == (4, 2)
