"""`generate` with the mitigation options: shared by `SepFormerForCausalLM` and the models `add_mitigations` serves.

`generate` passes the options (keywords of `forward`, see `mitigations.with_mitigation_keywords`) to every prefill and
decoding step; this mixin makes the cache a `SepFormerCache` (which keeps what the mitigations fix at prefill), repeats
per-row options for beams and return sequences, refuses assisted decoding with options that act on the prompt's last
token, and runs `reorder_documents=` on the prompt first.
"""

from transformers.cache_utils import DynamicCache

from .cache_sepformer import SepFormerCache
from .mitigations import MITIGATIONS, check_assisted_decoding
from .reordering import reorder_generate_prompt


class MitigationGenerationMixin:
    """Put before `GenerationMixin` (or the model class that has it) in the bases."""

    def check_generate_inputs(self, prompt, generation_config, kwargs: dict) -> None:
        """Refuse, before any work, a prompt `generate` would fail on deep inside (the model's own checks)."""

    def generate(self, inputs=None, *args, **kwargs):
        """`GenerationMixin.generate`, after `check_generate_inputs`.

        `reorder_documents` (a `ReorderDocuments` or the dict of its fields, *optional*): the prompt's documents are
        reordered by relevance first (`sepformer.reordering`), and generation runs on the reordered prompt, which
        begins the returned sequences."""
        reordering = kwargs.pop("reorder_documents", None)
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        generation_config = args[0] if args else kwargs.get("generation_config")
        if prompt is not None:
            self.check_generate_inputs(prompt, generation_config, kwargs)
        if reordering is not None:
            inputs, kwargs = reorder_generate_prompt(self, reordering, inputs, kwargs, generation_config)
        return super().generate(inputs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """`generate` makes a `DynamicCache` by default: make it a `SepFormerCache`, which also carries the
        mitigation state and the fused decoding projections (transformers has no public hook for the cache class)."""
        given = model_kwargs.get("past_key_values")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        made = model_kwargs.get("past_key_values")
        if given is None and type(made) is DynamicCache and generation_config.cache_implementation in (None, "dynamic"):
            model_kwargs["past_key_values"] = SepFormerCache(config=self.config)

    def _get_candidate_generator(self, *args, model_kwargs, **kwargs):
        """Assisted decoding's drafts: refused, before the assistant or the model runs, with options that act on the
        prompt's last token (`check_assisted_decoding`)."""
        check_assisted_decoding(self.config, model_kwargs)
        return super()._get_candidate_generator(*args, model_kwargs=model_kwargs, **kwargs)

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Beams and return sequences repeat each input row; options given per input row are repeated with it."""
        for name, mitigation in MITIGATIONS.items():
            if model_kwargs.get(name) not in (None, False):
                model_kwargs[name] = mitigation.options_class.parse(model_kwargs[name]).repeat_rows(expand_size)
        return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **model_kwargs)
