"""transformers' own common model tests, run against `SepFormerModel` and `SepFormerForCausalLM`.

`ModelTesterMixin`, `ConfigTester` and `TrainingTesterMixin` come from the source archive of the *installed*
transformers, fetched with pip at test time into the git-ignored `.cache/` (see `hf_common_support`); nothing of it
is committed. If the archive cannot be fetched, `test_transformers_common_tests_are_available` fails with pip's
output: it never skips, and the rest of the suite still runs.

Three configurations run the whole set: the defaults of `tiny_config()` (learned table, untied semantic head); tied
embeddings + sinusoidal map + LayerNorm + partial rotary + biases; and `d_pos = 0` (NoPE) with the head reading the
whole vector.

Skips. One is ours, written on the test below (`test_generation_tester_mixin_inheritance`). The others are the
mixins' own, each with its reason in the report (`pytest -rs`); why none of them applies here:
- needs hardware or packages this CPU machine lacks: CUDA/accelerator, several accelerators, MPS, Flash Attention
  2/3/4, `kernels`, DeepSpeed (offload, parallelism, flash/flex attention, compile-on-GPU, resize under ZeRO-3);
- `@slow` (`test_torch_compile_for_training`, also accelerator-only);
- features SepFormer does not have: `_keep_in_fp32_modules`, a tensor-parallel plan, a checkpoint conversion
  mapping, sub-configs / composite models ("does not support SDPA" is that test's message for "not composite"),
  sliding-window attention, mixture-of-experts (grouped_mm, router logits), encoder-decoder loss, position-embedding
  resizing (`resize_position_embeddings`; longer inputs use the extrapolation methods instead);
- RoPE scaling / partial-rotation / axial-RoPE tests: they drive transformers' standard `rope_parameters`; SepFormer's
  optional rotary is its own (`rotary_dim`, `rope_theta`) with no rope-scaling types, so there is nothing to scale.
"""

import unittest
import warnings
from typing import ClassVar

import pytest
import torch
from conftest import tiny_config
from hf_common_support import load_common_tests

from sepformer import SepFormerConfig, SepFormerForCausalLM, SepFormerModel

# Any failure to fetch or import is reported by the first test below, loudly, so that the rest of the suite still runs.
try:
    with warnings.catch_warnings():
        # transformers' files carry marks of its own CI (flash_attn_test, torch_compile_test, is_training_test...)
        # that this project does not register; they select nothing here.
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        _COMMON = load_common_tests()
    _LOAD_ERROR = None
except Exception as error:  # noqa: BLE001
    _COMMON, _LOAD_ERROR = None, error


def test_transformers_common_tests_are_available():
    if _LOAD_ERROR is not None:
        raise AssertionError(f"transformers' common tests could not be loaded: {_LOAD_ERROR}") from _LOAD_ERROR


