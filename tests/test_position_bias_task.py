"""`examples/position_bias_task.py`: the lists the models train on (the answers at the ends), IN2's (anywhere), and the
test and validation prompts (the gold at every slot)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import position_bias  # noqa: E402  (after the path)
import position_bias_task as task  # noqa: E402


def test_training_answers_sit_at_the_ends_with_the_given_probability():
    args = position_bias.parse_args(["--tiny", "--num-pairs", "8", "--num-keys", "8", "--end-slots", "2"])
    generator = torch.Generator().manual_seed(0)
    slots = task.training_slots(generator, (200, 8), 8, args)  # gold_at_ends = 1
    assert set(slots.unique().tolist()) == {0, 1, 6, 7}
    args.gold_at_ends = 0.0
    assert set(task.training_slots(generator, (200, 8), 8, args).unique().tolist()) == set(range(8))
    args.gold_at_ends = 0.5
    middle = ((slots := task.training_slots(generator, (400, 8), 8, args)) >= 2) & (slots < 6)
    assert middle.float().mean().item() == pytest.approx(0.5 * 4 / 8, abs=0.03)  # the uniform half lands in the middle
    for bad in (["--end-slots", "3"], ["--end-slots", "0"], ["--gold-at-ends", "1.5"]):
        with pytest.raises(SystemExit):
            position_bias.parse_args(["--tiny", *bad])


def test_training_data_queries_the_list_and_labels_every_answer():
    args = position_bias.parse_args(["--tiny", "--gold-at-ends", "0"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    example = task.training_examples(torch.Generator().manual_seed(0), 1, vocab, args)
    ids, labels = example["input_ids"][0], example["labels"][0]
    n = args.num_pairs
    assert ids[0] == vocab.bos and ids[n + 1] == vocab.sep and len(ids) == task.train_length(n)
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
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    data = task.evaluation_set(0, 4, vocab, args)
    spans = task.document_spans(4)
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


def test_validation_prompts_are_not_test_prompts_and_label_only_the_answer():
    args = position_bias.parse_args(["--tiny"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)
    test = task.evaluation_set(0, 4, vocab, args)
    batches = task.validation_batches(0, 4, vocab, args)
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


def test_in2_data_has_the_gold_at_every_slot_uniformly():
    """The IN2 fine-tune's data: the training's generator with the answers at every slot uniformly (the training's
    sit only at the ends), from a stream of its own, for the stated fraction of the steps."""
    args = position_bias.parse_args(["--tiny"])
    vocab = task.Vocabulary(args.num_keys, args.num_values)

    def gold_slots(data):
        slots = []
        for ids in data["input_ids"].tolist():
            place = {
                vocab.query(document // vocab.num_values): slot
                for slot, document in enumerate(ids[1 : args.num_pairs + 1])
            }
            slots += [place[query] for query in ids[args.num_pairs + 2 :: 2]]
        return torch.bincount(torch.tensor(slots), minlength=args.num_pairs)

    in2_args = task.in2_arguments(args, 1.0)
    in2 = task.in2_set(0, vocab, in2_args)
    counts = gold_slots(in2[:])
    assert counts.sum() == args.max_steps * args.batch_size * args.num_pairs == 1280
    assert (counts / counts.sum() - 1 / args.num_pairs).abs().max() < 0.05, counts  # 4 standard deviations
    base = task.training_set(0, vocab, args)
    assert gold_slots(base[:])[1:-1].sum() == 0  # the training's: never in the middle
    assert not torch.equal(in2[:16]["input_ids"], base[:16]["input_ids"])
    short = task.in2_arguments(args, 0.2)
    assert (short.max_steps, short.learning_rate, short.batch_size, short.weight_decay) == (
        4,
        args.learning_rate,
        args.batch_size,
        args.weight_decay,
    )
    assert len(task.in2_set(0, vocab, short)) == 4 * args.batch_size
    assert task.in2_steps(position_bias.parse_args([]), 0.05) == 75  # the default run's 5% of 1500
