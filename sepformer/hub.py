"""Make `save_pretrained` write Hub custom code, loadable with `trust_remote_code=True` without this package."""

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .configuration_sepformer import SepFormerConfig


def prepare_for_hub(model, tokenizer=None):
    """Mark `model` (and `tokenizer`) so `save_pretrained`/`push_to_hub` copy the code files and a full `auto_map`;
    returns `model`. Only these objects are marked (their own `_auto_class`, where transformers'
    `register_for_auto_class` marks the class): another model, config or tokenizer saved later is a plain checkpoint.
    """
    if not (isinstance(model, PreTrainedModel) and isinstance(model.config, SepFormerConfig)):
        raise TypeError(
            f"prepare_for_hub takes a SepFormer model (SepFormerForCausalLM or SepFormerModel); got "
            f"{type(model).__name__}."
        )
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"prepare_for_hub: tokenizer must be a transformers tokenizer; got {type(tokenizer).__name__}.")
    model._auto_class = "AutoModelForCausalLM" if hasattr(model, "lm_head") else "AutoModel"
    model.config._auto_class = "AutoConfig"
    # Each object only adds its own entry: write the whole map so a folder can be loaded through any Auto class.
    model.config.auto_map = {
        "AutoConfig": "configuration_sepformer.SepFormerConfig",
        "AutoModel": "modeling_sepformer.SepFormerModel",
        "AutoModelForCausalLM": "modeling_sepformer.SepFormerForCausalLM",
    }
    if tokenizer is not None:
        tokenizer._auto_class = "AutoTokenizer"
    return model
