"""IN2 training data ("INformation-INtensive" training, arXiv 2404.16811), made by rule and offline: a question quotes
a span of a gold segment placed anywhere in a long context, the answer is the text that follows (or precedes) it there.
See docs/in2.md."""

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from transformers import PreTrainedTokenizerBase

from .mitigation_options import plain_integer

if TYPE_CHECKING:
    import datasets

QUESTIONS = ("follows", "precedes")
# the words around the quoted spans, per question: (before the first span, between spans, after the last)
QUESTION_WORDS = {
    "follows": ('Which text follows "', '", "', '"?'),
    "precedes": ('Which text precedes "', '", "', '"?'),
}
MAX_TRIES = 100  # draws of an example's spans (then of its segments) before the text is declared too repetitive
# in2_dataset's integer arguments, in the order it unpacks them, and the least value of each
MINIMUM = dict(
    context_length=1, segment_length=1, num_examples=1, segments_per_question=1, span_length=1, answer_length=1, seed=0
)


def in2_dataset(
    texts_or_dataset,
    tokenizer,
    *,
    context_length: int,
    segment_length: int = 128,
    num_examples: int,
    question: str = "follows",
    segments_per_question: int = 1,
    span_length: int = 8,
    answer_length: int = 8,
    seed: int = 0,
    text_column: str | None = None,
) -> "datasets.Dataset":
    """IN2 examples: `[bos] segment_1 ... segment_n [sep] question [sep] answer eos`, at most `context_length` tokens
    (at most the model's `max_position_embeddings`; checked against the tokenizer's `model_max_length`), as
    docs/in2.md describes.

    The source (a list of strings, a `datasets.Dataset` whose `text_column` holds the text, `"text"` by default, or the
    path of a text file read as one document) is tokenized without special tokens and each document cut into segments of
    `segment_length` tokens (a shorter tail is dropped); every example holds as many distinct segments as fit. The
    question quotes `span_length` tokens of each of `segments_per_question` gold segments, each span occurring once in
    the context; the answer is the `answer_length` tokens that follow each span (`question="precedes"`: precede it),
    in the order of the context. `labels` are the input ids on the answer and its eos, -100 elsewhere. Metadata:
    `gold_slots` (in context order), `answer_positions` (each answer piece's index in the context's input ids),
    `answer_start` (the first answer token), `num_segments` (`n`). Deterministic for a given `seed`.
    """
    counts = checked_counts(locals())  # every argument, by name
    context_length, segment_length, num_examples, per_question, span_length, answer_length, seed = counts
    texts = source_texts(texts_or_dataset, text_column)
    bos, sep, words, overhead = example_frame(tokenizer, question, per_question, span_length, answer_length)
    segments, num_segments = context_segments(tokenizer, texts, context_length, segment_length, overhead, per_question)
    rng = np.random.default_rng(seed)
    rows = []
    for slots in gold_slots(rng, num_examples, num_segments, per_question):
        context, positions, spans, answers = draw_example(
            rng, segments, num_segments, slots, question, span_length, answer_length
        )
        prompt = [*bos, *context, sep, *quoted(rng, words, spans), sep]
        answer = [token for piece in answers for token in piece] + [tokenizer.eos_token_id]
        rows.append(
            {
                "input_ids": prompt + answer,
                "attention_mask": [1] * (len(prompt) + len(answer)),
                "labels": [-100] * len(prompt) + answer,  # the loss is on the answer only
                "gold_slots": slots,
                "answer_positions": [len(bos) + position for position in positions],
                "answer_start": len(prompt),
                "num_segments": num_segments,
            }
        )
    import datasets  # here, not at the top: `import sepformer` would take half a second longer

    return datasets.Dataset.from_list(rows)


