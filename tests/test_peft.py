"""PEFT / LoRA on SepFormer: the default targets, Trainer, saving and loading an adapter (also on the Hub custom-code
folder, in a process that cannot import sepformer), merging, tied embeddings, and the fused decoding projections."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from ddp_train_script import build_dataset, training_arguments
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Trainer, default_data_collator

from sepformer import LORA_TARGET_MODULES, SepFormerCache, SepFormerTokenizer, prepare_for_hub
from sepformer.decoding import FusedLayer

IDS = torch.tensor([[257, 116, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]])  # "<s>the cat sat"
LAYER_TARGETS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj.position",
    "self_attn.v_proj.semantic",
    "self_attn.o_proj.position",
    "self_attn.o_proj.semantic",
    "mlp.position.up_proj",
    "mlp.position.down_proj",
    "mlp.semantic.up_proj",
    "mlp.semantic.down_proj",
]


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora(model, **overrides):
    """LoRA on the default targets; `init_lora_weights=False` gives a non-zero adapter (B = 0 is an identity)."""
    values = dict(r=4, lora_alpha=8, target_modules=list(LORA_TARGET_MODULES), init_lora_weights=False)
    values.update(overrides)
    return get_peft_model(model, LoraConfig(**values))


def adapted_modules(peft_model) -> list[str]:
    prefix = "base_model.model.model.layers."
    return sorted(name[len(prefix) :] for name, module in peft_model.named_modules() if hasattr(module, "lora_A"))


@pytest.mark.parametrize("overrides", [{}, {"position_size": 0}], ids=["blocks", "nope"])
def test_default_targets_are_every_projection_of_every_layer(overrides):
    model = tiny_model(**overrides)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(LORA_TARGET_MODULES)))
    expected = [
        f"{layer}.{name}"
        for layer in range(model.config.num_hidden_layers)
        for name in LAYER_TARGETS
        if overrides.get("position_size") != 0 or ".position" not in name
    ]
    assert adapted_modules(peft_model) == sorted(expected)
    # B = 0 at initialisation: the adapted model is the base model, bit for bit.
    assert torch.equal(logits(peft_model), logits(tiny_model(**overrides)))


def test_default_targets_are_needed():
    # PEFT has no default target_modules for a model type it does not ship.
    with pytest.raises(ValueError, match="target_modules"):
        get_peft_model(tiny_model(), LoraConfig(r=4))


@pytest.mark.parametrize(
    ("target", "blocks"), [("v_proj", "`<name>.position` and `<name>.semantic`"), ("mlp", "`<name>.position` and")]
)
def test_targeting_a_block_diagonal_module_says_to_target_its_blocks(target, blocks):
    """PEFT adapts linear layers; SepFormer's `v_proj`, `o_proj` and MLPs hold one per block."""
    message = (
        r"Target module BlockDiagonal\(.*\) \[a SepFormer block-diagonal module: adapters target its blocks, "
        rf"{blocks}.*"
        r"\(e.g. `v_proj.position` and `v_proj.semantic`; in an MLP its `up_proj` and `down_proj`\); "
        r"sepformer.LORA_TARGET_MODULES lists every projection\] is not supported"
    )
    with pytest.raises(ValueError, match=re.compile(message, re.DOTALL)):
        get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=[target]))


def train_adapter(output_dir: str, base):
    """Trainer on the LoRA parameters only (AdamW, 12 steps): the trained PeftModel and its eval losses before/after."""
    peft_model = lora(base, init_lora_weights=True, task_type="CAUSAL_LM")
    dataset = build_dataset()
    args = training_arguments(output_dir, optim="adamw_torch", learning_rate=5e-2, max_steps=12,
                              per_device_train_batch_size=4, per_device_eval_batch_size=4)  # fmt: skip
    trainer = Trainer(model=peft_model, args=args, train_dataset=dataset, eval_dataset=dataset,
                      data_collator=default_data_collator)  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return peft_model.eval(), before, trainer.evaluate()["eval_loss"]


