"""``popxl.transforms.autodiff`` of the PopXL stand-in against PopXL's (popart:
python/popxl/python_files/transforms/autodiff.py): the gradient graph's expected inputs (the
provided gradients, then forward tensors) and outputs (the required gradients), the
gradients themselves, the mappings between call sites, and the refusals.

The forward graph is y = x * w, z = x * x on small integers, so every gradient is exact."""
from __future__ import annotations

import numpy as np
import pytest

import ipu_standins.popxl as xl

Fwd = xl.transforms.ExpectedConnectionType.Fwd
FwdGrad = xl.transforms.ExpectedConnectionType.FwdGrad
X, W = np.float32([1, 2, 3]), np.float32([4, 5, 6])
GY, GZ = np.float32([1, -1, 2]), np.float32([3, 0, 1])


def _forward(ir):
    x, w = xl.constant(X, name="x"), xl.constant(W, name="w")
    graph = ir.create_graph(lambda a, b: [a * b, a * a], x, w)
    return x, w, graph


def _run(build):
    ir = xl.Ir()
    with ir.main_graph:
        outputs = build(ir)
        streams = {k: xl.d2h_stream(t.shape, t.dtype, k) for k, t in outputs.items()}
        for key, tensor in outputs.items():
            xl.ops.host_store(streams[key], tensor)
    with xl.Session(ir) as session:
        results = session.run()
    return {k: results[s] for k, s in streams.items()}


def test_by_default_every_output_s_gradient_in_and_every_input_s_out():
    def build(ir):
        x, w, graph = _forward(ir)
        grad = xl.transforms.autodiff(graph)
        a, b = graph.inputs
        y, z = graph.outputs
        assert [(c.connection_type, c.fwd_tensor) for c in grad.expected_inputs] == [
            (FwdGrad, y), (FwdGrad, z), (Fwd, a), (Fwd, b)]
        assert [(c.connection_type, c.fwd_tensor) for c in grad.expected_outputs] == [
            (FwdGrad, a), (FwdGrad, b)]
        assert grad.inputs == (y, z, a, b) and grad.outputs == (a, b)
        assert grad.forward_graph is graph and len(grad.graph.inputs) == 4
        info = xl.ops.call_with_info(graph, x, w)
        mapped = grad.inputs_dict(info)
        assert mapped == {grad.graph.inputs[2]: x, grad.graph.inputs[3]: w}
        grad_info = xl.ops.call_with_info(grad.graph, xl.constant(GY), xl.constant(GZ),
                                          inputs_dict=mapped)
        dx, dw = grad_info.outputs
        assert grad.fwd_parent_ins_to_grad_parent_outs(info, grad_info) == {x: dx, w: dw}
        assert grad.fwd_graph_ins_to_grad_parent_outs(grad_info) == {a: dx, b: dw}
        return {"dx": dx, "dw": dw}

    out = _run(build)
    assert np.array_equal(out["dx"], GY * W + GZ * 2 * X)
    assert np.array_equal(out["dw"], GY * X)


def test_chosen_gradients_in_and_out():
    def build(ir):
        x, w, graph = _forward(ir)
        a, b = graph.inputs
        y, z = graph.outputs
        only_w = xl.transforms.autodiff(graph, grads_provided=[y], grads_required=[b])
        assert [c.fwd_tensor for c in only_w.expected_inputs] == [y, a, b]
        # z does not depend on w: its gradient is zero, not missing.
        unused = xl.transforms.autodiff(graph, grads_provided=[z], grads_required=[b])
        info = xl.ops.call_with_info(graph, x, w)
        (dw,) = xl.ops.call(only_w.graph, xl.constant(GY), inputs_dict=only_w.inputs_dict(info))
        (zero,) = xl.ops.call(unused.graph, xl.constant(GZ),
                              inputs_dict=unused.inputs_dict(info))
        return {"dw": dw, "zero": zero}

    out = _run(build)
    assert np.array_equal(out["dw"], GY * X) and np.array_equal(out["zero"], np.zeros(3))


def test_refusals():
    ir = xl.Ir()
    with ir.main_graph:
        x, w, graph = _forward(ir)
        other = ir.create_graph(lambda a: a * 2.0, x)
        grad = xl.transforms.autodiff(graph)
        with pytest.raises(TypeError, match="does not match the graph that was differentiated"):
            grad.inputs_dict(xl.ops.call_with_info(other, x))
        with pytest.raises(ValueError, match="grads_provided"):
            xl.transforms.autodiff(graph, grads_provided=[graph.inputs[0]])
        with pytest.raises(ValueError, match="grads_required"):
            xl.transforms.autodiff(graph, grads_required=[graph.outputs[0]])
        counts = ir.create_graph(lambda n, a: a * 2.0, xl.constant(np.int32([1])), x)
        with pytest.raises(ValueError, match="not a float input"):
            xl.transforms.autodiff(counts, grads_required=[counts.inputs[0]])
