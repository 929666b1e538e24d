import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Before transformers is imported anywhere: no Hub on these machines, and a cache that belongs to the test run.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="sepformer-hf-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import sepformer  # noqa: E402,F401  (registers the Auto classes)
from sepformer import SepFormerConfig, SepFormerForCausalLM  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per xdist worker


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` sends the tests of one `xdist_group` to one worker by a suffix `@group` on their node ids,
    which pytest-xdist 3.8 writes where pytest 9.2 no longer reads it (pytest-xdist#1386): the groups then silently
    split, and a module's end-to-end fixture runs on both workers. Until pytest-xdist writes it where pytest reads it,
    a worker writes it there itself."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of a `--dist loadgroup` run
        return
    for item in items:
        groups = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(groups))
        if groups and not item.nodeid.endswith(suffix):  # xdist's own suffix is there on pytest before 9.2
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles from scratch: dynamo counts the graphs of a `forward` over the whole process, and a
    `fullgraph=True` compile past its recompile limit fails, so a test would pass or fail by which tests shared its
    worker before it."""
    torch._dynamo.reset()


def random_ids(batch: int, seq: int, seed: int = 0, vocab: int = 256) -> torch.LongTensor:
    """Token ids below `vocab` (bytes by default), the same for a given seed."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The model's logits for `ids`, without autograd."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def tiny_config(**overrides) -> SepFormerConfig:
    """A model small enough for exact comparisons in milliseconds; `head_dim = d_pos = 8`."""
    values = dict(
        vocab_size=259,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    values.update(overrides)
    return SepFormerConfig(**values)


def tiny_model(seed: int = 0, **overrides) -> SepFormerForCausalLM:
    torch.manual_seed(seed)
    return SepFormerForCausalLM(tiny_config(**overrides)).eval()


SPANS = ((0, 3), (3, 6), (6, 9))  # three documents of a prompt, for the mitigations that read document spans


def strong_positions(model):
    """A fresh table has rows of std 0.02, too small to move anything: make positions matter."""
    with torch.no_grad():
        model.model.embed_positions.weight.normal_(0, 1)
    return model


@pytest.fixture
def tmp_folder(tmp_path):
    return str(tmp_path)


def tiny_llama(attn="sdpa", rope_theta=10000.0, seed=0):
    """A tiny random Hugging Face Llama, attention sharpened so that positions matter."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than a fresh model's, so that positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def tiny_gpt2(attn="sdpa"):
    """A tiny random Hugging Face GPT-2 with learned positions of unit scale."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_implementation=attn,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 1)
    return model


def run_script(script: Path, *args: str, output_dir: Path, csv_name: str) -> tuple[str, list[dict]]:
    """Run an example or benchmark as a user types it; return its stdout and the rows of the CSV it wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, str(script), *args, "--output-dir", str(output_dir)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(Path(output_dir) / csv_name) as handle:
        return completed.stdout, list(csv.DictReader(handle))
