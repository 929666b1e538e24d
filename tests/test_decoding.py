"""The decoding fast path (`sepformer.decoding`): decoding steps with fused weights equal the layer's modules, and the
modules run wherever fusing would bypass what a hook, an adapter, autocast or training mode must see."""

from unittest import mock

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from conftest import random_ids, tiny_model
from test_model import VARIANTS, randomize_norms

from sepformer import SepFormerCache
from sepformer.decoding import FusedLayer, RowLinear


def fused_layers(cache: SepFormerCache) -> dict:
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
def test_decoding_steps_with_fused_layers_equal_the_block_projections(variant, options, layer_1_scale):
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
    assert {i for i, p in fused_layers(cache).items() if p is not None} == {0, 1}
    assert fused_layers(cache)[0].input_scale == ((), 1.0)
    assert fused_layers(cache)[1].input_scale == layer_1_scale
    blocks, block_cache = decode_steps(model, ids, 8, **options)  # autograd on
    assert fused_layers(block_cache) == {}
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


def test_fused_layers_are_not_used_when_a_projection_is_hooked_or_replaced():
    """A forward hook (as PEFT, accelerate or a user would add) must see every call, and a replaced projection
    must run: those layers keep their blocks, the others fuse."""
    model = tiny_model()
    calls = []
    model.model.layers[0].self_attn.v_proj.semantic.register_forward_hook(lambda *args: calls.append(1))
    ids = random_ids(1, 12)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 4)
    assert len(calls) == 1 + 8  # the prefill and every decoding step
    assert fused_layers(cache)[0] is None and fused_layers(cache)[1] is not None

    o_proj = model.model.layers[1].self_attn.o_proj
    replaced = ShiftedLinear(o_proj.semantic.in_features, o_proj.semantic.out_features, bias=False)
    replaced.load_state_dict(o_proj.semantic.state_dict())
    o_proj.semantic = replaced
    with torch.no_grad():
        fused, cache = decode_steps(model, ids, 4)
    blocks, _ = decode_steps(model, ids, 4)  # autograd on: every module runs
    assert fused_layers(cache)[1] is None
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
    assert fused_layers(cache)[0] is None and fused_layers(cache)[1] is not None
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
    assert fused_layers(cache)[0] is None and fused_layers(cache)[1] is not None
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
    assert fused_layers(cache) == {0: None, 1: None}
    blocks, _ = decode_steps(model, ids, 8)
    torch.testing.assert_close(fused, blocks.detach(), rtol=1e-5, atol=1e-5)


def test_decoding_under_autocast_keeps_the_modules():
    """Under autocast the fused norms would compute their statistics in half precision: the modules run."""
    model = randomize_norms(tiny_model())
    ids = random_ids(2, 12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused, cache = decode_steps(model, ids, 8)
        unfused, _ = decode_steps(model.train(), ids, 8)  # training mode: never fused
    assert fused_layers(cache) == {}
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
    assert fused_layers(cache) == {}
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
    assert fused_layers(cache) == {0: None, 1: None}
    assert len(seen) == 2 * (1 + 4)  # both layers, at the prefill and every decoding step
    torch.testing.assert_close(steps, decode_steps(model, ids, 8)[0].detach(), rtol=1e-5, atol=1e-5)


def test_attention_buckets_decode_every_copy_of_the_rows_with_one_copy_of_the_fused_weights():
    model = tiny_model()
    ids = random_ids(2, 12)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 8, attention_buckets={"scales": (1.0, 0.9, 0.8)})
    assert fused_layers(cache)[0] is not None and cache.layers[0].keys.shape[0] == 2 * 3


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
    assert all(projections is not None for projections in fused_layers(cache).values())
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


def test_fused_layers_can_be_switched_off():
    model = tiny_model(fuse_decoding_projections=False)
    with torch.no_grad():
        _, cache = decode_steps(model, random_ids(1, 8), 4)
    assert fused_layers(cache) == {}


def test_attentions_asked_for_at_a_decoding_step_are_recorded():
    """A call that asks for the attentions runs the attention modules, also on a cache whose steps were fused; and the
    recording hooks transformers leaves installed do not switch fused decoding off afterwards."""
    model = tiny_model(attn_implementation="eager")
    ids = random_ids(2, 8)
    with torch.no_grad():
        _, cache = decode_steps(model, ids, 6)  # fused weights made for this cache
        assert fused_layers(cache)[0] is not None
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True, output_attentions=True)
        assert len(step.attentions) == 2 and step.attentions[0].shape == (2, 4, 1, 9)
        model.config.output_attentions = True  # asked for by the config rather than the call
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True)
        assert len(step.attentions) == 2 and step.attentions[0].shape == (2, 4, 1, 10)
        model.config.output_attentions = False
        fused, cache = decode_steps(model, ids, 6)  # transformers' recording hooks are installed by now
    assert all(value is not None for value in fused_layers(cache).values())
    torch.testing.assert_close(fused, decode_steps(model, ids, 6)[0].detach(), rtol=1e-5, atol=1e-5)
