"""The tables and plots of docs/experiments/real_models.md, from the `results.csv` files of `lost_in_the_middle.py`
runs (one per model, pair count and seed).

    python examples/real_models_report.py outputs/real_model_runs/*/pairs*/seed*/results.csv \
        --output-dir docs/experiments

For each (model, task, pairs, mitigation, choice): the mean accuracy over slots and the worst slot's, each the mean over
seeds with the spread (min-max over seeds), the seconds per prompt, the settings of each seed; and a verdict against
no mitigation on the same prompts: `helps` when the worst slot rises by at least 0.10 and the mean does not fall, on
every seed; `hurts` when the mean falls by more than 0.05 on every seed; `neutral` otherwise. Writes
`real_models_tables<label>.md` and one `real_models_<model>_<pairs><label>.png` (accuracy by slot) per model and pair
count, `--label` naming a group of runs reported apart (e.g. `_calibration`).
"""

import argparse
import csv
import statistics
from pathlib import Path

from experiment_common import pyplot, save_figure, table_lines
from lost_in_the_middle_options import OPTION_CLASSES

NONE = "none"
MITIGATIONS = (NONE, *OPTION_CLASSES)
COLORS = [f"C{index}" for index in range(10)]


def read(paths: list[Path]) -> dict:
    """(model, keys, prompt, pairs, mitigation, choice) -> seed -> {"accuracy": by slot, "settings", "seconds"}. A slot
    given twice for the same seed (two runs of one condition, such as the model without mitigation in each run of some
    methods) must have the same accuracy: greedy decoding of the same prompts gives the same answers."""
    runs = {}
    for path in paths:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                task = (Path(row["model"]).name, row["keys"], row["prompt"], int(row["num_documents"]))
                seed = runs.setdefault((*task, row["mitigation"], row["choice"]), {}).setdefault(
                    int(row["seed"]), {"accuracy": {}}
                )
                if seed["accuracy"].get(int(row["slot"]), float(row["accuracy"])) != float(row["accuracy"]):
                    raise SystemExit(
                        f"{path}: {row['mitigation']} ({row['choice']}) seed {row['seed']} slot {row['slot']} has "
                        f"accuracy {row['accuracy']} here and {seed['accuracy'][int(row['slot'])]} in another results "
                        "file: two runs of one condition that disagree"
                    )
                seed["accuracy"][int(row["slot"])] = float(row["accuracy"])
                seed["settings"], seed["seconds"] = row["settings"], float(row["seconds_per_prompt"])
    return runs


def summary(seeds: dict) -> dict[int, tuple[float, float]]:
    """seed -> (mean over slots, worst slot)."""
    return {
        seed: (statistics.fmean(run["accuracy"].values()), min(run["accuracy"].values())) for seed, run in seeds.items()
    }


def verdict(mine: dict, none: dict) -> str:
    seeds = sorted(set(mine) & set(none))
    if not seeds:
        return "n/a (no seed run with none)"
    # accuracies are fractions of a few prompts, compared as such: in floats 0.3 - 0.2 is 0.0999... and 0.65 - 0.6 is
    # 0.0500...04, which would miss or pass the thresholds they meet exactly
    worst_gain = [round(mine[s][1] - none[s][1], 9) for s in seeds]
    mean_change = [round(mine[s][0] - none[s][0], 9) for s in seeds]
    if all(gain >= 0.10 and change >= 0 for gain, change in zip(worst_gain, mean_change, strict=True)):
        return "helps"
    if all(change < -0.05 for change in mean_change):
        return "hurts"
    return "neutral"


def spread(values: list[float], digits: int) -> str:
    mean = f"{statistics.fmean(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(runs: dict) -> list[str]:
    lines = []
    for (model, keys, prompt, pairs, mitigation, choice), seeds in runs.items():
        none = runs.get((model, keys, prompt, pairs, NONE, "paper"))
        if none is None:
            raise SystemExit(f"{model} ({keys} keys, {prompt}, {pairs} pairs) has no run of none to compare with")
        mine = summary(seeds)
        cells = {
            "model": model,
            "task": f"{keys}, {prompt}",
            "pairs": str(pairs),
            "mitigation": mitigation,
            "choice": choice,
            "settings": "; ".join(dict.fromkeys(run["settings"] for run in seeds.values())),
            "verdict": "" if mitigation == NONE else verdict(mine, summary(none)),
            "mean": spread([mean for mean, _ in mine.values()], 3),
            "worst slot": spread([worst for _, worst in mine.values()], 2),
            "s/prompt": f"{statistics.fmean(run['seconds'] for run in seeds.values()):.2f}",
            "seeds": ", ".join(map(str, sorted(seeds))),
        }
        lines.append(list(cells.values()))
    return table_lines(list(cells), lines, left=7)


def plot(runs: dict, output_dir: Path, label: str = "") -> list[Path]:
    plt, written = pyplot(), []
    for task in dict.fromkeys(key[:4] for key in runs):
        model, _, _, pairs = task
        figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for axis, choice in zip(axes, ("paper", "tuned"), strict=True):
            for (*condition_task, mitigation, kind), seeds in runs.items():
                if tuple(condition_task) != task or (kind != choice and mitigation != NONE):
                    continue
                slots = sorted(next(iter(seeds.values()))["accuracy"])
                curve = [statistics.fmean(run["accuracy"][slot] for run in seeds.values()) for slot in slots]
                color = COLORS[MITIGATIONS.index(mitigation) % len(COLORS)]  # one colour per method in both panels
                width = 2.5 if mitigation == NONE else 1.2
                axis.plot(slots, curve, marker="o", label=mitigation, linewidth=width, color=color)
            axis.set(
                title=f"{model}, {pairs} pairs: {choice} settings", xlabel="slot of the gold pair", ylim=(-0.02, 1.02)
            )
        axes[0].set_ylabel("accuracy (mean over seeds)")
        for axis in axes:
            axis.legend(fontsize="small", loc="lower left")
        path = output_dir / f"real_models_{model}_{pairs}{label}.png"
        save_figure(figure, path, dpi=110, bbox_inches="tight")
        written.append(path)
    return written


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="results.csv files of lost_in_the_middle.py runs")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/real_model_runs"))
    parser.add_argument("--label", default="", help="ends the written files' names: a group of runs reported apart")
    args = parser.parse_args(argv)
    runs = read(args.results)
    text = "\n".join(table(runs))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"real_models_tables{args.label}.md").write_text(text + "\n")
    plot(runs, args.output_dir, args.label)
    print(text)
    return text


if __name__ == "__main__":
    main()
