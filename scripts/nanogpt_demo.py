"""unit-scaling's release demo on nanoGPT, in this package and in the library itself.

    python scripts/nanogpt_demo.py --nanogpt DIR [--wheel PATH] [--seeds 0 1 2] [--steps 100]
        [--poptorch] [--out docs/results/nanogpt-demo]

``DIR`` is a checkout of karpathy/nanoGPT whose shakespeare-char data was made by its own
``data/shakespeare_char/prepare.py``. Its ``model.py`` is imported unchanged; three models are
trained from the same initial weights on the same batches, as the demo does:

- ``gpt``: nanoGPT's GPT;
- ``fp8_gpt``: ``simulate_fp8(gpt)``;
- ``unit_scaled_fp8_gpt``: ``unit_scale(simulate_fp8(gpt))``, without example inputs.

Each runs in a process of its own, once with ``ipu_unit_scaling`` imported as the package and
once with unit-scaling 0.3.5 itself (``--wheel``, as ``unit_scaling_side_by_side.py`` loads it;
without it the library's rows are left out). The optimiser is the model's own
``configure_optimizers`` (AdamW, weight decay 0.1, betas 0.9 and 0.99), with nanoGPT's warmup and
cosine decay; the demo's learning rates: 1e-3 to 1e-4, and 0.02 to 0.002 for the unit-scaled model.
The runs are named from ``model.backends``, as the demo names them. ``--poptorch`` also trains
this package's three models through ``poptorch.trainingModel`` under ``ipu-unit-scaling
emulate`` (2 replicas, 2 accumulated micro-batches, ``setOptimizer`` every step for the schedule)
and validates through ``poptorch.inferenceModel``.

Written to ``--out``: ``results.csv`` (one row per run), ``report.md`` (the table of final
validation losses, mean and spread over seeds) and ``curves.png`` (training loss per step).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

MODELS = ("gpt", "fp8_gpt", "unit_scaled_fp8_gpt")
# The demo's shape, small enough for a CPU: 2 layers, 64 wide, with nanoGPT's biases; no dropout,
# so that runs differ only by their arithmetic.
MODEL_SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=65, dropout=0.0,
                   bias=True)
BATCH = 32
VALIDATION_BATCHES = 20
WARMUP = 10
LEARNING_RATES = {"gpt": (1e-3, 1e-4), "fp8_gpt": (1e-3, 1e-4),
                  "unit_scaled_fp8_gpt": (0.02, 0.002)}


def learning_rate(step: int, steps: int, peak: float, floor: float) -> float:
    """nanoGPT's schedule: linear warmup, then cosine decay to `floor` at the last step."""
    if step < WARMUP:
        return peak * (step + 1) / (WARMUP + 1)
    ratio = (step - WARMUP) / max(1, steps - 1 - WARMUP)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


# ------------------------------------------------------------------ one run (its own process)


def _run_name(model: Any) -> str:
    """The demo's name for a model, from the transforms it carries."""
    names = [getattr(b, "__qualname__", "") for b in getattr(model, "backends", [])]
    unit = any("unit_scaling" in n for n in names)
    fp8 = any("quantisation" in n for n in names)
    return {(True, True): "unit_scaled_fp8_gpt", (True, False): "unit_scaled_gpt",
            (False, True): "fp8_gpt"}.get((unit, fp8), "gpt")


