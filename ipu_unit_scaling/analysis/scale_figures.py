"""Scale figures and the `analyse` entry point behind `ipu-unit-scaling analyse`."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from ..models.gpt import GPTConfig, build_gpt
from .report import worst_table
from .tracking import ScaleRecord, range_format, record_scales

__all__ = ["plot_scales", "scales_figure", "analyse", "gpt_config_of"]

# Shading of the representable ranges, widest first so the narrower ones stay visible.
_BANDS = (("FP16", "#d9d9d9"), ("F152", "#a6cee3"), ("F143", "#fdbf6f"))
_MARKERS = {
    "activation": ("o", "#1f78b4", "forward (activation)"),
    "weight": ("s", "#33a02c", "weight"),
    "gradient": ("v", "#e31a1c", "backward (gradient)"),
}


def plot_scales(
    records_by_model: Dict[str, Sequence[ScaleRecord]], path: Union[str, Path],
    title: str = "Tensor scales at initialisation",
) -> Path:
    """Save a figure of log2(std) per tensor, ops in graph order from top to bottom.

    One panel per model; the ranges a static cast to FP16, FP8 E5 (F152) and FP8 E4 (F143) can
    represent (smallest subnormal to max) are shaded.
    """
    import io

    from ..training.plots import load_pyplot
    from ..training.run_directory import atomic_write

    plt = load_pyplot()
    figure = scales_figure(plt, records_by_model, title)
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, dpi=120, format="png")
    finally:
        plt.close(figure)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buffer.getvalue())  # whole or not at all; a full disk names the file
    return path


def scales_figure(
    plt: Any, records_by_model: Dict[str, Sequence[ScaleRecord]], title: str,
) -> Any:
    """The figure of :func:`plot_scales`, laid out so that every label lies inside it."""
    panels = len(records_by_model)
    rows = max((1 + max((r.index for r in recs), default=0)) for recs in records_by_model.values())
    longest = max((len(r.op) for recs in records_by_model.values() for r in recs), default=0)
    # Room for the op names (about 0.055 inch a character at 6 points) beside each panel.
    figure, axes = plt.subplots(
        1, panels, figsize=(panels * (3.8 + 0.055 * longest), max(4.0, 0.14 * rows + 1.5)),
        sharex=True, squeeze=False,
    )
    for axis, (model_name, records) in zip(axes[0], records_by_model.items()):
        for fmt_name, colour in _BANDS:
            fmt = range_format(fmt_name)
            axis.axvspan(math.log2(fmt.min_subnormal), math.log2(fmt.max), color=colour,
                         alpha=0.45, lw=0, label=f"{fmt_name} range")
        for role, (marker, colour, label) in _MARKERS.items():
            chosen = [r for r in records if r.role == role and r.std > 0]
            axis.scatter([r.log2_std for r in chosen], [r.index for r in chosen], s=14,
                         marker=marker, color=colour, label=label, zorder=3)
        axis.axvline(0.0, color="black", lw=0.8)
        labels: Dict[int, str] = {}
        for record in records:
            if record.role != "weight":
                labels.setdefault(record.index, record.op)
        ticks = sorted(labels)
        axis.set_yticks(ticks)
        axis.set_yticklabels([labels[i] for i in ticks], fontsize=6)  # whole: the layer too
        axis.set_ylim(rows, -1)
        axis.set_xlabel("log2(std)")
        axis.set_title(model_name)
    axes[0][-1].legend(loc="lower left", fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def gpt_config_of(config: Any) -> GPTConfig:
    """A `GPTConfig` from itself or from a run config with a `model` section."""
    if isinstance(config, GPTConfig):
        return config
    model = getattr(config, "model", None)
    if model is None:
        raise TypeError(f"expected a GPTConfig or a config with a .model section, got {config!r}")
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{n: getattr(model, n) for n in names if hasattr(model, n)})


def analyse(
    config: Any,
    out_dir: Union[str, Path],
    plain_and_unit: bool = True,
    batch_size: Optional[int] = None,
    seed: int = 0,
) -> Tuple[str, Path]:
    """Track the config's GPT at initialisation; write `scales.png` and the table of the
    tensors nearest the formats' edges, `scales.txt`; return (table, png path).

    `config` is a `GPTConfig` or a run config (`ipu_unit_scaling.training.run_config.Config`): its
    `model`
    section gives the GPT and `training.batch_size` the batch, unless `batch_size` is given
    (default 8 for a bare `GPTConfig`). Tokens are uniform random: at initialisation the scales
    do not depend on the text. With `plain_and_unit`, the plain-torch build and the unit-scaled
    build are shown side by side; otherwise only the config's own build.
    """
    gpt = gpt_config_of(config)
    if batch_size is None:
        training = getattr(config, "training", None)
        batch_size = int(getattr(training, "batch_size", 8))
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, gpt.seq_len)
    input_ids = torch.randint(0, gpt.vocab_size, shape, generator=generator)
    labels = torch.randint(0, gpt.vocab_size, shape, generator=generator)
    builds = [("plain", False), ("unit-scaled", True)] if plain_and_unit else [
        ("unit-scaled" if gpt.unit_scaled else "plain", gpt.unit_scaled)
    ]
    records: Dict[str, Sequence[ScaleRecord]] = {}
    for name, unit_scaled in builds:
        torch.manual_seed(seed)
        model = build_gpt(dataclasses.replace(gpt, unit_scaled=unit_scaled))
        records[name] = record_scales(model, input_ids, labels)
    png = plot_scales(records, Path(out_dir) / "scales.png")
    table = worst_table(records)
    from ..training.run_directory import atomic_write

    atomic_write(Path(out_dir) / "scales.txt", (table + "\n").encode("utf-8"))
    return table, png
