"""`evaluate` metric scripts shipped with the package, loadable offline by path:

    import evaluate
    from sepformer.metrics import metric_path

    accuracy = evaluate.load(metric_path("accuracy_by_position"))
    accuracy.compute(predictions=[3, 5, 7], references=[3, 4, 7], positions=[0, 1, 1])
    perplexity = evaluate.load(metric_path("perplexity"))            # logits and labels
    perplexity = evaluate.load(metric_path("perplexity"), "losses")  # per-token losses (nats)

`evaluate` loads a script from a local path without the Hub: the scripts import only `datasets`, `evaluate`
and `numpy`.
"""

from pathlib import Path

METRICS = ("accuracy_by_position", "perplexity")


def metric_path(name: str) -> str:
    """The path of the metric script `name` (one of `METRICS`), for `evaluate.load`."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}: the package ships {', '.join(METRICS)}.")
    return str(Path(__file__).resolve().parent / f"{name}.py")
