"""The mitigations of `lost_in_the_middle.py` as settings: each one's paper defaults, the grid `--tune` searches, and
the option that a setting makes for a batch of prompts. Settings are plain dicts (written in `results.csv`); `layers`
is `"last half"` or `"all"` (resolved for the model), `windows` groups the documents into that many parallel
windows, and `base_multiples` gives Attention Buckets' bases as multiples of the model's own rotary base."""

from sepformer import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    ReorderDocuments,
    StableMask,
)

NONE = "none"
RAG_BASES = (10000, 13000, 16000, 19000, 22000, 25000, 28000)  # Attention Buckets' rotary bases for RAG
OPTION_CLASSES = {
    cls.name: cls
    for cls in (
        StableMask,
        MSPoE,
        AttentionCalibration,
        PositionalScaling,
        ParallelContextWindows,
        AttentionBuckets,
        ReorderDocuments,
    )
}
SPAN_OPTIONS = ("attention_calibration", "parallel_context_windows", "reorder_documents")

# Each method at its paper's defaults (the option dataclasses' defaults, and these). StableMask has no default gamma:
# 0.05, the README's. Positional scaling on a model other than SepFormer adds the channels its search picks.
PAPER = {
    "stable_mask": {"gamma": 0.05},
    "ms_poe": {"r_min": 1.2, "r_max": 1.8},
    "attention_calibration": {"temperature": 5e-5},
    "positional_scaling": {},
    "parallel_context_windows": {},  # one window per document
    "attention_buckets": {"bases": RAG_BASES},
    "reorder_documents": {"by": "attention", "strategy": "ends"},
}

BASE_MULTIPLES = ((1.0, 1.3), (0.8, 1.0, 1.25), (0.5, 1.0, 2.0), (1.0, 1.3, 1.6, 1.9, 2.2, 2.5, 2.8))

# What `--tune` tries (docs/experiments/lost_in_the_middle.md writes it out). Positional scaling's channels are the
# ones its search picks; the grid varies its factor and layers.
GRID = {
    "stable_mask": [{"gamma": gamma} for gamma in (0.01, 0.05, 0.2, 1.0, 5.0)],
    "ms_poe": [
        {"r_min": r_min, "r_max": r_max, **layers}
        for r_min, r_max in ((1.0, 1.1), (1.0, 1.2), (1.1, 1.3), (1.0, 1.5), (1.2, 1.8))
        for layers in ({}, {"layers": "last half"})
    ],
    "attention_calibration": [{"temperature": 5e-5}, {"temperature": 1e-2}, {"temperature": 1e-2, "layers": "all"}],
    "positional_scaling": [
        {"factor": factor, **layers} for factor in (0.5, 0.0, -0.5, -1.0) for layers in ({}, {"layers": "last half"})
    ],
    "parallel_context_windows": [{"windows": windows} for windows in (2, 3, 5)] + [{}],
    "attention_buckets": [{"base_multiples": multiples} for multiples in BASE_MULTIPLES],
    "reorder_documents": [{"by": "attention", "strategy": strategy} for strategy in ("ends", "first", "last")],
}

# Where a model refuses a method's paper settings, what `--tune` tries in their place (the method then has a tuned row
# only). Attention Buckets' bases multiply the model's one rotary base, which a model rotating each layer type with
# its own base (Gemma 3) does not have; scales read positions at `m · s` under any rotary layout. Each scale is the
# inverse of a base multiple of the grid: the turn that base gives the lowest frequency, given to every frequency.
IN_PLACE_OF_PAPER = {
    "attention_buckets": [
        {"scales": tuple(round(1 / multiple, 4) for multiple in multiples)} for multiples in BASE_MULTIPLES
    ]
}


def describe(settings: dict) -> str:
    """The settings as `name=value` words (`defaults` for none), for tables and `results.csv`."""
    words = [
        f"{name}={' '.join(map(str, value)) if isinstance(value, tuple) else value}" for name, value in settings.items()
    ]
    return ", ".join(words) or "defaults"


def windows(spans: tuple, count: int) -> tuple:
    """Every row's document spans grouped into `count` contiguous windows of as equal numbers of documents as can be."""
    grouped = []
    for row in spans:
        edges = [round(k * len(row) / count) for k in range(count + 1)]
        pairs = zip(edges[:-1], edges[1:], strict=True)
        grouped.append(tuple((row[first][0], row[last - 1][1]) for first, last in pairs if last > first))
    return tuple(grouped)


def own_rotary_base(config) -> float:
    """The model's one rotary base, for bases given as multiples of it (a model with one base per layer type, as
    Gemma 3, has none to multiply: refused)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in parameters:
        raise ValueError(
            f"attention_buckets base_multiples need the model's one rotary base; its rope parameters are {parameters}"
        )
    return float(parameters["rope_theta"])


def make_option(mitigation: str, settings: dict, spans: tuple, config):
    """The option `settings` make for a batch whose rows have these document `spans`."""
    keywords = dict(settings)
    layers = keywords.pop("layers", None)
    if layers is not None:
        num_layers = config.num_hidden_layers
        first = {"last half": num_layers // 2, "all": 0}[layers]
        keywords["layers"] = tuple(range(first, num_layers))
    if "windows" in keywords:
        spans = windows(spans, keywords.pop("windows"))
    if "base_multiples" in keywords:
        base = own_rotary_base(config)
        keywords["bases"] = tuple(base * multiple for multiple in keywords.pop("base_multiples"))
    if mitigation in SPAN_OPTIONS:
        keywords["spans"] = spans
    return OPTION_CLASSES[mitigation](**keywords)