def test_trainer_trains_adapter_only_and_adapter_reloads_on_fresh_base(tmp_path):
    base_state = {key: value.clone() for key, value in tiny_model(seed=0).state_dict().items()}
    peft_model, before, after = train_adapter(str(tmp_path / "run"), tiny_model(seed=0))
    assert after < before - 0.2, (before, after)
    trainable = [name for name, parameter in peft_model.named_parameters() if parameter.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    base_after = peft_model.get_base_model().state_dict()
    for key, value in base_state.items():  # the base weights did not move
        assert torch.equal(base_after[key.replace(".weight", ".base_layer.weight")] if key not in base_after
                           else base_after[key], value), key  # fmt: skip

    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(tiny_model(seed=0), tmp_path / "adapter").eval()
    assert torch.equal(logits(reloaded), logits(peft_model))
    assert not torch.allclose(logits(reloaded), logits(tiny_model(seed=0)))  # the adapter changes the model


def test_adapter_on_custom_code_folder_without_sepformer(tmp_path):
    """The base shared as Hub custom code, the adapter loaded on it where `import sepformer` fails; also a fresh
    adapter with task_type="CAUSAL_LM" generates (peft#2769: remote code without `prepare_inputs_for_generation`)."""
    base = tiny_model(seed=0)
    prepare_for_hub(base, SepFormerTokenizer()).save_pretrained(tmp_path / "base")
    peft_model = lora(tiny_model(seed=0), task_type="CAUSAL_LM").eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    torch.save(logits(peft_model), tmp_path / "expected.pt")
    expected_tokens = peft_model.generate(input_ids=IDS, max_new_tokens=6, do_sample=False)
    torch.save(expected_tokens, tmp_path / "expected_tokens.pt")

    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["sepformer"] = None  # any import of the package now fails
        import torch
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM
        folder = {str(tmp_path)!r}
        ids = torch.tensor({IDS.tolist()!r})
        base = AutoModelForCausalLM.from_pretrained(folder + "/base", trust_remote_code=True)
        assert type(base).__module__.startswith("transformers_modules"), type(base).__module__
        model = PeftModel.from_pretrained(base, folder + "/adapter").eval()
        assert type(model).__name__ == "PeftModelForCausalLM", type(model)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, torch.load(folder + "/expected.pt"))
        tokens = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, torch.load(folder + "/expected_tokens.pt")), tokens
        fresh = AutoModelForCausalLM.from_pretrained(folder + "/base", trust_remote_code=True)
        fresh = get_peft_model(fresh, LoraConfig(r=4, target_modules={list(LORA_TARGET_MODULES)!r},
                                                 task_type="CAUSAL_LM"))
        assert fresh.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
        print("REMOTE-PEFT-OK")
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-PEFT-OK" in result.stdout


def fused_layers_of_generation(model) -> dict:
    """Greedy `generate` with a cache of our own: which layers decoded with a `FusedLayer`."""
    cache = SepFormerCache(config=model.config)
    tokens = model.generate(input_ids=IDS, max_new_tokens=5, do_sample=False, past_key_values=cache)
    return tokens, {key[1]: value for key, value in cache.derived.items() if key[0] == "fused layer"}


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}], ids=["untied", "tied"])
def test_merge_and_unload_equals_adapter_and_fuses_again(tmp_path, overrides):
    peft_model = lora(tiny_model(seed=0, **overrides)).eval()
    adapted = logits(peft_model)
    assert not torch.allclose(adapted, logits(tiny_model(seed=0, **overrides)))
    tokens, fused = fused_layers_of_generation(peft_model)
    # Adapters active: the LoRA layers are not plain nn.Linear, so every layer keeps its per-block modules.
    assert set(fused) == {0, 1} and all(value is None for value in fused.values())

    merged = peft_model.merge_and_unload().eval()
    assert adapted_modules(merged) == []
    torch.testing.assert_close(logits(merged), adapted, atol=1e-5, rtol=1e-5)
    merged_tokens, fused = fused_layers_of_generation(merged)
    assert set(fused) == {0, 1} and all(isinstance(value, FusedLayer) for value in fused.values())
    assert torch.equal(merged_tokens, tokens)

    if overrides.get("tie_word_embeddings"):  # peft#2777: the default targets leave the tied weight alone
        assert merged.lm_head.weight is merged.model.embed_tokens.weight
        torch.testing.assert_close(merged.lm_head.weight, tiny_model(seed=0).model.embed_tokens.weight)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = type(merged).from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(logits(reloaded), logits(merged))


def test_lm_head_adapter_merges_on_untied_model():
    # What the README advises for an adapter on the head: an untied model (on a tied one PEFT merges into the shared
    # weight, peft#2777).
    peft_model = lora(tiny_model(seed=0), target_modules=[*LORA_TARGET_MODULES, "lm_head"]).eval()
    assert hasattr(peft_model.get_base_model().lm_head, "lora_A")
    adapted = logits(peft_model)
    torch.testing.assert_close(logits(peft_model.merge_and_unload()), adapted, atol=1e-5, rtol=1e-5)


def test_ms_poe_refuses_adapted_projections_and_runs_after_merging():
    # MS-PoE multiplies by q_proj.weight and k_proj.weight, which on a LoRA layer are the base weights only.
    peft_model = lora(tiny_model(seed=0)).eval()
    message = r"ms_poe .*layers\.1\.self_attn\.q_proj.: .peft\.tuners\.lora.*merge_and_unload"
    with pytest.raises(ValueError, match=message):
        peft_model(input_ids=IDS, ms_poe={"r_min": 1.2, "r_max": 1.8})
    merged = peft_model.merge_and_unload().eval()
    with torch.no_grad():
        merged(input_ids=IDS, ms_poe={"r_min": 1.2, "r_max": 1.8})
    peft_model = lora(tiny_model(seed=0), target_modules=["v_proj.semantic", "up_proj"]).eval()
    with torch.no_grad():  # adapters elsewhere do not concern it
        peft_model(input_ids=IDS, ms_poe={"r_min": 1.2, "r_max": 1.8})


def test_readme_lora_example_runs(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = next(block for block in blocks if "get_peft_model" in block)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(example, "README.md LoRA", "exec"), namespace)
    assert type(namespace["merged"]).__name__ == "SepFormerForCausalLM"
    assert (tmp_path / "outputs/lora/adapter/adapter_model.safetensors").exists()
