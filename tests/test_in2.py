"""IN2 data (`sepformer.in2_dataset`): gold slots uniform (and a biased sampler caught by the same check), each answer
in the context right after (or before) its quoted span, found once, inside its gold segment; labels on the answer
only; lengths; determinism; refused arguments; and the Trainer recipe of docs/in2.md, whose reported loss is the
answer-only loss."""

import itertools
import math
import re
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

import sepformer.in2
from sepformer import SepFormerTokenizer, in2_dataset

TEXTS = [topics[name] for name in sorted(topics)[:60]]  # the Python reference's prose, shipped with Python
TOKENIZER = SepFormerTokenizer()
SMALL = dict(context_length=300, segment_length=32, span_length=6, answer_length=5)


def build(num_examples=50, **overrides):
    return in2_dataset(TEXTS, TOKENIZER, **{**SMALL, "num_examples": num_examples, **overrides})


def within_four_sigma(counts: np.ndarray) -> bool:
    """Every slot's count within 4 standard deviations of the uniform expectation (an i.i.d. uniform sampler of 8
    slots fails this once in about 2000 datasets)."""
    total, expected = counts.sum(), counts.sum() / len(counts)
    sigma = math.sqrt(total * (1 / len(counts)) * (1 - 1 / len(counts)))
    return bool(np.all(np.abs(counts - expected) <= 4 * sigma))


def slot_counts(dataset) -> np.ndarray:
    slots = [slot for gold in dataset["gold_slots"] for slot in gold]
    return np.bincount(slots, minlength=dataset[0]["num_segments"])


# --- uniform gold slots -------------------------------------------------------------------------------------------


def test_one_gold_segment_is_exactly_balanced_over_slots():
    dataset = build(2000)
    counts = slot_counts(dataset)
    assert len(counts) == 8 == dataset[0]["num_segments"]
    assert counts.max() - counts.min() <= 1, counts  # each run of 8 examples uses every slot once
    assert within_four_sigma(counts)


def test_several_gold_segments_are_uniform_over_slots():
    counts = slot_counts(build(2000, segments_per_question=2))
    assert counts.sum() == 4000 and within_four_sigma(counts), counts


def test_a_biased_slot_sampler_fails_the_uniformity_check(monkeypatch):
    def primacy(rng, num_examples, num_segments, per_question):  # slot 0 twice as likely as each other slot
        weights = np.ones(num_segments)
        weights[0] = 2
        for _ in range(num_examples):
            yield [int(rng.choice(num_segments, p=weights / weights.sum()))]

    monkeypatch.setattr(sepformer.in2, "gold_slots", primacy)
    counts = slot_counts(build(2000))
    assert not within_four_sigma(counts), counts


# --- what an example holds ----------------------------------------------------------------------------------------


def joined(pieces, separator):
    return [token for k, piece in enumerate(pieces) for token in (separator if k else []) + piece]


def occurrences(ids, span) -> int:
    return sum(ids[start : start + len(span)] == span for start in range(len(ids) - len(span) + 1))


@pytest.mark.parametrize("question", ["follows", "precedes"])
@pytest.mark.parametrize("per_question", [1, 3])
def test_each_answer_stands_by_its_quoted_span_once_in_its_gold_segment(question, per_question):
    span, answer, segment = SMALL["span_length"], SMALL["answer_length"], SMALL["segment_length"]
    opening, between, closing = (
        TOKENIZER(words, add_special_tokens=False)["input_ids"] for words in sepformer.in2.QUESTION_WORDS[question]
    )
    bos, eos = TOKENIZER.bos_token_id, TOKENIZER.eos_token_id
    dataset = build(40, question=question, segments_per_question=per_question)
    quoted_orders = set()
    for row in dataset:
        ids, start, slots = row["input_ids"], row["answer_start"], row["gold_slots"]
        context_end = 1 + row["num_segments"] * segment
        assert ids[0] == bos and ids[context_end] == eos and ids[start - 1] == eos and ids[-1] == eos
        context = ids[1:context_end]
        pieces = [ids[start + i * answer : start + (i + 1) * answer] for i in range(per_question)]
        assert start + per_question * answer + 1 == len(ids)
        assert slots == sorted(set(slots)) and len(slots) == per_question
        spans = []
        for piece, slot, position in zip(pieces, slots, row["answer_positions"], strict=True):
            assert ids[position : position + answer] == piece  # in the context, where the metadata says
            span_at = position - span if question == "follows" else position + answer
            quoted = ids[span_at : span_at + span]
            spans.append(quoted)
            first, last = 1 + slot * segment, 1 + (slot + 1) * segment  # the gold segment, in input ids
            assert first <= min(span_at, position) and max(span_at + span, position + answer) <= last
            assert occurrences(context, quoted) == 1  # the span determines the answer
            # the answer needs this segment: without it (blanked), the span is nowhere in the context
            assert occurrences(context[: first - 1] + [-1] * segment + context[last - 1 :], quoted) == 0
        question_ids = ids[context_end + 1 : start - 1]
        orders = [
            order
            for order in itertools.permutations(range(per_question))
            if question_ids == opening + joined([spans[i] for i in order], between) + closing
        ]
        assert len(orders) == 1, TOKENIZER.decode(question_ids)
        quoted_orders.add(orders[0])
    if per_question > 1:  # the quoted order is not the context's (which would give away the answer's order)
        assert len(quoted_orders) > 1


