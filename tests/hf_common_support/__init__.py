"""Fetch transformers' own common model tests for the installed transformers, at test time, and import them.

`tests/test_modeling_common.py` (ModelTesterMixin), `tests/test_configuration_common.py` (ConfigTester) and
`tests/test_training_mixin.py` (TrainingTesterMixin) ship in the PyPI source archive of transformers, not in the
wheel. They are fetched with `pip download --no-binary :all:` into `<repo>/.cache/` (git-ignored), once per machine
and transformers version, under a file lock so that concurrent pytest-xdist workers download it once. Nothing
fetched is ever committed.

The archive lacks a few modules those files import; small stand-ins (below) are written next to them:
`__init__.py`, `exporters/test_export.py` (ExportTesterMixin), `generation/test_utils.py`
(GenerationTesterMixin) and `utils/test_configuration_utils.py` (`config_common_kwargs`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = REPO_ROOT / ".cache" / "transformers-common-tests"
PACKAGE = "transformers_common_tests"  # the import name the fetched `tests/` folder gets
FETCHED_FILES = ("test_modeling_common.py", "test_configuration_common.py", "test_training_mixin.py")
PIP_TIMEOUT_S = 600

STAND_INS = {
    "__init__.py": '"""transformers\' tests/ folder from the PyPI source archive (fetched at test time)."""\n',
    "exporters/__init__.py": "",
    "exporters/test_export.py": '''\
class ExportTesterMixin:
    """Stand-in: tests/exporters/test_export.py is not in the source archive, so no torch.export tests run."""
''',
    "generation/__init__.py": "",
    "generation/test_utils.py": '''\
class GenerationTesterMixin:
    """Stand-in: tests/generation/test_utils.py is not in the source archive, so no generate tests run here."""
''',
    "utils/__init__.py": "",
    # The dict of transformers 5.x `tests/utils/test_configuration_utils.py`: one non-default value for every
    # field of `PreTrainedConfig` (checked by `ConfigTester.check_config_arguments_init`).
    "utils/test_configuration_utils.py": """\
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
""",
}


def transformers_version() -> str:
    return importlib.metadata.version("transformers")


def fetch_common_tests(version: str | None = None) -> Path:
    """The folder holding transformers' `tests/` files for `version` (default: installed), fetched if needed.

    Raises `RuntimeError` with pip's output when the archive cannot be downloaded or lacks a file: a missing
    archive must fail the tests, never skip them.
    """
    version = version or transformers_version()
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    parent = CACHE_ROOT / f"transformers-{version}"
    package_dir = parent / PACKAGE
    with FileLock(str(CACHE_ROOT / f"transformers-{version}.lock"), timeout=2 * PIP_TIMEOUT_S):
        if not all((package_dir / name).is_file() for name in FETCHED_FILES):
            _download_and_extract(version, package_dir)
        for relative, text in STAND_INS.items():
            path = package_dir / relative
            if not path.is_file() or path.read_text() != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return parent


def _download_and_extract(version: str, package_dir: Path) -> None:
    with tempfile.TemporaryDirectory(dir=CACHE_ROOT, prefix="download-") as download_dir:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--no-input",
            "--dest",
            download_dir,
            f"transformers=={version}",
        ]
        try:
            result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"`{' '.join(command)}` timed out after {PIP_TIMEOUT_S} s") from error
        archives = sorted(Path(download_dir).glob(f"transformers-{version}.tar.gz"))
        if result.returncode != 0 or not archives:
            raise RuntimeError(
                f"could not fetch transformers' source archive (needed for its common model tests):\n"
                f"$ {' '.join(command)}\n(exit status {result.returncode})\n{result.stdout}\n{result.stderr}"
            )
        staging = Path(tempfile.mkdtemp(dir=CACHE_ROOT, prefix="extract-"))
        try:
            with tarfile.open(archives[0]) as archive:
                for name in FETCHED_FILES:
                    member_name = f"transformers-{version}/tests/{name}"
                    try:
                        member = archive.getmember(member_name)
                    except KeyError:
                        raise RuntimeError(f"{archives[0].name} has no {member_name}") from None
                    (staging / name).write_bytes(archive.extractfile(member).read())
            staging.chmod(0o755)  # mkdtemp makes it private
            if package_dir.exists():
                shutil.rmtree(package_dir)
            package_dir.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(package_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def load_common_tests() -> dict[str, ModuleType]:
    """Fetch (once) and import transformers' common test modules; returns them by short name."""
    parent = str(fetch_common_tests())
    sys.path.insert(0, parent)
    try:
        modules = {
            name: importlib.import_module(f"{PACKAGE}.{name}")
            for name in ("test_modeling_common", "test_configuration_common", "test_training_mixin")
        }
    finally:
        sys.path.remove(parent)
    return modules
