"""`examples/position_bias_conditions.py`: each mitigation's row is the model given that option, every condition acts,
reordering is scored by the gold's slot before it, and what fails past a model's checks stops the run."""

import math
import sys
from pathlib import Path

import evaluate
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import position_bias  # noqa: E402  (after the path)
import position_bias_conditions  # noqa: E402
import position_bias_report  # noqa: E402
import position_bias_task as task  # noqa: E402

from sepformer import add_mitigations, reordering  # noqa: E402
from sepformer.metrics import metric_path  # noqa: E402
from sepformer.positional_search import NoPositionalChannelError  # noqa: E402
from sepformer.reordering import relevance_order, reorder_prompt  # noqa: E402


def untrained(name: str):
    """The tiny preset's args and vocabulary, and contender `name` freshly built (seed 0)."""
    args = position_bias.parse_args(["--tiny"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    contender = next(c for c in position_bias.contenders(args, vocab) if c.slug == name)
    torch.manual_seed(0)
    return args, vocab, contender, position_bias.taking_options(contender.build().eval())


def oracle(ids, vocab):
    """1 for the document whose key the last token queries, 0 for the others."""
    pairs = ids.shape[1] - 3
    keys = ids[:, 1 : pairs + 1] // vocab.num_values
    return (keys == (ids[:, -1:] - vocab.query(0))).double()


def reorder_rows(monkeypatch, scores, name="gpt2"):
    """The reorder rows of an untrained model with the relevance replaced by `scores(input_ids)`, and what they ran
    on."""
    args, vocab, contender, model = untrained(name)
    monkeypatch.setattr(reordering, "relevance", lambda model, options, ids, mask, **kwargs: scores(ids, vocab))
    data = task.evaluation_set(0, args.num_pairs, vocab, args)
    conditions = [
        c
        for c in position_bias_conditions.mitigation_conditions(task.document_spans(args.num_pairs), vocab)
        if c.setting == "by attention"
    ]
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias_conditions.evaluate_model(model, conditions, data, args.num_pairs, metric, args, contender)
    return rows, data, model, args


def test_reorder_rows_are_keyed_by_the_gold_slot_before_reordering(monkeypatch):
    """With relevance that finds the gold, "ends" puts it first in every prompt: keyed by the new slot, every prompt
    would be at slot 1; keyed by the original slot, each slot keeps its prompts, and its accuracy is the model's on
    the prompts reordered by hand."""
    rows, data, model, args = reorder_rows(monkeypatch, oracle)
    ids = data["input_ids"]
    order = relevance_order(oracle(ids, task.Vocabulary(args.num_keys, args.num_values)), "ends")
    assert (order[:, 0] == data["gold_slot"]).all()
    moved, _ = reorder_prompt(ids, None, [task.document_spans(args.num_pairs)] * len(ids), order)
    with torch.no_grad():
        correct = position_bias_conditions.plain_logits(model, moved).argmax(-1) == data["answer"]
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
    table = position_bias_report.markdown_table([{**r, "seed": 0} for r in rows], args)
    assert "- SepFormer, by attention: 0.500" in table
    orders = torch.tensor([[2, 0, 3, 1]] * 4)
    gold = torch.tensor([2, 0, 3, 1])
    assert position_bias_conditions.gold_at_an_end(orders, gold, 1).tolist() == [True, False, False, True]
    assert position_bias_conditions.gold_at_an_end(orders, gold, 2).tolist() == [True, True, True, True]


def test_window_settings_tile_the_documents():
    spans = task.document_spans(16)
    settings = dict(position_bias_conditions.window_settings(spans))
    assert list(settings) == ["documents as windows", "4 windows of 4 documents", "2 windows of 8 documents"]
    assert settings["documents as windows"] == spans
    assert settings["4 windows of 4 documents"] == [(spans[i][0], spans[i + 3][1]) for i in (0, 4, 8, 12)]
    assert settings["2 windows of 8 documents"] == [(spans[0][0], spans[7][1]), (spans[8][0], spans[15][1])]
    assert [setting for setting, _ in position_bias_conditions.window_settings(spans[:4])] == [
        "documents as windows",
        "2 windows of 2 documents",
    ]


def test_pearson_r_is_the_textbook_one():
    x, y = torch.tensor([[1.0, 2.0, 3.0, 5.0]]), torch.tensor([[2.0, 1.0, 4.0, 4.0]])
    mx, my = x.mean(), y.mean()
    textbook = ((x - mx) * (y - my)).sum() / math.sqrt(((x - mx) ** 2).sum() * ((y - my) ** 2).sum())
    torch.testing.assert_close(position_bias_conditions.pearson(x, y), textbook[None])
    torch.testing.assert_close(position_bias_conditions.pearson(x, -2 * x + 1), torch.tensor([-1.0]))


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
    data = task.evaluation_set(0, args.num_pairs, vocab, args)
    condition = next(
        c
        for c in position_bias_conditions.mitigation_conditions(task.document_spans(args.num_pairs), vocab)
        if (c.mitigation, c.setting) == (mitigation, setting)
    )
    metric = evaluate.load(metric_path("accuracy_by_position"))
    rows = position_bias_conditions.evaluate_model(model, [condition], data, args.num_pairs, metric, args, contender)
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


def test_every_condition_acts_on_its_model():
    """Each mitigation row a model runs changes its logits (an option that silently did nothing would not; reordering:
    on the prompts it reorders, and it leaves the model's attention implementation as it was), and PCW on the
    experiment's Llama applies its window mask, not only its positions."""
    args = position_bias.parse_args(["--tiny"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    ids = task.evaluation_set(0, 4, vocab, args)["input_ids"][::4]
    spans = task.document_spans(4)
    validation = task.validation_batches(0, 4, vocab, args)
    for contender in position_bias.contenders(args, vocab):
        torch.manual_seed(0)
        model = position_bias.taking_options(contender.build().eval())
        with torch.no_grad():
            conditions = position_bias_conditions.accepted(
                model,
                position_bias_conditions.mitigation_conditions(spans, vocab)
                + position_bias_conditions.searched_scaling(model, validation),
                ids[:1],
                contender.name,
            )
            base = position_bias_conditions.plain_logits(model, ids)
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


def test_a_search_without_candidates_is_a_row_that_says_why(monkeypatch, tmp_path, capsys):
    """The paper's filter may keep no channel of a trained model (Llama, seed 1, at 32 pairs): the run goes on, and
    the search's pick is a row saying why it was not evaluated."""
    reason = "no channel of the attention input is monotone in position: give channel_sets."

    def no_candidate(model, batches):
        raise NoPositionalChannelError(reason)

    monkeypatch.setattr(position_bias_conditions, "search_positional_scaling", no_candidate)
    rows = position_bias.main(
        ["--tiny", "--models", "gpt", "--mitigations", "none", "positional_scaling", "--output-dir", str(tmp_path)]
    )
    statuses = {(r["mitigation"], r["setting"]): r["status"] for r in rows}
    pick = ("positional_scaling", position_bias_conditions.SEARCH_PICK)
    assert statuses == {("none", "-"): "ok", pick: f"not evaluated: {reason}"}
    assert f"| {position_bias_conditions.SEARCH_PICK} | not evaluated: {reason} |" in capsys.readouterr().out
    assert (tmp_path / "results.csv").read_text().count(reason) == position_bias.PRESETS["tiny"]["num_pairs"]


def test_a_search_given_bad_arguments_stops_the_run(monkeypatch, tmp_path):
    """Only a model without a positional channel becomes a row; a search called wrongly is the experiment's bug."""

    def called_wrongly(model, batches):
        raise ValueError("factors must be numbers < 1 (1 is the unscaled model); got [1.0].")

    monkeypatch.setattr(position_bias_conditions, "search_positional_scaling", called_wrongly)
    with pytest.raises(ValueError, match="factors must be numbers < 1"):
        position_bias.main(
            ["--tiny", "--models", "gpt", "--mitigations", "none", "positional_scaling", "--output-dir", str(tmp_path)]
        )


def fails_on_batches(model, input_ids):
    if len(input_ids) > 1:
        raise ValueError("parallel_context_windows spans overlap")
    return position_bias_conditions.plain_logits(model, input_ids)


def fails_with_type_error(model, input_ids):
    raise TypeError("forward() got an unexpected keyword argument 'parallel_context_window'")


@pytest.mark.parametrize(
    "logits, message", [(fails_on_batches, "spans overlap"), (fails_with_type_error, "unexpected keyword")]
)
def test_a_mitigation_that_fails_past_the_models_checks_stops_the_run(monkeypatch, tmp_path, logits, message):
    """A refusal is the ValueError of the model's checks on one prompt, before any work; an error after it, or of
    another kind, is a bug to see, not a missing row (only the search's missing candidates become rows)."""
    conditions = position_bias_conditions.mitigation_conditions
    monkeypatch.setattr(
        position_bias_conditions,
        "mitigation_conditions",
        lambda spans, vocab: [
            *conditions(spans, vocab)[:1],
            position_bias_conditions.Condition("parallel_context_windows", "x", logits),
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


def test_the_every_layer_settings_give_ms_poe_and_calibration_every_layer(monkeypatch):
    """Their papers' default layers leave out the first ones, where a two-layer model's bias sits."""
    seen = []
    monkeypatch.setattr(position_bias_conditions, "plain_logits", lambda model, ids, **options: seen.append(options))
    args = position_bias.parse_args(["--tiny"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    for condition in position_bias_conditions.every_layer_conditions(task.document_spans(4), vocab, 3):
        assert condition.setting.endswith("every layer")
        condition.logits(None, torch.zeros(2, 6, dtype=torch.long))
    assert [next(iter(options)) for options in seen] == ["ms_poe"] * 3 + ["attention_calibration"] * 3
    assert all(next(iter(options.values()))["layers"] == (0, 1, 2) for options in seen)
