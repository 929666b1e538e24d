"""Make `save_pretrained` write Hub custom code, loadable with `trust_remote_code=True` without this package."""

AUTO_MAP = {
    "AutoConfig": "configuration_sepformer.SepFormerConfig",
    "AutoModel": "modeling_sepformer.SepFormerModel",
    "AutoModelForCausalLM": "modeling_sepformer.SepFormerForCausalLM",
}


def prepare_for_hub(model, tokenizer=None):
    """Mark `model` (and `tokenizer`) so `save_pretrained`/`push_to_hub` copy the code files and a full `auto_map`.

    Returns `model`, so `prepare_for_hub(model).save_pretrained(folder)` is a one-liner.
    """
    model.config.register_for_auto_class()
    type(model).register_for_auto_class("AutoModelForCausalLM" if hasattr(model, "lm_head") else "AutoModel")
    # Each class only adds its own entry: write the whole map so a folder can be loaded through any Auto class.
    model.config.auto_map = dict(AUTO_MAP)
    if tokenizer is not None:
        type(tokenizer).register_for_auto_class("AutoTokenizer")
    return model
