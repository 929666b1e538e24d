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
    Examples may differ in length: give each without its padding (`logits[mask.bool()]`, `labels[mask.bool()]`). A
    left-padded row given whole scores its first real token from a padding position's logits, even with -100 on the
    padding's labels.
    shift (compute keyword, default True): as a causal LM's loss, logits[i] predicts references[i + 1]; False when
        references are already aligned with the logits.
Configuration "losses":
    predictions: per example, the negative log-likelihoods (nats, >= 0) of its scored tokens; neither references,
        shift nor ignore_index (they belong to "logits"). The one to use with a large vocabulary: evaluate stores
        every logit it is given (seconds per ten million), and `cross_entropy(..., reduction="none")` gives these.
Refused with a ValueError naming the example, the position and what is allowed: a label that is no integer (a float,
bool or string, which evaluate would cast), or neither a token id of the logits' vocabulary (0..vocab-1) nor
ignore_index, logits or losses that are no numbers (bools, strings), logits whose shape does not match the labels or
whose vocabulary differs between examples, a NaN loss (NaN or +inf logits), a negative or NaN loss in "losses" (a
log-probability passed for a loss), and inputs with no scored token at all.
Returns:
    perplexity: exp of the mean loss over all scored tokens (inf past float64's range, a mean loss above about
        709.8 nats).
    mean_loss: that mean, in nats.
    bits_per_token: mean_loss / ln 2.
    num_tokens: scored tokens.
    perplexities: per example, exp of its mean loss (nan for an example with no scored token, inf as above).
Example:
    >>> metric = evaluate.load(metric_path("perplexity"), "losses")
    >>> metric.compute(predictions=[[math.log(2), math.log(2)], [math.log(8)]])["perplexity"]  # exp(5 ln 2 / 3)
    3.1748021039363983
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

    # evaluate drops `references` when they are no input (the "losses" configuration) and fails on a len(None) when
    # they are missing: check them first. (evaluate appends the inputs' description to these docstrings.)
    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch of examples."""
        self._check_references(predictions, references)
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """Add one example."""
        self._check_references(*(None if value is None else [value] for value in (prediction, reference)))
        return super().add(prediction=prediction, reference=reference, **kwargs)

    def compute(self, *, predictions=None, references=None, **kwargs):
        """Perplexity of the examples given here and of those added before."""
        self._check_references(predictions, references)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def _check_references(self, predictions, references):
        if self.config_name == "losses" and references is not None:
            raise ValueError(
                "perplexity 'losses' takes only predictions (each example's token losses): references would be "
                "ignored; for logits and labels load the default 'logits' configuration."
            )
        if self.config_name != "losses" and predictions is not None and references is None:
            raise ValueError(
                "perplexity needs references with the predictions: per example, the n labels of its (n, vocab) "
                "logits (ignore_index for positions not scored)."
            )
        if self.config_name != "losses" and hasattr(predictions, "__len__") and hasattr(references, "__len__"):
            if len(predictions) != len(references):
                raise ValueError(
                    f"perplexity got {len(predictions)} predictions and {len(references)} references: one list of "
                    "labels per example's logits."
                )
            for index, labels in enumerate(references):
                _check_labels(index, labels)
        # evaluate casts what it is given to the features ("1" to 1.0, True to 1): check the raw values first
        if hasattr(predictions, "__len__"):
            for index, numbers in enumerate(predictions):
                _check_numbers("losses" if self.config_name == "losses" else "logits", index, numbers)

    def _compute(self, predictions, references=None, shift=None, ignore_index=None, **unknown):
        if unknown:
            allowed = "shift, ignore_index" if self.config_name != "losses" else "no keyword"
            raise TypeError(f"perplexity got unknown keywords {sorted(unknown)}: compute takes {allowed}.")
        if self.config_name == "losses":
            pairs = (("shift", shift), ("ignore_index", ignore_index))
            given = [f"{name}={value!r}" for name, value in pairs if value is not None]
            if given:
                raise ValueError(
                    f"perplexity 'losses' takes no {' or '.join(given)} (it would be ignored): the losses are those "
                    "of the scored tokens already; shift and ignore_index belong to the 'logits' configuration."
                )
            losses = [_checked_losses(index, row) for index, row in enumerate(predictions)]
        else:
            shift = True if shift is None else shift
            ignore_index = -100 if ignore_index is None else ignore_index
            if not isinstance(shift, bool | np.bool_):
                raise ValueError(f"perplexity shift={shift!r} must be True (causal LM logits) or False.")
            if isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer):
                raise ValueError(f"perplexity ignore_index={ignore_index!r} must be an integer (default -100).")
            shift, ignore_index = bool(shift), int(ignore_index)
            losses, vocab = [], None
            for index, (logits, labels) in enumerate(zip(predictions, references, strict=True)):
                logits = _logits_array(index, logits, labels)
                if len(labels) and vocab is not None and logits.shape[1] != vocab:
                    raise ValueError(
                        f"perplexity: the logits of example {index} have a vocabulary of {logits.shape[1]}, those of "
                        f"the examples before {vocab}: every example's logits are (n, vocab) with the same vocab."
                    )
                vocab = logits.shape[1] if len(labels) else vocab
                losses.append(_token_losses(index, logits, np.asarray(labels, dtype=np.int64), shift, ignore_index))
        num_tokens = sum(len(row) for row in losses)
        if num_tokens == 0:
            raise ValueError(
                f"perplexity: no token is scored in {len(losses)} example(s) (all labels ignore_index, one-token "
                "examples with shift=True, or empty loss lists): the perplexity of nothing is undefined."
            )
        # float64 sums: the mean of many float32 losses should not depend on the order they were added in
        mean_loss = sum(float(row.sum()) for row in losses) / num_tokens
        return {
            "perplexity": _exp(mean_loss),
            "mean_loss": mean_loss,
            "bits_per_token": mean_loss / math.log(2),
            "num_tokens": num_tokens,
            "perplexities": [_exp(row.mean()) if len(row) else float("nan") for row in losses],
        }


def _exp(loss: float) -> float:
    """exp(loss), inf where it overflows float64 (math.exp would raise OverflowError past a loss of about 709.8)."""
    return math.exp(loss) if loss < math.log(np.finfo(np.float64).max) else math.inf


def _check_labels(index: int, labels) -> None:
    """Example `index`'s labels are integers: evaluate casts True and "1" to 1, and refuses 1.2 without saying where."""
    labels = labels.tolist() if hasattr(labels, "tolist") else labels
    if isinstance(labels, str) or not hasattr(labels, "__len__"):
        raise ValueError(f"perplexity: the labels of example {index} are {labels!r}: give each example a list.")
    for position, label in enumerate(labels):
        if isinstance(label, bool | np.bool_) or not isinstance(label, int | np.integer):
            raise ValueError(
                f"perplexity: label {label!r} at position {position} of example {index} is a {type(label).__name__}: "
                "a label is an integer, a token id of the logits' vocabulary or ignore_index."
            )


