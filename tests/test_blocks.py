"""The block-diagonal modules (`sepformer.blocks`): the projections are real linear blocks, and the one-pass block norm
equals the two torch norms it stands for (values and gradients, fp32 and bf16, float32 statistics under autocast)."""

import copy

import pytest
import torch
from conftest import random_ids, tiny_model
from test_model import randomize_norms


def test_value_and_output_projections_are_real_linear_blocks():
    model = tiny_model(position_size=12)
    attn = model.model.layers[0].self_attn
    for projection in (attn.v_proj, attn.o_proj):
        assert isinstance(projection.position, torch.nn.Linear) and projection.position.weight.shape == (12, 12)
        assert isinstance(projection.semantic, torch.nn.Linear) and projection.semantic.weight.shape == (20, 20)
    assert attn.q_proj.weight.shape == attn.k_proj.weight.shape == (32, 32)
    assert model.model.embed_tokens.weight.shape == (259, 20)
    assert model.lm_head.weight.shape == (259, 20)


@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_norm_equals_the_two_torch_norms_and_their_gradients(norm_type, dtype):
    """`BlockNorm` against its own `position`/`semantic` torch norms called on each block, in float32 (in bf16 the
    reference would round its own weight gradients; torch's bf16 layer norm, which the LayerNorm blocks run, rounds
    its gradients as bf16 does, by up to 0.03 here)."""
    model = randomize_norms(tiny_model(position_size=12, norm_type=norm_type))
    norm = model.model.layers[0].input_layernorm
    reference_norm = copy.deepcopy(norm)
    norm.to(dtype)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) * 4 + 1
    grad = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    x_reference = x.clone().requires_grad_()
    x = x.to(dtype).requires_grad_()
    out = norm(x)
    reference = torch.cat(
        (reference_norm.position(x_reference[..., :12]), reference_norm.semantic(x_reference[..., 12:])), -1
    )
    assert out.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), reference, **tolerance)
    if dtype == torch.bfloat16 and norm_type == "layernorm":
        tolerance["atol"] = 4e-2
    grads = torch.autograd.grad(out, [x, *norm.parameters()], grad.to(dtype))
    reference_grads = torch.autograd.grad(reference, [x_reference, *reference_norm.parameters()], grad)
    for name, got, expected in zip(["x", *dict(norm.named_parameters())], grads, reference_grads, strict=True):
        torch.testing.assert_close(got.float(), expected, **tolerance, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
def test_block_norm_keeps_float32_statistics_under_autocast(norm_type):
    """Under autocast (Trainer's bf16) the statistics stay in float32, as in the torch norms."""
    norm = randomize_norms(tiny_model(position_size=12, norm_type=norm_type)).model.layers[0].input_layernorm
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1000
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    reference = torch.cat((norm.position(x[..., :12]), norm.semantic(x[..., 12:])), -1)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
def test_block_norm_outside_autograd_follows_its_parameters(norm_type):
    """Outside autograd the block norm keeps its combined parameters; a change in place (an optimiser step, loading),
    a swapped tensor or a dtype change must remake them, and autograd must still reach the parameters."""
    norm = randomize_norms(tiny_model(position_size=12, norm_type=norm_type)).model.layers[0].input_layernorm
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1

    def reference():
        return torch.cat((norm.position(x[..., :12]), norm.semantic(x[..., 12:])), -1)

    with torch.no_grad():
        torch.testing.assert_close(norm(x), reference(), rtol=1e-5, atol=1e-5)
        norm.position.weight.mul_(3)  # in place
        norm.semantic.bias.add_(1) if norm_type == "layernorm" else norm.semantic.weight.add_(1)
        torch.testing.assert_close(norm(x), reference(), rtol=1e-5, atol=1e-5)
    norm.semantic.weight = torch.nn.Parameter(norm.semantic.weight.detach() * -2)  # a new tensor
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), reference(), rtol=1e-5, atol=1e-5)
    norm.double()
    x = x.double()
    with torch.no_grad():
        torch.testing.assert_close(norm(x), reference(), rtol=1e-5, atol=1e-5)
    norm(x).sum().backward()
    assert norm.position.weight.grad is not None and norm.semantic.weight.grad.abs().sum() > 0


class Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_block_norm_reads_a_parametrised_weight_at_every_call():
    """A parametrised weight is a new tensor at every access: each call reads it as it is."""
    norm = randomize_norms(tiny_model(position_size=12)).model.layers[0].input_layernorm
    torch.nn.utils.parametrize.register_parametrization(norm.semantic, "weight", Doubled())
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    with torch.no_grad():
        for _ in range(3):
            reference = torch.cat((norm.position(x[..., :12]), norm.semantic(x[..., 12:])), -1)
            torch.testing.assert_close(norm(x), reference, rtol=1e-5, atol=1e-5)
            norm.semantic.parametrizations.weight.original.add_(1.0)


def test_constants_first_made_under_inference_mode_train_afterwards():
    """The cached constants (block norms, StableMask's τ) made under `inference_mode` are not inference tensors."""
    model = tiny_model(norm_eps=1.25e-5, stable_mask={"gamma": 0.0625})  # values no other test caches
    ids = random_ids(2, 12)
    with torch.inference_mode():
        model(ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.model.layers[0].input_layernorm.parameters())
