"""The byte-level tokenizer, every config validation error, and the config's derived sizes. (Bad inputs added
since: `test_bad_inputs.py`.)"""

import json
import random
import warnings

import pytest
import torch
from transformers import AddedToken, AutoConfig, AutoModelForCausalLM, AutoTokenizer

from sepformer import (
    PositionExtrapolation,
    SepFormerConfig,
    SepFormerForCausalLM,
    SepFormerTokenizer,
    StableMask,
    prepare_for_hub,
)
from sepformer.configuration_sepformer import LEGACY_FIELDS
from sepformer.positional_options import BSplineMap, SinusoidalMap

SMALL = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)


def random_strings(count=300, seed=0):
    rng = random.Random(seed)
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF), (0xD800, 0xDFFF)]
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(0, 40)):
            low, high = rng.choice(ranges)
            pieces.append(chr(rng.randint(low, high)))
        yield "".join(pieces)


def test_decode_encode_round_trips_any_string():
    tokenizer = SepFormerTokenizer()
    specials = ["<pad>", "<s>", "</s>", "  <s> </s>\n\t ", "\x00\r\n", "😀 ", " leading and trailing  "]
    for text in [*specials, *random_strings()]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < 256 for i in ids), text  # user text never becomes a special token
        assert tokenizer.decode(ids) == text, repr(text)


def test_ids_are_utf8_bytes_and_specials_follow():
    tokenizer = SepFormerTokenizer()
    assert tokenizer("é€").input_ids == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)
    assert len(tokenizer) == SepFormerConfig().vocab_size == 259
    assert tokenizer.decode([104, 105, 258], skip_special_tokens=True) == "hi"
    assert tokenizer.decode([104, 105, 258]) == "hi</s>"


def test_the_special_tokens_may_be_renamed_not_removed():
    renamed = SepFormerTokenizer(bos_token="<bos>")
    assert renamed.bos_token_id == 257 and renamed.decode([257]) == "<bos>"
    for name in ("pad_token", "bos_token", "eos_token"):
        with pytest.raises(ValueError, match=f"SepFormerTokenizer {name}=None: ids 256 \\(pad\\), 257 \\(bos\\)"):
            SepFormerTokenizer(**{name: None})


def test_invalid_utf8_from_a_model_decodes_to_replacement_characters():
    assert SepFormerTokenizer().decode([0xFF, 104, 0xC3]) == "\ufffdh\ufffd"


def test_padding_sides():
    right = SepFormerTokenizer()(["ab", "abcd"], padding=True).input_ids
    left = SepFormerTokenizer(padding_side="left")(["ab", "abcd"], padding=True).input_ids
    assert right[0] == [97, 98, 256, 256] and left[0] == [256, 256, 97, 98]


def test_added_tokens_encode_and_decode_as_their_ids(tmp_path):
    tokenizer = SepFormerTokenizer()
    assert tokenizer.add_tokens(["<new>", "€"]) == 2
    assert len(tokenizer) == 261
    text = "a<new>b€<s>"
    ids = tokenizer.encode(text)
    assert ids == [97, 259, 98, 260, *b"<s>"]  # a special token's string is still its bytes
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("<new><new>")) == "<new><new>"
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(reloaded) == 261 and reloaded.encode(text) == ids and reloaded.decode(ids) == text