def run_one(task: Dict[str, Any]) -> Dict[str, Any]:
    import importlib

    import numpy as np
    import torch

    sys.path.insert(0, task["nanogpt"])
    from model import GPT, GPTConfig  # nanoGPT's, unchanged

    # One thread: the models are small, and a run's time should not depend on what else loads
    # the machine (intra-op threads spin while they wait for each other).
    torch.set_num_threads(1)
    transforms = importlib.import_module(task["package"] + ".transforms")
    torch.manual_seed(task["seed"])
    gpt = GPT(GPTConfig(**MODEL_SHAPE))
    model = gpt
    if task["model"] != "gpt":
        model = transforms.simulate_fp8(gpt)
    if task["model"] == "unit_scaled_fp8_gpt":
        model = transforms.unit_scale(model)
    name = _run_name(model)
    if name != task["model"]:
        raise RuntimeError(f"model.backends names the run {name!r}, not {task['model']!r}")

    data_dir = Path(task["nanogpt"], "data", "shakespeare_char")
    data = {split: np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
            for split in ("train", "val")}
    generator = torch.Generator().manual_seed(1000 + task["seed"])

    def batch(split: str) -> Any:
        tokens = data[split]
        starts = torch.randint(len(tokens) - MODEL_SHAPE["block_size"] - 1, (BATCH,),
                               generator=generator)
        rows = [torch.from_numpy(tokens[i:i + MODEL_SHAPE["block_size"] + 1].astype(np.int64))
                for i in starts.tolist()]
        stacked = torch.stack(rows)
        return stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()

    train_batches = [batch("train") for _ in range(task["steps"])]
    val_batches = [batch("val") for _ in range(VALIDATION_BATCHES)]
    peak, floor = LEARNING_RATES[task["model"]]
    optimizer = model.configure_optimizers(0.1, peak, (0.9, 0.99), "cpu")
    started = time.perf_counter()
    if task["poptorch"]:
        losses, val = _train_poptorch(model, optimizer, train_batches, val_batches, peak, floor)
    else:
        losses, val = _train_eager(model, optimizer, train_batches, val_batches, peak, floor)
    return {**{k: task[k] for k in ("package", "model", "seed", "steps", "poptorch")},
            "final_val_loss": val, "train_losses": losses,
            "seconds": round(time.perf_counter() - started, 1)}


def _train_eager(model: Any, optimizer: Any, train: List[Any], val: List[Any], peak: float,
                 floor: float) -> Any:
    import torch

    losses = []
    model.train()
    for step, (x, y) in enumerate(train):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, len(train), peak, floor)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val_loss = sum(model(x, y)[1].item() for x, y in val) / len(val)
    return losses, val_loss


def _train_poptorch(model: Any, optimizer: Any, train: List[Any], val: List[Any], peak: float,
                    floor: float) -> Any:
    import poptorch

    options = poptorch.Options()
    options.replicationFactor(2)
    options.Training.gradientAccumulation(2)
    model.train()
    training = poptorch.trainingModel(model, options, optimizer=optimizer)
    losses = []
    for step, (x, y) in enumerate(train):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, len(train), peak, floor)
        training.setOptimizer(optimizer)
        _, loss = training(x, y)
        losses.append(float(loss.mean()))
    training.detachFromDevice()
    inference_options = poptorch.Options()
    inference_options.replicationFactor(2)
    inference = poptorch.inferenceModel(model.eval(), inference_options)
    val_loss = sum(float(inference(x, y)[1].mean()) for x, y in val) / len(val)
    return losses, val_loss


# ------------------------------------------------------------------ the driver


def _command(task: Dict[str, Any]) -> List[str]:
    worker = [str(Path(__file__).resolve()), "--worker", json.dumps(task)]
    if task["poptorch"]:
        return [sys.executable, "-m", "ipu_unit_scaling", "emulate", "--ipus", "2", *worker]
    return [sys.executable, *worker]


