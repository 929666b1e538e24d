"""Instructions per cached decoding step, counted by valgrind's callgrind: the Llama given `add_mitigations` (the
benchmark's shape, batch 1 unless `--batch`, one thread) without option and with each position-bias option.

Unlike a timing, the count does not drift with the machine's load (on a shared 2-core CPU the same option's paired
ratio moves by up to 0.1 from run to run), so an option's overhead at batch 1, mostly Python and small kernels on this
model, can be compared between runs and versions of the code. Instructions are not time: the matmuls' memory traffic
costs none.

    python benchmarks/count_instructions.py                                # every option (about 4 min + 1 min each)
    python benchmarks/count_instructions.py --options stable_mask positional_scaling
    python benchmarks/count_instructions.py --batch 8 --options stable_mask  # about 15 min a variant

The script runs itself under `valgrind --tool=callgrind` and has callgrind dump its counts between generations
(`callgrind_control --dump`): a variant's step is (instructions generating `5 × --tokens` new tokens - generating
`--tokens`) / (4 × tokens), so the prefill and the first step cancel out.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from benchmark_sections import MITIGATED_LLAMA, MITIGATIONS, measured_on  # noqa: E402
from cli_arguments import positive_int  # noqa: E402

DUMPS = "COUNT_INSTRUCTIONS_DUMPS"  # set in the run under callgrind: the folder its dumps go to
NO_OPTION = "no option"


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", nargs="+", choices=measured_on(MITIGATED_LLAMA), default=None)
    parser.add_argument("--tokens", type=positive_int, default=8, help="new tokens of the shorter generation")
    parser.add_argument("--batch", type=positive_int, default=1, help="prompts generated together")
    return parser.parse_args(argv)


def dump(label: str, folder: Path) -> None:
    """Have callgrind write the counts since the last dump to a file of `folder`, named `label` inside. Callgrind
    serves the request between two blocks of this process's code, hence the busy loop, and writes the whole file
    before the process goes on."""
    before = set(folder.iterdir())
    command = ["callgrind_control", "--dump=" + label, str(os.getpid())]
    subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while set(folder.iterdir()) == before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"callgrind wrote no dump named {label!r} in 5 minutes")


def count_under_callgrind(options: list[str], tokens: int, batch: int, folder: Path) -> None:
    """The generations whose counts the dumps hold, labelled `<variant>/<new tokens>`."""
    from benchmark_models import FULL, build, generate

    from sepformer import add_mitigations

    model = add_mitigations(build("Llama", FULL))
    for variant in (NO_OPTION, *options):
        given = {} if variant == NO_OPTION else MITIGATIONS[variant](batch, FULL.prompt)
        generate(model, batch, FULL.prompt, 4, 0, **given)  # warm-up
        dump(f"{variant}/warm-up", folder)
        for new_tokens in (tokens, 5 * tokens):
            generate(model, batch, FULL.prompt, new_tokens, 0, **given)
            dump(f"{variant}/{new_tokens}", folder)


def read_dumps(folder: Path) -> dict[str, int]:
    """{label: instructions} of the dumps in `folder`."""
    counts = {}
    for path in folder.iterdir():
        text = path.read_text()
        label = re.search(r"^desc: Trigger: dump (.+)$", text, re.MULTILINE)
        if label is not None:
            counts[label.group(1)] = int(re.search(r"^summary: (\d+)$", text, re.MULTILINE).group(1))
    return counts


def per_step(counts: dict[str, int], variants: list[str], tokens: int) -> dict[str, float]:
    """Instructions of one decoding step per variant, from the dumps' counts."""
    return {
        variant: (counts[f"{variant}/{5 * tokens}"] - counts[f"{variant}/{tokens}"]) / (4 * tokens)
        for variant in variants
    }


def main(argv=None) -> dict[str, float] | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_arguments(argv)
    options = args.options or measured_on(MITIGATED_LLAMA)
    if DUMPS in os.environ:
        return count_under_callgrind(options, args.tokens, args.batch, Path(os.environ[DUMPS]))
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not found: this count runs under valgrind (apt install valgrind).")
    with tempfile.TemporaryDirectory() as folder:
        callgrind = ["--tool=callgrind", f"--callgrind-out-file={folder}/steps.%p", f"--log-file={folder}/valgrind.log"]
        command = ["valgrind", *callgrind, sys.executable, __file__]
        environment = {**os.environ, DUMPS: folder, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        subprocess.run([*command, *argv], env=environment, check=True)
        steps = per_step(read_dumps(Path(folder)), [NO_OPTION, *options], args.tokens)
    print(f"| Llama + add_mitigations, batch {args.batch} | instructions per decoding step | vs no option |")
    print("|---|---:|---:|")
    for variant, count in steps.items():
        print(f"| {variant} | {count / 1e6:.3f} M | {count / steps[NO_OPTION]:.3f} |")
    return steps


if __name__ == "__main__":
    main()
