"""Perplexity from logits and labels, or from per-token losses: no model is loaded (unlike the Hub's `perplexity`,
which downloads one).

A self-contained `evaluate` metric script (it imports only `datasets`, `evaluate` and `numpy`), loaded offline by
path: `evaluate.load(sepformer.metrics.metric_path("perplexity"))` for logits and labels, with the configuration
name `"losses"` for per-token losses.
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Perplexity `exp(mean NLL)` over every scored token of every example (token-weighted), in nats, with the same mean
in bits per token (bits per byte for a byte-level tokenizer) and each example's own perplexity.
"""

_KWARGS_DESCRIPTION = """
Configuration "logits" (default):
    predictions: per example, the logits (n, vocab) of its n positions.
    references: per example, n label ids; `ignore_index` (default -100) marks the positions not scored.
    shift (compute keyword, default True): as a causal LM's loss, logits[i] predicts references[i + 1]; False when
        references are already aligned with the logits.
Configuration "losses":
    predictions: per example, the negative log-likelihoods (nats) of its scored tokens.
Returns:
    perplexity: exp of the mean loss over all scored tokens.
    mean_loss: that mean, in nats.
    bits_per_token: mean_loss / ln 2.
    num_tokens: scored tokens.
    perplexities: per example, exp of its mean loss (nan for an example with no scored token).
Example:
    >>> metric = evaluate.load(metric_path("perplexity"), "losses")
    >>> metric.compute(predictions=[[math.log(2), math.log(2)], [math.log(8)]])["perplexity"]  # exp(mean) = 4
    3.9999999999999996
"""


class Perplexity(evaluate.Metric):
    def _info(self):
        if self.config_name == "losses":
            features = datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64"))})
        elif self.config_name in ("default", "logits"):
            features = datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            )
        else:
            raise ValueError(f"perplexity configuration {self.config_name!r}: use 'logits' (default) or 'losses'.")
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION, features=features
        )

    def _compute(self, predictions, references=None, shift=True, ignore_index=-100):
        if self.config_name == "losses":
            losses = [np.asarray(row, dtype=np.float64) for row in predictions]
        else:
            losses = [
                _token_losses(logits, labels, shift, ignore_index)
                for logits, labels in zip(predictions, references, strict=True)
            ]
        num_tokens = sum(len(row) for row in losses)
        # float64 sums: the mean of many float32 losses should not depend on the order they were added in
        mean_loss = sum(float(row.sum()) for row in losses) / num_tokens if num_tokens else float("nan")
        return {
            "perplexity": math.exp(mean_loss),
            "mean_loss": mean_loss,
            "bits_per_token": mean_loss / math.log(2),
            "num_tokens": num_tokens,
            "perplexities": [math.exp(row.mean()) if len(row) else float("nan") for row in losses],
        }


def _token_losses(logits, labels, shift: bool, ignore_index: int) -> np.ndarray:
    """The cross-entropy (nats) of every scored label, in float64."""
    logits, labels = np.asarray(logits, dtype=np.float64), np.asarray(labels, dtype=np.int64)
    if logits.ndim != 2 or len(logits) != len(labels):
        raise ValueError(
            f"perplexity: logits of shape {logits.shape} do not match {len(labels)} labels; "
            "each example needs logits (n, vocab) and n labels."
        )
    if shift:
        logits, labels = logits[:-1], labels[1:]
    scored = labels != ignore_index
    logits, labels = logits[scored], labels[scored]
    peak = logits.max(-1, keepdims=True)
    log_normaliser = peak[:, 0] + np.log(np.exp(logits - peak).sum(-1))
    return log_normaliser - logits[np.arange(len(labels)), labels]
