"""The family matrix (`family_matrix.py`): every causal-LM family of the installed transformers, each mitigation exact
against its oracle or refused by name, as docs/families.md says where it was generated with the same transformers;
families that cannot be built tiny are skipped with the reason."""

import copy

import pytest
import transformers
from family_matrix import CHECKS, FAMILIES, NotBuilt, check, documented, kind, prompts, run, tiny_model
from transformers import DynamicCache

from sepformer import StableMask, add_mitigations

DOCUMENTED_VERSION, DOCUMENTED = documented()


@pytest.mark.parametrize("name", CHECKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_option_is_exact_or_refused_by_name(family, name):
    try:
        outcome = check(family, name)
    except NotBuilt as reason:
        pytest.skip(f"{family}: {reason}")
    assert outcome == "exact" or outcome.startswith(("refused: ", "no oracle: ")), outcome
    if transformers.__version__ == DOCUMENTED_VERSION:  # a cell that turns from exact to refused is a change to see
        assert kind(outcome) == DOCUMENTED[family, name], f"docs/families.md says {DOCUMENTED[family, name]}: {outcome}"


def test_options_given_to_the_module_holding_the_layers_are_refused_where_base_model_is_the_causal_lm():
    """Llama 4's causal LM names a `language_model` it does not have as its base model prefix (`base_model` is the
    causal LM itself): the refusal is on the child that holds the layers, and the causal LM takes the options."""
    model, _ = tiny_model("llama4_text")
    model = add_mitigations(copy.deepcopy(model))
    ids, cache = prompts(), DynamicCache()
    assert model.base_model is model
    with pytest.raises(TypeError, match=r"\['stable_mask'\] reached Llama4TextModel as keywords it ignores"):
        model.model(ids, past_key_values=cache, stable_mask=StableMask(0.5))
    assert cache.get_seq_length() == 0
    assert run(model, ids, stable_mask=StableMask(0.5)).shape[:2] == ids.shape