def _check_numbers(name: str, index: int, numbers) -> None:
    """Example `index`'s logits or losses are numbers: evaluate would read True as 1 and "1" as 1.0. NumPy's kind of
    the values is read from an array's or a tensor's dtype (a vocabulary's logits made into Python floats would cost
    seconds and gigabytes), of anything else from NumPy's reading of it."""
    dtype = getattr(numbers, "dtype", None)
    if isinstance(dtype, np.dtype):
        kind = dtype.kind
    elif hasattr(dtype, "is_floating_point"):  # a torch tensor, whose dtypes NumPy does not all have (bfloat16)
        kind = (
            "f" if dtype.is_floating_point else "c" if dtype.is_complex else "b" if str(dtype) == "torch.bool" else "i"
        )
    else:
        try:
            kind = np.asarray(numbers).dtype.kind
        except ValueError:  # rows of different widths: `_logits_array` says so
            return
    if kind not in "iuf":
        found = {"b": "bools", "U": "strings"}.get(kind, "values that are no numbers")
        raise ValueError(f"perplexity: the {name} of example {index} are {found}: they must be numbers (int or float).")


def _checked_losses(index: int, row) -> np.ndarray:
    losses = np.asarray(row, dtype=np.float64)
    bad = np.flatnonzero(np.isnan(losses) | (losses < 0))
    if len(bad):
        position = int(bad[0])
        raise ValueError(
            f"perplexity: the loss {losses[position]} at position {position} of example {index} is not allowed: "
            "losses are negative log-likelihoods in nats, >= 0 (+inf for a token of probability 0); a negative one "
            "is a log-probability (negate it), NaN a placeholder (give each example only its scored tokens)."
        )
    return losses


def _logits_array(index: int, logits, labels) -> np.ndarray:
    """Example `index`'s logits as an (n, vocab) array, n the number of its labels."""
    try:
        array = np.asarray(logits, dtype=np.float64)
    except ValueError:  # rows of different lengths
        raise ValueError(
            f"perplexity: the logits of example {index} have rows of different widths "
            f"{sorted({len(row) for row in logits})}: each example needs logits (n, vocab) and n labels."
        ) from None
    if len(labels) == 0 and array.size == 0:
        return array.reshape(0, 0)
    if array.ndim != 2 or len(array) != len(labels) or array.shape[1] == 0:
        raise ValueError(
            f"perplexity: logits of shape {array.shape} do not match {len(labels)} labels in example {index}; "
            "each example needs logits (n, vocab) and n labels."
        )
    return array


def _token_losses(index: int, logits: np.ndarray, labels: np.ndarray, shift: bool, ignore_index: int) -> np.ndarray:
    """The cross-entropy (nats) of every scored label, in float64."""
    vocab = logits.shape[1]
    bad = np.flatnonzero((labels != ignore_index) & ((labels < 0) | (labels >= vocab)))
    if len(bad):
        position = int(bad[0])
        raise ValueError(
            f"perplexity: label {int(labels[position])} at position {position} of example {index} is not allowed: "
            f"a label is a token id 0..{vocab - 1} (the logits' vocabulary) or ignore_index={ignore_index}."
        )
    if shift:
        logits, labels = logits[:-1], labels[1:]
    scored = labels != ignore_index
    positions = np.flatnonzero(scored) + int(shift)
    logits, labels = logits[scored], labels[scored]
    if len(labels) == 0:
        return np.zeros(0)
    peak = logits.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # NaN and +inf logits give NaN losses: refused below
        log_normaliser = peak[:, 0] + np.log(np.exp(logits - peak).sum(-1))
        losses = log_normaliser - logits[np.arange(len(labels)), labels]
    nan = np.flatnonzero(np.isnan(losses))
    if len(nan):
        raise ValueError(
            f"perplexity: the loss of the label at position {int(positions[nan[0]])} of example {index} is NaN: its "
            "logits contain NaN or +inf, or are all -inf; finite logits (or -inf for impossible tokens) are allowed."
        )
    return losses
