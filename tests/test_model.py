"""The architecture (`h = [p(i) ‖ s(token)]`, block-diagonal V, O, MLPs and norms), checked against formulas written
independently of the model code."""

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids, tiny_config, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half

from sepformer import SepFormerCache, SepFormerForCausalLM, SepFormerModel, SepFormerTokenizer
from sepformer.rotary import rotary_cos_sin, rotate_partial

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


# ------------------------------------------------------------------------------------------------ isolation invariant


def all_hidden_states(model, **inputs):
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_a_turn_by_roll_and_signed_sine_is_rotate_half_bit_for_bit(rotary_dim, dtype):
    """`rotate_partial` with `rotary_cos_sin`'s tables (the sine signed, a `roll`) gives transformers' rotate-half turn
    bit for bit: `x · cos + rotate_half(x) · sin` on the first `rotary_dim` dimensions of each head, the rest as is."""
    x = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # (b, heads, seq, head_dim)
    positions = torch.tensor([[0.0, 1.0, 2.5, 7.0, 1e4], [3.0, -0.5, 64.0, 100.25, 5.0]])  # MS-PoE's turns: any real
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    cos, sin = rotary_cos_sin(positions, inv_freq, dtype)  # (b, seq, rotary_dim)
    angles = positions[..., None] * inv_freq  # (b, seq, rotary_dim / 2): each rotated pair's angle
    their_cos, their_sin = (torch.cat((t, t), -1).to(dtype)[:, None] for t in (angles.cos(), angles.sin()))
    turned = x[..., :rotary_dim]
    expected = torch.cat((turned * their_cos + rotate_half(turned) * their_sin, x[..., rotary_dim:]), -1)
    assert torch.equal(rotate_partial(x, cos[:, None], sin[:, None]), expected)


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
    with pytest.raises(ValueError, match=r"position 64 is past the learned positional table of 64 rows"):
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
