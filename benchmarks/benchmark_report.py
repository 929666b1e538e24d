"""The report of `benchmark.py`: the markdown tables of the summary rows under a header naming the run, and the
`.md` and `.csv` files."""

import csv
import math
import os
import platform
from pathlib import Path

import torch
import transformers
from benchmark_models import Shape


def fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["n"] == 1 or row["q1"] == row["q3"]:
        return fmt(row["median"])
    return f"{fmt(row['median'])} [{fmt(row['q1'])}, {fmt(row['q3'])}]"


def markdown(rows: list[dict], header: str, notes: dict[str, list[str]]) -> str:
    """The tables of `rows` under `header`; `notes`: lines printed under a section's table, by section."""
    lines = [header, ""]
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["metric"], []).append(row)
    sections = {}
    for group in grouped.values():
        sections.setdefault(group[0]["section"], []).append(group)

    def find(group, variant):
        return next((r for r in group if r["variant"] == variant), None)

    comparison = sections.get("comparison", []) + sections.get("memory", [])
    if comparison:
        lines += [
            "| measurement | unit | SepFormer | GPT-2 | Llama | SepFormer / GPT-2 | SepFormer / Llama | target |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for group in comparison:
            first = group[0]
            unit = next((r["unit"] for r in group if r["unit"] != "ratio"), "ratio")
            direction = " (higher is better)" if first["higher_is_better"] else ""
            lines.append(
                f"| {first['label']} | {unit}{direction} | "
                + " | ".join(
                    cell(find(group, v))
                    for v in ("SepFormer", "GPT-2", "Llama", "SepFormer / GPT-2", "SepFormer / Llama")
                )
                + f" | {first['target']} |"
            )
        lines.append("")
    for section, title in (
        ("extrapolation", "Extrapolation past the trained length"),
        ("mitigations", "Position-bias mitigations"),
        ("compile", "torch.compile"),
    ):
        if section not in sections:
            continue
        lines += [f"### {title}", "", "| measurement | variant | median [q1, q3] | target |", "|---|---|---:|---|"]
        for group in sections[section]:
            for i, row in enumerate(group):
                label = group[0]["label"] if i == 0 else ""
                unit = "" if row["unit"] == "ratio" else " " + row["unit"]
                lines.append(
                    f"| {label} | {row['variant']} | {cell(row)}{unit} | "
                    f"{row['target'] if row['unit'] == 'ratio' else ''} |"
                )
        lines += ["", *notes.get(section, ()), *([""] if notes.get(section) else ())]
    return "\n".join(lines)


def write_outputs(table: str, rows: list[dict], output_dir: Path, stem: str) -> None:
    """`<stem>.md` (the table) and `<stem>.csv` (the rows) under `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{stem}.md").write_text(table + "\n")
    with open(output_dir / f"{stem}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def header(shape: Shape, args, sections: list[str], load_before: float, elapsed: float) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if shape.device == "cuda":
        cpu = f"{torch.cuda.get_device_name()} (host: {cpu})"
    d_pos = shape.hidden_size // shape.heads
    text = (
        f"## SepFormer benchmark{' (tiny preset)' if args.tiny else ''}\n\n"
        f"d_model={shape.hidden_size}, layers={shape.layers}, heads={shape.heads} (SepFormer d_pos = head_dim = "
        f"{d_pos}), vocab={shape.vocab_size}, {shape.dtype} on {shape.device}, sdpa, Llama intermediate="
        f"{shape.llama_intermediate}; sections: {', '.join(sections)}; "
        f"{shape.reps} repetitions, models interleaved; cells are median [q1, q3], ratios the median of "
        f"per-repetition SepFormer / peer ratios.\n"
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"{cpu}, {os.cpu_count()} CPUs, 1-min load average at start {load_before:.2f}, wall time "
        f"{elapsed / 60:.1f} min."
    )
    return text
