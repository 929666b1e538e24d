"""The extrapolation experiment's report: the rows summarised over seeds, the markdown table, the plot, and the rows
of earlier runs' `results.csv` read back (`--from-csv`)."""

import csv
import math
from pathlib import Path

from experiment_common import mean_and_std, pyplot, save_figure, table_lines, write_csv
from extrapolation_conditions import NATIVE
from extrapolation_task import MULTIPLIERS

RESULT_FIELDS = (
    "model method seed train_length length bits_per_byte bits_per_byte_beyond_L tokens_scored status parameters "
    "train_steps train_bits_per_byte train_seconds"
).split()
FLOAT_FIELDS = ("bits_per_byte", "bits_per_byte_beyond_L")


def summarise(rows: list[dict], args) -> tuple[list[tuple[str, str]], dict]:
    """(model, method) in run order, and {(model, method, length): (mean, std, reason or None)}."""
    keys, cells = list(dict.fromkeys((row["model"], row["method"]) for row in rows)), {}
    for model, method in keys:
        for length in (args.block_size * multiplier for multiplier in MULTIPLIERS):
            same = [r for r in rows if (r["model"], r["method"], r["length"]) == (model, method, length)]
            values = [r["bits_per_byte"] for r in same if r["status"] == "ok"]
            failures = [r["status"] for r in same if r["status"] != "ok"]
            if failures:
                cells[model, method, length] = (float("nan"), float("nan"), failures[0])
            else:
                cells[model, method, length] = (*mean_and_std(values), None)
    return keys, cells


def markdown_table(rows: list[dict], args) -> str:
    keys, cells = summarise(rows, args)
    seeds = sorted({r["seed"] for r in rows})
    parameters = {(r["model"], r["method"]): r["parameters"] for r in rows}
    header = ["model", "method", "params"] + [f"{args.block_size * m} ({m}L)" for m in MULTIPLIERS]
    table, reasons = [], []  # one footnote per row that cannot run somewhere: its first error
    for model, method in keys:
        out = [model, method, f"{parameters[model, method] / 1e6:.3f}M"]
        for length in (args.block_size * m for m in MULTIPLIERS):
            mean, std, reason = cells[model, method, length]
            if reason is not None:
                if not reasons or reasons[-1][0] != (model, method):
                    reasons.append(((model, method), f"{model} / {method} at {length}: {reason}"))
                out.append(f"n/a [{len(reasons)}]")
            else:
                out.append(f"{mean:.3f}" + (f" ± {std:.3f}" if len(seeds) > 1 else ""))
        table.append(out)
    caption = (
        "Bits per byte on held-out text (lower is better): the same "
        f"{args.eval_tokens_used} validation tokens at every length n, cut into windows of n, every token but "
        "the first of each window scored. Trained at "
        f"L = {args.block_size} for {args.max_steps} steps of {args.batch_size} sequences; "
        + (f"mean ± std over seeds {seeds}." if len(seeds) > 1 else f"seed {seeds[0]}.")
    )
    footnotes = [f"[{i}] {reason}" for i, (_, reason) in enumerate(reasons, 1)]
    return "\n".join([*table_lines(header, table, left=3), "", caption, *footnotes])


def read_csv(paths: list[str], args) -> list[dict]:
    """The rows of earlier runs' `results.csv` (e.g. one run per seed, run side by side), typed as a run makes them.
    The preset's flags must be those of the runs: the table's caption and lengths come from them. A file that lacks a
    column or a value, or a cell (model, method, seed, length) that two files (or one) hold twice, is refused: the
    table would count it twice."""
    rows, origin = [], {}
    for path in paths:
        for row in typed_rows(path):
            cell = (row["model"], row["method"], row["seed"], row["length"])
            if cell in origin:
                raise SystemExit(
                    f"--from-csv {origin[cell]} and {path} both hold {row['model']} / {row['method']}, seed "
                    f"{row['seed']}, length {row['length']}: give each run's results once"
                )
            origin[cell] = path
            rows.append(row)
    if not rows:
        raise SystemExit(f"--from-csv {' '.join(paths)}: no rows; give the results.csv that an extrapolation run wrote")
    lengths, steps = sorted({r["train_length"] for r in rows}), sorted({r["train_steps"] for r in rows})
    if lengths != [args.block_size] or steps != [args.max_steps]:
        raise SystemExit(
            f"--from-csv rows were trained at L={lengths} for {steps} steps; give the runs' preset flags "
            f"(now L={args.block_size}, {args.max_steps} steps)"
        )
    first = next(row for row in rows if row["length"] == args.block_size)
    args.eval_tokens_used = first["tokens_scored"] * args.block_size // (args.block_size - 1)
    return rows


