"""SepFormer: a causal LM with separate positional and semantic dimensions, as a Hugging Face Transformers plugin.

Importing this package registers `SepFormerConfig`, `SepFormerModel`, `SepFormerForCausalLM` and
`SepFormerTokenizer` with the Auto classes under `model_type = "sepformer"`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .any_decoder import add_mitigations
from .cache_sepformer import SepFormerCache
from .configuration_sepformer import SepFormerConfig
from .hub import prepare_for_hub
from .in2 import in2_dataset
from .lora import LORA_TARGET_MODULES
from .mitigation_options import (
    AttentionBuckets,
    AttentionCalibration,
    MSPoE,
    ParallelContextWindows,
    PositionalScaling,
    StableMask,
)
from .modeling_sepformer import SepFormerForCausalLM, SepFormerModel, SepFormerPreTrainedModel
from .positional_options import EXTRAPOLATION_METHODS, PositionExtrapolation
from .positional_search import search_positional_scaling
from .reordering import ReorderDocuments, document_relevance, relevance_order, reorder_documents, reorder_prompt
from .tokenization_sepformer import SepFormerTokenizer

AutoConfig.register(SepFormerConfig.model_type, SepFormerConfig, exist_ok=True)
AutoModel.register(SepFormerConfig, SepFormerModel, exist_ok=True)
AutoModelForCausalLM.register(SepFormerConfig, SepFormerForCausalLM, exist_ok=True)
AutoTokenizer.register(SepFormerConfig, tokenizer_class=SepFormerTokenizer, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "EXTRAPOLATION_METHODS",
    "LORA_TARGET_MODULES",
    "AttentionBuckets",
    "AttentionCalibration",
    "MSPoE",
    "ParallelContextWindows",
    "PositionalScaling",
    "ReorderDocuments",
    "StableMask",
    "PositionExtrapolation",
    "SepFormerCache",
    "SepFormerConfig",
    "SepFormerForCausalLM",
    "SepFormerModel",
    "SepFormerPreTrainedModel",
    "SepFormerTokenizer",
    "add_mitigations",
    "document_relevance",
    "in2_dataset",
    "prepare_for_hub",
    "relevance_order",
    "reorder_documents",
    "reorder_prompt",
    "search_positional_scaling",
]
