"""Exact-match accuracy grouped by the gold item's position: the curve of a "lost in the middle" experiment.

A self-contained `evaluate` metric script (it imports only `datasets`, `evaluate` and `numpy`), loaded offline by
path: `evaluate.load(sepformer.metrics.metric_path("accuracy_by_position"))`.
"""

from collections import defaultdict

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Exact match of each prediction with its reference, grouped by `positions` (for example the slot of the gold
key-value pair in a retrieval prompt, or the gold document's index). A prediction is one token id, a sequence of
token ids (all of them must match, in order, and the lengths must agree) or a string.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: one per example: an int, a list of ints or a string.
    references: the gold answers, of the same kind as the predictions.
    positions: one int per example, the group it is counted in.
Refused with a ValueError naming the example and what is allowed: predictions, references and positions of
different lengths, an answer that is no int, list of ints or string (a float would be truncated, None counted as a
miss), a prediction of another kind than its reference or than the examples before (evaluate would cast "3" to 3),
a position that is no int, and no example at all.
Returns:
    accuracy: exact match over all examples.
    accuracy_by_position: {position: exact match of that position's examples}, positions in increasing order.
    count_by_position: {position: number of examples}.
Example:
    >>> metric = evaluate.load(metric_path("accuracy_by_position"))
    >>> metric.compute(predictions=[3, 5, 7, 1], references=[3, 4, 7, 1], positions=[0, 1, 1, 2])
    {'accuracy': 0.75, 'accuracy_by_position': {0: 1.0, 1: 0.5, 2: 1.0}, 'count_by_position': {0: 1, 1: 2, 2: 1}}
"""


def _features(answer) -> datasets.Features:
    return datasets.Features({"predictions": answer, "references": answer, "positions": datasets.Value("int64")})


class AccuracyByPosition(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            # evaluate picks the first feature set the first example fits; strings first, since "3" fits int64 too
            # (cast to 3) and an int or a list fits no string (evaluate refuses to cast one to a string)
            features=[
                _features(datasets.Value("string")),
                _features(datasets.Value("int64")),
                _features(datasets.Sequence(datasets.Value("int64"))),
            ],
        )

    # evaluate casts what it is given to the features of the first example ("3" to 3, 3.7 to 3): check the raw inputs
    # first. (evaluate appends the inputs' description to these docstrings.)
    def add_batch(self, *, predictions=None, references=None, positions=None, **kwargs):
        """Add a batch of examples."""
        predictions, references, positions = self._checked(predictions, references, positions)
        return super().add_batch(predictions=predictions, references=references, positions=positions, **kwargs)

    def add(self, *, prediction=None, reference=None, positions=None, **kwargs):
        """Add one example (`positions` is its one position)."""
        (prediction,), (reference,), (positions,) = self._checked([prediction], [reference], [positions])
        return super().add(prediction=prediction, reference=reference, positions=positions, **kwargs)

    def compute(self, *, predictions=None, references=None, positions=None, **kwargs):
        """Accuracy by position of the examples given here and of those added before."""
        if predictions is not None or references is not None or positions is not None:
            predictions, references, positions = self._checked(predictions, references, positions)
        return super().compute(predictions=predictions, references=references, positions=positions, **kwargs)

    def _checked(self, predictions, references, positions) -> tuple[list, list, list]:
        """The three columns as lists of plain Python values (tensors and arrays converted), once checked."""
        columns = {"predictions": predictions, "references": references, "positions": positions}
        missing = [name for name, column in columns.items() if column is None]
        if missing:
            raise ValueError(f"accuracy_by_position needs predictions, references and positions; {missing} missing.")
        for name, column in columns.items():
            if isinstance(column, str) or not hasattr(column, "__len__"):
                raise ValueError(f"accuracy_by_position {name}={column!r} must be a list: one entry per example.")
        columns = {name: [_plain(value) for value in column] for name, column in columns.items()}
        predictions, references, positions = columns.values()
        if len({len(column) for column in columns.values()}) != 1:
            raise ValueError(
                f"accuracy_by_position got {', '.join(f'{len(column)} {name}' for name, column in columns.items())}: "
                "one of each per example."
            )
        if not predictions:
            raise ValueError("accuracy_by_position got no examples: predictions, references and positions are empty.")
        kind = _feature_kind(self.selected_feature_format)  # of the examples added before, if any
        for index, (prediction, reference, position) in enumerate(zip(predictions, references, positions, strict=True)):
            for name, answer in (("prediction", prediction), ("reference", reference)):
                answer_kind = _answer_kind(answer)
                if answer_kind is None:
                    raise ValueError(
                        f"accuracy_by_position: the {name} {answer!r} of example {index} is a "
                        f"{type(answer).__name__}: an answer is a token id (int), a list of token ids or a string."
                    )
                if kind is not None and answer_kind != kind:
                    raise ValueError(
                        f"accuracy_by_position: the {name} {answer!r} of example {index} is {KINDS[answer_kind][0]}, "
                        f"but the answers before it are {KINDS[kind][1]}: predictions and references are all of one "
                        "kind (evaluate would cast one to the other)."
                    )
                kind = answer_kind
            if not _is_int(position):
                raise ValueError(
                    f"accuracy_by_position: the position {position!r} of example {index} is a "
                    f"{type(position).__name__}: a position is an int (the group the example is counted in)."
                )
        return predictions, references, positions

    def _compute(self, predictions, references, positions, **unknown):
        if unknown:
            raise TypeError(f"accuracy_by_position got unknown keywords {sorted(unknown)}: compute takes none.")
        hits, counts = defaultdict(int), defaultdict(int)
        for prediction, reference, position in zip(predictions, references, positions, strict=True):
            # lists, arrays and scalars alike: equal only if the same length and the same items
            hit = np.array_equal(np.asarray(prediction), np.asarray(reference))
            hits[int(position)] += int(hit)
            counts[int(position)] += 1
        return {
            "accuracy": sum(hits.values()) / len(predictions),  # not 0: every input with no example is refused
            "accuracy_by_position": {p: hits[p] / counts[p] for p in sorted(counts)},
            "count_by_position": {p: counts[p] for p in sorted(counts)},
        }


KINDS = {  # singular, plural
    "id": ("a token id", "token ids"),
    "ids": ("a list of token ids", "lists of token ids"),
    "text": ("a string", "strings"),
}


def _plain(value):
    """Tensors, arrays and NumPy scalars as Python values (`tolist`); anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _is_int(value) -> bool:
    """Python and NumPy integers, not bools."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _answer_kind(answer) -> str | None:
    if isinstance(answer, str):
        return "text"
    if _is_int(answer):
        return "id"
    if isinstance(answer, list | tuple) and all(_is_int(item) for item in answer):
        return "ids"
    return None


def _feature_kind(features) -> str | None:
    """The kind of answer evaluate chose for the examples added so far (`None` before the first)."""
    if features is None:
        return None
    feature = features["predictions"]
    if isinstance(feature, datasets.Value):
        return "text" if feature.dtype == "string" else "id"
    return "ids"