@pytest.mark.parametrize(
    "token, message",
    [
        ("é", r"cannot add the token 'é': it is byte 233's token already"),
        (AddedToken("<x>", lstrip=True), r"cannot add the token '<x>' with lstrip=True: SepFormerTokenizer splits"),
    ],
)
def test_added_tokens_the_byte_vocabulary_cannot_hold_are_refused(token, message):
    tokenizer = SepFormerTokenizer()
    with pytest.raises(ValueError, match=message):
        tokenizer.add_tokens([token])
    assert len(tokenizer) == 259 and tokenizer.decode([233]) == "\ufffd"  # nothing was added


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"hidden_size": -8}, "hidden_size=-8"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size=30 is not divisible by num_attention_heads=4"),
        ({"position_size": 32}, r"position_size=32 .*0 <= position_size < hidden_size=32"),
        ({"position_size": 40}, r"position_size=40"),
        ({"position_size": -1}, r"position_size=-1"),
        ({"position_size": 7, "positional_map": "sinusoidal"}, "position_size=7 is odd"),
        ({"positional_map": "rope"}, "positional_map='rope' is not allowed: choose one of 'learned', 'sinusoidal'"),
        ({"norm_type": "batchnorm"}, "norm_type='batchnorm'"),
        ({"lm_head_input": "position"}, "lm_head_input='position'"),
        ({"hidden_act": "swish2"}, "hidden_act='swish2'"),
        ({"rotary_dim": 3}, "rotary_dim=3"),
        ({"rotary_dim": 10}, r"rotary_dim=10 .*head_dim=8"),
        ({"rope_theta": 0.0}, "rope_theta=0.0"),
        ({"norm_eps": 0.0}, "norm_eps=0.0"),
        ({"attention_dropout": 1.0}, r"attention_dropout=1.0 is not allowed: .*or equal to 0 and smaller than 1"),
        ({"hidden_dropout": -0.1}, "hidden_dropout=-0.1"),
        ({"initializer_range": -1.0}, "initializer_range=-1.0"),
        ({"position_intermediate_size": 0}, "position_intermediate_size=0"),
        ({"semantic_intermediate_size": -2}, "semantic_intermediate_size=-2"),
        ({"tie_word_embeddings": True, "lm_head_input": "all"}, "tie_word_embeddings=True needs lm_head_input='sem"),
    ],
)
def test_invalid_config_is_a_value_error_naming_field_value_and_what_is_allowed(overrides, message):
    values = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    values.update(overrides)
    with pytest.raises(ValueError, match=message):
        SepFormerConfig(**values)


def test_a_model_without_positions_ties_its_head_whatever_block_it_reads():
    # position_size=0: the whole vector is the semantic block (transformers' test_tied_weights_keys ties such a model)
    config = SepFormerConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        position_size=0,
        lm_head_input="all",
        tie_word_embeddings=True,
    )
    model = SepFormerForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_derived_sizes():
    config = SepFormerConfig(hidden_size=64, num_attention_heads=4)
    assert (config.head_dim, config.position_size, config.semantic_size) == (16, 16, 48)
    assert (config.position_intermediate_size, config.semantic_intermediate_size) == (64, 192)
    nope = SepFormerConfig(hidden_size=64, num_attention_heads=4, position_size=0)
    assert nope.semantic_size == 64


def test_config_round_trips_through_json(tmp_path):
    config = SepFormerConfig(hidden_size=64, num_attention_heads=4, position_size=10, rotary_dim=6)
    config.save_pretrained(tmp_path)
    loaded = SepFormerConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()


def test_the_option_dataclasses_are_taken_by_the_fields_that_hold_them_and_kept_with_every_parameter(tmp_path):
    """A dataclass sets every parameter it reads, at their defaults too, as the dict of all of them does."""
    given = dict(position_extrapolation=PositionExtrapolation("fourier"), stable_mask=StableMask(0.1))
    kept = dict(
        position_extrapolation={"method": "fourier", "components": 16}, stable_mask={"gamma": 0.1, "columns": None}
    )
    config = SepFormerConfig(**given)
    assert {name: getattr(config, name) for name in kept} == kept
    config.save_pretrained(tmp_path)
    assert {name: getattr(SepFormerConfig.from_pretrained(tmp_path), name) for name in kept} == kept
    spline = SepFormerConfig(positional_map=BSplineMap(control_points=8))
    assert spline.positional_map == {"map": "bspline", "control_points": 8, "degree": 3, "extension": "clamp"}
    spline.positional_map = BSplineMap()  # not "the same map again", which would keep 8 control points
    assert spline.map_options() == BSplineMap()
    learned = SepFormerConfig()
    learned.position_extrapolation = PositionExtrapolation("clamp")
    assert learned.position_extrapolation == {"method": "clamp"}
    with pytest.raises(ValueError, match="position_extrapolation='clamp' needs a learned positional table"):
        SepFormerConfig(positional_map=SinusoidalMap(), position_extrapolation="clamp")
    with pytest.raises(TypeError, match="position_extrapolation=SinusoidalMap.. is not allowed"):
        SepFormerConfig(position_extrapolation=SinusoidalMap())  # a map's, though 'sinusoidal' is also a method


