"""``ipu_standins.popxl_custom_ops.add_op``, where a PopXL program would bind a custom op: the
op's host function runs with the graph's other ops in creation order, its output shapes
come from running it once on zeros, and ``out_dtypes`` names what torch cannot tell apart
(FP8 codes are uint8)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipu_standins.popxl as xl
from ipu_standins.popxl_custom_ops import add_op


def test_outputs_take_the_shapes_and_dtypes_the_function_gives():
    calls = []

    def concat_and_sum(a, b):
        calls.append((a.clone(), b.clone()))
        joined = torch.cat([a, b])
        return joined, joined.sum().to(torch.int32)

    ir = xl.Ir()
    with ir.main_graph:
        a, b = xl.constant(np.float32([1, 2])), xl.constant(np.float32([3, 4, 5]))
        joined, total = add_op("concat_and_sum", concat_and_sum, [a, b])
        assert (joined.shape, joined.dtype, total.shape, total.dtype) == (
            (5,), xl.float32, (), xl.int32)
        streams = [xl.d2h_stream(t.shape, t.dtype, n) for t, n in ((joined, "j"), (total, "t"))]
        for stream, tensor in zip(streams, (joined, total)):
            xl.ops.host_store(stream, tensor)
    assert len(calls) == 1 and not calls[0][0].any()  # once on zeros, for the shapes
    with xl.Session(ir) as session:
        out = session.run()
    assert np.array_equal(out[streams[0]], [1, 2, 3, 4, 5]) and out[streams[1]] == 15
    assert len(calls) == 2 and torch.equal(calls[1][1], torch.tensor([3.0, 4.0, 5.0]))


def test_out_dtypes_name_fp8_codes():
    def codes(x):
        return (x * 0).to(torch.uint8)

    ir = xl.Ir()
    with ir.main_graph:
        x = xl.constant(np.float32([1, 2]))
        (fp8,) = add_op("codes", codes, [x], [xl.float8_152])
        assert fp8.dtype is xl.float8_152
        with pytest.raises(TypeError, match="no PopXL stand-in dtype"):
            add_op("codes", codes, [x])


def test_the_op_runs_in_creation_order_with_the_graph_s_other_ops():
    ir = xl.Ir()
    with ir.main_graph:
        total = xl.variable(np.float32([1, 1]), name="total")
        before = add_op("read", torch.clone, [total])[0]
        xl.ops.var_updates.accumulate_(total, xl.constant(np.float32([1, 2])))
        after = add_op("read", torch.clone, [total])[0]
        streams = {}
        for name, t in (("before", before), ("after", after)):
            streams[name] = xl.d2h_stream(t.shape, t.dtype, name)
            xl.ops.host_store(streams[name], t)
    with xl.Session(ir) as session:
        out = session.run()
    assert out[streams["before"]].tolist() == [1, 1] and out[streams["after"]].tolist() == [2, 3]


def test_inputs_from_another_graph_are_refused_and_subgraphs_take_ops():
    ir = xl.Ir()
    with ir.main_graph:
        outside = xl.constant(np.float32([2, 3]))
        with pytest.raises(ValueError, match="not in the current graph"):
            ir.create_graph(lambda t: add_op("mul", torch.mul, [t, outside])[0], outside)
        graph = ir.create_graph(lambda t: add_op("square", torch.square, [t])[0], outside)
        (squared,) = xl.ops.call(graph, outside)
        stream = xl.d2h_stream(squared.shape, squared.dtype, "squared")
        xl.ops.host_store(stream, squared)
    with xl.Session(ir) as session:
        assert session.run()[stream].tolist() == [4, 9]
