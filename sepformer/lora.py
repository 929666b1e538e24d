"""Default LoRA targets for PEFT, which knows default `target_modules` only for the model types it ships."""

# Every projection of the layers, named by the suffix PEFT matches (`name == target` or `name.endswith("." +
# target)`): `q_proj`, `k_proj`, each block of `v_proj` and `o_proj`, and both linears of both MLPs. The token
# embedding and the LM head are left out: with `tie_word_embeddings=True` they share one weight, and PEFT merges an
# adapter on either into that shared weight (twice with `ensure_weight_tying`), so the merged model would differ
# from the adapted one.
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj.position",
    "v_proj.semantic",
    "o_proj.position",
    "o_proj.semantic",
    "up_proj",
    "down_proj",
)
