"""Side-by-side of u-μP's rules with a choice (ipu_unit_scaling.parametrization.umup_rules).

    python scripts/umup_rules.py [--steps 250] [--seeds 3] [--residual-mults 1 0.25]
        [--learning-rates 1] [--constraints to_output_scale gmean] [--attention constant per-row]
        [--gelu to_output_scale gmean] [--run-root runs/umup-rules]
        [--out docs/results/umup-rules/results.md]

Trains the u-μP GPT of the default config (width 128, depth 2) in fp32 with each combination of
the hidden linears' constraint, attention's output scale and the GELU's constraint (run
directories name the GELU's unless only gmean, the form of runs made before it had a choice,
is asked), at each residual_mult and learning
rate asked, with `ipu-unit-scaling compare --regimes umup-fp32 --seeds N` (one run directory
per combination, reused when rerun), then writes a Markdown table of the final validation
losses (mean ± sample std over seeds) with the exact commands.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

CONSTRAINTS = ("to_output_scale", "gmean")
ATTENTION = ("constant", "per-row")
GELU = ("to_output_scale", "gmean")
Key = Tuple[float, float, str, str, str]


def command(run_dir: Path, steps: int, seeds: int, residual_mult: float, learning_rate: float,
            constraint: str, attention: str, gelu: str) -> List[str]:
    return ["python", "-m", "ipu_unit_scaling", "compare", "--regimes", "umup-fp32",
            "--seeds", str(seeds), "--quiet", "--run-dir", str(run_dir), "--set",
            "model.parametrization=u-mup",
            f"training.steps={steps}", f"model.residual_mult={residual_mult}",
            f"compare.learning_rates.umup-fp32={learning_rate}",
            f"model.umup_hidden_constraint={constraint}",
            f"model.umup_attention_scaling={attention}",
            f"model.umup_gelu_constraint={gelu}"]


def losses(run_dir: Path) -> List[float]:
    result = json.loads((run_dir / "compare.json").read_text())
    return [float(x) for x in result["regimes"][0]["losses"]]


def mean_std(values: Sequence[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {spread:.4f}"


def _constraint_key(constraint: str, others: Tuple[str, str]) -> Tuple[str, str, str]:
    return constraint, others[0], others[1]


def _attention_key(attention: str, others: Tuple[str, str]) -> Tuple[str, str, str]:
    return others[0], attention, others[1]


def _gelu_key(gelu: str, others: Tuple[str, str]) -> Tuple[str, str, str]:
    return others[0], others[1], gelu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--residual-mults", type=float, nargs="+", default=[1.0, 0.25])
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[1.0])
    parser.add_argument("--constraints", nargs="+", choices=CONSTRAINTS, default=CONSTRAINTS)
    parser.add_argument("--attention", nargs="+", choices=ATTENTION, default=ATTENTION)
    parser.add_argument("--gelu", nargs="+", choices=GELU, default=GELU[:1])
    parser.add_argument("--run-root", type=Path, default=Path("runs/umup-rules"))
    parser.add_argument("--out", type=Path, default=Path("docs/results/umup-rules/results.md"))
    args = parser.parse_args()
    # Runs made before the GELU's rule had a choice used gmean and keep their directory names.
    legacy_names = args.gelu == ["gmean"]

    results: Dict[Key, List[float]] = {}
    commands: List[str] = []
    for residual_mult in args.residual_mults:
        for learning_rate in args.learning_rates:
            for constraint in args.constraints:
                for attention in args.attention:
                    for gelu in args.gelu:
                        name = f"res{residual_mult:g}-lr{learning_rate:g}-{constraint}-{attention}"
                        run_dir = args.run_root / (name if legacy_names else f"{name}-gelu_{gelu}")
                        argv = command(run_dir, args.steps, args.seeds, residual_mult,
                                       learning_rate, constraint, attention, gelu)
                        commands.append(shlex.join(argv))
                        print(commands[-1], flush=True)
                        subprocess.run([sys.executable, *argv[1:]], check=True)
                        key = (residual_mult, learning_rate, constraint, attention, gelu)
                        results[key] = losses(run_dir)
                        print(f"  {mean_std(results[key])}", flush=True)

    lines = [
        f"Final validation loss (nats per character) of the u-μP GPT (width 128, depth 2, "
        f"fp32, {args.steps} steps, Adam, seeds 0..{args.seeds - 1}; mean ± sample std over "
        "seeds, then each seed's loss).",
        "",
        "| residual_mult | learning rate | hidden constraint | attention scaling | "
        "GELU constraint | val loss | per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for (residual_mult, learning_rate, constraint, attention, gelu), values in results.items():
        lines.append(f"| {residual_mult:g} | {learning_rate:g} | {constraint} | {attention} | "
                     f"{gelu} | {mean_std(values)} | "
                     f"{', '.join(f'{v:.4f}' for v in values)} |")
    lines += ["", "Paired differences (same seed, same data; mean ± sample std over seeds; "
              "negative: the first form has the lower loss):", "",
              "| residual_mult | learning rate | other rule | difference | val loss difference |",
              "|---|---|---|---|---|"]
    for residual_mult in args.residual_mults:
        for learning_rate in args.learning_rates:
            for first, second, others, rule_of in (
                    ("gmean", "to_output_scale",
                     [(a, g) for a in args.attention for g in args.gelu], _constraint_key),
                    ("constant", "per-row",
                     [(c, g) for c in args.constraints for g in args.gelu], _attention_key),
                    ("gmean", "to_output_scale",
                     [(c, a) for c in args.constraints for a in args.attention], _gelu_key)):
                for other in others:
                    a = results.get((residual_mult, learning_rate, *rule_of(first, other)))
                    b = results.get((residual_mult, learning_rate, *rule_of(second, other)))
                    if a is None or b is None:
                        continue
                    rule = "GELU " if rule_of is _gelu_key else ""
                    lines.append(f"| {residual_mult:g} | {learning_rate:g} | {', '.join(other)} | "
                                 f"{rule}{first} - {rule}{second} | "
                                 f"{mean_std([x - y for x, y in zip(a, b)])} |")
    lines += ["", "Commands (one per row of the first table, in order):", "", "```"] + commands
    lines += ["```", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
