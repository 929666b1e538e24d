"""The family matrix (`family_matrix.py`): every causal-LM family of the installed transformers, each mitigation exact
against its oracle or refused by name, as docs/families.md says where it was generated with the same transformers;
families that cannot be built tiny are skipped with the reason."""

import pytest
import transformers
from family_matrix import CHECKS, FAMILIES, NotBuilt, check, documented, kind

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
