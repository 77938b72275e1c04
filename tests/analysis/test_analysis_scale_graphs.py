"""unit-scaling's analysis of a `track_scales` graph (``ipu_unit_scaling.analysis``): `plot`,
`graph_to_dataframe`, `example_batch`."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from ipu_unit_scaling.analysis import example_batch, graph_to_dataframe, plot
from ipu_unit_scaling.transforms import track_scales

pytest.importorskip("torch._dynamo")
try:  # track_scales captures with TorchDynamo, which torch 2.0 refuses on Python 3.11
    torch._dynamo.eval_frame.check_if_dynamo_supported()
except RuntimeError as refusal:
    pytest.skip(f"torch {torch.__version__}: {refusal}", allow_module_level=True)
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _scales_graph(backward: bool = True):
    torch.manual_seed(0)
    tracked = track_scales(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)))
    out = tracked(torch.randn(32, 8))
    if backward:
        out.sum().backward()
    return tracked.scales_graph()


def test_plot_draws_each_float_tensor_forward_and_backward():
    graph = _scales_graph()
    axes = plot(graph, title="scales", metric="std", show_zero_tensors=True)
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert len(labels) >= 5 and axes.get_title() == "scales"
    forward, backward = (collection.get_offsets() for collection in axes.collections[:2])
    assert len(forward) == len(labels) and len(backward) == len(labels)
    shown = plot(graph, metric="std").collections[0].get_offsets()
    assert len(shown) < len(labels)  # the scalar output's std is 0: left out by default
    stds = {n.meta["clean_name"]: n.meta["metrics"].fwd.std for n in graph.nodes
            if "metrics" in n.meta}
    first = labels[0]
    assert forward[0][0] == pytest.approx(math.log2(stds[first]))
    assert axes.get_xlabel() == "log2(standard deviation)"


def test_plot_without_a_backward_pass_draws_forward_only_and_refuses_unknown_metrics():
    axes = plot(_scales_graph(backward=False), prune_same_scale=False, show_error_bars=False)
    assert len(axes.collections[1].get_offsets()) == 0  # no gradients recorded
    with pytest.raises(ValueError, match="metric='median'"):
        plot(_scales_graph(), metric="median")


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="needs pandas")
def test_graph_to_dataframe_has_a_row_per_node_and_direction():
    frame = graph_to_dataframe(_scales_graph())
    assert list(frame.columns[:4]) == ["layer", "weight tensor", "direction", "tensor type"]
    assert set(frame["direction"]) == {"fwd", "bwd"}
    assert "grad_w" in set(frame["tensor type"])


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None,
                    reason="datasets installed (the batch would need the network)")
def test_example_batch_says_what_it_needs():
    with pytest.raises(ImportError, match="needs Hugging Face datasets"):
        example_batch(None, 2, 8)
