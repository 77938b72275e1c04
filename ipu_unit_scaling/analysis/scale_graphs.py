"""unit-scaling's analysis of a `track_scales` graph (its ``unit_scaling.analysis`` path):
`graph_to_dataframe`, `plot`, and `visualiser` with `example_batch` for a Hugging Face causal LM.

The graph comes from :func:`ipu_unit_scaling.transforms.track_scales`: after a forward (and
backward) pass, ``module.scales_graph()`` carries a `Metrics` on each node that produced a
floating-point tensor. One row per node and direction (``fwd`` for the tensor, ``bwd`` for its
gradient) with the metrics as columns; `plot` draws log2 of one metric per row, forward and
backward side by side, after pruning the nodes that are not floating-point tensors (and, by
default, those that keep their input's scale). pandas is needed for the data frame only,
matplotlib for the figure, Hugging Face ``datasets`` for `example_batch`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, fx, nn

from ..transforms import (
    Metrics,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    track_scales,
)

__all__ = ["graph_to_dataframe", "plot", "example_batch", "visualiser"]

_COLUMNS = ["layer", "weight tensor", "direction", "tensor type"]


def _rows(graph: fx.Graph) -> List[Dict[str, Any]]:
    rows = []
    for node in graph.nodes:
        if node.op == "output" or "metrics" not in node.meta:
            continue
        weight = bool(node.meta.get("requires_grad", False))
        for direction in ("fwd", "bwd"):
            data = getattr(node.meta["metrics"], direction)
            row: Dict[str, Any] = {
                "layer": node.meta.get("clean_name", node.name), "weight tensor": weight,
                "direction": direction,
                "tensor type": ("" if direction == "fwd" else "grad_") + ("w" if weight else "x")}
            for name in Metrics.names():
                row[Metrics.get_full_name(name)] = None if data is None else getattr(data, name)
            rows.append(row)
    return rows


def graph_to_dataframe(g: fx.Graph) -> Any:
    """The metrics of a `track_scales` graph as a pandas DataFrame: one row per node and
    direction, columns ``layer``, ``weight tensor``, ``direction``, ``tensor type`` and each
    metric's full name (``Metrics.full_names()``)."""
    try:
        import pandas as pd
    except ImportError as error:
        raise ImportError(f"graph_to_dataframe needs pandas ({error})") from error
    return pd.DataFrame(_rows(g), columns=_COLUMNS + Metrics.full_names())


def plot(g: fx.Graph, title: str = "", metric: str = "mean_abs", prune_same_scale: bool = True,
         show_arrows: bool = True, show_error_bars: bool = True,
         show_zero_tensors: bool = False, xmin: Optional[float] = None,
         xmax: Optional[float] = None) -> Any:
    """A matplotlib figure of log2 of `metric` (a `Metrics` name) for each floating-point
    tensor of a `track_scales` graph, top to bottom in graph order, forward and backward;
    returns its axes. `show_error_bars` draws each tensor's log2 range (absolute min to max),
    `show_arrows` joins a forward point to its gradient's, `show_zero_tensors` keeps tensors
    whose metric is 0 (at the left edge), `xmin`/`xmax` fix the axis."""
    if metric not in Metrics.names():
        raise ValueError(f"metric={metric!r} must be one of {Metrics.names()}")
    import matplotlib.pyplot as plt

    g = prune_non_float_tensors(g)
    if prune_same_scale:
        g = prune_same_scale_tensors(g)
    rows = _rows(g)
    layers = list(dict.fromkeys(row["layer"] for row in rows))
    floor = math.log2(torch.finfo(torch.float32).tiny)
    _, axes = plt.subplots(figsize=(10, max(3.0, 0.25 * len(layers) + 1)))
    points: Dict[Tuple[str, str], float] = {}
    for direction, colour in (("fwd", "tab:blue"), ("bwd", "tab:orange")):
        xs, ys = [], []
        for row in rows:
            value = row[Metrics.get_full_name(metric)]
            if row["direction"] != direction or value is None or math.isnan(value):
                continue
            if value == 0 and not show_zero_tensors:
                continue
            x = math.log2(value) if value > 0 else floor
            y = layers.index(row["layer"])
            points[(row["layer"], direction)] = x
            xs.append(x)
            ys.append(y)
            low, high = row["absolute minimum"], row["absolute maximum"]
            if show_error_bars and low is not None and high is not None and high > 0:
                axes.plot([math.log2(low) if low > 0 else floor, math.log2(high)], [y, y],
                          color=colour, alpha=0.2, linewidth=1)
        axes.scatter(xs, ys, color=colour, s=12, label=direction, zorder=3)
    if show_arrows:
        for layer in layers:
            if (layer, "fwd") in points and (layer, "bwd") in points:
                y = layers.index(layer)
                axes.annotate("", xy=(points[(layer, "bwd")], y),
                              xytext=(points[(layer, "fwd")], y),
                              arrowprops={"arrowstyle": "->", "alpha": 0.3})
    axes.set_yticks(range(len(layers)), layers)
    axes.invert_yaxis()
    axes.set_xlabel(f"log2({Metrics.get_full_name(metric)})")
    axes.set_xlim(xmin, xmax)
    axes.axvline(0, color="grey", linewidth=0.5)
    axes.set_title(title)
    axes.legend()
    return axes


def example_batch(tokenizer: Any, batch_size: int, seq_len: int,
                  dataset_path: str = "wikitext", dataset_name: str = "wikitext-103-v1",
                  shuffle_buffer_size: int = 10_000, seed: int = 1472
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """`(input_ids, attention_mask, labels)` of `batch_size` texts of a Hugging Face dataset
    (streamed, shuffled within `shuffle_buffer_size` texts by `seed`), tokenized to `seq_len`
    tokens; the labels are the inputs shifted by one."""
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise ImportError(f"example_batch needs Hugging Face datasets ({error})") from error
    texts = load_dataset(dataset_path, dataset_name, split="train", streaming=True)
    texts = texts.shuffle(seed=seed, buffer_size=shuffle_buffer_size)
    chosen = [row["text"] for row, _ in zip((r for r in texts if len(r["text"]) > 4 * seq_len),
                                            range(batch_size))]
    encoded = tokenizer(chosen, max_length=seq_len + 1, truncation=True, padding="max_length",
                        return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    return ids[:, :-1], mask[:, :-1], ids[:, 1:]


def visualiser(model: nn.Module, tokenizer: Any, batch_size: int, seq_len: int,
               backward: bool = True, dataset_path: str = "wikitext",
               dataset_name: str = "wikitext-103-v1", **plot_kwargs: Any) -> Any:
    """`plot` of the scales of `model` (called ``output, loss = model(inputs, labels)``) on an
    `example_batch`, with its backward pass unless `backward` is False."""
    inputs, _, labels = example_batch(tokenizer, batch_size, seq_len, dataset_path, dataset_name)
    tracked: Any = track_scales(model.to("cpu"))
    _, loss = tracked(inputs, labels)
    if backward:
        loss.backward()
    return plot(tracked.scales_graph(), **plot_kwargs)
