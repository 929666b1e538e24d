"""Position-bias mitigations: options of `forward` and `generate`, off by default.

| option                  | where it acts                                                                          |
|-------------------------|----------------------------------------------------------------------------------------|
| `stable_mask`           | one extra logit per query row (a sink with a zero value): rows sum to less than 1      |
| `ms_poe`                | head `h` of the chosen layers sees positions `m / r_h` (rotary and the positional block) |
| `attention_calibration` | re-weights the last query row's attention over given documents ("Found in the Middle") |
| `positional_scaling`    | scales positional channels of the attention input for the keys and the last query     |
| `parallel_context_windows` | windows attend within themselves, positions restart per window; task attends all   |
| `attention_buckets`     | copies of the input read positions with other bases or scales; logits mixed            |

This module registers them (`MITIGATIONS`), checks which can be combined (`mitigation_options.REFUSED_TOGETHER`), and
resolves a call's options into a `MitigationPlan`. A new mitigation is a `Mitigation` subclass with its options
dataclass, added to `MITIGATIONS` here or with `register_mitigation` (see `mitigation_base` for the hooks).
"""

import contextlib
import contextvars
import copy
import dataclasses
import inspect
from dataclasses import dataclass

import torch

from .attention_buckets import AttentionBucketsMitigation
from .attention_calibration import CalibrationMitigation, KeyDocuments, calibrate_row
from .cache_sepformer import SepFormerCache
from .mitigation_base import CallContext, Mitigation, MitigationPlan, cache_kind
from .mitigation_options import (
    AttentionBuckets,
    AttentionCalibration,
    MitigationOptions,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
    check_combination,
)
from .ms_poe import MSPoEMitigation, fixed_head_ranks, head_ratios, position_awareness
from .parallel_context_windows import ParallelContextWindowsMitigation
from .positional_scaling import PositionalScalingMitigation
from .spans import check_last_column_real
from .stable_mask import StableMaskMitigation

# By keyword; a plan applies its mitigations' hooks in this order.
MITIGATIONS: dict[str, type[Mitigation]] = {
    mitigation.options_class.name: mitigation
    for mitigation in (
        StableMaskMitigation,
        MSPoEMitigation,
        PositionalScalingMitigation,
        CalibrationMitigation,
        ParallelContextWindowsMitigation,  # before the buckets: a bucket scales the windows' positions
        AttentionBucketsMitigation,
    )
}


def call_options(kwargs: dict, plan: MitigationPlan | None = None) -> dict:
    """The call's option keywords, taken out of the keywords of `forward`; refused beside a `mitigation_plan` (which
    carries mitigations already resolved in their place)."""
    options = {name: kwargs.pop(name) for name in MITIGATIONS if name in kwargs}
    if plan is not None and options:
        raise ValueError(f"give either mitigation_plan or the options {sorted(options)}, not both.")
    return options


def parse_options(config, options: dict) -> dict[str, MitigationOptions]:
    """The call's options, parsed, without those that are off. An option not given (`None`) takes the mitigation's
    `default_options(config)` (StableMask's is the config's); `False` switches it off for the call."""
    parsed = {}
    for name, mitigation in MITIGATIONS.items():
        value, _ = given_option(config, options, name)
        if value is not None and value is not False:
            parsed[name] = mitigation.options_class.parse(value)
    return parsed


def causal_lm_wrapper(options: dict, cache) -> tuple[type[Mitigation], MitigationOptions, dict] | None:
    """The call's mitigation whose options replace the whole forward of the causal LM (several attention buckets),
    with its parsed options and the call's (each parsed, or as given where off), or `None`; a cache that holds tokens
    is checked by every mitigation's `check_continuation` on the way."""
    wrappers, parsed = [], {}
    for name, mitigation in MITIGATIONS.items():
        value = None if options.get(name) in (None, False) else mitigation.options_class.parse(options[name])
        if name in options:
            parsed[name] = options[name] if value is None else value
        if isinstance(cache, SepFormerCache) and cache.get_seq_length() > 0:
            mitigation.check_continuation(cache, value)
        if value is not None and mitigation.wraps_causal_lm(value):
            wrappers.append((mitigation, value))
    return (*wrappers[0], parsed) if wrappers else None


def check_last_rows_are_prompt(call: CallContext, parsed: dict[str, MitigationOptions]) -> None:
    """Options that act on each row's last prompt token find it in the prefill's last column: not in a row padded on
    the right, which has a pad there. Read at an eager prefill (in a traced call, a guard on the mask's values)."""
    mask = call.attention_mask
    if call.continuing or mask is None or mask.dim() != 2 or torch.compiler.is_compiling():
        return
    acting = [name for name, value in parsed.items() if MITIGATIONS[name].acts_on_last_rows(value)]
    if acting:
        reading = "acts on each row's last prompt token, which it takes from the prefill's last column"
        check_last_column_real(mask, f"{', '.join(acting)} {reading}")


