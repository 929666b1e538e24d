"""`tests/fingerprint.py`, the check that a refactor of the mitigations changes nothing observable: it must flag a
changed logit, token or message, and nothing within its tolerance."""

import copy

from fingerprint import ROWS, TOLERANCE, differences, outputs
from test_any_decoder import left_padded, mitigated

from sepformer import MSPoE


def test_a_changed_logit_token_or_refusal_is_flagged_and_rounding_is_not():
    model = mitigated("qwen2")
    ids, mask = left_padded(list(ROWS))
    prints = {
        "qwen2 ms_poe": outputs(model, ids, mask, {"ms_poe": MSPoE()}),
        "qwen2 refused": outputs(model, ids, mask, {"ms_poe": MSPoE(layers=(9,))}),
    }
    assert "refused" in prints["qwen2 refused"] and "logits" in prints["qwen2 ms_poe"]
    assert differences(prints, copy.deepcopy(prints)) == []

    def changed(edit) -> list[str]:
        edited = copy.deepcopy(prints)
        edit(edited)
        return differences(prints, edited)

    largest = prints["qwen2 ms_poe"]["logits"].abs().max()
    assert changed(lambda p: p["qwen2 ms_poe"]["logits"][0, -1, 0].add_(0.1 * TOLERANCE * largest)) == []
    assert changed(lambda p: p["qwen2 ms_poe"]["logits"][0, -1, 0].add_(10 * TOLERANCE * largest)) == [
        "qwen2 ms_poe: logits differs"
    ]
    assert changed(lambda p: p["qwen2 ms_poe"]["beams"][1, -1].add_(1)) == ["qwen2 ms_poe: beams differs"]
    assert changed(lambda p: p["qwen2 refused"].update(refused="another message")) == ["qwen2 refused: refused differs"]
    assert changed(lambda p: p.pop("qwen2 refused")) == ["qwen2 refused: ['refused'] before, [] after"]