def test_an_older_field_and_an_option_dataclass_that_both_set_a_parameter_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fourier_components=8 and position_extrapolation=.* both set components"):
        SepFormerConfig(position_extrapolation=PositionExtrapolation("fourier"), fourier_components=8)
    SepFormerConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="interpolation_length=2000 and position_extrapolation=.* both set length"):
        SepFormerConfig.from_pretrained(
            tmp_path,
            position_extrapolation=PositionExtrapolation("interpolate", length=1000),
            interpolation_length=2000,
        )


DERIVED = ("position_size", "position_table_size", "position_intermediate_size", "semantic_intermediate_size")


def test_assigning_max_position_embeddings_resizes_the_table_it_derives():
    # transformers' own generation tests do this: the table must follow, and the config stay valid
    config = SepFormerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=16)
    config.max_position_embeddings = 40
    assert config.position_table_size == 40
    config.check_combinations()
    model = SepFormerForCausalLM(config)
    assert model.model.embed_positions.weight.shape == (40, 8)
    with torch.no_grad():
        assert model(torch.zeros(1, 40, dtype=torch.long)).logits.shape == (1, 40, 259)


def test_assigning_the_widths_resizes_the_blocks_derived_from_them():
    config = SepFormerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    config.hidden_size, config.num_attention_heads = 64, 2
    assert [getattr(config, name) for name in DERIVED] == [32, 512, 128, 128]
    mlp = SepFormerForCausalLM(config).model.layers[0].mlp
    assert mlp.position.up_proj.weight.shape == (128, 32) and mlp.semantic.up_proj.weight.shape == (128, 32)


def test_explicit_sizes_are_kept_and_none_follows_again():
    config = SepFormerConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        position_size=10,
        max_position_embeddings=16,
        position_table_size=64,
        random_position_offsets=True,
    )
    config.hidden_size, config.max_position_embeddings = 64, 32
    assert (config.position_size, config.position_table_size) == (10, 64)  # what the user set
    assert (config.position_intermediate_size, config.semantic_intermediate_size) == (40, 4 * 54)  # derived
    config.position_size = None
    assert config.position_size == 16


def test_derived_sizes_save_as_null_and_reload_identically(tmp_path):
    config = SepFormerConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        position_table_size=None,
        semantic_intermediate_size=100,
    )
    stored = config.to_dict()
    assert [stored[name] for name in DERIVED] == [None, None, None, 100]  # what was given, not the resolved sizes
    assert [getattr(config, name) for name in DERIVED] == [8, 512, 32, 100]
    config.save_pretrained(tmp_path)
    assert [json.loads((tmp_path / "config.json").read_text())[name] for name in DERIVED] == [None, None, None, 100]
    loaded = SepFormerConfig.from_pretrained(tmp_path)
    loaded_dict = loaded.to_dict()  # (+ auto_map, where a test before registered the class for the Hub)
    assert {key: loaded_dict[key] for key in stored} == stored
    loaded.max_position_embeddings = 64  # still derived after the round trip
    assert loaded.position_table_size == 64


