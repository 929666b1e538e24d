"""The architecture (`h = [p(i) ‖ s(token)]`, block-diagonal V, O, MLPs and norms), checked against formulas written
independently of the model code."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module
from conftest import random_ids, tiny_config, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from sepformer import SepFormerCache, SepFormerForCausalLM, SepFormerModel, SepFormerTokenizer
from sepformer.decoding import FusedLayer, RowLinear

VARIANTS = {
    "learned": {},
    "sinusoidal": {"positional_map": "sinusoidal"},
    "nope": {"position_size": 0},
    "wide_positions": {"position_size": 12, "norm_type": "layernorm", "attention_bias": True, "mlp_bias": True},
    "rotary": {"rotary_dim": 4},
    "head_reads_all": {"lm_head_input": "all"},
    "tied": {"tie_word_embeddings": True},
}


def randomize_norms(model):
    """Norm weights start at 1 (and biases at 0); perturb them so the tests see their placement."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


# ------------------------------------------------------------------------ dense reference, written from the formula


def dense_reference_logits(model: SepFormerForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The whole model with dense matrices: `W_V`, `W_O` and the MLP weights are block-diagonal full matrices."""
    cfg = model.config
    d_pos, heads, head_dim = cfg.position_size, cfg.num_attention_heads, cfg.head_dim
    batch, seq = input_ids.shape

    def dense(block, attr="weight"):  # block-diagonal dense matrix from the two per-subspace weights
        parts = [getattr(block.position, attr)] if block.position is not None else []
        return torch.block_diag(*parts, getattr(block.semantic, attr))

    def dense_bias(block):
        parts = [block.position.bias] if block.position is not None else []
        return torch.cat([*parts, block.semantic.bias]) if block.semantic.bias is not None else 0.0

    def norm(block, x):
        def one(module, part):
            if cfg.norm_type == "rmsnorm":
                return part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * module.weight
            centred = part - part.mean(-1, keepdim=True)
            scale = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
            return centred / scale * module.weight + module.bias

        parts = [one(block.position, x[..., :d_pos])] if d_pos > 0 else []
        return torch.cat([*parts, one(block.semantic, x[..., d_pos:])], -1)

    positions = torch.arange(seq)
    token_part = model.model.embed_tokens.weight[input_ids]
    if d_pos > 0:
        if cfg.positional_map == "learned":
            pos_part = model.model.embed_positions.weight[positions]
        else:
            k = torch.arange(d_pos // 2, dtype=torch.float32)
            angle = positions[:, None].float() / 10000 ** (2 * k / d_pos)
            pos_part = torch.zeros(seq, d_pos)
            pos_part[:, 0::2], pos_part[:, 1::2] = angle.sin(), angle.cos()
        h = torch.cat([pos_part.expand(batch, seq, d_pos), token_part], -1)
    else:
        h = token_part

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for layer in model.model.layers:
        attn = layer.self_attn
        x = norm(layer.input_layernorm, h)
        q = x @ attn.q_proj.weight.T + (attn.q_proj.bias if attn.q_proj.bias is not None else 0)
        k = x @ attn.k_proj.weight.T + (attn.k_proj.bias if attn.k_proj.bias is not None else 0)
        v = x @ dense(attn.v_proj).T + dense_bias(attn.v_proj)
        q, k, v = (t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        if cfg.rotary_dim:
            inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2).float() / cfg.rotary_dim)
            angle = positions[:, None].float() * inv_freq  # (seq, rotary_dim / 2)
            cos, sin = angle.cos(), angle.sin()

            def rotate(t, cos=cos, sin=sin):
                half = cfg.rotary_dim // 2
                a, b, rest = t[..., :half], t[..., half : cfg.rotary_dim], t[..., cfg.rotary_dim :]
                return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)

            q, k = rotate(q), rotate(k)
        scores = (q @ k.transpose(-1, -2)) / head_dim**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        mixed = (probs @ v).transpose(1, 2).reshape(batch, seq, -1)
        h = h + mixed @ dense(attn.o_proj).T + dense_bias(attn.o_proj)
        x = norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        up = x @ torch.block_diag(*([mlp.position.up_proj.weight] if d_pos else []), mlp.semantic.up_proj.weight).T
        if cfg.mlp_bias:
            up = up + torch.cat([*([mlp.position.up_proj.bias] if d_pos else []), mlp.semantic.up_proj.bias])
        act = F.gelu(up, approximate="tanh")
        position_down = [mlp.position.down_proj.weight] if d_pos else []
        down_weight = torch.block_diag(*position_down, mlp.semantic.down_proj.weight)
        down = act @ down_weight.T
        if cfg.mlp_bias:
            down = down + torch.cat([*([mlp.position.down_proj.bias] if d_pos else []), mlp.semantic.down_proj.bias])
        h = h + down
    h = norm(model.model.norm, h)
    if cfg.lm_head_input == "semantic":
        h = h[..., d_pos:]
    return h @ model.lm_head.weight.T


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_block_diagonal_model_equals_dense_reference(variant):
    model = randomize_norms(tiny_model(**VARIANTS[variant]))
    ids = random_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense_reference_logits(model, ids), rtol=1e-5, atol=1e-5)


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


# ------------------------------------------------------------------------------------------------ isolation invariant


def all_hidden_states(model, **inputs):
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states


def test_zeroed_query_key_makes_positional_blocks_content_free():
    model = tiny_model()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    d_pos = model.config.position_size
    first, second = (
        all_hidden_states(model, input_ids=random_ids(1, 16, 1)),
        all_hidden_states(model, input_ids=random_ids(1, 16, 2)),
    )
    assert len(first) == model.config.num_hidden_layers + 1
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a[..., :d_pos], b[..., :d_pos])
        assert not torch.allclose(a[..., d_pos:], b[..., d_pos:])
    # Attention no longer depends on content: uniform over the causal prefix.
    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(random_ids(1, 16, 1), output_attentions=True).attentions[0][0, 0]
    torch.testing.assert_close(probs, torch.ones(16, 16).tril() / torch.arange(1, 17)[:, None])


class AttentionReplay:
    """An attention function that records the probabilities of one pass and replays them, detached, in the next."""

    name = "sepformer_test_replay"

    def __init__(self):
        self.recorded, self.replaying = {}, False
        AttentionInterface.register(self.name, self)
        AttentionMaskInterface.register(self.name, eager_mask)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if not self.replaying:
            output, probs = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
            self.recorded[module.layer_idx] = probs.detach()
            return output, probs
        probs = self.recorded[module.layer_idx]
        return (probs @ value).transpose(1, 2).contiguous(), probs


def test_with_attention_held_fixed_positional_blocks_ignore_token_embeddings():
    model = randomize_norms(tiny_model(position_size=12))
    replay = AttentionReplay()
    model.set_attn_implementation(replay.name)
    d_pos = model.config.position_size
    embeds = model.model.embed_tokens(random_ids(2, 16))
    original = all_hidden_states(model, inputs_embeds=embeds)
    replay.replaying = True
    perturbed = all_hidden_states(model, inputs_embeds=embeds + torch.randn_like(embeds))
    for a, b in zip(original, perturbed, strict=True):
        assert torch.equal(a[..., :d_pos], b[..., :d_pos])
        assert not torch.allclose(a[..., d_pos:], b[..., d_pos:])


# ------------------------------------------------------------------------------- attention paths, cache, left padding


@pytest.mark.parametrize("variant", ["learned", "nope", "rotary", "wide_positions"])
def test_eager_equals_sdpa(variant):
    model = tiny_model(**VARIANTS[variant])
    ids = random_ids(3, 24)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(eager[real], sdpa[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_incremental_decoding_equals_full_forward(variant):
    model = tiny_model(**VARIANTS[variant])
    ids = random_ids(2, 20)
    with torch.no_grad():
        full = model(ids).logits
        cache = SepFormerCache(config=model.config)
        steps = [model(ids[:, :8], past_key_values=cache, use_cache=True).logits]
        for t in range(8, 20):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def fused_projections(cache: SepFormerCache) -> dict:
    """Each layer's `FusedLayer` on a generation's cache (its latest input scale's), `None` where it runs its
    modules."""
    return {key[1]: value for key, value in cache.derived.items() if key[0] == "fused layer"}


def decode_steps(model, ids, prefill, attention_mask=None, **options):
    """Logits of a prefill of `prefill` tokens and then one decoding step per remaining token, and the cache."""
    cache = SepFormerCache(config=model.config)
    mask = lambda end: None if attention_mask is None else attention_mask[:, :end]  # noqa: E731
    steps = [model(ids[:, :prefill], attention_mask=mask(prefill), past_key_values=cache, use_cache=True, **options)]
    for t in range(prefill, ids.shape[1]):
        step = ids[:, t : t + 1]
        steps.append(model(step, attention_mask=mask(t + 1), past_key_values=cache, use_cache=True, **options))
    return torch.cat([step.logits for step in steps], 1), cache


SCALED = (tuple(range(8)), 0.5)  # positional scaling's default channels (the positional block) at factor 0.5


@pytest.mark.parametrize(
    "variant, options, layer_1_scale",
    [(variant, {}, ((), 1.0)) for variant in sorted(VARIANTS)]
    + [
        ("learned", {"positional_scaling": {"factor": 0.5, "layers": (1,)}}, SCALED),
        ("rotary", {"positional_scaling": {"factor": 0.5, "layers": (1,)}}, SCALED),
        (
            "wide_positions",
            {"positional_scaling": {"factor": -1.0, "channels": (3, 20), "layers": (1,)}},
            ((3, 20), -1.0),
        ),
        # steps at positions 8-11 are not scaled, then 12-19 are: the scale changes within the generation
        ("learned", {"positional_scaling": {"factor": 0.5, "layers": (1,), "skip_first": 12}}, SCALED),
        ("learned", {"positional_scaling": {"factor": 0.5, "layers": (1,), "skip_first": 30}}, (SCALED[0], 1.0)),
        ("rotary", {"ms_poe": {"head_order": (2, 0, 3, 1)}}, ((), 1.0)),
    ],
)
def test_decoding_steps_with_fused_projections_equal_the_block_projections(variant, options, layer_1_scale):
    """Without autograd, decoding steps use one `[W_q; W_k; W_V]` and one dense `W_O` per layer (kept on the
    cache), positional scaling's factor in the columns of `W_q` and `W_k`; with autograd the per-block modules run,
    on the scaled inputs. Both give the same logits."""
    model = randomize_norms(tiny_model(**VARIANTS[variant]))
    with torch.no_grad():  # biases start at 0: perturb them, or scaling one with the weights' columns goes unseen
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    ids = random_ids(2, 20)
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 8, **options)
    assert {i for i, p in fused_projections(cache).items() if p is not None} == {0, 1}
    assert fused_projections(cache)[0].input_scale == ((), 1.0)
    assert fused_projections(cache)[1].input_scale == layer_1_scale
    blocks, block_cache = decode_steps(model, ids, 8, **options)  # autograd on
    assert fused_projections(block_cache) == {}
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


def test_decoding_steps_whose_rows_scale_differently_run_the_blocks():
    """With left padding the rows of a step sit at different positions: while `skip_first` scales one row's token
    and not the other's, no single input scale stands for both and the layer runs its blocks; once both are scaled
    it fuses. The same logits as the blocks at every step."""
    model = randomize_norms(tiny_model())
    ids = random_ids(2, 16)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0's step tokens sit 3 positions before row 1's
    options = {"positional_scaling": {"factor": 0.5, "layers": (1,), "skip_first": 10}}
    scales = []
    fused_layer = FusedLayer.of

    def recording(layer, input_scale):
        scales.append(input_scale)
        return fused_layer(layer, input_scale)

    with torch.no_grad(), mock.patch.object(FusedLayer, "of", recording):
        fused, _ = decode_steps(model, ids, 8, attention_mask=mask, **options)
    # layer 0 once; layer 1 unscaled (both rows before 10), its blocks while the rows sit at 7-9 and 10-12, then
    # scaled (both rows from 10)
    assert scales == [((), 1.0), (SCALED[0], 1.0), SCALED]
    blocks, _ = decode_steps(model, ids, 8, attention_mask=mask, **options)
    real = mask.bool()
    torch.testing.assert_close(fused[real], blocks.detach()[real], rtol=1e-5, atol=1e-5)


class ShiftedLinear(torch.nn.Linear):
    """A subclass standing in for an adapter (PEFT, quantisation): its forward is not the matrix alone."""

    def forward(self, x):
        return super().forward(x) + 0.5


def test_fused_projections_are_not_used_when_a_projection_is_hooked_or_replaced():
    """A forward hook (as PEFT, accelerate or a user would add) must see every call, and a replaced projection
    must run: those layers keep their blocks, the others fuse."""
    model = tiny_model()
    calls = []
    model.model.layers[0].self_attn.v_proj.semantic.register_forward_hook(lambda *args: calls.append(1))
    ids = random_ids(1, 12)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 4)
    assert len(calls) == 1 + 8  # the prefill and every decoding step
    assert fused_projections(cache)[0] is None and fused_projections(cache)[1] is not None

    o_proj = model.model.layers[1].self_attn.o_proj
    replaced = ShiftedLinear(o_proj.semantic.in_features, o_proj.semantic.out_features, bias=False)
    replaced.load_state_dict(o_proj.semantic.state_dict())
    o_proj.semantic = replaced
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 4)
    blocks, _ = decode_steps(model, ids, 4)  # autograd on: every module runs
    assert fused_projections(cache)[1] is None
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


HOOK_TARGETS = {  # a module of a layer, and the dimensions of its input in the modules' path
    "self_attn": (lambda layer: layer.self_attn, 3),
    "input_layernorm": (lambda layer: layer.input_layernorm, 3),
    "mlp": (lambda layer: layer.mlp, 3),
    "mlp_block": (lambda layer: layer.mlp.position, 2),
    "activation": (lambda layer: layer.mlp.semantic.act_fn, 2),
    "down_proj": (lambda layer: layer.mlp.semantic.down_proj, 2),
}


@pytest.mark.parametrize("target", sorted(HOOK_TARGETS))
def test_hooked_modules_see_what_they_see_without_fusing(target):
    """A hook sees at every decoding step the tensors the layer's modules pass: a hooked attention, norm, MLP,
    activation or projection keeps its layer's modules; the other layer fuses."""
    model = randomize_norms(tiny_model())
    module_of, dims = HOOK_TARGETS[target]
    inputs = []
    module_of(model.model.layers[0]).register_forward_hook(lambda module, args, output: inputs.append(args[0].dim()))
    ids = random_ids(2, 12)
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 8)
    assert fused_projections(cache)[0] is None and fused_projections(cache)[1] is not None
    assert inputs == [dims] * (1 + 4)  # the prefill and every decoding step
    blocks, _ = decode_steps(model, ids, 8)  # autograd on: every module runs
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


class Shifted(ModelHook):
    """An accelerate hook that changes what its module returns: accelerate replaces the instance's `forward`."""

    def post_forward(self, module, output):
        return output + 0.25


@pytest.mark.parametrize("target", ["q_proj", "input_layernorm", "act_fn"])
def test_a_module_whose_forward_accelerate_replaced_runs_it(target):
    """accelerate's `add_hook_to_module` (offloading, device maps) sets the instance's own `forward`, with no torch
    hook: that layer keeps its modules, and its hook changes the steps as it changes a full forward pass."""
    model = tiny_model()
    layer = model.model.layers[0]
    module = {
        "q_proj": layer.self_attn.q_proj,
        "input_layernorm": layer.input_layernorm,
        "act_fn": layer.mlp.semantic.act_fn,
    }[target]
    add_hook_to_module(module, Shifted())
    ids = random_ids(2, 12)
    with torch.no_grad():
        steps, cache = decode_steps(model, ids, 8)
        full = model(ids).logits
    assert fused_projections(cache)[0] is None and fused_projections(cache)[1] is not None
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_a_layer_whose_norm_or_mlp_was_replaced_runs_it():
    """A module of another class in a norm or MLP slot is run, not fused over."""
    model = tiny_model()
    hidden = model.config.hidden_size
    model.model.layers[0].input_layernorm = torch.nn.RMSNorm(hidden)
    model.model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
    ids = random_ids(2, 12)
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 8)
    assert fused_projections(cache) == {0: None, 1: None}
    blocks, _ = decode_steps(model, ids, 8)
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


