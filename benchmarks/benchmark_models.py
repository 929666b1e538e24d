"""The models of `benchmark.py` (SepFormer, GPT-2 and Llama built at one `Shape`) and the workloads timed on them:
a training step, a prefill, a `generate` call."""

import dataclasses
import math
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import sepformer  # noqa: F401  (registers the Auto classes)
from sepformer import SepFormerConfig

PAD, BOS, EOS = 256, 257, 258
MODELS = ("SepFormer", "GPT-2", "Llama")
PEERS = ("GPT-2", "Llama")


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    vocab_size: int = 259
    train_batch: int = 8
    train_seq: int = 512
    train_steps: int = 2  # steps per timed sample
    prefill_lengths: tuple[int, ...] = (512, 2048)
    prompt: int = 64  # prompt of the generation measurements
    new_tokens: int = 256
    generate_batches: tuple[int, ...] = (1, 8)
    extrapolation_length: int = 256  # L of the extrapolation section: the prompt, so every new token is past L
    reps: int = 7
    device: str = "cpu"  # where every model runs, and its precision (`--device`, `--dtype`)
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def extrapolation_reps(self) -> int:
        return 3 * self.reps

    @property
    def max_length(self) -> int:
        return max(
            *self.prefill_lengths,
            self.train_seq,
            self.prompt + self.new_tokens,
            self.extrapolation_length + self.new_tokens,
        )

    @property
    def llama_intermediate(self) -> int:
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)


FULL = Shape()
TINY = Shape(
    hidden_size=64,
    layers=2,
    heads=4,
    train_batch=2,
    train_seq=64,
    train_steps=1,
    prefill_lengths=(64, 256),
    prompt=8,
    new_tokens=12,
    generate_batches=(1, 2),
    extrapolation_length=16,
    reps=3,
)


# --------------------------------------------------------------------------------------------------------------- models


def build(name: str, shape: Shape, seed: int = 0, max_length: int | None = None):
    """One of `MODELS` at `shape` (on its device, in its dtype), sdpa, dropout 0, deterministic weights for a seed."""
    max_length = max_length or shape.max_length
    common = dict(vocab_size=shape.vocab_size, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if name == "SepFormer":
        config = SepFormerConfig(
            hidden_size=shape.hidden_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            max_position_embeddings=max_length,
            **common,
        )
    elif name == "GPT-2":
        config = GPT2Config(
            n_embd=shape.hidden_size,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_positions=max_length,
            activation_function="gelu_pytorch_tanh",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    elif name == "Llama":
        config = LlamaConfig(
            hidden_size=shape.hidden_size,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads,
            intermediate_size=shape.llama_intermediate,
            max_position_embeddings=max_length,
            tie_word_embeddings=False,
            **common,
        )
    else:
        raise ValueError(f"unknown model {name!r}: choose one of {MODELS}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=shape.torch_dtype)
    model.generation_config.pad_token_id = PAD
    return model.to(shape.device).eval()


def with_table(model, rows: int):
    """The same SepFormer weights with a positional table of `rows` rows (`L = rows`)."""
    config = SepFormerConfig(**{**model.config.to_dict(), "max_position_embeddings": rows, "position_table_size": rows})
    state = dict(model.state_dict())
    key = "model.embed_positions.weight"
    table = state[key]
    if rows <= table.shape[0]:
        state[key] = table[:rows].clone()
    else:
        state[key] = torch.cat((table, table[-1:].expand(rows - table.shape[0], -1)), 0)
    shorter = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=model.dtype)
    shorter.load_state_dict(state)
    shorter.generation_config.pad_token_id = PAD
    return shorter.to(model.device).eval()


def token_ids(batch: int, length: int, seed: int, device: torch.device) -> torch.LongTensor:
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


# ------------------------------------------------------------------------------------------------------------ workloads


def make_train_step(model, shape: Shape, seed: int) -> Callable[[int, int], None]:
    """`step(batch, seq)`: forward, backward, AdamW step; batch and sequence default to the shape's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(batch: int = shape.train_batch, seq: int = shape.train_seq):
        model.train()
        ids = token_ids(batch, seq, seed, model.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def prefill(model, length: int, seed: int):
    model.eval()
    with torch.no_grad():
        return model(input_ids=token_ids(1, length, seed, model.device), use_cache=True, logits_to_keep=1).logits


def generate(model, batch: int, prompt: int, new_tokens: int, seed: int, **kwargs):
    model.eval()
    ids = token_ids(batch, prompt, seed, model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=PAD,
        **kwargs,
    )
    if out.shape != (batch, prompt + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {(batch, prompt + new_tokens)}")
    return out