def check_prefill_state(name: str, options: MitigationOptions, call: CallContext) -> None:
    """Options that fix state at prefill need a cache that keeps it, and the same options all through a cache."""
    if call.sepformer_cache is None:
        if call.continuing:
            raise MITIGATIONS[name].prefilled_without(call.cache)
        raise ValueError(
            f"{name} keeps what it fixes at prefill on the cache, so it needs a cache that grows with the tokens and "
            f"carries that state (a SepFormerCache: what forward and generate make with options); got "
            f"{cache_kind(call.cache)}."
        )
    fixed = call.sepformer_cache.prefill_options
    if not call.continuing:
        return
    if fixed is None or name not in fixed:
        raise ValueError(MITIGATIONS[name].prefill_requirement)
    if fixed[name] != options:
        raise ValueError(
            f"{name} fixed state at prefill that decoding steps reuse: continuing a cache needs the options of its "
            f"prefill ({fixed[name]}); got {options}. Start a new cache for new options."
        )


def check_prefill_options_kept(call: CallContext, parsed: dict[str, MitigationOptions]) -> None:
    """A cache continued without an option whose state its prefill fixed would decode with half a method."""
    fixed = getattr(call.cache, "prefill_options", None) if call.continuing else None
    dropped = sorted(set(fixed or ()) - set(parsed))
    if dropped:
        raise ValueError(
            f"this cache was prefilled with {', '.join(f'{name}={fixed[name]}' for name in dropped)}: continue it "
            "with the same options, or start a new cache."
        )


# The plans kept by the decoding steps of the `generate` calls running (`kept_for_generation`), by cache.
GENERATION_PLANS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("generation_plans", default=None)


@dataclass(frozen=True, eq=False)
class KeptPlan:
    """The plan a decoding step of a `generate` call resolved, kept for the steps after it: a step on the same cache
    that gives the same options in the same form (`call_form`) reuses it, and parses no option and runs no check.
    Resolving reads only what such steps share; what changes from step to step is read when the plan starts a run,
    and a step's own work runs in `Mitigation.prepare`."""

    cache: SepFormerCache
    options: dict  # by name: each option as given (or the model's default), resolved into `plan`
    form: tuple  # `call_form` of the step
    plan: MitigationPlan
    dtype: torch.dtype  # the model's (`model.dtype`, a walk to its first parameter), which its runs start the plan with


@contextlib.contextmanager
def kept_for_generation():
    """The scope of one `generate` call: its decoding steps keep their plan (`KeptPlan`), dropped when it ends, so
    nothing holds the cache or the model after it."""
    token = GENERATION_PLANS.set({})
    try:
        yield
    finally:
        GENERATION_PLANS.reset(token)


def call_form(call: CallContext) -> tuple:
    mask = call.attention_mask
    mask_form = None if mask is None else "per layer type" if isinstance(mask, dict) else mask.dim()
    grad = torch.is_grad_enabled()  # `derived_store` keeps tensors made from the weights only without autograd
    return call.batch, call.new_tokens, mask_form, call.extrapolation, call.model.training, grad


def given_option(config, options: dict, name: str) -> tuple[object, bool]:
    """Option `name` of a call as `parse_options` reads it, and whether it is the model's default (not given)."""
    value = options.get(name)
    return (MITIGATIONS[name].default_options(config), True) if value is None else (value, False)


def options_as_given(config, options: dict) -> dict | None:
    """Every mitigation's option as the call gives it (or the model's default), or `None` where one could change in
    place unseen: a step is matched to a kept plan by the very objects (frozen options dataclasses, as `generate` passes
    them) or, for the model's default, by value (a copy of the config's dict)."""
    given = {}
    for name in MITIGATIONS:
        value, default = given_option(config, options, name)
        if default:
            value = copy.deepcopy(value)  # the config's (its fields are JSON): compared by value
        elif value is not False and not isinstance(value, MitigationOptions):
            return None  # a caller's dict: parsed and resolved at every call
        given[name] = value
    return given


def plan_kept_for(cache, config, options: dict) -> KeptPlan | None:
    """The plan a decoding step of the running `generate` kept for `cache`, if resolved from these options (the model's
    `config` gives the defaults)."""
    if not isinstance(cache, SepFormerCache) or torch.compiler.is_compiling():  # compiled: no context to read
        return None
    kept = (GENERATION_PLANS.get() or {}).get(id(cache))
    if kept is None or kept.cache is not cache:
        return None
    for name in MITIGATIONS:
        value, default = given_option(config, options, name)
        if value is not kept.options.get(name) and not (default and value == kept.options.get(name)):
            return None
    return kept


def kept_plan(call: CallContext, kept: KeptPlan | None) -> MitigationPlan | None:
    """The plan `kept` (`plan_kept_for` the call's cache and options) when this decoding step has the same form, its
    mitigations prepared for the step (`Mitigation.prepare`: a step's own work, as when resolved)."""
    if kept is None or not call.continuing or call_form(call) != kept.form:
        return None
    prepare(call, kept.plan)
    return kept.plan