def test_decoding_under_autocast_keeps_the_modules():
    """Under autocast the fused norms would compute their statistics in half precision: the modules run."""
    model = randomize_norms(tiny_model())
    ids = random_ids(2, 12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused, cache = decode_steps(model, ids, 8)
        unfused, _ = decode_steps(model.train(), ids, 8)  # training mode: never fused
    assert fused_projections(cache) == {}
    assert torch.equal(fused, unfused)


def test_decoding_steps_in_training_mode_run_the_dropout():
    """A model in `train()` decoding without autograd (an evaluation that forgot `eval()`): the steps run the modules,
    dropout included, as with autograd on, where nothing is fused."""
    model = tiny_model(hidden_dropout=0.5, attention_dropout=0.5).train()
    ids = random_ids(2, 12)
    torch.manual_seed(0)
    with torch.no_grad():
        steps, cache = decode_steps(model, ids, 8)
    torch.manual_seed(0)
    with_autograd, _ = decode_steps(model, ids, 8)
    assert fused_projections(cache) == {}
    assert torch.equal(steps, with_autograd.detach())


@pytest.mark.parametrize(
    "register",
    [torch.nn.modules.module.register_module_forward_hook, torch.nn.modules.module.register_module_forward_pre_hook],
)
def test_a_global_hook_sees_every_module_at_every_decoding_step(register):
    """A hook registered for every module (`register_module_forward_hook`, or the pre-hook) sees the layers' modules
    at every step: nothing is fused while one is registered."""
    model = tiny_model()
    seen = []
    q_projs = [layer.self_attn.q_proj for layer in model.model.layers]
    handle = register(lambda module, *args: seen.append(module) if any(module is q for q in q_projs) else None)
    ids = random_ids(2, 12)
    try:
        with torch.no_grad():
            steps, cache = decode_steps(model, ids, 8)
    finally:
        handle.remove()
    assert fused_projections(cache) == {0: None, 1: None}
    assert len(seen) == 2 * (1 + 4)  # both layers, at the prefill and every decoding step
    torch.testing.assert_close(steps, decode_steps(model, ids, 8)[0].detach(), rtol=1e-5, atol=1e-5)


def test_attention_buckets_share_one_copy_of_the_fused_weights():
    model = tiny_model()
    ids = random_ids(2, 12)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 8, attention_buckets={"scales": (1.0, 0.9, 0.8)})
    assert fused_projections(cache)[0] is not None
    assert all(bucket.derived is cache.derived for bucket in cache.mitigation_state["attention_buckets"].caches)


