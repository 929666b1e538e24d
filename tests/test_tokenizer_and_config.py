"""The byte-level tokenizer and every config validation error."""

import random

import pytest

from sepformer import SepFormerConfig, SepFormerTokenizer


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


def test_invalid_utf8_from_a_model_decodes_to_replacement_characters():
    assert SepFormerTokenizer().decode([0xFF, 104, 0xC3]) == "\ufffdh\ufffd"


def test_padding_sides():
    right = SepFormerTokenizer()(["ab", "abcd"], padding=True).input_ids
    left = SepFormerTokenizer(padding_side="left")(["ab", "abcd"], padding=True).input_ids
    assert right[0] == [97, 98, 256, 256] and left[0] == [256, 256, 97, 98]


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
        ({"attention_dropout": 1.0}, r"attention_dropout=1.0 must be in \[0, 1\)"),
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