def checked_counts(arguments: dict) -> tuple[int, ...]:
    """`in2_dataset`'s integer arguments as plain ints, in `MINIMUM`'s order, once every argument is checked."""
    counts = {}
    for name, minimum in MINIMUM.items():
        given = arguments[name]
        value = counts[name] = plain_integer(given)
        if value is None:
            raise TypeError(f"{name}={given!r} is a {type(given).__name__}: give an integer >= {minimum}.")
        if value < minimum:
            raise ValueError(f"{name}={value} is out of range: give an integer >= {minimum}.")
    question, text_column, tokenizer = arguments["question"], arguments["text_column"], arguments["tokenizer"]
    if question not in QUESTIONS:
        raise ValueError(f"question={question!r} is not a question type: choose one of {', '.join(QUESTIONS)}.")
    if text_column is not None and not isinstance(text_column, str):
        raise TypeError(f"text_column={text_column!r} is a {type(text_column).__name__}: give a column name (str).")
    window = counts["span_length"] + counts["answer_length"]
    if window > counts["segment_length"]:
        raise ValueError(
            f"span_length={counts['span_length']} plus answer_length={counts['answer_length']} is {window} tokens, "
            f"more than segment_length={counts['segment_length']}: the span and its answer lie in one segment."
        )
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(
            f"tokenizer={tokenizer!r:.60} is a {type(tokenizer).__name__}: give a transformers tokenizer "
            "(a PreTrainedTokenizerBase, e.g. SepFormerTokenizer() or AutoTokenizer.from_pretrained(...))."
        )
    if counts["context_length"] > tokenizer.model_max_length:
        raise ValueError(
            f"context_length={counts['context_length']} is longer than the tokenizer's model_max_length="
            f"{tokenizer.model_max_length}: give at most the model's length (max_position_embeddings)."
        )
    return tuple(counts.values())


def source_texts(source, text_column: str | None) -> list[str]:
    import datasets

    if text_column is not None and not isinstance(source, datasets.Dataset):
        raise ValueError(
            f"text_column={text_column!r} is read only from a datasets.Dataset (it would be ignored); the "
            f"source is a {type(source).__name__}: leave text_column out."
        )
    if isinstance(source, str | os.PathLike):
        if not os.path.isfile(source):  # False for a text given as the source too ("File name too long")
            raise ValueError(
                f"{str(source)!r:.80} is not a file: a str source is the path of a text file; give a text "
                "as a list of strings ([text]), or a datasets.Dataset."
            )
        try:
            return [Path(source).read_text(encoding="utf-8")]
        except UnicodeDecodeError as error:
            raise ValueError(
                f"the source file {str(Path(source))!r} is not UTF-8 text ({error}): give a UTF-8 file, or its "
                "text decoded as a list of strings."
            ) from None
    if isinstance(source, datasets.Dataset):
        text_column = text_column or "text"
        if text_column not in source.column_names:
            raise ValueError(
                f"the dataset has no column text_column={text_column!r}: its columns are {source.column_names}."
            )
        texts = source[text_column]
    elif isinstance(source, list | tuple):
        texts = source
    else:
        raise TypeError(
            f"the source is a {type(source).__name__}: give a list of strings, a datasets.Dataset or the "
            "path of a text file."
        )
    wrong = next((index for index, text in enumerate(texts) if not isinstance(text, str)), None)
    if wrong is not None:
        raise TypeError(
            f"the source holds a {type(texts[wrong]).__name__} ({texts[wrong]!r:.60}) at index {wrong}: "
            "every text must be a str."
        )
    if not texts:
        raise ValueError("the source holds no text: give at least one document.")
    return list(texts)