def test_row_linear_copies_to_in_out_on_a_cpu_only():
    weight = torch.randn(6, 4)
    on_cpu = RowLinear.of(weight, None)
    assert on_cpu.weight.is_contiguous() and torch.equal(on_cpu.weight, weight.t())
    elsewhere = RowLinear.of(weight.to("meta"), None)
    assert elsewhere.weight.shape == (4, 6) and not elsewhere.weight.is_contiguous()  # a view: no second copy


def test_fused_layers_keep_each_mlp_its_own_activation():
    """An activation with parameters (PReLU) differs between the two MLPs: each block runs its own."""
    model = tiny_model(hidden_act="prelu")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.position.act_fn.weight.fill_(0.9)
            layer.mlp.semantic.act_fn.weight.fill_(-0.4)
    ids = random_ids(2, 12)
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 8)
    assert all(projections is not None for projections in fused_projections(cache).values())
    blocks, _ = decode_steps(model, ids, 8)
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


def test_a_model_made_under_inference_mode_generates():
    """Weights made under inference mode are inference tensors: generation runs, fused and with MS-PoE."""
    with torch.inference_mode():
        model = tiny_model().eval()
        ids = random_ids(2, 6)
        plain = model.generate(ids, max_new_tokens=3, do_sample=False)
        with_ms_poe = model.generate(ids, max_new_tokens=3, do_sample=False, ms_poe={"layers": (1,)})
    assert plain.shape == with_ms_poe.shape == (2, 9)


