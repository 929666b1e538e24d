"""What `generate` does before its first step with the mitigation options (keywords of `forward`, passed to every
step), for `SepFormerForCausalLM` and the models `add_mitigations` serves."""

import copy
import functools

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.configuration_utils import GenerationConfig, GenerationMode

from .cache_sepformer import SepFormerCache
from .mitigation_base import CallContext
from .mitigation_options import SpanOptions
from .mitigations import MITIGATIONS, check_prefill, kept_for_generation, parse_options
from .positional_maps import check_position_readable
from .reordering import ReorderDocuments, check_combinable, reorder_documents
from .spans import prompt_lengths

LOSS_KEYWORDS = ("ignore_index", "shift_labels")  # keywords of transformers' causal-LM loss, not of the model


class MitigationGenerationMixin:
    """Put before `GenerationMixin` (or the model class that has it) in the bases."""

    loss_keywords = ("num_items_in_batch", *LOSS_KEYWORDS)  # what `loss_function` takes besides logits and labels

    def check_generate_inputs(self, prompt, generation_config, kwargs: dict) -> None:
        """Refuse, before any work, a prompt `generate` would fail on deep inside (the model's own checks); `prompt`:
        its token ids, `None` where it is given as `inputs_embeds` (among `kwargs`)."""

    def call_context(self, inputs: dict) -> CallContext:
        """The call of the model on `inputs` (keywords of `forward`) as the mitigations are resolved against it: by
        `generate` to check its options before reordering runs forwards."""
        raise NotImplementedError

    def generate(self, inputs=None, *args, **kwargs):
        """`GenerationMixin.generate`, after `check_generate_inputs`, its decoding steps resolving the options once. A
        `SepFormerCache` it continues drops what an earlier generation made from the weights.

        `reorder_documents` (a `ReorderDocuments` or the dict of its fields, *optional*): the prompt's documents are
        reordered by relevance first (`sepformer.reordering`), and generation runs on the reordered prompt, which
        begins the returned sequences."""
        reordering = kwargs.pop("reorder_documents", None)
        if reordering is not None:
            check_combinable(kwargs)  # the options generation runs with (they do not reach the scoring passes)
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        generation_config = args[0] if args else kwargs.get("generation_config")
        check_no_options_in(generation_config, "the generation_config given to generate")
        check_no_options_in(self.generation_config, "model.generation_config")
        if prompt is not None or kwargs.get("inputs_embeds") is not None:
            self.check_generate_inputs(prompt, generation_config, kwargs)
        check_assistance(self, prompt, generation_config, kwargs)
        check_prefill_in_one_call(self, prompt, generation_config, kwargs)
        if isinstance(kwargs.get("past_key_values"), SepFormerCache):
            kwargs["past_key_values"].start_generation()
        if reordering is not None:
            inputs, kwargs = reorder_generate_prompt(self, reordering, prompt, inputs, kwargs, generation_config)
        with kept_for_generation():  # the decoding steps resolve the options once
            return super().generate(inputs, *args, **kwargs)

    def generation_keeps_state(self, model_kwargs: dict) -> bool:
        """Whether a generation with `model_kwargs` keeps state on its cache: the state of the options it runs with.
        Without, the model generates with transformers' own default cache, as it did before `add_mitigations`."""
        return bool(parse_options(self.config, model_kwargs))

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` makes a `DynamicCache` by default: make it a `SepFormerCache`, which also carries the
        mitigation state and the fused decoding projections, where the generation keeps them (transformers has no
        public hook for the cache class)."""
        given = model_kwargs.get("past_key_values")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        made = model_kwargs.get("past_key_values")
        default = (
            given is None and type(made) is DynamicCache and generation_config.cache_implementation in (None, "dynamic")
        )
        if default and self.generation_keeps_state(model_kwargs):
            model_kwargs["past_key_values"] = SepFormerCache(config=self.config)
            if generation_config.is_assistant:  # as transformers marks its own: the main model crops its drafts
                model_kwargs["past_key_values"].activate_past_recording()

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Beams and return sequences repeat each input row; options given per input row are repeated with it."""
        for name, mitigation in MITIGATIONS.items():
            if model_kwargs.get(name) not in (None, False):
                model_kwargs[name] = mitigation.options_class.parse(model_kwargs[name]).repeat_rows(expand_size)
        return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **model_kwargs)


def check_assistance(model, prompt, generation_config, kwargs: dict) -> None:
    """Refuse, before any work, assisted decoding (the generation mode transformers names on the settings `generate`
    merges) with options that act on the prompt's last token, or with options an assistant not served would be given.
    Assisted decoding (an assistant model, prompt lookup) prefills the prompt with drafted tokens after it, then
    verifies several drafted tokens per call: options that act on the prompt's last token would act on a drafted one,
    and generate other tokens than plain decoding. With an assistant model, each option's `check_assistant_model`
    refuses what the assistant's cache, cropped before the prompt's last token after each round, would break."""
    merged = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    merged.update(**model.generation_config.to_dict(), defaults_only=True)  # merged as `generate` merges them
    merged.update(**kwargs)  # the generation settings among the keywords
    assistant = kwargs.get("assistant_model")
    if merged.get_generation_mode(assistant) != GenerationMode.ASSISTED_GENERATION:
        return
    parsed = parse_options(model.config, kwargs)
    if acting := [name for name, value in parsed.items() if MITIGATIONS[name].acts_on_last_rows(value)]:
        raise ValueError(
            f"{', '.join(acting)} acts on the prompt's last token, but assisted decoding (assistant_model, "
            "prompt_lookup_num_tokens) prefills the prompt with drafted tokens after it: it would act on a drafted "
            "token instead, and generate other tokens than plain decoding. Generate without assistance, or without "
            f"{', '.join(acting)}."
        )
    given = sorted(name for name in MITIGATIONS if kwargs.get(name) not in (None, False))
    if given and assistant is not None and not isinstance(assistant, MitigationGenerationMixin):
        raise ValueError(
            f"generate passes the model's keywords ({', '.join(given)}) to the assistant model too, and "
            f"{type(assistant).__name__} does not take them: call sepformer.add_mitigations on the assistant too."
        )
    if assistant is not None and prompt is not None:
        lengths = prompt_lengths(generation_padding(model, prompt, generation_config, kwargs), *prompt.shape)
        for name, value in parsed.items():
            MITIGATIONS[name].check_assistant_model(value, lengths)


def check_prefill_in_one_call(model, prompt, generation_config, kwargs: dict) -> None:
    """Refuse, before any work, a chunked prefill (`prefill_chunk_size` shorter than the prompt, on an empty cache:
    `generate` feeds the prompt in several calls, the first one taken for the prefill) with options that read the
    whole prompt there: its last token (`acts_on_last_rows`) or its documents' spans; and a chunked prefill of a prompt
    given as embeddings, which transformers cannot run."""
    chunk = generation_setting(model, generation_config, kwargs, "prefill_chunk_size")
    if chunk is not None and prompt is None and kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            f"prefill_chunk_size={chunk}: generate's chunked prefill splits the prompt's token ids, and feeds a prompt "
            "given as inputs_embeds whole with positions for none of its tokens (a plain transformers model fails on "
            "it too): generate without prefill_chunk_size, or from input_ids."
        )
    cache = kwargs.get("past_key_values")
    if chunk is None or prompt is None or prompt.shape[-1] <= chunk:
        return
    if isinstance(cache, Cache) and cache.get_seq_length() > 0:  # the chunks continue a prefill made before
        return
    parsed = parse_options(model.config, kwargs)
    whole = [
        name
        for name, options in parsed.items()
        if MITIGATIONS[name].acts_on_last_rows(options) or isinstance(options, SpanOptions)
    ]
    if whole:
        names, count = ", ".join(whole), prompt.shape[-1]
        raise ValueError(
            f"{names} {'reads' if len(whole) == 1 else 'read'} the whole prompt at prefill (its last token or its "
            f"documents' spans), but prefill_chunk_size={chunk} feeds the prompt of {count} tokens in chunks, of which "
            f"the first would be taken for the prompt: generate without prefill_chunk_size (or with one of at least "
            f"{count}), or without {names}."
        )


def check_no_options_in(generation_config, where: str) -> None:
    """The options are keywords of `generate` (and `forward`): found on a `GenerationConfig`, they would be ignored."""
    found = [name for name in (*MITIGATIONS, "reorder_documents") if getattr(generation_config, name, None) is not None]
    if found:
        raise ValueError(
            f"{', '.join(found)} found on {where}, which generate does not pass to the model: give "
            f"{'them' if len(found) > 1 else 'it'} as keywords of generate (generate(..., {found[0]}=...))."
        )


def generation_setting(model, generation_config, kwargs: dict, name: str):
    """A setting of `generate` as it merges them: its keywords, the given generation config, the model's."""
    sources = [kwargs, vars(generation_config) if generation_config is not None else {}, vars(model.generation_config)]
    return next((source[name] for source in sources if source.get(name) is not None), None)


def check_last_position(model, prompt: torch.Tensor, generation_config, kwargs: dict) -> None:
    """Refuse, before the first step, a generation whose last fed position (the last new token is returned, not fed)
    the learned table of `model` (a `SepFormerForCausalLM`) cannot read (`check_position_readable`), as the call
    feeding it would. `prompt`: (b, seq) ids or (b, seq, d) embeddings. Options that move the positions read are left
    to the steps, which check the positions they read."""
    if any(MITIGATIONS[name].moves_positions(options) for name, options in parse_options(model.config, kwargs).items()):
        return
    setting = functools.partial(generation_setting, model, generation_config, kwargs)
    new_tokens, length = setting("max_new_tokens"), prompt.shape[1]
    final_length = length + new_tokens if new_tokens is not None else setting("max_length")
    if final_length is None:  # by default generate makes 20 tokens up to max_position_embeddings
        return
    mask = kwargs.get("attention_mask")
    longest = int(mask.sum(-1).max()) if mask is not None and mask.dim() == 2 else length  # a row's real tokens
    last_fed = longest - 1 + max(final_length - length - 1, 0)
    # a step feeds a new token (otherwise only the prompt is fed, at prefill), continuing the cache
    continuing = final_length - length >= 2 and setting("use_cache") is not False
    check_position_readable(model, last_fed, kwargs.get("position_extrapolation"), continuing)


def check_fed_token_ids(model, generation_config, kwargs: dict) -> None:
    """Refuse, before the first step, a `pad_token_id` that `generate` would feed the model and the embedding cannot
    read: a row that ends (on an `eos_token_id` of the vocabulary) is fed padding. transformers' "never stop"
    (`eos_token_id=-1`) feeds none."""
    vocab_size = model.config.vocab_size
    pad, eos = (generation_setting(model, generation_config, kwargs, name) for name in ("pad_token_id", "eos_token_id"))
    eos = eos if isinstance(eos, list) else [eos]
    if isinstance(pad, int) and not 0 <= pad < vocab_size and any(e is not None and 0 <= e < vocab_size for e in eos):
        raise ValueError(
            f"generate: pad_token_id={pad} is outside the vocabulary 0..{vocab_size - 1}, and generate feeds it to the "
            "model after a row ends (eos_token_id is set): give pad_token_id a token id."
        )


def generation_padding(model, prompt, generation_config, kwargs: dict) -> torch.Tensor | None:
    """The padding mask `generate` runs with: the given one, or the one it infers without it (`pad_token_id` in the
    prompt and not an eos: transformers' `_prepare_attention_mask_for_generation`), so that spans count from the
    first real token that generation sees."""
    if kwargs.get("attention_mask") is not None:
        return kwargs["attention_mask"]
    pad, eos = (generation_setting(model, generation_config, kwargs, name) for name in ("pad_token_id", "eos_token_id"))
    if pad is None or pad in (eos if isinstance(eos, list) else [eos]) or not (prompt == pad).any():
        return None
    return prompt.ne(pad).long()


def reorder_generate_prompt(model, options, prompt, inputs, kwargs: dict, generation_config=None):
    """`generate`'s `(inputs, kwargs)` with the prompt's documents reordered, before it expands the rows for beams and
    return sequences; the options whose spans would describe the old order are refused."""
    options = ReorderDocuments.parse(options)
    cache = kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, Cache) or cache.get_seq_length() > 0):
        held = f"{cache.get_seq_length()} tokens" if isinstance(cache, Cache) else f"a {type(cache).__name__}"
        raise ValueError(
            f"reorder_documents moves the prompt's documents, but past_key_values already holds {held} of the prompt "
            "in its old order: generate without past_key_values (or with an empty cache)."
        )
    if prompt is None:
        raise ValueError("reorder_documents moves the prompt's token ids: give the prompt as input_ids.")
    forward_kwargs = {}  # for the scoring passes only: given scores run none
    if options.from_model and kwargs.get("position_extrapolation") is not None:
        forward_kwargs["position_extrapolation"] = kwargs["position_extrapolation"]
    mask = generation_padding(model, prompt, generation_config, kwargs)
    # what the prefill would refuse of the options it runs with, before the scoring passes
    check_prefill(model.call_context({**kwargs, "input_ids": prompt, "attention_mask": mask}), kwargs)
    reordered = reorder_documents(model, prompt, mask, options, **forward_kwargs)[0]
    return (reordered, kwargs) if inputs is not None else (None, {**kwargs, "input_ids": reordered})