def example_frame(tokenizer, question: str, per_question: int, span_length: int, answer_length: int):
    """The ids around an example's segments: the bos that leads ([] where the tokenizer has none), the separator and
    the question's words (see `QUESTION_WORDS`); and how many tokens these, the spans and the answer and eos take."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer {type(tokenizer).__name__} has no eos_token: IN2 examples end with eos; "
            "set tokenizer.eos_token."
        )
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    sep = tokenizer.eos_token_id if tokenizer.sep_token_id is None else tokenizer.sep_token_id
    words = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in QUESTION_WORDS[question]]
    question_length = len(words[0]) + per_question * span_length + (per_question - 1) * len(words[1]) + len(words[2])
    return bos, sep, words, len(bos) + 1 + question_length + 1 + per_question * answer_length + 1


def context_segments(
    tokenizer, texts, context_length, segment_length, overhead, per_question
) -> tuple[np.ndarray, int]:
    """The texts' segments, as rows: each document's consecutive runs of `segment_length` tokens (its shorter tail
    dropped); and how many fit in an example beside its `overhead` tokens."""
    num_segments = (context_length - overhead) // segment_length
    if num_segments < per_question:
        raise ValueError(
            f"context_length={context_length} leaves room for {max(num_segments, 0)} segment(s) of {segment_length} "
            f"tokens beside the question and answer ({overhead} tokens), fewer than segments_per_question="
            f"{per_question}: give a context_length of at least {overhead + per_question * segment_length}, or "
            "shorter segments."
        )
    rows = [
        ids[start : start + segment_length]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - segment_length + 1, segment_length)
    ]
    if len(rows) < num_segments:
        raise ValueError(
            f"the text gives {len(rows)} segment(s) of {segment_length} tokens; an example of context_length="
            f"{context_length} holds {num_segments} distinct ones: give more text, shorter segments or a shorter "
            "context_length."
        )
    return np.array(rows, dtype=np.int64), num_segments


def gold_slots(rng: np.random.Generator, num_examples: int, num_segments: int, per_question: int):
    """The gold slots of each example, in increasing order: with one gold segment, each run of `num_segments` examples
    uses every slot once, in a shuffled order; with several, a uniform random subset per example."""
    if per_question == 1:
        for block in range(0, num_examples, num_segments):
            for slot in rng.permutation(num_segments)[: num_examples - block]:
                yield [int(slot)]
    else:
        for _ in range(num_examples):
            yield sorted(int(slot) for slot in rng.choice(num_segments, per_question, replace=False))


def draw_example(
    rng, segments: np.ndarray, num_segments: int, slots: list[int], question: str, span_length: int, answer_length: int
):
    """A context of `num_segments` distinct segments and, in each gold slot, a span found once in the context and
    its answer: the context's ids, each answer piece's position in it, the spans and the answer pieces."""
    segment_length = segments.shape[1]
    room = segment_length - span_length - answer_length + 1  # the places of a span and its answer in a segment
    for _ in range(MAX_TRIES):
        context = segments[rng.choice(len(segments), num_segments, replace=False)].reshape(-1)
        for _ in range(MAX_TRIES):
            starts = [slot * segment_length + int(rng.integers(room)) for slot in slots]
            span_starts = [start + (answer_length if question == "precedes" else 0) for start in starts]
            if all(occurrences(context, context[start : start + span_length]) == 1 for start in span_starts):
                break
        else:
            continue  # every span drawn in these segments repeats: draw other segments
        answer_starts = [start + (0 if question == "precedes" else span_length) for start in starts]
        spans = [context[start : start + span_length].tolist() for start in span_starts]
        answers = [context[start : start + answer_length].tolist() for start in answer_starts]
        return context.tolist(), answer_starts, spans, answers
    raise ValueError(
        f"found no span of span_length={span_length} tokens that occurs once in its context in {MAX_TRIES} draws of "
        f"segments: the text repeats itself too much for spans this short; give a longer span_length or other text."
    )


def quoted(rng: np.random.Generator, words: list[list[int]], spans: list[list[int]]) -> list[int]:
    """The question's words around the spans, quoted in a random order (the answer keeps the context's)."""
    opening, between, closing = words
    question = [*opening]
    for rank, piece in enumerate(rng.permutation(len(spans))):
        question += ([] if rank == 0 else between) + spans[piece]
    return question + closing


def occurrences(ids: np.ndarray, span: np.ndarray) -> int:
    """How often `span` occurs in `ids` (overlaps counted)."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(span))
    return int((windows == span).all(axis=1).sum())


__all__ = ["in2_dataset"]