def test_fused_projections_can_be_switched_off():
    model = tiny_model(fuse_decoding_projections=False)
    with torch.no_grad():
        _, cache = decode_steps(model, random_ids(1, 8), 4)
    assert fused_projections(cache) == {}


@pytest.mark.parametrize("variant", ["learned", "sinusoidal", "nope", "rotary"])
def test_cached_and_uncached_greedy_generation_are_identical(variant):
    model = tiny_model(**VARIANTS[variant])
    ids = random_ids(2, 6)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=256)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (2, 18)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["learned", "sinusoidal", "rotary", "nope"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(variant, attn):
    model = tiny_model(**VARIANTS[variant])
    model.set_attn_implementation(attn)
    tokenizer = SepFormerTokenizer(padding_side="left")
    prompts = ["def f(x):", "import os", "a longer prompt, with more bytes"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    together = model.generate(**batch, **kwargs)[:, batch.input_ids.shape[1] :]
    for row, prompt in enumerate(prompts):
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), **kwargs)
        assert torch.equal(together[row], alone[0, -10:]), prompt


def test_left_padded_forward_uses_positions_from_the_mask():
    model = tiny_model()
    ids = random_ids(1, 10)
    padded = torch.cat([torch.full((1, 4), 256), ids], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], 1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 4:], model(ids).logits)


