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
            # evaluate picks the first feature set the first example fits: token ids, token-id sequences, strings
            features=[
                _features(datasets.Value("int64")),
                _features(datasets.Sequence(datasets.Value("int64"))),
                _features(datasets.Value("string")),
            ],
        )

    def _compute(self, predictions, references, positions):
        hits, counts = defaultdict(int), defaultdict(int)
        for prediction, reference, position in zip(predictions, references, positions, strict=True):
            # lists, arrays and scalars alike: equal only if the same length and the same items
            hit = np.array_equal(np.asarray(prediction), np.asarray(reference))
            hits[int(position)] += int(hit)
            counts[int(position)] += 1
        total = sum(counts.values())
        return {
            "accuracy": sum(hits.values()) / total if total else float("nan"),
            "accuracy_by_position": {p: hits[p] / counts[p] for p in sorted(counts)},
            "count_by_position": {p: counts[p] for p in sorted(counts)},
        }