# `save_pretrained` of the configuration before the derived sizes were kept as given: every size resolved
OLD_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "fourier_components": 16,
    "fuse_decoding_projections": True,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_dropout": 0.0,
    "hidden_size": 32,
    "initializer_range": 0.02,
    "interpolation_length": None,
    "lm_head_input": "semantic",
    "max_position_embeddings": 16,
    "mlp_bias": False,
    "model_type": "sepformer",
    "norm_eps": 1e-06,
    "norm_type": "rmsnorm",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "pad_token_id": 256,
    "position_extrapolation": "none",
    "position_intermediate_size": 32,
    "position_size": 8,
    "position_table_size": 16,
    "positional_map": "learned",
    "random_position_offsets": False,
    "rope_theta": 10000.0,
    "rotary_dim": 0,
    "semantic_intermediate_size": 96,
    "stable_mask": None,
    "tie_word_embeddings": False,
    "transformers_version": "5.23.0",
    "use_cache": True,
    "vocab_size": 259,
}


@pytest.mark.parametrize("nope", [False, True], ids=["learned", "nope"])
def test_configs_saved_with_resolved_sizes_still_load(tmp_path, nope):
    saved = dict(OLD_CONFIG)
    if nope:  # as saved then: position_size=0 with a positional MLP width of 0
        saved.update(position_size=0, position_intermediate_size=0, semantic_intermediate_size=128, lm_head_input="all")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    config = AutoConfig.from_pretrained(tmp_path)
    assert [getattr(config, name) for name in DERIVED] == [saved[name] for name in DERIVED]
    assert isinstance(AutoModelForCausalLM.from_config(config), SepFormerForCausalLM)


# --------------------------------------------------------------------------------------- special token ids

OUTSIDE_THE_VOCABULARY = [
    ({"vocab_size": 99, "pad_token_id": 256}, r"pad_token_id=256 is outside the vocabulary: token ids are 0..98 \("),
    ({"pad_token_id": 259}, r"pad_token_id=259 is outside the vocabulary: token ids are 0..258 \(vocab_size=259\);"),
    ({"pad_token_id": -1}, r"pad_token_id=-1 is outside the vocabulary: token ids are 0..258 .*use None for no such"),
    ({"bos_token_id": 1000}, r"bos_token_id=1000 is outside the vocabulary: token ids are 0..258"),
    ({"eos_token_id": [258, 300]}, r"eos_token_id=\[258, 300\] is outside .* 0..258 \(vocab_size=259\), or -1 for"),
    ({"eos_token_id": -2}, r"eos_token_id=-2 is outside the vocabulary: .*, or -1 for never stopping"),
]


@pytest.mark.parametrize("overrides, message", OUTSIDE_THE_VOCABULARY, ids=[str(o) for o, _ in OUTSIDE_THE_VOCABULARY])
def test_a_token_id_outside_the_vocabulary_is_refused_when_saving_not_by_the_config(tmp_path, overrides, message):
    config = SepFormerConfig(**SMALL, **overrides)  # transformers' workflows set the ids after the vocabulary
    model = SepFormerForCausalLM(config)  # as transformers' test_resize_tokens_embeddings builds one
    for save, folder in ((config.save_pretrained, "config"), (prepare_for_hub(model).save_pretrained, "model")):
        with pytest.raises(ValueError, match=message):
            save(tmp_path / folder)
        assert not (tmp_path / folder).exists()  # nothing written, Hub code files included


def test_token_ids_set_after_the_vocabulary_save(tmp_path):
    config = SepFormerConfig(**SMALL, vocab_size=99)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, [2, 3]
    SepFormerForCausalLM(config).save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.shape[0] == 99 and reloaded.generation_config.eos_token_id == [2, 3]


@pytest.mark.parametrize("never_stop", [-1, [-1, 258]])
def test_eos_token_id_minus_one_never_stops(tmp_path, never_stop):
    torch.manual_seed(0)
    prompt = torch.tensor([[104, 105]])
    first = SepFormerForCausalLM(SepFormerConfig(**SMALL)).eval().generate(prompt, max_new_tokens=1, do_sample=False)
    stop_at = first[0, -1].item()  # the first token greedy decoding gives: as eos, generation stops there
    torch.manual_seed(0)
    stops = SepFormerForCausalLM(SepFormerConfig(**SMALL, eos_token_id=stop_at)).eval()
    assert stops.generate(prompt, max_new_tokens=6, do_sample=False).shape == (1, 3)
    torch.manual_seed(0)
    model = SepFormerForCausalLM(SepFormerConfig(**SMALL, eos_token_id=never_stop)).eval()
    assert model.generation_config.eos_token_id == never_stop
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 8) and out[0, 2].item() == stop_at
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.eos_token_id == never_stop