# ------------------------------------------------------------------------------------------------ outputs and errors


def test_outputs_attentions_and_hidden_states():
    model = tiny_model()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(random_ids(2, 9), output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(2, 4, 9))
    assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 9, 32)


def test_positional_block_of_the_embedding_is_the_table_row():
    model = tiny_model()
    with torch.no_grad():
        first = model(random_ids(1, 5), output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(first[0, :, :8], model.model.embed_positions.weight[:5])
    torch.testing.assert_close(first[0, :, 8:], model.model.embed_tokens.weight[random_ids(1, 5)[0]])


def test_base_model_returns_full_hidden_state():
    torch.manual_seed(0)
    model = SepFormerModel(tiny_config()).eval()
    with torch.no_grad():
        assert model(random_ids(2, 7)).last_hidden_state.shape == (2, 7, 32)


def test_tied_head_shares_the_token_embedding():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_position_past_the_learned_table_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"position 64 is past the learned positional table of L=64 rows"):
        model(random_ids(1, 65))


def test_inputs_embeds_of_the_wrong_width_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="semantic_size=24"):
        model(inputs_embeds=torch.zeros(1, 3, 32))


def test_compiled_forward_matches_eager_mode():
    model = tiny_model()
    ids = random_ids(2, 12)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_flex_attention_equals_sdpa_at_inference():
    """torch implements flex attention's backward on accelerators only; on CPU it serves inference."""
    model = tiny_model()
    ids = random_ids(2, 16)
    with torch.no_grad():
        sdpa = model(ids).logits
        model.set_attn_implementation("flex_attention")
        torch.testing.assert_close(model(ids).logits, sdpa, rtol=1e-5, atol=1e-5)


def test_attentions_asked_for_at_a_decoding_step_are_recorded():
    """A call that asks for the attentions runs the attention modules, also on a cache whose steps were fused; and the
    recording hooks transformers leaves installed do not switch fused decoding off afterwards."""
    model = tiny_model(attn_implementation="eager")
    ids = random_ids(2, 8)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 6)  # fused weights made for this cache
        assert fused_projections(cache)[0] is not None
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True, output_attentions=True)
        assert len(step.attentions) == 2 and step.attentions[0].shape == (2, 4, 1, 9)
        model.config.output_attentions = True  # asked for by the config rather than the call
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True)
        assert len(step.attentions) == 2 and step.attentions[0].shape == (2, 4, 1, 10)
        model.config.output_attentions = False
        fused, cache = decode_steps(model, ids, 6)  # transformers' recording hooks are installed by now
    assert all(value is not None for value in fused_projections(cache).values())
    torch.testing.assert_close(fused, decode_steps(model, ids, 6)[0].detach(), rtol=1e-5, atol=1e-5)
