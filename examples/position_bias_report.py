"""The report of `position_bias.py`: accuracy by gold slot over seeds (mean and 95% interval), as markdown tables,
`results.csv`, `attention.csv` and the plots."""

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from experiment_common import interval95, pyplot, save_figure, table_lines, write_csv
from position_bias_conditions import IN2, MITIGATION_NAMES, NONE, SEARCH_PICK

RESULT_FIELDS = (
    "model mitigation setting seed num_pairs slot accuracy examples status details gold_at_end train_pairs parameters "
    "train_steps train_loss train_seconds finetune_steps finetune_loss finetune_seconds"
).split()
ATTENTION_FIELDS = ["model", "seed", "layer", "head", "group", "attention"]
COLOURS = dict(
    zip(
        MITIGATION_NAMES,
        ["black", *(f"tab:{c}" for c in "blue orange green red purple brown pink olive".split())],
        strict=True,
    )
)


@dataclass
class Curve:
    """A (model, mitigation, setting, num_pairs) cell over seeds: per-slot mean and 95% half-width, and summaries."""

    model: str
    mitigation: str
    setting: str
    num_pairs: int
    status: str
    per_seed: dict  # {seed: [accuracy by slot]}
    gold_at_end: list = field(default_factory=list)  # reordering's rows: each slot's and seed's fraction

    @property
    def mean_by_slot(self) -> list[float]:
        return [statistics.fmean(slot) for slot in zip(*self.per_seed.values(), strict=True)]

    @property
    def interval_by_slot(self) -> list[float]:
        return [interval95(list(slot)) for slot in zip(*self.per_seed.values(), strict=True)]

    @property
    def seed_means(self) -> list[float]:
        return [statistics.fmean(curve) for curve in self.per_seed.values()]

    @property
    def worst_over_best(self) -> float:
        means = self.mean_by_slot
        return min(means) / max(means) if max(means) > 0 else float("nan")


def curves(rows: list[dict]) -> list[Curve]:
    cells = {}
    for row in rows:
        key = (row["model"], row["mitigation"], row["setting"], row["num_pairs"])
        cell = cells.setdefault(key, Curve(*key, row["status"], {}))
        if row["status"] != "ok":  # not evaluated on one seed: the cell says why
            cell.status = row["status"]
        cell.per_seed.setdefault(row["seed"], []).append(row["accuracy"])  # rows come slot by slot
        if row.get("gold_at_end") is not None:  # reordering's rows
            cell.gold_at_end.append(row["gold_at_end"])
    return list(cells.values())


def table_row(curve: Curve, baseline: dict, seeds: list[int]) -> list[str]:
    """The curve's mean ± 95% over seeds (`seeds`: the run's; a curve of fewer names them), worst slot, worst/best,
    change against `baseline` (no mitigation: model -> seed -> mean) on the curve's seeds, ± the 95% interval of the
    paired per-seed changes (which the seeds' spread of each mean overstates: a seed's prompts and model are shared),
    slots."""
    if curve.status != "ok":
        return [curve.model, curve.mitigation, curve.setting, curve.status] + [""] * (curve.num_pairs + 3)
    means, seed_means = curve.mean_by_slot, curve.seed_means
    mean = statistics.fmean(seed_means)
    worst = min(range(curve.num_pairs), key=means.__getitem__)
    base = baseline.get(curve.model, {})
    changes = [own - base[seed] for seed, own in zip(curve.per_seed, seed_means, strict=True) if seed in base]
    delta = "" if curve.mitigation == NONE else f"{statistics.fmean(changes) if changes else float('nan'):+.3f}"
    delta += f" ± {interval95(changes):.3f}" if delta and len(changes) > 1 else ""
    mine = sorted(curve.per_seed)
    spread = f"± {interval95(seed_means):.3f}" if mine == seeds else f"(seeds {mine} of {seeds})"
    summary = [f"**{mean:.3f}** {spread}", f"{means[worst]:.2f} (slot {worst + 1})"]
    summary += [f"{curve.worst_over_best:.2f}", delta, *(f"{a:.2f}" for a in means)]
    return [curve.model, curve.mitigation, curve.setting, *summary]


