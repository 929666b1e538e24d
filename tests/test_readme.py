"""The README's quickstart runs as written."""

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(block for block in blocks if "Trainer(" in block)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    assert os.path.exists(tmp_path / "outputs/quickstart/model/modeling_sepformer.py")
    assert type(namespace["reloaded"]).__name__ == "SepFormerForCausalLM"


def test_position_bias_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(block for block in blocks if "StableMask(" in block)
    exec(compile(example, "README.md position bias", "exec"), {})