# ----------------------------------------------------------------------------------------- ignored keywords

IGNORED_KEYWORDS = [
    ("num_heads", 8, r"num_heads=8, which SepFormer does not read \(it would be ignored\): use num_attention_heads"),
    ("d_model", 64, r"d_model=64, which SepFormer does not read .*: use hidden_size"),
    ("dropout", 0.1, r"dropout=0.1, which SepFormer does not read .*: use hidden_dropout and attention_dropout"),
    ("max_seq_len", 1024, r"max_seq_len=1024, which SepFormer does not read .*: use max_position_embeddings"),
    ("position_extrapolaton", "clamp", r"unknown keyword position_extrapolaton='clamp' .*'position_extrapolation'"),
    ("positonal_map", "sinusoidal", r"unknown keyword positonal_map='sinusoidal' .* did you mean 'positional_map'"),
    ("spline_degre", 2, r"unknown keyword spline_degre=2 .* did you mean 'spline_degree'"),  # an older field
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, r"rope_scaling=.* SepFormer does not read"),
    ("num_key_value_heads", 2, r"num_key_value_heads=2, which SepFormer does not read"),
    ("temperature", 0.7, r"temperature=0.7, a generation parameter: transformers does not keep it on the config"),
    ("my_experiment_tag", "run-7", r"unknown keyword my_experiment_tag='run-7' \(it would be ignored\)"),
]


@pytest.mark.parametrize(("key", "value", "message"), IGNORED_KEYWORDS, ids=[k for k, _, _ in IGNORED_KEYWORDS])
def test_a_keyword_the_config_would_ignore_is_a_type_error(key, value, message):
    with pytest.raises(TypeError, match=message):
        SepFormerConfig(**SMALL, **{key: value})
    with pytest.raises(TypeError, match=message):
        AutoConfig.for_model("sepformer", **SMALL, **{key: value})


def test_several_ignored_keywords_are_named_together():
    with pytest.raises(TypeError, match=r"d_model=64, .* num_heads=8, .* did you mean"):
        SepFormerConfig(d_model=64, num_heads=8, hiden_size=64)


@pytest.mark.parametrize(("key", "value", "message"), IGNORED_KEYWORDS, ids=[k for k, _, _ in IGNORED_KEYWORDS])
def test_a_saved_config_with_a_key_sepformer_ignores_loads_with_a_warning(tmp_path, key, value, message):
    # a config.json of an older version or written by a tool must still load: the key is named, not refused
    tiny = SepFormerForCausalLM(SepFormerConfig(**SMALL))
    tiny.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, key: value}))
    for load in (SepFormerConfig.from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.warns(UserWarning, match=rf"SepFormerConfig got .*{message}.* \(A saved config: it loads all"):
            load(tmp_path)
    del saved["transformers_version"]  # written by hand, not saved: refused as a keyword is
    path.write_text(json.dumps({**saved, key: value}))
    with pytest.raises(TypeError, match=message):
        AutoConfig.from_pretrained(tmp_path)


# Generation parameters given to a config: some transformers keeps on it (the model's generation_config reads them),
# others it drops. LlamaConfig says which.
GENERATION_PARAMETERS = {
    "max_new_tokens": 3,
    "min_new_tokens": 2,
    "max_time": 5.0,
    "min_p": 0.1,
    "max_length": 7,
    "num_beams": 2,
    "temperature": 0.5,
    "do_sample": True,
    "repetition_penalty": 1.3,
}


@pytest.mark.parametrize("key", list(GENERATION_PARAMETERS))
def test_a_generation_parameter_is_accepted_where_llama_keeps_it_and_refused_where_llama_drops_it(tmp_path, key):
    from transformers import LlamaConfig, LlamaForCausalLM

    value = GENERATION_PARAMETERS[key]
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            **{key: value},
        )
    )
    llama.save_pretrained(tmp_path / "llama")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    kept = getattr(llama.generation_config, key) == value
    assert getattr(reloaded.generation_config, key) == getattr(llama.generation_config, key)
    if not kept:
        with pytest.raises(TypeError, match=rf"{key}={value!r}, a generation parameter: transformers does not keep"):
            SepFormerConfig(**SMALL, **{key: value})
        return
    model = SepFormerForCausalLM(SepFormerConfig(**SMALL, **{key: value}))
    assert getattr(model.generation_config, key) == value
    model.save_pretrained(tmp_path / "sepformer")
    assert getattr(AutoModelForCausalLM.from_pretrained(tmp_path / "sepformer").generation_config, key) == value