def run_all(tasks: Sequence[Dict[str, Any]], library_site: Optional[Path]) -> List[Dict[str, Any]]:
    results = []
    for number, task in enumerate(tasks, 1):
        environment = dict(os.environ)
        if task["package"] == "unit_scaling":
            assert library_site is not None
            environment["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(library_site), environment.get("PYTHONPATH")) if p)
        label = (f"{task['package']}{' via poptorch' if task['poptorch'] else ''} "
                 f"{task['model']} seed {task['seed']}")
        print(f"[{number}/{len(tasks)}] {label} ...", file=sys.stderr, flush=True)
        done = subprocess.run(_command(task), env=environment, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"nanogpt_demo: {label} failed (exit status {done.returncode})")
        result = json.loads(lines[-1])
        print(f"    final validation loss {result['final_val_loss']:.3f} "
              f"({result['seconds']} s)", file=sys.stderr, flush=True)
        results.append(result)
    return results


def _label(result: Dict[str, Any]) -> str:
    package = "unit-scaling 0.3.5" if result["package"] == "unit_scaling" else "ipu_unit_scaling"
    return package + (", through PopTorch (emulate)" if result["poptorch"] else ", eager")


def report(results: Sequence[Dict[str, Any]], command: str, machine: str) -> str:
    rows: Dict[str, Dict[str, List[float]]] = {}
    for result in results:
        rows.setdefault(_label(result), {}).setdefault(result["model"], []).append(
            result["final_val_loss"])
    steps = results[0]["steps"] if results else 0
    lines = [
        "# unit-scaling's nanoGPT demo, in this package and in the library", "",
        "```bash", command, "```", "",
        f"{machine}. nanoGPT's `model.py` unchanged, 2 layers, 64 wide, block 64, batch "
        f"{BATCH}, {steps} AdamW steps; final validation loss over {VALIDATION_BATCHES} "
        "batches, mean over seeds (lowest to highest in brackets).", "",
        "| run | " + " | ".join(f"`{m}`" for m in MODELS) + " |",
        "|---" * (len(MODELS) + 1) + "|",
    ]
    for label, by_model in rows.items():
        cells = []
        for model in MODELS:
            values = by_model.get(model, [])
            if not values:
                cells.append("")
                continue
            mean = sum(values) / len(values)
            spread = f" ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else ""
            cells.append(f"{mean:.3f}{spread}")
        seeds = max(len(v) for v in by_model.values())
        lines.append(f"| {label} ({seeds} seed{'s' if seeds > 1 else ''}) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[Dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(8, 4.5))
    styles = {"gpt": "-", "fp8_gpt": "--", "unit_scaled_fp8_gpt": ":"}
    for result in results:
        if result["seed"] != 0:
            continue
        axes.plot(result["train_losses"], styles[result["model"]], lw=1.2,
                  label=f"{result['model']}, {_label(result)}")
    axes.set(xlabel="step", ylabel="training loss", ylim=(2.0, 4.5))
    axes.legend(fontsize=7, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout with prepared data")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="unit-scaling 0.3.5's wheel or install directory")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--poptorch", action="store_true",
                        help="also train this package's models through PopTorch (emulate)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_one(json.loads(args.worker))), flush=True)
        return 0
    if args.nanogpt is None:
        parser.error("--nanogpt DIR is required")
    prepared = args.nanogpt / "data" / "shakespeare_char" / "train.bin"
    if not (args.nanogpt / "model.py").is_file() or not prepared.is_file():
        parser.error(f"{args.nanogpt} needs nanoGPT's model.py and "
                     f"{prepared.relative_to(args.nanogpt)}"
                     " (run python prepare.py in data/shakespeare_char)")
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warmup steps")
    base = {"nanogpt": str(args.nanogpt.resolve()), "steps": args.steps}
    tasks = [{**base, "package": "ipu_unit_scaling", "model": m, "seed": s, "poptorch": False}
             for s in args.seeds for m in MODELS]
    site = None
    with tempfile.TemporaryDirectory() as scratch:
        if args.wheel is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from unit_scaling_side_by_side import prepare_site

            site = prepare_site(args.wheel, Path(scratch), download=False)
            tasks += [{**base, "package": "unit_scaling", "model": m, "seed": s,
                       "poptorch": False} for s in args.seeds for m in MODELS]
        if args.poptorch:
            tasks += [{**base, "package": "ipu_unit_scaling", "model": m, "seed": s,
                       "poptorch": True} for s in args.seeds[:1] for m in MODELS]
        results = run_all(tasks, site)
    command = "python scripts/nanogpt_demo.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]))
    text = report(results, command, _machine())
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        with open(args.out / "results.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["package", "poptorch", "model", "seed", "steps", "final_val_loss",
                             "seconds"])
            for r in results:
                writer.writerow([r["package"], r["poptorch"], r["model"], r["seed"], r["steps"],
                                 f"{r['final_val_loss']:.4f}", r["seconds"]])
        plot(results, args.out / "curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