def test_labels_are_the_answer_and_its_eos_only():
    for row in build(20, segments_per_question=2):
        start = row["answer_start"]
        assert row["labels"][:start] == [-100] * start
        assert row["labels"][start:] == row["input_ids"][start:]
        assert len(row["labels"][start:]) == 2 * SMALL["answer_length"] + 1
        assert row["attention_mask"] == [1] * len(row["input_ids"])


@pytest.mark.parametrize("segment_length", [11, 32])
@pytest.mark.parametrize("per_question", [1, 2])
def test_every_example_fits_the_context_length_with_as_many_segments_as_fit(segment_length, per_question):
    """Every context length over a whole period of the segment length: a length budget miscounted by one token (the
    final eos forgotten) makes the examples of one context length in each period one token too long."""
    for context_length in range(160, 160 + segment_length):
        dataset = in2_dataset(
            TEXTS[:10],
            TOKENIZER,
            **{**SMALL, "segment_length": segment_length, "context_length": context_length},
            num_examples=2,
            segments_per_question=per_question,
        )
        for ids in dataset["input_ids"]:
            assert context_length - segment_length < len(ids) <= context_length, (context_length, len(ids))


def test_deterministic_for_a_seed():
    assert build(30, seed=3).to_dict() == build(30, seed=3).to_dict()
    assert build(30, seed=3)["input_ids"] != build(30, seed=4)["input_ids"]


def test_sources_a_list_a_dataset_and_a_file_give_the_same_examples(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXTS[0], encoding="utf-8")
    arguments = dict(SMALL, context_length=140, num_examples=5)
    from_list = in2_dataset(TEXTS[:1], TOKENIZER, **arguments).to_dict()
    assert in2_dataset(path, TOKENIZER, **arguments).to_dict() == from_list
    assert in2_dataset(str(path), TOKENIZER, **arguments).to_dict() == from_list
    dataset = Dataset.from_dict({"body": TEXTS[:1]})
    assert in2_dataset(dataset, TOKENIZER, text_column="body", **arguments).to_dict() == from_list


# --- refused arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(context_length=60), ValueError, "context_length=60 leaves room for 0 segment"),
        (dict(context_length=100, segments_per_question=2), ValueError, "fewer than segments_per_question=2"),
        (dict(span_length=20, answer_length=13), ValueError, "span_length=20 plus answer_length=13 is 33 tokens"),
        (dict(question="why"), ValueError, "question='why' is not a question type: choose one of follows, precedes"),
        (dict(segments_per_question=0), ValueError, "segments_per_question=0 is out of range"),
        (dict(num_examples=2.0), TypeError, "num_examples=2.0 is a float"),
        (dict(seed=True), TypeError, "seed=True is a bool"),
        (dict(seed=-1), ValueError, "seed=-1 is out of range: give an integer >= 0"),
        (dict(text_column=0), TypeError, "text_column=0 is a int"),
        (dict(text_column="body"), ValueError, r"text_column='body' is read only from a datasets.Dataset .* a list"),
        (
            dict(context_length=10**6),
            ValueError,
            r"segment\(s\) of 32 tokens; an example of context_length=1000000 holds 31248 distinct",
        ),
    ],
)
def test_bad_arguments_are_refused(overrides, error, message):
    with pytest.raises(error, match=message):
        in2_dataset(TEXTS, TOKENIZER, **{**SMALL, "num_examples": 5, **overrides})


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("no/such/file.txt", ValueError, "'no/such/file.txt' is not a file"),
        (["text", 3], TypeError, "the source holds a int"),
        (["text", None], TypeError, r"the source holds a NoneType \(None\) at index 1: every text must be a str"),
        (Dataset.from_dict({"text": ["a", None, "b"]}), TypeError, r"a NoneType \(None\) at index 1"),
        (
            "a text, not a path " * 300,
            ValueError,
            r"'a text, not a path a text.* is not a file: a str source is the path of a text file; give a text as a "
            r"list of strings \(\[text\]\)",
        ),
        ([], ValueError, "the source holds no text"),
        ({"text": "a"}, TypeError, "the source is a dict"),
        (Dataset.from_dict({"body": ["a"]}), ValueError, r"no column text_column='text': its columns are \['body'\]"),
        (["ab" * 2000], ValueError, "found no span of span_length=6 tokens that occurs once"),
    ],
)
def test_bad_sources_are_refused(source, error, message):
    with pytest.raises(error, match=message):
        in2_dataset(source, TOKENIZER, **SMALL, num_examples=5)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("déjà vu ".encode("latin-1") * 100)
    with pytest.raises(ValueError, match=f"the source file '{path}' is not UTF-8 text"):
        in2_dataset(path, TOKENIZER, **SMALL, num_examples=5)


