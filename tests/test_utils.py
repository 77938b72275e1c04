"""unit-scaling's two ``utils`` paths: ``ipu_unit_scaling.transforms.utils`` (the helpers a graph
transform is written with, and a transformed torch.fx GraphModule that keeps its transforms when
copied) and ``ipu_unit_scaling.utils`` (the scale tracker under `analyse_module`)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import torch_before
from torch import fx, nn

import ipu_unit_scaling.functional as U
from ipu_unit_scaling import utils as scale_utils
from ipu_unit_scaling.transforms import utils


def test_replace_node_with_function_rewires_users_and_keeps_the_annotation():
    graph = fx.Graph()
    x = graph.placeholder("x")
    gelu = graph.call_function(F.gelu, (x,), type_expr=torch.Tensor)
    graph.output(graph.call_function(torch.neg, (gelu,)))
    utils.replace_node_with_function(graph, gelu, U.torch_map[F.gelu])
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [U.gelu, torch.neg]
    assert next(n for n in graph.nodes if n.target is U.gelu).type is torch.Tensor
    utils.replace_node_with_function(graph, next(n for n in graph.nodes if n.target is U.gelu),
                                     torch.relu, keep_type_expr=False)
    assert next(n for n in graph.nodes if n.target is torch.relu).type is None


def test_torch_nn_modules_become_user_modules_with_their_state():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    x = torch.randn(4, 2)
    before = model(x)
    utils.torch_nn_modules_to_user_modules(model)
    kinds = [type(m) for m in model.modules()][1:]
    assert all(not k.__module__.startswith("torch.nn") for k in kinds), kinds
    assert isinstance(model[0], nn.Linear) and type(model[0]).__name__.startswith(
        "trivial_subclass_modules_linear")
    assert torch.equal(model(x), before)


def test_patch_to_expand_modules_keeps_the_function():
    def forward(x: torch.Tensor) -> torch.Tensor:
        """doc"""
        return x + 1

    patched = utils.patch_to_expand_modules(forward)
    assert patched.__doc__ == "doc" and torch.equal(patched(torch.zeros(1)), torch.ones(1))


def _gelu_to_relu(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.gelu:
            utils.replace_node_with_function(gm.graph, node, F.relu)
    gm.recompile()
    return gm


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


@pytest.mark.skipif(torch_before(2, 1),
                    reason="TorchDynamo refuses Python 3.11 before torch 2.1")
def test_a_transformed_graph_module_keeps_its_transform_when_copied():
    """PopTorch's trainingModel and inferenceModel copy the model (copy.copy); a GraphModule's
    copy is rebuilt from its graph, which would drop the transform."""
    pytest.importorskip("torch._dynamo")
    gm = fx.symbolic_trace(_Net())
    transformed = utils.apply_transform(gm, _gelu_to_relu)
    x = -torch.ones(2, 4)
    want = F.relu(gm.linear(x))
    assert torch.equal(transformed(x), want)
    assert torch.equal(copy.copy(transformed)(x), want)
    assert [n for n, _ in transformed.named_parameters()] == [n for n, _ in gm.named_parameters()]


class _Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return U.gelu(x, constraint=None) * 2.0


@pytest.mark.skipif(torch_before(2, 1),
                    reason="TorchDynamo refuses Python 3.11 before torch 2.1")
def test_a_transform_run_eagerly_captures_each_scale_as_one_op_with_its_gradient():
    """A graph transform runs its captured graph eagerly: a unit-scaled op's scales are in it
    as the one ``scaled_identity`` op each, not as higher-order ops whose forward and backward
    graphs would be interpreted at every call; the values and gradients are eager's."""
    pytest.importorskip("torch._dynamo")
    targets: list = []

    def record(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    transformed = utils.apply_transform(_Scaled(), record)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    eager_x = x.detach().clone().requires_grad_(True)
    out, want = transformed(x), _Scaled()(eager_x)
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    want.backward(grad)
    assert "ipu_unit_scaling.scaled_identity" in targets, targets
    assert not any("autograd_function_apply" in t for t in targets), targets
    # The same float32 ops in both (tolerances: a few roundings of float32).
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=1e-6, atol=1e-6)


def test_scale_tracking_interpreter_records_each_tensor_and_its_gradient():
    gm = fx.symbolic_trace(_Net())
    interpreter = scale_utils.ScaleTrackingInterpreter(gm)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = interpreter.run(x)
    out.sum().backward()
    scales: scale_utils.ScaleDict = interpreter.scales
    assert list(scales) == ["x", "linear", "gelu"]
    assert scales["linear"].forward == pytest.approx(float(gm.linear(x).detach().std()))
    assert all(pair.backward is not None for pair in scales.values())


def test_scale_tracker_is_the_identity_recording_both_passes():
    pair = scale_utils.ScalePair()
    x = torch.randn(100, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = scale_utils.ScaleTracker.track(x, pair)
    (y * 3).sum().backward()
    assert torch.equal(y, x) and pair.forward == pytest.approx(float(x.detach().std()))
    assert pair.backward == 0.0 and torch.equal(x.grad, torch.full_like(x, 3.0))
