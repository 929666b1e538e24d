"""`examples/position_bias.py`: the lost-in-the-middle experiment, run end to end at its tiny preset."""

import csv
import math
import sys
from pathlib import Path

import evaluate
import pytest
import torch
from conftest import run_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import position_bias  # noqa: E402  (after the path)

from sepformer import add_mitigations, reordering  # noqa: E402
from sepformer.metrics import metric_path  # noqa: E402
from sepformer.positional_search import NoPositionalChannelError  # noqa: E402
from sepformer.reordering import relevance_order, reorder_prompt  # noqa: E402

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
# What each model refuses, with the start of its reason, as the run prints it; everything else has its rows.
REFUSED = {
    ("SepFormer", "attention_buckets"): "bases=[10000, 17500, 25000]; bases=[10000, 13000, ",
    ("Llama (rotary)", "positional_scaling"): "factor=0.5; factor=0.0; factor=-0.5; factor=-1.0: refused: "
    "positional_scaling on LlamaForCausalLM needs channels",
    ("Llama (rotary)", "attention_calibration"): "bias_estimate='positional' reads the positional block, but Llama",
    ("Llama (rotary)", "reorder"): "by='position_free' zeroes SepFormer's positional block",
    ("GPT-2 (learned absolute)", "ms_poe"): "r_max=1.5; r_max=1.8; r_max=2.4: refused: ms_poe rescales the rotary "
    "positions of each head, but GPT2LMHeadModel",
    ("GPT-2 (learned absolute)", "attention_buckets"): "attention_buckets reads positions with other rotary bases or "
    "scales, but GPT2LMHeadModel",
    ("GPT-2 (learned absolute)", "positional_scaling"): "positional_scaling on GPT2LMHeadModel needs channels",
    ("GPT-2 (learned absolute)", "attention_calibration"): "bias_estimate='positional' reads the positional block",
    ("GPT-2 (learned absolute)", "reorder"): "by='position_free' zeroes SepFormer's positional block",
}
REORDER_SETTINGS = {"by attention", "attention sorting, 3 rounds", "by calibrated attention"}


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
        assert position_bias.SEARCH_PICK in searched, model
        picks = {r["details"] for r in mine if r["setting"] == position_bias.SEARCH_PICK}
        assert len(picks) == 1 and next(iter(picks)).startswith("channels="), (model, picks)
    for model in EXPECTED_MITIGATIONS:
        calibrations = {
            r["setting"]: r["details"]
            for r in rows
            if r["model"] == model and r["mitigation"] == "attention_calibration"
        }
        positional = [setting for setting in calibrations if ", positional bias(k)" in setting]
        assert len(calibrations) == 3 + len(positional) and len(positional) == 3 * (model == "SepFormer"), model
        assert all(calibrations[s].startswith("bias(k) vs the dummy passes': Pearson r ") for s in positional)


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
    assert settings[(llama, "ms_poe")] == settings[(sepformer, "ms_poe")] == {"r_max=1.5", "r_max=1.8", "r_max=2.4"}
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
    assert len(refusals) == len(REFUSED), refusals


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