def pairs_table(every: list[Curve], pairs: int, seeds: list[int], args) -> list[str]:
    """The table of the curves at `pairs` documents, then reordering's gold-at-an-end fractions."""
    mine = [c for c in every if c.num_pairs == pairs]
    baseline = {c.model: dict(zip(c.per_seed, c.seed_means, strict=True)) for c in mine if c.mitigation == NONE}
    header = ["model", "mitigation", "setting", "mean ± 95%", "worst slot", "worst/best", "Δ mean"]
    header += [str(slot) for slot in range(1, pairs + 1)]
    title = "the training length" if pairs == args.num_pairs else f"trained at {args.num_pairs}"
    lines = [f"**{pairs} pairs ({title})**: exact-match accuracy by gold slot, mean over seeds", ""]
    lines += [*table_lines(header, [table_row(curve, baseline, seeds) for curve in mine], left=3), ""]
    if reordered_curves := [c for c in mine if c.gold_at_end]:
        lines += [
            f"Gold at an end after reordering ({pairs} pairs): the fraction of test prompts whose gold "
            f"document the reordering put in the first or last {args.end_slots} slots (the trained end "
            "slots); the table's slots are the gold's before reordering.",
            "",
        ]
        lines += [f"- {c.model}, {c.setting}: {statistics.fmean(c.gold_at_end):.3f}" for c in reordered_curves] + [""]
    return lines


def markdown_table(rows: list[dict], args) -> str:
    every = curves(rows)
    seeds = sorted({r["seed"] for r in rows})
    lines = [line for pairs in args.eval_pairs for line in pairs_table(every, pairs, seeds, args)]
    picks = [
        f"{r['model']}, seed {r['seed']}: {r['details']}"
        for r in rows
        if r["setting"] == SEARCH_PICK and r["slot"] == 1 and r["num_pairs"] == args.num_pairs
    ]
    if picks:
        lines += ["The positional-dimension search's pick (on validation prompts):", ""]
        lines += [f"- {pick}" for pick in picks] + [""]
    over_seeds = f"mean over seeds {seeds}, ± the 95% interval of the mean over seeds. "
    in2 = (
        f" IN2: a copy of each trained model fine-tuned for the stated fraction of its {args.max_steps} steps on "
        "lists of the same task with the answer at every slot uniformly (its own data stream; the same learning "
        f"rate {args.learning_rate:g}, batch size {args.batch_size} and weight decay, a fresh optimiser and "
        "schedule), evaluated with no other mitigation."
    )
    lines.append(
        f"Trained on lists of {args.num_pairs} documents ({args.num_keys} keys, {args.num_values} values), the "
        f"answer in the first or last {args.end_slots} slots with probability {args.gold_at_ends:g} and anywhere "
        f"otherwise, {args.max_steps} steps of {args.batch_size}; {args.eval_per_slot} test prompts per gold slot; "
        + (over_seeds if len(seeds) > 1 else f"seed {seeds[0]}. ")
        + "Δ mean: against the same model with no mitigation, ± the 95% interval of the paired per-seed changes."
        + (in2 if IN2 in args.mitigations else "")
    )
    return "\n".join(lines)


def shown_curves(curves: list[Curve]) -> dict[str, Curve]:
    """Per mitigation: positional scaling at the search's pick (not one picked on the test prompts), each other at its
    setting with the highest mean test accuracy (the first of equals)."""
    by_mitigation = {}
    for curve in curves:
        by_mitigation.setdefault(curve.mitigation, []).append(curve)
    return {
        mitigation: next((c for c in mine if c.setting == SEARCH_PICK), None)
        or max(mine, key=lambda c: statistics.fmean(c.mean_by_slot))
        for mitigation, mine in by_mitigation.items()
    }


