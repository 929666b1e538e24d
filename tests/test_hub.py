"""Saving, loading, the Auto classes and Hub custom code."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_gpt2, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

from sepformer import SepFormerConfig, SepFormerForCausalLM, SepFormerModel, SepFormerTokenizer, prepare_for_hub

IDS = torch.tensor([[5, 17, 200, 3, 99, 41, 7, 250]])


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_auto_classes_know_sepformer():
    config = AutoConfig.for_model("sepformer", hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    assert isinstance(config, SepFormerConfig)
    assert isinstance(AutoModel.from_config(config), SepFormerModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), SepFormerForCausalLM)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"positional_map": "sinusoidal"}, {"position_size": 0}, {"rotary_dim": 4}, {"tie_word_embeddings": True}],
    ids=["learned", "sinusoidal", "nope", "rotary", "tied"],
)
def test_save_and_reload_gives_identical_logits(tmp_folder, overrides):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_folder)
    assert os.path.exists(os.path.join(tmp_folder, "model.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_folder).eval()
    assert type(reloaded) is SepFormerForCausalLM
    assert torch.equal(logits(reloaded), logits(model))
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_tokenizer_saves_and_loads_through_auto_tokenizer(tmp_folder):
    SepFormerTokenizer().save_pretrained(tmp_folder)
    tokenizer = AutoTokenizer.from_pretrained(tmp_folder)
    assert isinstance(tokenizer, SepFormerTokenizer)
    assert tokenizer("héllo").input_ids == list("héllo".encode())


def test_custom_code_folder_loads_where_sepformer_cannot_be_imported(tmp_folder):
    model = tiny_model(rotary_dim=4)
    tokenizer = SepFormerTokenizer()
    prepare_for_hub(model, tokenizer).save_pretrained(tmp_folder)
    tokenizer.save_pretrained(tmp_folder)
    config = json.load(open(os.path.join(tmp_folder, "config.json")))
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    code_files = ["configuration_sepformer.py", "modeling_sepformer.py", "tokenization_sepformer.py"]
    for name in [*code_files, "positional_maps.py"]:
        assert os.path.exists(os.path.join(tmp_folder, name)), name
    torch.save(logits(model), os.path.join(tmp_folder, "expected.pt"))

    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["sepformer"] = None  # any import of the package now fails
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = {tmp_folder!r}
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        assert "sepformer" not in type(model).__module__.split(".")[0], type(model).__module__
        assert tokenizer.decode(tokenizer("ünïcode").input_ids) == "ünïcode"
        with torch.no_grad():
            got = model(torch.tensor({IDS.tolist()!r})).logits
        assert torch.equal(got, torch.load(folder + "/expected.pt"))
        print("REMOTE-OK", type(model).__module__)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-OK transformers_modules" in result.stdout


def test_prepare_for_hub_marks_only_the_model_and_tokenizer_it_is_given(tmp_path):
    tokenizer = SepFormerTokenizer()
    prepare_for_hub(tiny_model(), tokenizer).save_pretrained(tmp_path / "hub")
    tokenizer.save_pretrained(tmp_path / "hub")
    assert {"configuration_sepformer.py", "modeling_sepformer.py", "tokenization_sepformer.py"} <= {
        path.name for path in (tmp_path / "hub").glob("*.py")
    }
    # saved later in the same process: plain checkpoints, no code files and no auto_map
    tiny_model().save_pretrained(tmp_path / "model")
    SepFormerTokenizer().save_pretrained(tmp_path / "model")
    SepFormerConfig().save_pretrained(tmp_path / "config")
    for folder in ("model", "config"):
        assert not list((tmp_path / folder).glob("*.py")), folder
        assert "auto_map" not in json.loads((tmp_path / folder / "config.json").read_text()), folder
    assert "auto_map" not in json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_attention_heads", 3, "hidden_size=32 is not divisible by num_attention_heads=3"),
        ("position_size", 4, "model.config no longer describes the model's weights"),
    ],
)
def test_a_refused_hub_save_writes_nothing(tmp_path, field, value, message):
    model = prepare_for_hub(tiny_model())
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def folder_bytes(folder) -> dict:
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize("earlier", ["absent", "a plain save", "a sharded Hub save"])
def test_a_save_whose_weights_cannot_be_written_leaves_the_folder_as_it_was(tmp_path, monkeypatch, earlier):
    """transformers writes the Hub code files and the config before the weights: each is written in a staging folder,
    moved in once all are written."""
    import transformers.modeling_utils

    folder = tmp_path / "out"
    if earlier == "a plain save":
        tiny_model(seed=1).save_pretrained(folder)
    elif earlier == "a sharded Hub save":
        prepare_for_hub(tiny_model(seed=1)).save_pretrained(folder, max_shard_size="40KB")
    before = folder_bytes(folder)

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", no_room)
    with pytest.raises(OSError, match="No space left on device"):
        prepare_for_hub(tiny_model(rotary_dim=4)).save_pretrained(folder)
    assert folder_bytes(folder) == before
    assert folder.exists() == (earlier != "absent")
    assert os.listdir(tmp_path) == (["out"] if folder.exists() else [])  # no staging folder left


def test_a_save_over_a_sharded_one_leaves_what_transformers_leaves(tmp_path):
    """Saving into a folder drops the shards of an earlier save that it does not rewrite (as transformers does, which
    keeps the earlier index), and keeps every other file."""
    expected, folder = tmp_path / "in place", tmp_path / "staged"
    for target in (expected, folder):
        tiny_model(seed=1).save_pretrained(target, max_shard_size="40KB")
        assert len(list(target.glob("model-0000?-of-0000?.safetensors"))) > 1
        (target / "notes.txt").write_text("kept")
    super(SepFormerForCausalLM, tiny_model()).save_pretrained(expected)  # transformers' own save, in place
    model = tiny_model()
    model.save_pretrained(folder)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(expected))
    assert (folder / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()
    assert torch.equal(logits(SepFormerForCausalLM.from_pretrained(folder)), logits(model))
    assert sorted(os.listdir(tmp_path)) == ["in place", "staged"]


def test_a_save_to_a_file_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match=r"save_pretrained: '.*model.bin' is a file; give a folder \(made if absent\)"):
        tiny_model().save_pretrained(path)
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("load", [SepFormerForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained])
def test_a_weights_file_cut_short_is_named(tmp_path, load):
    tiny_model().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = rf"from_pretrained: {re.escape(str(weights))} is not a whole safetensors file \(.*\): it was probably "
    with pytest.raises(OSError, match=message + r"cut short by an interrupted save or download; save or download it"):
        load(tmp_path)


def test_a_folder_that_is_missing_or_holds_no_config_is_named(tmp_path):
    missing = tmp_path / "missing"
    for path in (missing, str(missing), "./no/such/folder"):
        with pytest.raises(OSError, match=r"from_pretrained: '.*' does not exist; give the folder save_pretrained"):
            SepFormerForCausalLM.from_pretrained(path)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(OSError, match=r"'.*' is a file; give the folder save_pretrained wrote"):
        SepFormerForCausalLM.from_pretrained(tmp_path / "notes.txt")
    with pytest.raises(
        OSError,
        match=r"the folder '.*' has no config.json, so it is not a saved model "
        r"\(save_pretrained writes config.json beside the weights\); it holds \['notes.txt'\]",
    ):
        SepFormerForCausalLM.from_pretrained(tmp_path)
    model = tiny_model()
    model.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").unlink()  # a config given to the call stands in for the file
    reloaded = SepFormerForCausalLM.from_pretrained(tmp_path / "saved", config=model.config)
    assert torch.equal(logits(reloaded), logits(model))


@pytest.mark.parametrize(
    ("model", "tokenizer", "kind"),
    [(None, None, "NoneType"), ("model", "tokenizer", "str"), (tiny_gpt2, None, "GPT2LMHeadModel")],
)
def test_prepare_for_hub_refuses_what_is_no_sepformer_model(model, tokenizer, kind):
    model = model() if callable(model) else model  # another Transformers model: its config is no SepFormerConfig
    with pytest.raises(
        TypeError,
        match=rf"prepare_for_hub takes a SepFormer model \(SepFormerForCausalLM or "
        rf"SepFormerModel\); got {kind}",
    ):
        prepare_for_hub(model, tokenizer)
    with pytest.raises(TypeError, match=r"prepare_for_hub: tokenizer must be a transformers tokenizer; got dict"):
        prepare_for_hub(tiny_model(), {})


def test_text_generation_pipeline():
    model = tiny_model()
    generator = pipeline("text-generation", model=model, tokenizer=SepFormerTokenizer(), device="cpu")
    out = generator("def main():", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("def main():")
