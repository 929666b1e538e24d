"""What SepFormer's `generate` and `add_mitigations` rely on in transformers where it has no public seam, pinned on a
plain Llama: a release that changes it fails here, by name, rather than as a wrong generation elsewhere
(docs/design.md, "The call").

- `generate` rejects a keyword that `forward`'s signature does not list: the option keywords are added to the
  signature of `forward` (`mitigations.with_mitigation_keywords`).
- `generate` makes its default cache in `_prepare_cache_for_generation`, a `DynamicCache` left in `model_kwargs`: the
  override makes it a `SepFormerCache`.
- `generate` repeats the rows for beams and return sequences in `_expand_inputs_for_generation`, which receives the
  model keywords (the options among them) with the number of copies: the override repeats per-row options alike.
"""

import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

SIZES = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
PROMPT = torch.arange(3, 9)[None]
GREEDY = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)


class Recording(LlamaForCausalLM):
    """A plain Llama recording the two private steps of `generate` that SepFormer overrides."""

    def __init__(self, config):
        super().__init__(config)
        self.caches, self.expansions = [], []

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        self.caches.append(type(model_kwargs.get("past_key_values")))

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        self.expansions.append((expand_size, sorted(model_kwargs)))
        return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **model_kwargs)

    def forward(self, *args, row_option=None, **kwargs):  # a keyword forward's signature lists, as the options are
        return super().forward(*args, **kwargs)


@pytest.fixture(scope="module")
def model() -> Recording:
    torch.manual_seed(0)
    return Recording(LlamaConfig(**SIZES)).eval()


def test_generate_rejects_a_keyword_that_the_signature_of_forward_does_not_list(model):
    plain = LlamaForCausalLM(model.config).eval()
    with pytest.raises(ValueError, match="row_option"):
        plain.generate(PROMPT, row_option="x", **GREEDY)
    assert "row_option" in inspect.signature(model.forward).parameters
    model.generate(PROMPT, row_option="x", **GREEDY)  # listed: accepted and handed to forward


def test_generate_makes_its_default_cache_in_prepare_cache_for_generation(model):
    model.caches.clear()
    model.generate(PROMPT, **GREEDY)
    assert model.caches == [DynamicCache]


@pytest.mark.parametrize(
    ("settings", "copies"),
    [
        (dict(num_beams=2, num_return_sequences=2), 2),  # beam search: one row per beam
        (dict(do_sample=True, num_return_sequences=3), 3),  # sampling: one row per returned sequence
    ],
)
def test_generate_expands_rows_in_expand_inputs_for_generation_with_the_model_keywords(model, settings, copies):
    model.expansions.clear()
    model.generate(PROMPT, row_option="x", **{**GREEDY, **settings})
    assert len(model.expansions) == 1
    expand_size, keywords = model.expansions[0]
    assert expand_size == copies and "row_option" in keywords