def prepare(call: CallContext, plan: MitigationPlan) -> None:
    for mitigation in plan.mitigations:
        mitigation.prepare(call, tuple(other for other in plan.mitigations if other is not mitigation))


def keep_plan(call: CallContext, options: dict, plan: MitigationPlan) -> None:
    """Keep a decoding step's `plan` for the next steps of the running `generate` (`KeptPlan`); a prefill drops the
    plan kept for its cache."""
    if not isinstance(call.cache, SepFormerCache) or torch.compiler.is_compiling():
        return
    plans = GENERATION_PLANS.get()
    if plans is None:
        return
    given = options_as_given(call.model.config, options)
    plans.pop(id(call.cache), None)
    if call.continuing and given is not None:
        plans[id(call.cache)] = KeptPlan(call.cache, given, call_form(call), plan, call.model.dtype)


def resolve_plan(call: CallContext, options: dict) -> MitigationPlan | None:
    """The call's options resolved against the model and the call, checked, in one plan; `None` when all are off. A
    decoding step's plan is kept for the next steps (`kept_plan`)."""
    parsed = parse_options(call.model.config, options)
    check_prefill_options_kept(call, parsed)
    if not call.continuing and isinstance(call.cache, SepFormerCache):
        call.cache.drop_prefill_state()  # a prefill starts anew: one refused mid-way may have left its options
    if not parsed:
        return None
    if call.cache is None:
        call = dataclasses.replace(call, sepformer_cache=SepFormerCache())
    plan = checked_plan(call, parsed)  # every check done: now the work
    prepare(call, plan)
    if not call.continuing and call.sepformer_cache is not None:
        fixing = {name: value for name, value in parsed.items() if MITIGATIONS[name].fixes_state_at_prefill(value)}
        call.sepformer_cache.prefill_options = fixing
    keep_plan(call, options, plan)
    return plan


def checked_plan(call: CallContext, parsed: dict[str, MitigationOptions]) -> MitigationPlan:
    """The plan of the `parsed` options, resolved against the model and the call, every check done and no work."""
    num_layers = call.model.config.num_hidden_layers
    check_combination({name: value.layer_set(num_layers) for name, value in parsed.items()})
    check_last_rows_are_prompt(call, parsed)
    for name, value in parsed.items():
        if MITIGATIONS[name].fixes_state_at_prefill(value):
            check_prefill_state(name, value, call)
    return MitigationPlan.of(
        tuple(MITIGATIONS[name].resolve(value, call) for name, value in parsed.items()), num_layers
    )


def check_prefill(call: CallContext, options: dict) -> None:
    """Refuse what resolving `options` on the prefill `call` refuses (their checks against the model, the prompt and
    the cache), without the prefill: for `generate`, whose reordering of the documents runs forwards before it. What
    the prefill checks as it runs (positions read past a learned table, the cache several buckets need) comes then."""
    if call.cache is None:  # as `resolve_plan`: the prefill's own cache
        call = dataclasses.replace(call, sepformer_cache=SepFormerCache())
    parsed = parse_options(call.model.config, options)
    for name, value in list(parsed.items()):
        if MITIGATIONS[name].wraps_causal_lm(value):  # several attention buckets: as the copies of the rows run it
            parsed[name], call = MITIGATIONS[name].in_wrapped_call(value, call)
    checked_plan(call, parsed)


FORWARDS_WITH_KEYWORDS = []  # the forward functions whose signature lists the registered options


def with_mitigation_keywords(forward):
    """Give `forward`'s signature a keyword per registered option: `generate` accepts the keywords it names."""
    FORWARDS_WITH_KEYWORDS.append((forward, inspect.signature(forward)))
    refresh_signatures()
    return forward


def refresh_signatures() -> None:
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in MITIGATIONS]
    for forward, signature in FORWARDS_WITH_KEYWORDS:
        *parameters, variadic = signature.parameters.values()
        forward.__signature__ = signature.replace(parameters=[*parameters, *keywords, variadic])


def register_mitigation(mitigation: type[Mitigation]) -> None:
    """Add a mitigation: its options' `name` becomes a keyword of `forward` and `generate`."""
    MITIGATIONS[mitigation.options_class.name] = mitigation
    refresh_signatures()


def unregister_mitigation(name: str) -> None:
    del MITIGATIONS[name]
    refresh_signatures()


__all__ = [
    "MITIGATIONS",
    "AttentionBuckets",
    "AttentionCalibration",
    "MSPoE",
    "ParallelContextWindows",
    "PositionalScaling",
    "StableMask",
    "KeyDocuments",
    "calibrate_row",
    "fixed_head_ranks",
    "head_ratios",
    "position_awareness",
    "register_mitigation",
    "resolve_plan",
    "unregister_mitigation",
]