@pytest.mark.parametrize(
    ("tokenizer", "error", "message"),
    [
        ("gpt2", TypeError, "tokenizer='gpt2' is a str: give a transformers tokenizer"),
        (TOKENIZER.encode, TypeError, "is a method: give a transformers tokenizer"),
        (
            SepFormerTokenizer(model_max_length=256),
            ValueError,
            "context_length=300 is longer than the tokenizer's model_max_length=256: give at most the model's length",
        ),
    ],
)
def test_bad_tokenizers_are_refused(tokenizer, error, message):
    with pytest.raises(error, match=message):
        in2_dataset(TEXTS, tokenizer, **SMALL, num_examples=5)


# --- the Trainer recipe (docs/in2.md) -----------------------------------------------------------------------------


def losses(model, batch) -> tuple[float, float]:
    """The mean next-token cross-entropy on the labelled tokens, and on every token."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    predicted = logits.flatten(0, 1)
    answer = F.cross_entropy(predicted, batch["labels"][:, 1:].flatten(), ignore_index=-100)
    full = F.cross_entropy(predicted, batch["input_ids"][:, 1:].flatten())
    return answer.item(), full.item()


class HandLosses(TrainerCallback):
    """Before each step, the losses of that step's batch computed by hand with the weights the step starts from."""

    def __init__(self, batches):
        self.batches, self.losses = batches, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.losses.append(losses(model, self.batches[state.global_step]))


def test_trainer_reports_the_answer_only_loss(tmp_folder):
    dataset = build(24, context_length=128, segment_length=16, span_length=4, answer_length=4)
    collator = DataCollatorForSeq2Seq(TOKENIZER, label_pad_token_id=-100)
    batch_size = 4
    batches = [
        collator(
            [
                {key: row[key] for key in ("input_ids", "attention_mask", "labels")}
                for row in dataset.select(range(start, start + batch_size))
            ]
        )
        for start in range(0, len(dataset), batch_size)
    ]
    model = tiny_model(seed=0, max_position_embeddings=128)
    args = TrainingArguments(
        output_dir=tmp_folder,
        max_steps=len(batches),
        per_device_train_batch_size=batch_size,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        train_sampling_strategy="sequential",
        save_strategy="no",
    )
    hand = HandLosses(batches)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[hand])
    trainer.train()

    reported = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    answer_only, full = zip(*hand.losses, strict=True)
    assert reported == pytest.approx(answer_only, abs=1e-4)
    assert reported[-1] < reported[0] - 0.5  # it learns
    # not the loss of every token: at each step 20 times farther from it than from the answer-only loss
    assert all(abs(loss - every) > 2e-3 for loss, every in zip(reported, full, strict=True)), (reported, full)


def test_the_collator_pads_labels_with_minus_100():
    rows = [build(1, context_length=length)[0] for length in (300, 340)]
    batch = DataCollatorForSeq2Seq(TOKENIZER, label_pad_token_id=-100)(
        [{key: row[key] for key in ("input_ids", "attention_mask", "labels")} for row in rows]
    )
    short, long = (len(row["input_ids"]) for row in rows)
    assert short < long and batch["input_ids"].shape == (2, long)
    assert batch["labels"][0, short:].tolist() == [-100] * (long - short)
    assert batch["attention_mask"][0, short:].tolist() == [0] * (long - short)
    assert batch["input_ids"][0, short:].tolist() == [TOKENIZER.pad_token_id] * (long - short)


def test_the_docs_recipe_runs(tmp_path, monkeypatch):
    text = (Path(__file__).resolve().parent.parent / "docs" / "in2.md").read_text()
    recipe = next(code for code in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "Trainer(" in code)
    monkeypatch.chdir(tmp_path)  # its output_dir
    namespace = {}
    exec(recipe, namespace)
    state = namespace["trainer"].state
    assert state.global_step == 4 and math.isfinite(state.log_history[-1]["train_loss"])


def test_counts_of_any_integer_type_give_the_examples_plain_ints_give():
    numpy_and_torch = build(num_examples=np.int64(4), seed=torch.tensor(0))
    assert numpy_and_torch.to_dict() == build(num_examples=4, seed=0).to_dict()