def test_in2_data_has_the_gold_at_every_slot_uniformly():
    """The IN2 fine-tune's data: the training's generator with the answers at every slot uniformly (the training's
    sit only at the ends), from a stream of its own, for the stated fraction of the steps."""
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)

    def gold_slots(data):
        slots = []
        for ids in data["input_ids"].tolist():
            place = {
                vocab.query(document // vocab.num_values): slot
                for slot, document in enumerate(ids[1 : args.num_pairs + 1])
            }
            slots += [place[query] for query in ids[args.num_pairs + 2 :: 2]]
        return torch.bincount(torch.tensor(slots), minlength=args.num_pairs)

    in2_args = position_bias.in2_arguments(args, 1.0)
    in2 = position_bias.in2_set(0, vocab, in2_args)
    counts = gold_slots(in2[:])
    assert counts.sum() == args.max_steps * args.batch_size * args.num_pairs == 1280
    assert (counts / counts.sum() - 1 / args.num_pairs).abs().max() < 0.05, counts  # 4 standard deviations
    base = position_bias.training_set(0, vocab, args)
    assert gold_slots(base[:])[1:-1].sum() == 0  # the training's: never in the middle
    assert not torch.equal(in2[:16]["input_ids"], base[:16]["input_ids"])
    short = position_bias.in2_arguments(args, 0.2)
    assert (short.max_steps, short.learning_rate, short.batch_size, short.weight_decay) == (
        4,
        args.learning_rate,
        args.batch_size,
        args.weight_decay,
    )
    assert len(position_bias.in2_set(0, vocab, short)) == 4 * args.batch_size
    assert position_bias.in2_steps(position_bias.parse_args([]), 0.05) == 75  # the default run's 5% of 1500


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
    evaluation = {args.num_pairs: position_bias.evaluation_set(0, args.num_pairs, vocab, args)}
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias.in2_rows(model, contender, 0, vocab, evaluation, metric, args)
    assert len(tuned) == 1 and [r["accuracy"] for r in rows] == [1.0] * args.num_pairs
    assert {(r["mitigation"], r["finetune_steps"], r["finetune_loss"]) for r in rows} == {("in2", 1, 0.5)}
    none = position_bias.mitigation_conditions(position_bias.document_spans(4), vocab)[:1]
    base = position_bias.evaluate_model(
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


def untrained(name: str):
    """The tiny preset's args and vocabulary, and contender `name` freshly built (seed 0)."""
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    contender = next(c for c in position_bias.contenders(args, vocab) if c.slug == name)
    torch.manual_seed(0)
    return args, vocab, contender, position_bias.taking_options(contender.build().eval())


def reorder_rows(monkeypatch, scores, name="gpt2"):
    """The reorder rows of an untrained model with the relevance replaced by `scores(input_ids)`, and what they ran
    on."""
    args, vocab, contender, model = untrained(name)
    monkeypatch.setattr(reordering, "relevance", lambda model, options, ids, mask, **kwargs: scores(ids, vocab))
    data = position_bias.evaluation_set(0, args.num_pairs, vocab, args)
    conditions = [
        c
        for c in position_bias.mitigation_conditions(position_bias.document_spans(args.num_pairs), vocab)
        if c.setting == "by attention"
    ]
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias.evaluate_model(model, conditions, data, args.num_pairs, metric, args, contender)
    return rows, data, model, args


def oracle(ids, vocab):
    """1 for the document whose key the last token queries, 0 for the others."""
    pairs = ids.shape[1] - 3
    keys = ids[:, 1 : pairs + 1] // vocab.num_values
    return (keys == (ids[:, -1:] - vocab.query(0))).double()


def test_reorder_rows_are_keyed_by_the_gold_slot_before_reordering(monkeypatch):
    """With relevance that finds the gold, "ends" puts it first in every prompt: keyed by the new slot, every prompt
    would be at slot 1; keyed by the original slot, each slot keeps its prompts, and its accuracy is the model's on
    the prompts reordered by hand."""
    rows, data, model, args = reorder_rows(monkeypatch, oracle)
    ids = data["input_ids"]
    order = relevance_order(oracle(ids, position_bias.Vocabulary(args.num_keys, args.num_values)), "ends")
    assert (order[:, 0] == data["gold_slot"]).all()
    moved, _ = reorder_prompt(ids, None, [position_bias.document_spans(args.num_pairs)] * len(ids), order)
    with torch.no_grad():
        correct = position_bias.plain_logits(model, moved).argmax(-1) == data["answer"]
    assert [r["examples"] for r in rows] == [args.eval_per_slot] * args.num_pairs
    assert [r["gold_at_end"] for r in rows] == [1.0] * args.num_pairs
    assert [r["accuracy"] for r in rows] == pytest.approx(
        [correct[data["gold_slot"] == slot].float().mean().item() for slot in range(args.num_pairs)]
    )


def test_gold_at_an_end_is_a_hand_count(monkeypatch):
    """Scores falling with the original slot: "ends" places the documents 0, 2, 3, 1 in every prompt, so with one end
    slot the gold ends at an end from original slots 1 and 2 (places 1 and 4), not from 3 and 4 (places 2, 3)."""
    rows, _, _, args = reorder_rows(monkeypatch, lambda ids, vocab: -torch.arange(4.0).expand(len(ids), 4), "sepformer")
    assert args.end_slots == 1 and args.num_pairs == 4
    assert [r["gold_at_end"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    table = position_bias.markdown_table([{**r, "seed": 0} for r in rows], args)
    assert "- SepFormer, by attention: 0.500" in table
    orders = torch.tensor([[2, 0, 3, 1]] * 4)
    gold = torch.tensor([2, 0, 3, 1])
    assert position_bias.gold_at_an_end(orders, gold, 1).tolist() == [True, False, False, True]
    assert position_bias.gold_at_an_end(orders, gold, 2).tolist() == [True, True, True, True]


def test_a_search_without_candidates_is_a_row_that_says_why(monkeypatch, tmp_path, capsys):
    """The paper's filter may keep no channel of a trained model (Llama, seed 1, at 32 pairs): the run goes on, and
    the search's pick is a row saying why it was not evaluated."""
    reason = "no channel of the attention input is monotone in position: give channel_sets."

    def no_candidate(model, batches):
        raise NoPositionalChannelError(reason)

    monkeypatch.setattr(position_bias, "search_positional_scaling", no_candidate)
    rows = position_bias.main(
        ["--tiny", "--models", "gpt", "--mitigations", "none", "positional_scaling", "--output-dir", str(tmp_path)]
    )
    statuses = {(r["mitigation"], r["setting"]): r["status"] for r in rows}
    pick = ("positional_scaling", position_bias.SEARCH_PICK)
    assert statuses == {("none", "-"): "ok", pick: f"not evaluated: {reason}"}
    assert f"| {position_bias.SEARCH_PICK} | not evaluated: {reason} |" in capsys.readouterr().out
    assert (tmp_path / "results.csv").read_text().count(reason) == position_bias.PRESETS["tiny"]["num_pairs"]


def test_a_search_given_bad_arguments_stops_the_run(monkeypatch, tmp_path):
    """Only a model without a positional channel becomes a row; a search called wrongly is the experiment's bug."""

    def called_wrongly(model, batches):
        raise ValueError("factors must be numbers < 1 (1 is the unscaled model); got [1.0].")

    monkeypatch.setattr(position_bias, "search_positional_scaling", called_wrongly)
    with pytest.raises(ValueError, match="factors must be numbers < 1"):
        position_bias.main(
            ["--tiny", "--models", "gpt", "--mitigations", "none", "positional_scaling", "--output-dir", str(tmp_path)]
        )


def test_window_settings_tile_the_documents():
    spans = position_bias.document_spans(16)
    settings = dict(position_bias.window_settings(spans))
    assert list(settings) == ["documents as windows", "4 windows of 4 documents", "2 windows of 8 documents"]
    assert settings["documents as windows"] == spans
    assert settings["4 windows of 4 documents"] == [(spans[i][0], spans[i + 3][1]) for i in (0, 4, 8, 12)]
    assert settings["2 windows of 8 documents"] == [(spans[0][0], spans[7][1]), (spans[8][0], spans[15][1])]
    assert [setting for setting, _ in position_bias.window_settings(spans[:4])] == [
        "documents as windows",
        "2 windows of 2 documents",
    ]


def fails_on_batches(model, input_ids):
    if len(input_ids) > 1:
        raise ValueError("parallel_context_windows spans overlap")
    return position_bias.plain_logits(model, input_ids)


def fails_with_type_error(model, input_ids):
    raise TypeError("forward() got an unexpected keyword argument 'parallel_context_window'")


@pytest.mark.parametrize(
    "logits, message", [(fails_on_batches, "spans overlap"), (fails_with_type_error, "unexpected keyword")]
)
def test_a_mitigation_that_fails_past_the_models_checks_stops_the_run(monkeypatch, tmp_path, logits, message):
    """A refusal is the ValueError of the model's checks on one prompt, before any work; an error after it, or of
    another kind, is a bug to see, not a missing row (only the search's missing candidates become rows)."""
    conditions = position_bias.mitigation_conditions
    monkeypatch.setattr(
        position_bias,
        "mitigation_conditions",
        lambda spans, vocab: [
            *conditions(spans, vocab)[:1],
            position_bias.Condition("parallel_context_windows", "x", logits),
        ],
    )
    with pytest.raises((ValueError, TypeError), match=message):
        position_bias.main(
            [
                "--tiny",
                "--models",
                "gpt2",
                "--mitigations",
                "none",
                "parallel_context_windows",
                "--output-dir",
                str(tmp_path),
            ]
        )


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


def test_pearson_r_is_the_textbook_one():
    x, y = torch.tensor([[1.0, 2.0, 3.0, 5.0]]), torch.tensor([[2.0, 1.0, 4.0, 4.0]])
    mx, my = x.mean(), y.mean()
    textbook = ((x - mx) * (y - my)).sum() / math.sqrt(((x - mx) ** 2).sum() * ((y - my) ** 2).sum())
    torch.testing.assert_close(position_bias.pearson(x, y), textbook[None])
    torch.testing.assert_close(position_bias.pearson(x, -2 * x + 1), torch.tensor([-1.0]))


def test_accuracy_is_a_fraction_and_every_condition_runs(run):
    _, rows, _ = run
    for row in rows:
        assert row["status"] == "ok", row
        assert 0.0 <= float(row["accuracy"]) <= 1.0, row
        assert int(row["examples"]) == position_bias.PRESETS["tiny"]["eval_per_slot"]


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


def test_interval_is_students_t_over_seeds():
    assert position_bias.interval95([0.5]) == 0.0
    # n = 2: t(1) = 12.706, stdev([0, 1]) = 1/sqrt(2), so 12.706 * (1/sqrt(2)) / sqrt(2) = 6.353
    assert position_bias.interval95([0.0, 1.0]) == pytest.approx(6.353)
    # n = 3: t(2) = 4.303, stdev([0.8, 0.9, 1.0]) = 0.1
    assert position_bias.interval95([0.8, 0.9, 1.0]) == pytest.approx(4.303 * 0.1 / math.sqrt(3))


def test_curves_summarise_per_slot_over_seeds():
    rows = [
        dict(
            model="m", mitigation="none", setting="-", num_pairs=2, slot=slot, seed=seed, accuracy=accuracy, status="ok"
        )
        for seed, curve in ((0, (1.0, 0.5)), (1, (0.8, 0.3)))
        for slot, accuracy in zip((1, 2), curve, strict=True)
    ]
    (curve,) = position_bias.curves(rows)
    assert curve.mean_by_slot == pytest.approx([0.9, 0.4])
    assert curve.seed_means == pytest.approx([0.75, 0.55])
    assert curve.worst_over_best == pytest.approx(0.4 / 0.9)


def test_training_answers_sit_at_the_ends_with_the_given_probability():
    args = position_bias.parse_args(["--tiny", "--num-pairs", "8", "--num-keys", "8", "--end-slots", "2"])
    generator = torch.Generator().manual_seed(0)
    slots = position_bias.training_slots(generator, (200, 8), 8, args)  # gold_at_ends = 1
    assert set(slots.unique().tolist()) == {0, 1, 6, 7}
    args.gold_at_ends = 0.0
    assert set(position_bias.training_slots(generator, (200, 8), 8, args).unique().tolist()) == set(range(8))
    args.gold_at_ends = 0.5
    middle = ((slots := position_bias.training_slots(generator, (400, 8), 8, args)) >= 2) & (slots < 6)
    assert middle.float().mean().item() == pytest.approx(0.5 * 4 / 8, abs=0.03)  # the uniform half lands in the middle
    for bad in (["--end-slots", "3"], ["--end-slots", "0"], ["--gold-at-ends", "1.5"]):
        with pytest.raises(SystemExit):
            position_bias.parse_args(["--tiny", *bad])


def test_training_data_queries_the_list_and_labels_every_answer():
    args = position_bias.parse_args(["--tiny", "--gold-at-ends", "0"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    example = position_bias.training_examples(torch.Generator().manual_seed(0), 1, vocab, args)
    ids, labels = example["input_ids"][0], example["labels"][0]
    n = args.num_pairs
    assert ids[0] == vocab.bos and ids[n + 1] == vocab.sep and len(ids) == position_bias.train_length(n)
    stored = {}
    for document in ids[1 : n + 1]:
        key, value = divmod(document, vocab.num_values)
        assert vocab.document(key, value) == document
        stored[vocab.query(key)] = vocab.value(value)
    queries = ids[n + 2 :: 2]
    assert len(queries) == n and set(queries) <= set(stored)  # n queries of the list's keys
    assert ids[n + 3 :: 2] == [stored[query] for query in queries]  # each followed by its value
    assert [label for label in labels if label != -100] == ids[n + 3 :: 2]  # only the answers are labelled


def test_evaluation_prompts_end_with_the_gold_query():
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    data = position_bias.evaluation_set(0, 4, vocab, args)
    spans = position_bias.document_spans(4)
    assert [position for start, end in spans for position in range(start, end)] == [1, 2, 3, 4]  # the documents
    for ids, answer, slot in zip(
        data["input_ids"].tolist(), data["answer"].tolist(), data["gold_slot"].tolist(), strict=True
    ):
        (document,) = ids[slice(*spans[slot])]  # the gold slot's span holds the gold document
        key, value = divmod(document, vocab.num_values)
        assert ids[-1] == vocab.query(key) and answer == vocab.value(value)
    assert set(data["gold_slot"].tolist()) == set(range(4))
    ids = data["input_ids"]
    specials = {vocab.bos, vocab.sep, vocab.pad, *vocab.dummy_document}
    assert len(specials) == 4 and max(specials) == len(vocab) - 1
    assert not specials & set(ids[:, 1:-2].flatten().tolist())  # documents are never special


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
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    assert [c.slug for c in position_bias.contenders(args, vocab)] == kept


def test_models_that_match_nothing_stop_the_run():
    """Even beside one that matches: a mistyped name would silently drop its model."""
    args = position_bias.parse_args(["--tiny", "--models", "gpt2", "mamba"])
    with pytest.raises(
        SystemExit, match="--models mamba matches none of: SepFormer.*folder names sepformer, llama, gpt2"
    ):
        position_bias.contenders(args, position_bias.Vocabulary(args.num_keys, args.num_values))


@pytest.mark.parametrize(
    "slug, mitigation, setting, option",
    [
        ("llama", "stable_mask", "gamma=0.05", {"gamma": 0.05}),
        ("llama", "ms_poe", "r_max=1.8", {"r_min": 1.2, "r_max": 1.8}),
        ("llama", "attention_buckets", "bases=[10000, 17500, 25000]", {"bases": [10000, 17500, 25000]}),
        ("gpt2", "stable_mask", "gamma=0.2", {"gamma": 0.2}),
    ],
)
def test_a_hugging_face_row_is_the_model_given_the_option_by_hand_through_add_mitigations(
    slug, mitigation, setting, option
):
    """A Llama (GPT-2) row of a setting is the model, built alike, given that option by hand through `add_mitigations`:
    the same logits bit for bit, hence the same accuracy at every slot; and the option acts."""
    args, vocab, contender, model = untrained(slug)
    data = position_bias.evaluation_set(0, args.num_pairs, vocab, args)
    condition = next(
        c
        for c in position_bias.mitigation_conditions(position_bias.document_spans(args.num_pairs), vocab)
        if (c.mitigation, c.setting) == (mitigation, setting)
    )
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias.evaluate_model(model, [condition], data, args.num_pairs, metric, args, contender)
    torch.manual_seed(0)
    by_hand = add_mitigations(contender.build().eval())
    with torch.no_grad():
        call = dict(input_ids=data["input_ids"], use_cache=False, logits_to_keep=1)
        logits, plain = by_hand(**call, **{mitigation: option}).logits[:, -1], by_hand(**call).logits[:, -1]
        assert torch.equal(condition.logits(model, data["input_ids"]), logits)
    assert not torch.allclose(logits, plain, atol=1e-4)
    correct = logits.argmax(-1) == data["answer"]
    assert [r["accuracy"] for r in rows] == [
        correct[data["gold_slot"] == slot].float().mean().item() for slot in range(args.num_pairs)
    ]


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


def test_validation_prompts_are_not_test_prompts_and_label_only_the_answer():
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    test = position_bias.evaluation_set(0, 4, vocab, args)
    batches = position_bias.validation_batches(0, 4, vocab, args)
    ids = torch.cat([batch["input_ids"] for batch in batches])
    assert len(ids) == 4 * args.validation_per_slot
    assert not {tuple(row[:-1].tolist()) for row in ids} & {tuple(row.tolist()) for row in test["input_ids"]}
    for batch in batches:
        labelled = batch["labels"] != -100
        assert labelled[:, -1].all() and labelled.sum() == len(batch["labels"])
        documents = batch["input_ids"][torch.arange(len(batch["input_ids"])), 1 + batch["gold_position"]]
        keys, values = documents // vocab.num_values, documents % vocab.num_values
        assert torch.equal(batch["input_ids"][:, -2], vocab.query(keys))
        assert torch.equal(batch["labels"][:, -1], vocab.value(values))


def test_every_condition_acts_on_its_model():
    """Each mitigation row a model runs changes its logits (an option that silently did nothing would not; reordering:
    on the prompts it reorders, and it leaves the model's attention implementation as it was), and PCW on the
    experiment's Llama applies its window mask, not only its positions."""
    args = position_bias.parse_args(["--tiny"])
    vocab = position_bias.Vocabulary(args.num_keys, args.num_values)
    ids = position_bias.evaluation_set(0, 4, vocab, args)["input_ids"][::4]
    spans = position_bias.document_spans(4)
    validation = position_bias.validation_batches(0, 4, vocab, args)
    for contender in position_bias.contenders(args, vocab):
        torch.manual_seed(0)
        model = position_bias.taking_options(contender.build().eval())
        with torch.no_grad():
            conditions = position_bias.accepted(
                model,
                position_bias.mitigation_conditions(spans, vocab) + position_bias.searched_scaling(model, validation),
                ids[:1],
                contender.name,
            )
            base = position_bias.plain_logits(model, ids)
            implementation = model.config._attn_implementation
            for condition in conditions[1:]:
                prompts = condition.reorder(model, ids)[0] if condition.reorder else ids
                assert model.config._attn_implementation == implementation
                logits = condition.logits(model, prompts)
                assert not torch.allclose(logits, base, atol=1e-6), (contender.name, condition)
            if contender.name.startswith("Llama"):
                windows = next(c for c in conditions if c.mitigation == "parallel_context_windows")
                positions = torch.tensor([[0, 1, 1, 1, 1, 2, 3]])  # one-token windows at 1, the task from 2
                positions_only = model(ids, position_ids=positions.expand(len(ids), -1)).logits[:, -1]
                assert not torch.allclose(windows.logits(model, ids), positions_only, atol=1e-6)


def test_evaluated_pairs_stay_within_the_training_length():
    with pytest.raises(SystemExit):
        position_bias.parse_args(["--tiny", "--eval-pairs", "8"])
    assert position_bias.parse_args(["--tiny", "--eval-pairs", "2"]).eval_pairs == (4, 2)