def test_keywords_transformers_passes_are_accepted(tmp_path):
    given = dict(num_labels=3, output_attentions=True, attn_implementation="eager", torch_dtype="float32")
    given.update(name_or_path="somewhere", tokenizer_class="SepFormerTokenizer", sep_token_id=5)
    config = SepFormerConfig(**SMALL, **given, _attn_implementation="eager")
    assert (config.num_labels, config.output_attentions, config.tokenizer_class) == (3, True, "SepFormerTokenizer")
    assert SepFormerConfig(**config.to_dict()).to_dict() == config.to_dict()
    assert SepFormerConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of them is warned about
        assert SepFormerConfig.from_pretrained(tmp_path).to_diff_dict() == config.to_diff_dict()


# ------------------------------------------------------------------------------ fields the settings never read

UNREAD_FIELDS = [
    (
        {"rope_theta": 500000.0},
        r"rope_theta=500000.0 is read only with rotary_dim > 0 \(it would be ignored\); this "
        r"config has rotary_dim=0\. Set that, or leave rope_theta at its default 10000.0",
    ),
]
# the fields before `position_extrapolation` and `positional_map` held their parameters: keywords and saved configs only
LEGACY_UNREAD = [
    (
        {"interpolation_length": 2048},
        r"interpolation_length=2048 is read only with 'interpolate' .* has position_"
        r"extrapolation='none'",
    ),
    ({"position_extrapolation": "clamp", "fourier_components": 8}, r"fourier_components=8 is read only with 'fourier'"),
    (
        {"spline_extension": "linear"},
        r"spline_extension='linear' is read only with 'bspline' .* positional_map='learned'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), UNREAD_FIELDS, ids=[str(o) for o, _ in UNREAD_FIELDS])
def test_a_field_the_settings_never_read_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SepFormerConfig(**SMALL, **overrides)
    config = SepFormerConfig(**SMALL)
    for field, value in overrides.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        SepFormerForCausalLM(config)


@pytest.mark.parametrize(("overrides", "message"), LEGACY_UNREAD, ids=[str(o) for o, _ in LEGACY_UNREAD])
def test_a_legacy_field_its_choice_does_not_read_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SepFormerConfig(**SMALL, **overrides)


@pytest.mark.parametrize(("overrides", "message"), LEGACY_UNREAD, ids=[str(o) for o, _ in LEGACY_UNREAD])
def test_a_saved_config_with_a_legacy_field_its_choice_does_not_read_loads_with_a_warning(tmp_path, overrides, message):
    SepFormerForCausalLM(SepFormerConfig(**SMALL)).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, **overrides}))
    for load in (SepFormerConfig.from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.warns(UserWarning, match=rf"{message}.* \(A saved config: it loads all the same\.\)"):
            loaded = load(tmp_path)
        config = getattr(loaded, "config", loaded)
        assert config.position_extrapolation == overrides.get("position_extrapolation", "none")  # the field dropped
        assert not set(LEGACY_FIELDS) & set(config.to_dict())


def test_a_saved_config_with_a_legacy_field_at_a_refused_value_is_refused(tmp_path):
    """Not warned about and loaded with the parameter's default: that would be another model."""
    SepFormerConfig(**SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "positional_map": "bspline", "spline_degree": 0}))
    with pytest.raises(ValueError, match=r"bspline degree=0 must be a positive integer"):
        SepFormerConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("overrides", "message"), UNREAD_FIELDS, ids=[str(o) for o, _ in UNREAD_FIELDS])
