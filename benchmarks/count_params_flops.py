"""Parameters and forward FLOPs per token: SepFormer against GPT-2 of the same width, depth, heads and vocabulary.

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on one forward pass of `--seq-len` tokens (matmuls
and attention; training is about 3x this), so both models are measured by the same counter. Attention runs on
torch's math backend while counted: the counter has no formula for the CPU's fused attention kernel (it would count
0), and on every device attention is then its two matmuls over every query-key pair, masked ones included.

    python benchmarks/count_params_flops.py --hidden-size 128 --layers 4 --heads 4 --seq-len 256
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPT2Config, GPT2LMHeadModel

from sepformer import SepFormerConfig, SepFormerForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from cli_arguments import int_at_least, positive_int  # noqa: E402


def forward_flops_per_token(model, seq_len: int) -> float:
    ids = torch.randint(0, 256, (1, seq_len), device=model.device)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids)
    return counter.get_total_flops() / seq_len


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--vocab-size", type=int_at_least(256), default=259, help="at least the 256 byte ids measured")
    parser.add_argument("--seq-len", type=positive_int, default=256)
    args = parser.parse_args(argv)

    sepformer = SepFormerForCausalLM(
        SepFormerConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            max_position_embeddings=args.seq_len,
        )
    ).eval()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=args.vocab_size,
            n_embd=args.hidden_size,
            n_layer=args.layers,
            n_head=args.heads,
            n_positions=args.seq_len,
            bos_token_id=257,
            eos_token_id=258,
        )
    ).eval()
    rows = []
    for name, model in (("SepFormer", sepformer), ("GPT-2", gpt2)):
        total = model.num_parameters()
        # token/position embeddings and the (untied) head: what scales with vocabulary and table length
        embedding = sum(
            p.numel()
            for n, p in model.named_parameters()
            if "embed" in n or "lm_head" in n or n.startswith(("transformer.wte", "transformer.wpe"))
        )
        rows.append((name, total, total - embedding, forward_flops_per_token(model, args.seq_len)))
    print(
        f"d_model={args.hidden_size} layers={args.layers} heads={args.heads} vocab={args.vocab_size} "
        f"seq_len={args.seq_len} (SepFormer d_pos={sepformer.config.position_size})\n"
    )
    print("| model | parameters | non-embedding parameters | forward FLOPs / token |")
    print("|---|---:|---:|---:|")
    for name, total, body, flops in rows:
        print(f"| {name} | {total:,} | {body:,} | {flops / 1e6:.2f} M |")
    print(
        f"| ratio SepFormer / GPT-2 | {rows[0][1] / rows[1][1]:.3f} | {rows[0][2] / rows[1][2]:.3f} | "
        f"{rows[0][3] / rows[1][3]:.3f} |"
    )


if __name__ == "__main__":
    main()