if _COMMON is not None:
    from transformers.models.auto import modeling_auto

    ModelTesterMixin = _COMMON["test_modeling_common"].ModelTesterMixin
    ids_tensor = _COMMON["test_modeling_common"].ids_tensor
    ConfigTester = _COMMON["test_configuration_common"].ConfigTester
    TrainingTesterMixin = _COMMON["test_training_mixin"].TrainingTesterMixin

    # The mixins decide "base model or causal LM" (labels, training, head checks) from these static name tables.
    # Adding a model type that CONFIG_MAPPING_NAMES lacks changes no Auto-class lookup.
    _MODEL_TYPE = SepFormerConfig.model_type
    modeling_auto.MODEL_MAPPING_NAMES.setdefault(_MODEL_TYPE, SepFormerModel.__name__)
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(_MODEL_TYPE, SepFormerForCausalLM.__name__)

    class SepFormerModelTester:
        """What the mixins expect of a model tester (as transformers' CausalLMModelTester), on `tiny_config()`.

        `inputs_embeds` is built by the mixins with `get_input_embeddings()`, so it has SepFormer's width
        (`semantic_size`); there are no `token_type_ids`.
        """

        base_model_class = SepFormerModel
        causal_lm_class = SepFormerForCausalLM
        config_class = SepFormerConfig

        def __init__(
            self, parent, config_overrides=None, batch_size=13, seq_length=7, is_training=True, use_input_mask=True
        ):
            self.parent = parent
            self.config_overrides = dict(config_overrides or {})
            config = self.get_config()
            self.batch_size = batch_size
            self.seq_length = seq_length
            self.is_training = is_training
            self.use_input_mask = use_input_mask
            self.use_labels = True
            self.vocab_size = config.vocab_size
            self.hidden_size = config.hidden_size
            self.num_hidden_layers = config.num_hidden_layers
            self.num_attention_heads = config.num_attention_heads
            self.head_dim = config.head_dim
            self.max_position_embeddings = config.max_position_embeddings
            self.pad_token_id = config.pad_token_id
            self.bos_token_id = config.bos_token_id
            self.eos_token_id = config.eos_token_id

        def get_config(self) -> SepFormerConfig:
            return tiny_config(**self.config_overrides)

        def prepare_config_and_inputs(self):
            input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            # Right padding of every length from 1 to seq_length, as transformers' CausalLMModelTester does.
            input_mask = torch.tril(torch.ones_like(input_ids)) if self.use_input_mask else None
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            return self.get_config(), input_ids, input_mask, token_labels

        def prepare_config_and_inputs_for_common(self):
            config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
            return config, {"input_ids": input_ids, "attention_mask": input_mask}

    class SepFormerCommonTest(ModelTesterMixin, TrainingTesterMixin, unittest.TestCase):
        all_model_classes = (SepFormerModel, SepFormerForCausalLM)
        config_overrides: ClassVar[dict] = {}  # on top of `tiny_config()`: the defaults
        # SepFormer has no `resize_position_embeddings`: `test_resize_position_vector_embeddings` skips itself.
        test_resize_position_embeddings = False
        # The mixin runs this only for models whose config file starts "# Copyright 2023" or later; ours has no such
        # header, but `_init_weights` must cover every weight and buffer (from_pretrained relies on it): run it.
        test_can_init_all_missing_weights_before_2023 = True

        def setUp(self):
            self.model_tester = SepFormerModelTester(self, self.config_overrides)
            self.config_tester = ConfigTester(
                self, config_class=SepFormerConfig, hidden_size=32, num_attention_heads=4, num_hidden_layers=2
            )

        @unittest.skip(
            reason="transformers' GenerationTesterMixin (tests/generation/test_utils.py) is not in the source archive: "
            "the stand-in has no tests, so inheriting it would only pretend. generate() is exercised by "
            "test_training_overfit here and by the project's own generation tests."
        )
        def test_generation_tester_mixin_inheritance(self):
            pass

        def test_config(self):
            self.config_tester.run_common_tests()

        def test_model(self):
            config, input_ids, input_mask, labels = self.model_tester.prepare_config_and_inputs()
            batch, seq = input_ids.shape
            torch.manual_seed(0)
            base = SepFormerModel(config).eval()
            with torch.no_grad():
                hidden = base(input_ids, attention_mask=input_mask).last_hidden_state
            self.assertEqual(hidden.shape, (batch, seq, config.hidden_size))
            lm = SepFormerForCausalLM(config).eval()
            with torch.no_grad():
                out = lm(input_ids, attention_mask=input_mask, labels=labels)
            self.assertEqual(out.logits.shape, (batch, seq, config.vocab_size))
            self.assertTrue(torch.isfinite(out.loss))

    class SepFormerTiedRotaryCommonTest(SepFormerCommonTest):
        config_overrides: ClassVar[dict] = {
            "tie_word_embeddings": True,
            "positional_map": "sinusoidal",
            "norm_type": "layernorm",
            "rotary_dim": 4,
            "attention_bias": True,
            "mlp_bias": True,
        }

    class SepFormerNoPECommonTest(SepFormerCommonTest):
        config_overrides: ClassVar[dict] = {"position_size": 0, "lm_head_input": "all"}
