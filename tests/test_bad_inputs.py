"""A new user's mistake in the config, the tokenizer or the metrics is refused before any work is done, by a
ValueError or TypeError that names what was wrong, the value and what is allowed. (Bad inputs of a model call:
`test_bad_call_inputs.py`; the config's original checks: `test_tokenizer_and_config.py`.)"""

import dataclasses
import json
import math
import os
from fractions import Fraction

import evaluate
import numpy as np
import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from sepformer import SepFormerConfig, SepFormerForCausalLM, SepFormerTokenizer
from sepformer.metrics import metric_path

SMALL = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
NAN, INF = float("nan"), float("inf")

# ------------------------------------------------------------------------------------------------------ config

NON_FINITE = [
    ("norm_eps", NAN, r"norm_eps=nan is not allowed: value must be greater than 0 and smaller than inf"),
    ("norm_eps", INF, r"norm_eps=inf is not allowed: value must be greater than 0 and smaller than inf"),
    ("rope_theta", NAN, r"rope_theta=nan is not allowed: value must be greater than 0 and smaller than inf"),
    ("rope_theta", -INF, r"rope_theta=-inf is not allowed: value must be greater than 0 and smaller than inf"),
    ("initializer_range", NAN, r"initializer_range=nan is not allowed: .*greater or equal to 0 and smaller than inf"),
    ("initializer_range", INF, r"initializer_range=inf is not allowed: .*greater or equal to 0 and smaller than inf"),
    ("attention_dropout", NAN, r"attention_dropout=nan is not allowed: .*greater or equal to 0 and smaller than 1"),
    ("hidden_dropout", NAN, r"hidden_dropout=nan is not allowed: .*greater or equal to 0 and smaller than 1"),
    ("hidden_dropout", INF, r"hidden_dropout=inf is not allowed: .*greater or equal to 0 and smaller than 1"),
]


@pytest.mark.parametrize(("field", "value", "message"), NON_FINITE, ids=[f"{f}={v}" for f, v, _ in NON_FINITE])
def test_non_finite_floats_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SepFormerConfig(**SMALL, **{field: value})


@pytest.mark.parametrize(("field", "value", "message"), NON_FINITE, ids=[f"{f}={v}" for f, v, _ in NON_FINITE])
def test_non_finite_floats_are_refused_on_assignment(field, value, message):
    config = SepFormerConfig(**SMALL)
    before = getattr(config, field)
    with pytest.raises(ValueError, match=message):
        setattr(config, field, value)
    assert getattr(config, field) == before  # nothing was set


