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

import sepformer  # noqa: E402,F401  (registers the Auto classes)
from sepformer import SepFormerConfig, SepFormerForCausalLM  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per xdist worker


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


@pytest.fixture
def tmp_folder(tmp_path):
    return str(tmp_path)


def run_script(script: Path, *args: str, output_dir: Path, csv_name: str) -> tuple[str, list[dict]]:
    """Run an example or benchmark as a user types it; return its stdout and the rows of the CSV it wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run([sys.executable, str(script), *args, "--output-dir", str(output_dir)], check=False,
                               capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(Path(output_dir) / csv_name) as handle:
        return completed.stdout, list(csv.DictReader(handle))
