"""Does unit scaling still matter under fine-grained FP8 recipes? The figure and table of a
seeded ``compare --recipes`` run.

Reads the ``compare.json`` files that ``ipu-unit-scaling compare --recipes ... --seeds N``
wrote and, for every recipe, takes each FP8 run's gap to the FP32 run of the same model and
seed (plain against ``fp32``, unit-scaled against ``unit-fp32``), so that each model is judged
against itself at its own learning rate. Writes ``gaps.md`` (mean and sample standard
deviation over seeds) and ``gaps.png`` (the same, as bars) into ``--out``.

    python scripts/fp8_recipe_result.py runs/recipes/compare.json --out docs/results/fp8-recipes
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ipu_unit_scaling.training.precision import regime_settings

MODELS = ("plain", "unit")
BASELINES = {"plain": "fp32", "unit": "unit-fp32"}
LABELS = {"plain": "plain GPT", "unit": "unit-scaled GPT"}


def recipe_gaps(paths: Sequence[Path]) -> Dict[str, Dict[str, List[float]]]:
    """recipe -> model kind -> per-seed gap (percent) to that model's own fp32 run."""
    gaps: Dict[str, Dict[str, List[float]]] = {}
    for path in paths:
        rows = {row["regime"]: row for row in json.loads(path.read_text())["regimes"]}
        for regime, row in rows.items():
            kind, dtype, recipe = regime_settings(regime)
            if dtype != "fp8" or kind not in MODELS:
                continue
            baseline = rows[BASELINES[kind]]
            if baseline["seeds"] != row["seeds"]:
                raise ValueError(f"{path}: {regime} and its baseline ran other seeds")
            per_seed = [100.0 * (loss - base) / base if loss is not None else float("inf")
                        for loss, base in zip(row["losses"], baseline["losses"])]
            gaps.setdefault(recipe, {})[kind] = per_seed
    return gaps


def summary(values: List[float]) -> Tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(gaps: Dict[str, Dict[str, List[float]]]) -> str:
    lines = ["| recipe | plain GPT: gap to fp32 | unit-scaled GPT: gap to unit-fp32 | "
             "per seed (plain; unit) |", "|---|---|---|---|"]
    for recipe, by_kind in gaps.items():
        cells = []
        for kind in MODELS:
            mean, std = summary(by_kind[kind])
            cells.append(f"{mean:+.2f}% ± {std:.2f}%")
        seeds = "; ".join(", ".join(f"{v:+.2f}" for v in by_kind[kind]) for kind in MODELS)
        lines.append(f"| {recipe} | {cells[0]} | {cells[1]} | {seeds} |")
    return "\n".join(lines)


def figure(gaps: Dict[str, Dict[str, List[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(gaps)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for offset, kind in zip((-width / 2, width / 2), MODELS):
        stats = [summary(gaps[recipe][kind]) for recipe in recipes]
        ax.bar([i + offset for i in range(len(recipes))], [m for m, _ in stats], width,
               yerr=[s for _, s in stats], capsize=3, label=LABELS[kind])
    ax.axhline(0.0, color="black", linewidth=0.8)
    # Linear below 0.5 %, logarithmic above: the static gap and the FP8 ones on one axis.
    ax.set_yscale("symlog", linthresh=0.5)
    lowest = min(m - sd for by_kind in gaps.values()
                 for m, sd in (summary(v) for v in by_kind.values()))
    ax.set_ylim(bottom=min(0.0, lowest) - 0.05)
    ax.set_xticks(range(len(recipes)))
    ax.set_xticklabels(recipes)
    ax.set_ylabel("final validation loss: gap to own FP32 (%)")
    ax.set_title("Low-precision recipes on the plain and the unit-scaled GPT "
                 "(mean ± std over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_json", type=Path, nargs="+",
                        help="compare.json of seeded compare --recipes runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gaps = recipe_gaps(args.compare_json)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gaps.md").write_text(table(gaps) + "\n")
    figure(gaps, args.out / "gaps.png")
    print(table(gaps))


if __name__ == "__main__":
    main()