@pytest.mark.parametrize("special", [False, True], ids=["plain-json-NaN", "transformers-tagged-NaN"])
@pytest.mark.parametrize("field", ["norm_eps", "rope_theta", "initializer_range", "attention_dropout"])
def test_nan_in_a_config_json_is_refused_by_every_loader(tmp_path, field, special):
    SepFormerConfig(**SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved[field] = {"__float__": "NaN"} if special else NAN  # json.dump writes a bare NaN
    path.write_text(json.dumps(saved))
    message = rf"{field}=nan (is not allowed|must be in)"
    # a plain ValueError: the constructor checks each field as it is set, not @strict's wrapped class validators
    for load in (SepFormerConfig.from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=message):
            load(tmp_path)


def test_a_wrong_type_in_a_config_json_is_a_type_error(tmp_path):
    SepFormerConfig(**SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved["norm_eps"] = "1e-6"
    path.write_text(json.dumps(saved))
    with pytest.raises(TypeError, match=r"norm_eps='1e-6' is not allowed: .*expected float, got str"):
        SepFormerConfig.from_pretrained(tmp_path)


WRONG_TYPES = [  # @strict's messages, after the field and the value
    ("random_position_offsets", 1, r"random_position_offsets=1 is not allowed: .*expected bool, got int"),
    ("attention_bias", 0, r"attention_bias=0 is not allowed: .*expected bool, got int"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings='yes' is not allowed: .*expected bool, got str"),
    ("use_cache", 1, r"use_cache=1 is not allowed: .*expected bool, got int"),
    ("fuse_decoding_projections", None, r"fuse_decoding_projections=None .*expected bool, got NoneType"),
    ("hidden_size", 32.0, r"hidden_size=32.0 is not allowed: .*expected int, got float"),
    ("num_hidden_layers", True, r"num_hidden_layers=True is not allowed: .*expected int, got bool"),
    ("norm_eps", True, r"norm_eps=True is not allowed: .*expected float, got bool"),
    ("pad_token_id", True, r"pad_token_id=True is not allowed: .*expected int, got bool.*expected NoneType"),
    ("eos_token_id", [258, 2.0], r"eos_token_id=\[258, 2.0\] .*Invalid item at index 1"),
    ("hidden_act", None, r"hidden_act=None is not allowed: .*expected str, got NoneType"),
    ("stable_mask", 0.1, r"stable_mask=0.1 is not allowed: .*expected dict, got float"),
]


@pytest.mark.parametrize(("field", "value", "message"), WRONG_TYPES, ids=[f for f, _, _ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_a_type_error(field, value, message):
    with pytest.raises(TypeError, match=message) as error:
        SepFormerConfig(**{**SMALL, field: value})
    # also what @strict dataclasses raise, for code that catches that
    assert isinstance(error.value, StrictDataclassFieldValidationError)
    config = SepFormerConfig(**SMALL)
    with pytest.raises(TypeError, match=message):
        setattr(config, field, value)


BAD_VALUES = [
    ({"position_extrapolation": "fourier", "fourier_components": -1}, r"fourier components=-1 must be a positive int"),
    ({"position_extrapolation": {"method": "interpolate", "length": 0}}, r"interpolate length=0 must be None or a pos"),
    ({"position_table_size": 0}, r"position_table_size=0 .* a positive integer, or None for max_position_embeddings"),
    ({"rotary_dim": -2}, r"rotary_dim=-2 is not allowed: it must be 0 \(off\) or an even number"),
    ({"position_extrapolation": "Clamp"}, r"position_extrapolation method 'Clamp' is unknown: choose one of 'none'"),
    ({"eos_token_id": []}, r"eos_token_id=\[\] is not allowed: it must be None, a token id or a non-empty list"),
    ({"stable_mask": {}}, r"stable_mask=\{\} is not allowed: it must be a dict of StableMask's fields .*'gamma'"),
    ({"stable_mask": {"gamma": NAN}}, r"stable_mask gamma=nan must be a finite number"),
    ({"position_extrapolation": {"method": "fourier", "components": True}}, r"fourier components=True must be a pos"),
    ({"position_size": 0, "position_intermediate_size": 16}, r"position_intermediate_size=16 is not used: position_"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_VALUES, ids=[str(o) for o, _ in BAD_VALUES])
def test_a_wrong_value_is_a_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        SepFormerConfig(**SMALL, **overrides)


MISTAKEN_KEYWORDS = [
    ({"hiden_size": 64}, r"unknown keyword hiden_size=64 \(it would be ignored\): did you mean 'hidden_size'( or|\?)"),
    ({"num_attention_head": 8}, r"unknown keyword num_attention_head=8 .* did you mean 'num_attention_heads'"),
    ({"stable_masks": {"gamma": 1}}, r"unknown keyword stable_masks=.* did you mean 'stable_mask'\?"),
    ({"intermediate_size": 128}, r"intermediate_size=128, which SepFormer does not read .* use position_interm"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05, which SepFormer does not read .* use norm_eps"),
    ({"n_positions": 1024}, r"n_positions=1024, which SepFormer does not read .* use max_position_embeddings"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2, .* SepFormer has no grouped-query attention"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling=.* SepFormer does not read .* no scaling"),
    ({"head_dim": 16}, r"head_dim=16, which SepFormer does not read .* set hidden_size and num_attention_heads"),
    ({"max_length": 100}, r"max_length=100, a generation parameter: .* model.generation_config or .* generate\(\)"),
    ({"temperature": 0.7}, r"temperature=0.7, a generation parameter"),
]


@pytest.mark.parametrize(("kwargs", "message"), MISTAKEN_KEYWORDS, ids=[next(iter(k)) for k, _ in MISTAKEN_KEYWORDS])
def test_a_keyword_the_config_would_ignore_is_a_type_error(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SepFormerConfig(**SMALL, **kwargs)


def test_tool_attributes_still_save_and_load_with_a_warning(tmp_path):
    # transformers' tools set attributes of their own on configs (`set_config_for_less_flaky_test` sets
    # `layer_norm_eps`): a saved config carrying them loads, keeps them, and says that SepFormer does not read them.
    config = SepFormerConfig(**SMALL, sep_token_id=5)
    config.layer_norm_eps = 1.0
    config.my_experiment_tag = "run-7"
    config.save_pretrained(tmp_path)
    with pytest.warns(UserWarning) as warned:
        loaded = SepFormerConfig.from_pretrained(tmp_path)
    (message,) = (str(warning.message) for warning in warned)  # both named in one warning
    assert "layer_norm_eps=1.0, which SepFormer does not read (it would be ignored): use norm_eps." in message
    assert "an unknown keyword my_experiment_tag='run-7' (it would be ignored)" in message
    assert message.endswith("(A saved config: it loads all the same.)")
    assert (loaded.layer_norm_eps, loaded.my_experiment_tag, loaded.sep_token_id) == (1.0, "run-7", 5)


def test_an_extra_special_token_outside_the_vocabulary_is_refused_when_saving(tmp_path):
    config = SepFormerConfig(**SMALL, sep_token_id=300)
    for save in (config.save_pretrained, SepFormerForCausalLM(config).save_pretrained):
        with pytest.raises(ValueError, match=r"sep_token_id=300 is outside the vocabulary: token ids are 0..258"):
            save(tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_an_invalid_combination_made_by_assignments_is_refused_before_saving_writes_anything(tmp_path):
    config = SepFormerConfig(**SMALL)
    config.vocab_size = 200  # pad 256, bos 257, eos 258 are now outside: fine until the config is used as a whole
    folder = tmp_path / "out"
    with pytest.raises(ValueError, match=r"pad_token_id=256 is outside the vocabulary: token ids are 0..199"):
        config.save_pretrained(folder)
    assert not folder.exists()
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None
    config.save_pretrained(folder)  # valid again
    assert SepFormerConfig.from_pretrained(folder).vocab_size == 200


def test_an_explicit_table_smaller_than_an_assigned_length_is_refused_on_saving(tmp_path):
    config = SepFormerConfig(**SMALL, max_position_embeddings=16, position_table_size=16)  # explicit: kept
    config.max_position_embeddings = 32
    with pytest.raises(ValueError, match=r"position_table_size=16 must be >= max_position_embeddings=32"):
        config.check_combinations()
    with pytest.raises(ValueError, match=r"position_table_size=16 must be >= max_position_embeddings=32"):
        config.save_pretrained(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


# --------------------------------------------------------------------------------------------------- tokenizer

ALLOWED_IDS = r"token ids are integers 0..258 \(0-255 the bytes, then 256 '<pad>', 257 '<s>', 258 '</s>'\)"


@pytest.mark.parametrize("token", [259, 300, -1, 10**9])
def test_decoding_an_id_outside_the_vocabulary_is_a_value_error(token):
    tokenizer = SepFormerTokenizer()
    message = rf"token id {token} is outside the vocabulary: {ALLOWED_IDS}"
    with pytest.raises(ValueError, match=message):
        tokenizer.decode([104, token])
    with pytest.raises(ValueError, match=message):
        tokenizer.decode(torch.tensor([[104, 105], [106, token]]))  # a batch, as generate returns it
    with pytest.raises(ValueError, match=message):
        tokenizer.convert_ids_to_tokens(token)


@pytest.mark.parametrize(
    ("token", "kind"), [(3.5, "float"), (104.0, "float"), (True, "bool"), (np.float32(3), "float32"), ("h", "str")]
)
def test_decoding_an_id_that_is_no_integer_is_a_type_error(token, kind):
    # transformers would truncate 3.5 to 3 and read True as 1
    with pytest.raises(TypeError, match=rf"token id .* is a {kind}, not a token id: {ALLOWED_IDS}"):
        SepFormerTokenizer().decode([104, token])


def test_decoding_integer_arrays_and_tensors_still_works():
    tokenizer = SepFormerTokenizer()
    assert tokenizer.decode(np.array([104, 105])) == tokenizer.decode([np.int64(104), 105]) == "hi"
    assert tokenizer.decode(torch.tensor([104, 105, 258]), skip_special_tokens=True) == "hi"


def test_an_unknown_decode_keyword_is_a_type_error():
    # transformers passes unknown keywords of decode on and ignores them: a typo would change nothing silently
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['skip_special_token'\]: .* skip_special_tokens"):
        SepFormerTokenizer().decode([104, 258], skip_special_token=True)


# ----------------------------------------------------------------------------------------------------- metrics


def perplexity(config="logits"):
    return evaluate.load(metric_path("perplexity"), config)


UNIFORM = np.zeros((3, 4)).tolist()  # 3 positions over a vocabulary of 4


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            [0, -1, 2],
            r"label -1 at position 1 of example 0 is not allowed: a label is a token id 0..3 \(the logits' "
            r"vocabulary\) or ignore_index=-100",
        ),
        ([0, -5, -100], r"label -5 at position 1 of example 0 .* 0..3 .* or ignore_index=-100"),
        ([0, 1, 4], r"label 4 at position 2 of example 0 .* a token id 0..3 .* or ignore_index=-100"),
        ([7, 1, 2], r"label 7 at position 0 of example 0"),  # never scored with shift=True, still a mistake
    ],
)
def test_perplexity_refuses_a_label_outside_the_vocabulary(labels, message):
    with pytest.raises(ValueError, match=message):
        perplexity().compute(predictions=[UNIFORM], references=[labels])


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            [0, 1.2, 2],
            r"label 1.2 at position 1 of example 0 is a float: a label is an integer, a token id of the "
            r"logits' vocabulary or ignore_index",
        ),  # evaluate refuses it without saying where
        ([0, 1.0, 2], r"label 1.0 at position 1 of example 0 is a float"),  # evaluate would cast it to 1
        ([0, True, 2], r"label True at position 1 of example 0 is a bool"),
        (["0", "1", "2"], r"label '0' at position 0 of example 0 is a str"),  # evaluate would cast it to 0
        (np.array([0.0, 1.0, 2.0]), r"label 0.0 at position 0 of example 0 is a float"),
        (torch.tensor([0, 1, 2]).bool(), r"label False at position 0 of example 0 is a bool"),
        (3, r"the labels of example 0 are 3: give each example a list"),
    ],
    ids=["fraction", "integral-float", "bool", "string", "float-array", "bool-tensor", "scalar"],
)
def test_perplexity_refuses_labels_that_are_no_integers(labels, message):
    for call in (
        lambda: perplexity().compute(predictions=[UNIFORM], references=[labels]),
        lambda: perplexity().add_batch(predictions=[UNIFORM], references=[labels]),
        lambda: perplexity().add(prediction=UNIFORM, reference=labels),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def test_perplexity_refuses_logits_and_losses_that_are_no_numbers():
    with pytest.raises(ValueError, match=r"the logits of example 1 are strings: they must be numbers \(int or float\)"):
        perplexity().compute(predictions=[UNIFORM, [["1"] * 4] * 3], references=[[0, 1, 2]] * 2)
    with pytest.raises(ValueError, match=r"the logits of example 0 are bools"):
        perplexity().compute(predictions=[[[True] * 4] * 3], references=[[0, 1, 2]])
    with pytest.raises(ValueError, match=r"the losses of example 0 are strings"):
        perplexity("losses").compute(predictions=[["0.5"]])
    assert perplexity().compute(predictions=[np.zeros((3, 4), dtype=int)], references=[np.arange(3)])[
        "perplexity"
    ] == pytest.approx(4.0)  # integer logits and arrays are numbers
    # tensors are read by their dtype: bfloat16 (no NumPy dtype) is a number, a bool tensor is not
    with pytest.raises(ValueError, match=r"the logits of example 0 are bools"):
        perplexity().compute(predictions=[torch.ones(3, 4, dtype=torch.bool)], references=[[0, 1, 2]])
    with pytest.raises(ValueError, match=r"the losses of example 0 are bools"):
        perplexity("losses").compute(predictions=[np.ones(2, dtype=bool)])
    logits = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int64)]
    assert perplexity().compute(predictions=logits, references=[[0, 1, 2], [3, 0]])["perplexity"] == pytest.approx(4.0)


def test_perplexity_accepts_a_custom_ignore_index_and_refuses_the_default_then():
    metric = perplexity()
    assert metric.compute(predictions=[UNIFORM], references=[[0, -1, 2]], ignore_index=-1)["num_tokens"] == 1
    with pytest.raises(ValueError, match=r"label -100 at position 2 .* or ignore_index=-1"):
        metric.compute(predictions=[UNIFORM], references=[[0, 1, -100]], ignore_index=-1)


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [
        ([UNIFORM, UNIFORM], [[0, 1, 2]], r"perplexity got 2 predictions and 1 references: one list of labels per"),
        (
            [UNIFORM],
            [[0, 1]],
            r"logits of shape \(3, 4\) do not match 2 labels in example 0; each example needs "
            r"logits \(n, vocab\) and n labels",
        ),
        (
            [[[0.0] * 4, [0.0] * 3, [0.0] * 4]],
            [[0, 1, 2]],
            r"the logits of example 0 have rows of different widths "
            r"\[3, 4\]",
        ),
        (
            [UNIFORM, np.zeros((3, 5)).tolist()],
            [[0, 1, 2], [0, 1, 2]],
            r"the logits of example 1 have a vocabulary "
            r"of 5, those of the examples before 4",
        ),
        ([UNIFORM], None, r"perplexity needs references with the predictions: per example, the n labels"),
    ],
    ids=["examples", "positions", "ragged", "vocabularies", "no-references"],
)
def test_perplexity_refuses_mismatched_lengths_and_shapes(predictions, references, message):
    with pytest.raises(ValueError, match=message):
        perplexity().compute(predictions=predictions, references=references)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_perplexity_refuses_logits_that_make_a_nan_loss(bad):
    logits = np.zeros((3, 4))
    logits[1, 2] = bad
    with pytest.raises(ValueError, match=r"the loss of the label at position 2 of example 0 is NaN: its logits"):
        perplexity().compute(predictions=[logits.tolist()], references=[[0, 1, 2]])


def test_perplexity_refuses_inputs_with_no_scored_token():
    with pytest.raises(ValueError, match=r"no token is scored in 2 example\(s\) \(all labels ignore_index"):
        perplexity().compute(predictions=[UNIFORM, UNIFORM[:1]], references=[[-100, -100, -100], [3]])
    with pytest.raises(ValueError, match=r"no token is scored in 1 example\(s\)"):
        perplexity("losses").compute(predictions=[[]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shift": "no"}, r"perplexity shift='no' must be True \(causal LM logits\) or False"),
        ({"ignore_index": "-100"}, r"perplexity ignore_index='-100' must be an integer \(default -100\)"),
        ({"shfit": False}, r"perplexity got unknown keywords \['shfit'\]: compute takes shift, ignore_index"),
    ],
)
def test_perplexity_refuses_bad_compute_keywords(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        perplexity().compute(predictions=[UNIFORM], references=[[0, 1, 2]], **kwargs)


@pytest.mark.parametrize(
    ("losses", "message"),
    [
        (
            [[math.log(2), -0.5]],
            r"the loss -0.5 at position 1 of example 0 is not allowed: losses are negative "
            r"log-likelihoods in nats, >= 0 .* a negative one is a log-probability",
        ),
        ([[0.5], [0.5, NAN]], r"the loss nan at position 1 of example 1 is not allowed: .* >= 0"),
    ],
)
def test_perplexity_losses_refuses_negative_and_nan_losses(losses, message):
    with pytest.raises(ValueError, match=message):
        perplexity("losses").compute(predictions=losses)


def test_perplexity_losses_refuses_keywords_it_would_ignore():
    metric = perplexity("losses")
    with pytest.raises(ValueError, match=r"'losses' takes only predictions .* references would be ignored"):
        metric.compute(predictions=[[0.5]], references=[[1]])
    with pytest.raises(ValueError, match=r"'losses' takes only predictions .* references would be ignored"):
        metric.add_batch(predictions=[[0.5]], references=[[1]])
    with pytest.raises(ValueError, match=r"'losses' takes no shift=False \(it would be ignored\)"):
        metric.compute(predictions=[[0.5]], shift=False)


@pytest.fixture
def accuracy():
    return evaluate.load(metric_path("accuracy_by_position"))


@pytest.mark.parametrize(
    ("predictions", "references", "positions", "message"),
    [
        ([1, 2, 3], [1, 2], [0, 0, 0], r"got 3 predictions, 2 references, 3 positions: one of each per example"),
        ([1, 2], [1, 2], [0], r"got 2 predictions, 2 references, 1 positions: one of each per example"),
        ([], [], [], r"got no examples: predictions, references and positions are empty"),
        ([1], [1], None, r"needs predictions, references and positions; \['positions'\] missing"),
        ([1], [1], 0, r"positions=0 must be a list: one entry per example"),
    ],
    ids=["references", "positions", "empty", "missing", "scalar"],
)
def test_accuracy_by_position_refuses_mismatched_lengths(accuracy, predictions, references, positions, message):
    with pytest.raises(ValueError, match=message):
        accuracy.compute(predictions=predictions, references=references, positions=positions)


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [
        (
            [3.7],
            [3],
            r"the prediction 3.7 of example 0 is a float: an answer is a token id \(int\), a list of token "
            r"ids or a string",
        ),  # evaluate would cast it to 3, a hit
        ([None], [3], r"the prediction None of example 0 is a NoneType: an answer is a token id"),
        ([True], [1], r"the prediction True of example 0 is a bool"),
        ([[[1]]], [[[1]]], r"the prediction \[\[1\]\] of example 0 is a list: an answer is a token id \(int\), a list"),
        (
            ["3"],
            [3],
            r"the reference 3 of example 0 is a token id, but the answers before it are strings: "
            r"predictions and references are all of one kind",
        ),  # evaluate would cast 3 to "3", a hit
        (
            [3, [3]],
            [3, [3]],
            r"the prediction \[3\] of example 1 is a list of token ids, but the answers before it "
            r"are token ids",
        ),
    ],
    ids=["float", "none", "bool", "nested", "string-vs-id", "kinds-across-examples"],
)
def test_accuracy_by_position_refuses_answers_it_would_cast(accuracy, predictions, references, message):
    with pytest.raises(ValueError, match=message):
        accuracy.compute(predictions=predictions, references=references, positions=[0] * len(predictions))


def test_accuracy_by_position_refuses_a_batch_of_another_kind_than_the_first(accuracy):
    accuracy.add_batch(predictions=[1], references=[1], positions=[0])
    with pytest.raises(
        ValueError,
        match=r"the prediction 'a' of example 0 is a string, but the answers before it are "
        r"token ids",
    ):
        accuracy.add_batch(predictions=["a"], references=["a"], positions=[0])


def test_accuracy_by_position_refuses_a_fractional_position(accuracy):
    with pytest.raises(ValueError, match=r"the position 1.5 of example 0 is a float: a position is an int"):
        accuracy.compute(predictions=[1], references=[1], positions=[1.5])


def test_accuracy_by_position_refuses_unknown_compute_keywords(accuracy):
    with pytest.raises(TypeError, match=r"accuracy_by_position got unknown keywords \['normalize'\]: compute takes"):
        accuracy.compute(predictions=[1], references=[1], positions=[0], normalize=True)


def test_a_models_config_keeps_the_sizes_of_its_weights(tmp_path):
    """A config's derived sizes follow assignments until a model is built; the model's config then describes its
    weights, so a checkpoint it saves loads back."""
    config = SepFormerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=16)
    model = SepFormerForCausalLM(config)
    assert config.to_dict()["position_table_size"] is None  # the caller's config still derives
    assert model.config.to_dict()["position_table_size"] == 16
    model.config.max_position_embeddings = 32
    with pytest.raises(ValueError, match="position_table_size=16 must be >= max_position_embeddings=32"):
        model.save_pretrained(tmp_path / "model")
    config.max_position_embeddings = 32
    assert SepFormerForCausalLM(config).model.embed_positions.num_embeddings == 32


def test_an_unknown_extrapolation_method_is_refused_when_assigned():
    config = SepFormerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    with pytest.raises(ValueError, match="position_extrapolation method 'Clamp' is unknown: choose one of 'none'"):
        config.position_extrapolation = "Clamp"
    assert config.position_extrapolation == "none"  # nothing written half-way


# ------------------------------------------------------------------------------ numbers of any numeric type

# (integer kind, real kind): what NumPy, torch and the standard library hand a user
NUMERIC_KINDS = {
    "numpy scalars": (np.int64, np.float32),
    "numpy int32, float64": (np.int32, np.float64),
    "0-d tensors": (torch.tensor, torch.tensor),
    "0-d arrays": (np.array, np.array),
    "Fraction": (int, Fraction),
}


@pytest.mark.parametrize("kinds", list(NUMERIC_KINDS.values()), ids=list(NUMERIC_KINDS))
def test_config_fields_take_numbers_of_any_numeric_type_as_plain_python_numbers(tmp_path, kinds):
    integer, real = kinds
    config = SepFormerConfig(
        **SMALL,
        max_position_embeddings=integer(64),
        norm_eps=real(0.25),
        eos_token_id=[integer(258)],
        position_extrapolation={"method": "interpolate", "length": integer(128)},
        stable_mask={"gamma": real(0.5), "columns": integer(64)},
    )
    plain = SepFormerConfig(
        **SMALL,
        max_position_embeddings=64,
        norm_eps=0.25,
        eos_token_id=[258],
        position_extrapolation={"method": "interpolate", "length": 128},
        stable_mask={"gamma": 0.5, "columns": 64},
    )
    assert json.loads(config.to_json_string()) == json.loads(plain.to_json_string())  # plain numbers: JSON
    config.save_pretrained(tmp_path)
    assert SepFormerConfig.from_pretrained(tmp_path).to_dict() == plain.to_dict()


@pytest.mark.parametrize("kinds", list(NUMERIC_KINDS.values()), ids=list(NUMERIC_KINDS))
def test_options_take_numbers_of_any_numeric_type_as_plain_python_numbers(kinds):
    from sepformer import PositionExtrapolation
    from sepformer.mitigations import MITIGATIONS

    integer, real = kinds
    given = {
        PositionExtrapolation: [dict(method="fourier", components=4), dict(method="interpolate", length=64)],
        "stable_mask": [dict(gamma=0.5, columns=8)],
        "ms_poe": [dict(r_min=1.5, r_max=1.75, layers=[0], head_order=[1, 0])],
        "attention_calibration": [dict(spans=[[(0, 3)]], temperature=0.5, layers=[1], dummy_document=[5])],
        "positional_scaling": [dict(factor=0.5, channels=[0], layers=[1], skip_first=1, last_recompute_tokens=2)],
        "attention_buckets": [dict(bases=[0.5], scales=[0.25])],
        "parallel_context_windows": [dict(spans=[[(0, 2), (2, 4)]])],
    }

    def of_kinds(value):
        if isinstance(value, list):
            return [of_kinds(item) for item in value]
        if isinstance(value, tuple):
            return tuple(of_kinds(item) for item in value)
        return value if isinstance(value, str) else (integer if isinstance(value, int) else real)(value)

    for name, fields in given.items():
        options_class = MITIGATIONS[name].options_class if isinstance(name, str) else name
        for plain in fields:
            option = options_class(**{field: of_kinds(value) for field, value in plain.items()})
            assert option == options_class(**plain)
            json.dumps(dataclasses.asdict(option))  # plain Python numbers, as a config saves them


REFUSED_BOOLS = [  # (options class, fields, message): a bool is no number, whatever its type
    ("position_extrapolation", dict(method="fourier", components=True), r"fourier components=True must be a pos"),
    ("position_extrapolation", dict(method="interpolate", length=np.bool_(True)), r"length=(np\.)?(bool_\()?True"),
    ("stable_mask", dict(gamma=True), r"stable_mask gamma=True must be a finite number \(a bool is not a"),
    ("stable_mask", dict(gamma=1.0, columns=torch.tensor(True)), r"columns=tensor\(True\) must be None or a pos"),
    ("ms_poe", dict(r_min=True), r"ms_poe r_min=True must be a finite number \(a bool is not a"),
    ("ms_poe", dict(head_order=[True, False]), r"ms_poe head_order=\(True, False\) must be a sequence of integers"),
    ("attention_calibration", dict(spans=[[(0, 3)]], temperature=np.bool_(True)), r"temperature=.* \(a bool is"),
    ("positional_scaling", dict(skip_first=True), r"positional_scaling skip_first=True must be an integer >= 0"),
    ("attention_buckets", dict(scales=[True]), r"attention_buckets scale=True must be a finite number"),
]


@pytest.mark.parametrize(("name", "fields", "message"), REFUSED_BOOLS, ids=[str(f) for _, f, _ in REFUSED_BOOLS])
def test_a_bool_is_no_number_for_an_option(name, fields, message):
    from sepformer import PositionExtrapolation
    from sepformer.mitigations import MITIGATIONS

    options_class = PositionExtrapolation if name == "position_extrapolation" else MITIGATIONS[name].options_class
    with pytest.raises(ValueError, match=message):
        options_class(**fields)
