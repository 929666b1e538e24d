"""SepFormer configuration: sizes, the positional map, and every check on them in one place."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .mitigation_options import StableMask
from .positional_maps import PositionExtrapolation

POSITIONAL_MAPS = ("learned", "sinusoidal")
NORM_TYPES = ("rmsnorm", "layernorm")
LM_HEAD_INPUTS = ("semantic", "all")


@strict
class SepFormerConfig(PreTrainedConfig):
    r"""
    Configuration of a SepFormer: a decoder-only causal LM whose hidden state is `[p(i) ‖ s(token)]`, with the
    positional block in coordinates `[0, position_size)` and the semantic block in the rest.

    Args:
        vocab_size: tokens in the vocabulary (259 = 256 bytes + pad, bos, eos for `SepFormerTokenizer`).
        hidden_size: `d_model = d_pos + d_sem`.
        position_size: `d_pos`, the width of the positional block. `None` means `head_dim`; `0` is a model with no
            positional information at all (NoPE). Must be smaller than `hidden_size`.
        num_hidden_layers, num_attention_heads: depth and heads; `head_dim = hidden_size / num_attention_heads`.
        position_intermediate_size, semantic_intermediate_size: hidden widths of the two MLPs. `None` means
            4x the block's width.
        hidden_act: activation of both MLPs (any name of `transformers.activations.ACT2FN`).
        max_position_embeddings: `L`, the training length (rows of the learned positional table).
        positional_map: `"learned"` (a table of `L` rows) or `"sinusoidal"` (fixed, over `d_pos` dimensions).
        position_extrapolation: how a learned table answers positions past its rows: `"none"` (an error),
            `"clamp"`, `"sinusoidal"`, `"fourier"` or `"interpolate"` (SPEC §2). Overridable per call.
        fourier_components: `K` of the `"fourier"` method.
        interpolation_length: the length `"interpolate"` compresses positions for; `None` is the current length.
        position_table_size: rows of the learned table; `None` means `max_position_embeddings`. A larger table with
            `random_position_offsets` is trained past `L`.
        random_position_offsets: in training, shift each sequence's positions by a random offset so that every row
            of a `position_table_size > max_position_embeddings` table is trained.
        norm_type: `"rmsnorm"` or `"layernorm"`; each subspace is normalised on its own.
        norm_eps: epsilon of the norms.
        lm_head_input: which block the LM head reads, `"semantic"` or `"all"`.
        rotary_dim: rotary embedding on the first `rotary_dim` dimensions of every query/key head; `0` is off.
        rope_theta: rotary base.
        attention_dropout, hidden_dropout: dropout on attention probabilities and on the residual branches and
            embeddings.
        attention_bias, mlp_bias: biases of the attention projections and of the MLPs.
        initializer_range: std of the normal initialisation.
        stable_mask: StableMask's fields as a dict (`{"gamma": 0.05}`), on in training and inference; `None` is off.
            A call's `stable_mask=` overrides it.
        fuse_decoding_projections: decoding steps run each layer's q/k/v and o projections as two dense matmuls
            kept on the KV cache (faster where kernel count dominates; `4 d²` more memory per layer while the cache
            lives). `False` keeps the per-block projections everywhere.
    """

    model_type = "sepformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 259
    hidden_size: int = 256
    position_size: int | None = None
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    position_intermediate_size: int | None = None
    semantic_intermediate_size: int | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 512
    positional_map: str = "learned"
    position_extrapolation: str = "none"
    fourier_components: int = 16
    interpolation_length: int | None = None
    position_table_size: int | None = None
    random_position_offsets: bool = False
    norm_type: str = "rmsnorm"
    norm_eps: float | int = 1e-6
    lm_head_input: str = "semantic"
    tie_word_embeddings: bool = False
    rotary_dim: int = 0
    rope_theta: float | int = 10000.0
    attention_dropout: float | int = 0.0
    hidden_dropout: float | int = 0.0
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float | int = 0.02
    stable_mask: dict | None = None
    fuse_decoding_projections: bool = True
    use_cache: bool = True
    pad_token_id: int | None = 256
    bos_token_id: int | None = 257
    eos_token_id: int | list[int] | None = 258

    def __post_init__(self, **kwargs):
        # Derived sizes are resolved before validation so that `validate_architecture` sees final values.
        for name in ("hidden_size", "num_attention_heads"):
            _require_positive(name, getattr(self, name))
        if self.position_size is None and self.hidden_size % self.num_attention_heads == 0:
            self.position_size = self.head_dim
        if self.position_table_size is None:
            self.position_table_size = self.max_position_embeddings
        if self.position_intermediate_size is None and self.position_size is not None:
            self.position_intermediate_size = 4 * self.position_size
        if self.semantic_intermediate_size is None and self.position_size is not None:
            self.semantic_intermediate_size = 4 * (self.hidden_size - self.position_size)
        super().__post_init__(**kwargs)
        # `@strict` runs this too, but wraps the error; calling it here raises the plain `ValueError`.
        self.validate_architecture()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def semantic_size(self) -> int:
        return self.hidden_size - self.position_size

    def validate_architecture(self):
        """Every invalid value or combination, with the field, the value and what is allowed."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            _require_positive(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}: head_dim = hidden_size / num_attention_heads must be an integer."
            )
        if not 0 <= self.position_size < self.hidden_size:
            raise ValueError(
                f"position_size={self.position_size} is not allowed: it must satisfy 0 <= position_size < "
                f"hidden_size={self.hidden_size} (0 is a model without positions; position_size = hidden_size "
                "would leave no semantic dimensions)."
            )
        if self.position_size > 0:
            _require_positive("position_intermediate_size", self.position_intermediate_size)
        _require_positive("semantic_intermediate_size", self.semantic_intermediate_size)
        _require_choice("positional_map", self.positional_map, POSITIONAL_MAPS)
        _require_choice("norm_type", self.norm_type, NORM_TYPES)
        _require_choice("lm_head_input", self.lm_head_input, LM_HEAD_INPUTS)
        _require_choice("hidden_act", self.hidden_act, tuple(ACT2FN))
        if self.positional_map == "sinusoidal" and self.position_size % 2 == 1:
            raise ValueError(
                f"position_size={self.position_size} is odd, but positional_map='sinusoidal' needs an even "
                "position_size (sine/cosine pairs)."
            )
        self.check_extrapolation(self.default_extrapolation())  # raises on an unknown method or bad values
        has_table = self.has_positional_table
        if self.position_table_size < self.max_position_embeddings:
            raise ValueError(
                f"position_table_size={self.position_table_size} must be >= max_position_embeddings="
                f"{self.max_position_embeddings}."
            )
        if self.position_table_size > self.max_position_embeddings and not self.random_position_offsets:
            raise ValueError(
                f"position_table_size={self.position_table_size} > max_position_embeddings="
                f"{self.max_position_embeddings} needs random_position_offsets=True: otherwise the rows past "
                "max_position_embeddings are never trained."
            )
        if self.random_position_offsets and not (has_table and self.position_table_size > self.max_position_embeddings):
            raise ValueError(
                "random_position_offsets=True needs a learned table (positional_map='learned', position_size > 0) "
                f"with position_table_size > max_position_embeddings={self.max_position_embeddings}; got "
                f"positional_map={self.positional_map!r}, position_size={self.position_size}, "
                f"position_table_size={self.position_table_size}."
            )
        if self.rotary_dim < 0 or self.rotary_dim % 2 == 1 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim} is not allowed: it must be 0 (off) or an even number <= "
                f"head_dim={self.head_dim}."
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0.")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be > 0.")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1).")
        if self.initializer_range < 0:
            raise ValueError(f"initializer_range={self.initializer_range} must be >= 0.")
        if self.stable_mask is not None:
            StableMask.parse(self.stable_mask)  # a dict (the field's type): raises on unknown keys or bad values
        if self.tie_word_embeddings and self.lm_head_input != "semantic":
            raise ValueError(
                f"tie_word_embeddings=True needs lm_head_input='semantic' (the token embedding has width "
                f"semantic_size={self.semantic_size}); got lm_head_input={self.lm_head_input!r}."
            )

    @property
    def has_positional_table(self) -> bool:
        return self.positional_map == "learned" and self.position_size > 0

    def check_extrapolation(self, extrapolation: PositionExtrapolation) -> None:
        """An extrapolation method (the config's or a call's) is for a learned table, and `interpolate`'s length
        must be past it."""
        if extrapolation.method != "none" and not self.has_positional_table:
            raise ValueError(
                f"position_extrapolation={extrapolation.method!r} needs a learned positional table (it applies to a "
                f"learned positional table only); this model has positional_map={self.positional_map!r}, "
                f"position_size={self.position_size} (a sinusoid is defined at every position, position_size=0 has "
                "none): use 'none'."
            )
        if extrapolation.length is not None and extrapolation.length <= self.position_table_size:
            raise ValueError(
                f"interpolate length={extrapolation.length} must exceed the table's {self.position_table_size} rows: "
                "up to the table's length 'interpolate' is the identity."
            )

    def default_extrapolation(self) -> PositionExtrapolation:
        return PositionExtrapolation(
            method=self.position_extrapolation, components=self.fourier_components, length=self.interpolation_length
        )


def _require_positive(name, value):
    if value is None or value <= 0:
        raise ValueError(f"{name}={value} is not allowed: it must be a positive integer.")


def _require_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: choose one of {', '.join(map(repr, allowed))}.")


__all__ = ["SepFormerConfig"]
