"""StableMask (`sepformer/stable_mask.py`) against `softmax(A ⊙ C + P) ⊙ C` written out over `N` columns, and `τ_t`'s
closed form against the explicit sum; sdpa = eager, the config's option, training with random position offsets."""

import math

import pytest
import torch
from conftest import logits, random_ids, tiny_model
from transformers import AttentionInterface

from sepformer import SepFormerForCausalLM, StableMask
from sepformer.stable_mask import StableMaskMitigation, sink_logits


@pytest.mark.parametrize("gamma", [0.01, 0.3, 2.0])
def test_sink_logit_closed_form_equals_the_explicit_sum(gamma):
    length = 20
    tau = sink_logits(StableMask(gamma=gamma, columns=length), torch.arange(25), default_columns=99)
    for t in range(1, 26):  # t = position + 1
        terms = [math.exp(-gamma * (j - 1)) for j in range(t + 1, length + 1)]
        expected = math.log(sum(terms)) if terms else -math.inf
        assert tau[t - 1].item() == pytest.approx(expected, rel=1e-5, abs=1e-5), t


def test_a_billion_columns_cost_only_the_positions_read():
    """`τ_t` depends on `t` and `N` only: `N = 10⁹` builds nothing over the columns (a table of them took 8 GB per
    float64 temporary and the process was killed)."""
    gamma, columns = 0.01, 10**9
    positions = [0, 5, 1000, columns - 2, columns - 1, columns, 2 * columns]
    tau = sink_logits(StableMask(gamma, columns=columns), torch.tensor([positions]), default_columns=64)[0]
    for position, got in zip(positions, tau.tolist(), strict=True):
        t = position + 1
        expected = -math.inf
        if t < columns:
            expected = -gamma * t + math.log(-math.expm1(-gamma * (columns - t))) - math.log(-math.expm1(-gamma))
        assert got == pytest.approx(expected, rel=1e-6), position
    model = tiny_model()
    ids = random_ids(2, 12)
    # e^{-γ(N - t)} is below float32's resolution for N = 10⁴ already: the same sink logits as N = 10⁹
    billion = logits(model, ids, stable_mask=StableMask(gamma, columns=columns))
    torch.testing.assert_close(billion, logits(model, ids, stable_mask=StableMask(gamma, columns=10**4)))
    assert not torch.allclose(billion, logits(model, ids), atol=1e-4)


def dense_stable_mask(gamma, length):
    """`softmax(A ⊙ C + P) ⊙ C` over `N` columns, `P_ij = -γ(j-1)` for `j > i` (1-indexed), as an attention function
    for an unpadded full forward pass."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        seq = query.shape[2]
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (b, H, seq, seq): A
        i = torch.arange(1, seq + 1)[:, None]
        j = torch.arange(1, length + 1)[None]
        causal = (j <= i).float()  # (seq, N): C
        pseudo = torch.where(j > i, -gamma * (j - 1.0), 0.0)  # P
        masked = torch.zeros(*scores.shape[:3], length)
        masked[..., :seq] = scores
        probs = torch.softmax(masked * causal + pseudo, -1) * causal  # (b, H, seq, N)
        probs = probs[..., :seq]
        return torch.matmul(probs, value).transpose(1, 2), probs

    return attention


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 4}, {"position_size": 0}])
def test_stable_mask_equals_dense_reference(overrides):
    gamma, length = 0.3, 24
    model = tiny_model(**overrides)
    ids = random_ids(2, 16)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ours = model(ids, stable_mask=StableMask(gamma, length), output_attentions=True)
    AttentionInterface.register("dense_stable_mask", dense_stable_mask(gamma, length))
    model.set_attn_implementation("dense_stable_mask")
    with torch.no_grad():
        reference = model(ids, output_attentions=True)
    torch.testing.assert_close(ours.logits, reference.logits, rtol=1e-5, atol=1e-5)
    for got, expected in zip(ours.attentions, reference.attentions, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert (got.sum(-1) < 1).all()  # the pseudo-columns take mass from every row before N


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_very_large_gamma_is_the_base_model(attn):
    model = tiny_model(rotary_dim=4)
    model.set_attn_implementation(attn)
    ids = random_ids(2, 12)
    torch.testing.assert_close(logits(model, ids, stable_mask={"gamma": 1e4}), logits(model, ids), rtol=0, atol=1e-6)


def test_stable_mask_sdpa_equals_eager_with_padding_and_past_the_pseudo_columns():
    model = tiny_model()
    ids = random_ids(3, 20)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    option = StableMask(gamma=0.1, columns=12)  # rows at t >= 12 get no sink
    model.set_attn_implementation("eager")
    eager = logits(model, ids, attention_mask=mask, stable_mask=option)
    model.set_attn_implementation("sdpa")
    sdpa = logits(model, ids, attention_mask=mask, stable_mask=option)
    unpadded = logits(model, ids, stable_mask=option)  # sdpa's causal path: no mask at all
    real = mask.bool()
    torch.testing.assert_close(eager[real], sdpa[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpadded[[0, 2]], sdpa[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unpadded, logits(model, ids), atol=1e-3)


def test_stable_mask_from_the_config_trains_and_round_trips(tmp_path):
    model = tiny_model(stable_mask={"gamma": 0.1})
    model.train()
    ids = random_ids(4, 16)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    assert torch.equal(logits(model, ids), logits(model, ids, stable_mask=StableMask(0.1)))
    model.save_pretrained(tmp_path)
    reloaded = SepFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.stable_mask == {"gamma": 0.1}
    assert torch.equal(logits(reloaded, ids), logits(model, ids))


def test_stable_mask_in_training_with_random_position_offsets_reads_the_absolute_position(monkeypatch):
    """`random_position_offsets` shifts where the table is read (here past N), not where a row is in its sequence: τ
    is taken at positions 0..n-1, so StableMask stays on for shifted rows."""
    model = tiny_model(position_table_size=256, random_position_offsets=True).train()
    shifted = lambda position_ids, batch: position_ids + 100  # noqa: E731  every row read past N = 64
    monkeypatch.setattr(model.model.embed_positions, "training_positions", shifted)
    started, start = [], StableMaskMitigation.start

    def recorded_start(self, run):
        started.append(start(self, run))
        return started[-1]

    monkeypatch.setattr(StableMaskMitigation, "start", recorded_start)
    ids = random_ids(2, 12)
    option = StableMask(gamma=0.3)
    with torch.no_grad():
        on, off = logits(model, ids, stable_mask=option), logits(model, ids, stable_mask=False)
    expected = sink_logits(option, torch.arange(12)[None], model.config.max_position_embeddings)
    torch.testing.assert_close(started[0].sink_logits[:, 0, :, 0], expected)
    assert torch.isfinite(started[0].sink_logits).all()
    assert (on - off).abs().max() > 1e-4
