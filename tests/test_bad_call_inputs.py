"""Every bad input of a call is refused before any work is done, with what was wrong, the value and what is allowed."""

import pytest
import torch
from conftest import tiny_model

from sepformer import AttentionCalibration, MSPoE, StableMask

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def with_id(token: int) -> torch.Tensor:
    ids = IDS.clone()
    ids[1, 5] = token
    return ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": IDS[:, :0]}, r"the input has no tokens \(shape \(2, 0\)\)"),
        ({"input_ids": IDS[:0]}, r"the input has no tokens \(shape \(0, 12\)\)"),
        ({"input_ids": IDS[0]}, r"input_ids must be a 2-D tensor .* got shape \(12,\)"),
        ({"input_ids": IDS.float()}, r"input_ids must be a 2-D tensor of token ids .* torch.float32"),
        ({"input_ids": with_id(259)}, r"input_ids contains id 259, outside the vocabulary 0..258"),
        ({"input_ids": with_id(-1)}, r"input_ids contains id -1, outside the vocabulary 0..258"),
        ({"input_ids": IDS, "attention_mask": torch.ones(2, 13)}, r"attention_mask has shape \(2, 13\); .* \(2, 12\)"),
        ({"input_ids": IDS, "attention_mask": torch.ones(2, 1, 12)}, r"attention_mask must be a 2-D padding mask"),
        ({"input_ids": IDS, "position_ids": torch.arange(12)}, r"position_ids has shape \(12,\); .* \(2 or 1, 12\)"),
        ({"input_ids": IDS, "position_ids": torch.arange(11)[None]}, r"position_ids has shape \(1, 11\)"),
        ({"inputs_embeds": torch.zeros(2, 12, 32)}, r"inputs_embeds has shape \(2, 12, 32\).*semantic_size=24"),
        ({"input_ids": IDS, "inputs_embeds": torch.zeros(2, 12, 24)}, "exactly one of input_ids or inputs_embeds"),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, str) else None,
)
def test_bad_tensors_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_model()(**kwargs)


@pytest.mark.parametrize(
    ("ids", "message"),
    [(IDS[:, :0], "the input has no tokens"), (IDS[0], "input_ids must be a 2-D tensor")],
)
def test_generate_refuses_bad_prompts(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_model().generate(ids, max_new_tokens=2)


def test_an_unknown_keyword_is_refused_not_ignored():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['stablemask'\].*'stable_mask'"):
        model(IDS, stablemask={"gamma": 0.1})
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['extrapolation'\]"):
        model.model(IDS, extrapolation="clamp")
    with pytest.raises(ValueError, match="stablemask"):  # generate checks its keywords itself
        model.generate(IDS, max_new_tokens=1, stablemask={"gamma": 0.1})


def test_fractional_document_spans_are_refused_not_truncated():
    with pytest.raises(ValueError, match=r"span \(0, 3.5\) of row 0 must be two integers .* int, float"):
        AttentionCalibration(spans=[[(0, 3.5)]])
    with pytest.raises(ValueError, match="must be, per batch row, a sequence of \\(start, end\\)"):
        AttentionCalibration(spans=[[(0, 3, 5)]])


def test_dummy_document_ids_outside_the_vocabulary_are_refused():
    option = AttentionCalibration(spans=[[(0, 3)]] * 2, dummy_document=(5, 300))
    with pytest.raises(ValueError, match=r"dummy_document has ids \[300\] outside the vocabulary 0..258"):
        tiny_model()(IDS, attention_calibration=option)


def test_a_configured_stable_mask_can_be_switched_off_for_one_call():
    masked = tiny_model(stable_mask={"gamma": 0.5})
    plain = tiny_model()
    with torch.no_grad():
        off = masked(IDS, stable_mask=False).logits
        assert torch.equal(off, plain(IDS).logits)
        assert not torch.allclose(masked(IDS).logits, off)
        assert torch.equal(masked(IDS).logits, masked(IDS, stable_mask=StableMask(0.5)).logits)
    generated = masked.generate(IDS, max_new_tokens=3, do_sample=False, stable_mask=False)
    assert torch.equal(generated, plain.generate(IDS, max_new_tokens=3, do_sample=False))


def test_flex_attention_refuses_what_needs_the_attention_row_and_runs_a_fixed_order():
    model = tiny_model()
    model.set_attn_implementation("flex_attention")
    spans = AttentionCalibration(spans=[[(0, 3)]] * 2)
    with pytest.raises(ValueError, match="ms_poe ranks the heads .* flex_attention's block mask"):
        model(IDS, ms_poe=MSPoE())
    with pytest.raises(ValueError, match="attention_calibration rewrites .* flex_attention's block mask"):
        model(IDS, attention_calibration=spans)
    fixed = MSPoE(head_order=(0, 1, 2, 3), layers=(1,))
    with torch.no_grad():
        flex = model(IDS, ms_poe=fixed).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(flex, model(IDS, ms_poe=fixed).logits, rtol=1e-5, atol=1e-5)


def test_spans_of_numpy_or_torch_integers_are_integers():
    import numpy as np

    assert AttentionCalibration(spans=np.array([[[0, 3], [3, 6]]])).spans == (((0, 3), (3, 6)),)
    assert MSPoE(layers=torch.tensor([1])).layers == (1,)
    with pytest.raises(ValueError, match="must be two integers"):
        AttentionCalibration(spans=[[(0, np.bool_(True))]])


def test_a_stable_mask_saved_with_its_old_field_name_still_loads():
    assert StableMask.parse({"gamma": 0.1, "length": 40}) == StableMask(0.1, columns=40)
    assert tiny_model(stable_mask={"gamma": 0.1, "length": 40}).config.stable_mask == {"gamma": 0.1, "length": 40}


def test_a_resolved_plan_and_options_together_are_refused():
    from sepformer.mitigation_base import MitigationPlan

    model = tiny_model()
    with pytest.raises(ValueError, match=r"give either mitigation_plan or the options \['stable_mask'\], not both"):
        model.model(IDS, mitigation_plan=MitigationPlan.of((), 2), stable_mask={"gamma": 0.1})