def test_a_saved_config_with_a_field_the_settings_never_read_loads_with_a_warning(tmp_path, overrides, message):
    SepFormerForCausalLM(SepFormerConfig(**SMALL)).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **overrides}))
    with pytest.warns(UserWarning, match=rf"{message}.* \(A saved config: it loads all the same\.\)"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(getattr(model.config, field) == value for field, value in overrides.items())


# ------------------------------------------------------------------------- combinations set by assignment


def test_a_model_is_not_built_from_an_invalid_config_made_by_assignments(tmp_path):
    config = SepFormerConfig(**SMALL)
    config.num_attention_heads = 3  # checked alone: a positive integer
    message = r"hidden_size=32 is not divisible by num_attention_heads=3"
    with pytest.raises(ValueError, match=message):
        SepFormerForCausalLM(config)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(config)
    SepFormerForCausalLM(SepFormerConfig(**SMALL)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path, num_attention_heads=3)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("position_size", 4, r"model.embed_tokens.weight \(259, 24\) in the weights, \(259, 28\) for the config"),
        ("norm_type", "layernorm", r"model.layers.0.input_layernorm.position.bias absent in the weights, \(8,\) for"),
        ("positional_map", "sinusoidal", r"model.embed_positions.weight \(512, 8\) in the weights, absent for the c"),
    ],
)
def test_saving_refuses_a_config_changed_on_a_live_model_before_writing_anything(tmp_path, field, value, message):
    model = SepFormerForCausalLM(SepFormerConfig(**SMALL))
    setattr(model.config, field, value)  # a valid config, but not the one these weights were built for
    with pytest.raises(ValueError, match=rf"model.config no longer describes the model's weights \(.*{message}"):
        model.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_saving_given_weights_compares_those(tmp_path):
    model = SepFormerForCausalLM(SepFormerConfig(**SMALL))
    model.config.position_size = 4
    with pytest.raises(ValueError, match=r"lm_head.weight \(259, 24\) in the weights, \(259, 28\) for the config"):
        model.save_pretrained(tmp_path / "part", state_dict={"lm_head.weight": model.lm_head.weight})
    model.save_pretrained(tmp_path / "none", state_dict={})  # as DeepSpeed's Trainer does, ZeRO-3 keeping them sharded
    model.save_pretrained(tmp_path / "model", state_dict=SepFormerForCausalLM(model.config).state_dict())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").config.position_size == 4


def test_saving_a_model_whose_config_changed_without_changing_its_weights(tmp_path):
    model = SepFormerForCausalLM(SepFormerConfig(**SMALL)).eval()
    model.resize_token_embeddings(300)  # the weights and config.vocab_size change together
    model.config.hidden_dropout, model.config.position_extrapolation = 0.1, "clamp"
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (reloaded.config.vocab_size, reloaded.config.hidden_dropout) == (300, 0.1)
    ids = torch.tensor([[1, 299, 5]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_a_keyword_set_to_none_sets_nothing():
    """Tools that copy fields between configs pass `rope_scaling=None` or `max_length=None`: nothing is ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # ours; transformers itself warns that rope_scaling is deprecated
        config = SepFormerConfig(**SMALL, rope_scaling=None, max_length=None, sliding_window=None, layer_types=None)
    plain = SepFormerConfig(**SMALL).to_dict()
    assert {key: value for key, value in config.to_dict().items() if key in plain} == plain