def typed_rows(path: str):
    """The rows of one `results.csv`, their numbers as int or float; a missing column or a bad value stops the run."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if missing := [name for name in RESULT_FIELDS if name not in (reader.fieldnames or ())]:
            raise SystemExit(
                f"--from-csv {path} has no column {', '.join(missing)}: give the results.csv that "
                "an extrapolation run wrote"
            )
        for row in reader:
            try:
                typed(row, ("seed", "train_length", "length", "tokens_scored", "parameters", "train_steps"), int)
                typed(row, FLOAT_FIELDS, float)
            except ValueError as error:
                raise SystemExit(f"--from-csv {path}, line {reader.line_num}: {error}") from None
            yield row


def typed(row: dict, names, kind) -> None:
    """`row[name]` as `kind` (int or float) for each of `names`; a ValueError that names the column and value."""
    for name in names:
        try:
            row[name] = kind(row[name])
        except (TypeError, ValueError):  # TypeError: a row shorter than the header (None)
            raise ValueError(
                f"column {name} holds {row[name]!r}, not {'an integer' if kind is int else 'a number'}"
            ) from None


def write_report(rows: list[dict], table: str, args) -> list[Path]:
    """`results.csv`, `results.md` (`table`) and `extrapolation.png` under `--output-dir`; returns their paths."""
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / name for name in ("results.csv", "results.md", "extrapolation.png")]
    write_csv(rows, paths[0], RESULT_FIELDS, float_fields=FLOAT_FIELDS)
    paths[1].write_text(table + "\n")
    plot(rows, args, paths[2])
    return paths


def plot(rows: list[dict], args, path: Path) -> None:
    plt = pyplot()
    keys, cells = summarise(rows, args)
    lengths = [args.block_size * m for m in MULTIPLIERS]
    figure, axes = plt.subplots(figsize=(11, max(5.5, 1.2 + 0.18 * len(keys))))  # tall enough for every legend line
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours; markers tell apart rows that share one
    for index, (model, method) in enumerate(keys):
        points = [(n, *cells[model, method, n][:2]) for n in lengths if cells[model, method, n][2] is None]
        if not points:
            continue
        label = model if method == NATIVE else f"{model} / {method}"
        x, mean, std = zip(*points, strict=True)
        axes.errorbar(
            x,
            mean,
            yerr=[0 if math.isnan(s) else s for s in std],
            fmt=("-" if model.startswith("SepFormer") else "--") + "osD^v"[index // 20 % 5],
            color=colors[index % 20],
            capsize=3,
            markersize=4,
            label=label + (f" (cannot run past {x[-1]})" if len(points) < len(lengths) else ""),
        )
    axes.axvline(args.block_size, color="grey", linestyle=":", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [f"{args.block_size * m}\n({m}L)" for m in MULTIPLIERS])
    if at_l := [cells[k][0] for k in cells if k[2] == args.block_size and cells[k][2] is None]:
        axes.set_ylim(min(at_l) * 0.9, max(at_l) * 2.0)  # keep the interesting range readable; the table has all
    axes.set(xlabel="evaluation length (tokens)", ylabel="bits per byte (validation)")
    axes.set_title(f"Length extrapolation, trained at L = {args.block_size}")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    save_figure(figure, path, dpi=130)