def plot_panel(axis, curves: list[Curve], title: str, slots: range) -> None:
    for mitigation, curve in shown_curves(curves).items():
        means, half = torch.tensor(curve.mean_by_slot), torch.tensor(curve.interval_by_slot)
        colour, label = COLOURS[mitigation], NONE if mitigation == NONE else f"{mitigation} {curve.setting}"
        width = 2.5 if mitigation == NONE else 1.2
        axis.plot(slots, means, marker="o", markersize=3, color=colour, label=label, linewidth=width)
        axis.fill_between(slots, (means - half).clamp(min=0), (means + half).clamp(max=1), color=colour, alpha=0.15)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("gold slot")
    axis.set_xticks(list(slots)[:: max(1, len(slots) // 16)])  # at most ~16 labels: 64 slots would overlap
    axis.set_ylim(-0.02, 1.02)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15))  # below: the curves stay visible


def plot_curves(rows: list[dict], args, path: Path) -> None:
    """One panel per model at the training length: no mitigation, positional scaling at the search's pick and each
    other mitigation at its setting with the highest mean test accuracy, each with its 95% band over seeds."""
    plt = pyplot()
    every = [c for c in curves(rows) if c.num_pairs == args.num_pairs and c.status == "ok"]
    models = list(dict.fromkeys(c.model for c in every))
    figure, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False, sharey=True)
    for axis, model in zip(axes[0], models, strict=True):
        mine = [c for c in every if c.model == model]
        plot_panel(axis, mine, f"{model}, {args.num_pairs} pairs", range(1, args.num_pairs + 1))
    axes[0][0].set_ylabel("exact-match accuracy")
    seeds = sorted({r["seed"] for r in rows})
    figure.suptitle(
        f"Key-value retrieval accuracy by the gold pair's position (seeds {seeds}, 95% bands; "
        "positional scaling at the search's pick, the others at their best setting)",
        fontsize=10,
    )
    figure.tight_layout()
    save_figure(figure, path, dpi=120, bbox_inches="tight")


def plot_attention(attention_rows: list[dict], path: Path) -> None:
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in attention_rows))
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        mine = [r for r in attention_rows if r["model"] == model]
        groups = list(dict.fromkeys(r["group"] for r in mine))
        heads = list(dict.fromkeys((r["layer"], r["head"]) for r in mine))
        grid = torch.zeros(len(heads), len(groups))  # mean over seeds
        for r in mine:
            grid[heads.index((r["layer"], r["head"])), groups.index(r["group"])] += r["attention"]
        grid /= len({r["seed"] for r in mine})
        image = axis.imshow(grid.numpy(), aspect="auto", cmap="viridis")
        axis.set_xticks(range(len(groups)), groups, rotation=60, fontsize=7, ha="right")
        axis.set_yticks(range(len(heads)), [f"layer {layer} head {head}" for layer, head in heads], fontsize=7)
        axis.set_title(model, fontsize=9)
        figure.colorbar(image, ax=axis, fraction=0.04)
    figure.suptitle("A_G: last token's mean attention per key position in each group (no mitigation)")
    figure.tight_layout()
    save_figure(figure, path, dpi=120)


def write_results(rows: list[dict], output_dir: Path) -> None:
    write_csv(rows, output_dir / "results.csv", RESULT_FIELDS, float_fields=("accuracy", "gold_at_end"))


def write_report(rows: list[dict], attention_rows: list[dict], table: str, args, output_dir: Path) -> None:
    """`results.md` (the tables), `attention.csv` and the two plots."""
    (output_dir / "results.md").write_text(table + "\n")
    write_csv(attention_rows, output_dir / "attention.csv", ATTENTION_FIELDS, float_fields=("attention",))
    plot_curves(rows, args, output_dir / "position_bias.png")
    plot_attention(attention_rows, output_dir / "attention_by_position.png")
