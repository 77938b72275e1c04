"""The core of the PopXL stand-in (dtypes, tensors, graphs, the IR, the session) against
PopXL's (popart: python/popxl/python_files/tensor.py, graph.py, ir.py, session.py): dtype
inference of host data, Tensor's operators and shape properties, ``Ir.create_graph``'s inputs
and outputs, and what ``Session`` accepts and refuses."""
from __future__ import annotations

import numpy as np
import pytest

import ipu_standins.popxl as xl


def _run(build, inputs=None):
    """Build the main graph with ``build(ir) -> {name: tensor}``, run it once, return the
    stored values by name."""
    ir = xl.Ir()
    with ir.main_graph:
        outputs = build(ir)
        streams = {}
        for name, tensor in outputs.items():
            streams[name] = xl.d2h_stream(tensor.shape, tensor.dtype, name)
            xl.ops.host_store(streams[name], tensor)
    with xl.Session(ir, "ipu_model") as session:
        results = session.run(inputs(ir) if inputs else {})
    return {name: results[stream] for name, stream in streams.items()}


@pytest.mark.parametrize("data, expected", [
    (1.5, xl.float32), (np.float64(1.5), xl.float32), (np.ones(2, np.float16), xl.float16),
    (3, xl.int32), (np.arange(3, dtype=np.int64), xl.int32)])
def test_host_data_is_downcast_to_32_bits(data, expected):
    ir = xl.Ir()
    with ir.main_graph:
        made = xl.constant(data)
        assert made.dtype is expected
        assert xl.constant(data, xl.float16).dtype is xl.float16  # an explicit dtype wins
        with pytest.raises(TypeError, match="host_pow2scale_cast_to_fp8"):
            xl.constant(data, xl.float8_143)


def test_variables_live_in_the_main_graph_only_and_hold_a_copy():
    ir = xl.Ir()
    data = np.ones(3, np.float32)
    with ir.main_graph:
        weight = xl.variable(data, name="w")
        graph = ir.create_graph(lambda t: t + 1.0, weight)
        with graph, pytest.raises(ValueError, match="main graph"):
            xl.variable(data)
    data[:] = 5  # after creation: the variable keeps its own copy
    with xl.Session(ir) as session:
        assert np.array_equal(session.get_tensor_data(weight), np.ones(3))


def test_numbers_become_constants_of_the_tensor_s_dtype_on_either_side():
    x = np.array([1.0, 2.0, 4.0], np.float16)

    def build(ir):
        t = xl.constant(x)
        return {"add": t + 1, "rsub": 1 - t, "rdiv": 2 / t, "mul": 3 * t, "neg": -t,
                "sub": t - 0.5, "div": t / 4}

    out = _run(build)
    assert all(v.dtype == np.float16 for v in out.values())
    expected = {"add": x + 1, "rsub": 1 - x, "rdiv": 2 / x, "mul": 3 * x, "neg": -x,
                "sub": x - np.float16(0.5), "div": x / 4}
    for name, value in expected.items():  # exact: every result is a float16 number
        assert np.array_equal(out[name], value.astype(np.float16)), name


def test_an_empty_operand_is_refused():
    ir = xl.Ir()
    with ir.main_graph:
        t = xl.constant(np.ones(2, np.float32))
        with pytest.raises(ValueError, match="0 elements"):
            t + []  # noqa: B018


def test_shape_properties_and_matmul():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)

    def build(ir):
        t = xl.constant(a)
        assert (t.rank, t.nelms, len(t), t.T.shape) == (2, 6, 2, (3, 2))
        assert t.reshape((3, -1)).shape == (3, 2)
        with pytest.raises(ValueError, match="invalid shape"):
            t.reshape((-1, -1))
        with pytest.raises(ValueError, match="scalar"):
            len(xl.constant(1.0))
        cube = xl.constant(np.zeros((2, 3, 4), np.float32))
        assert cube.transpose((1, 2, 0)).shape == (3, 4, 2)
        return {"gram": t @ t.T, "flat": t.reshape((6,))}

    out = _run(build)
    assert np.array_equal(out["gram"], a @ a.T)  # small integers: exact in float32
    assert np.array_equal(out["flat"], a.reshape(6))


def test_create_graph_makes_tensor_arguments_inputs_in_signature_order():
    def body(x, ws, scale, spec):
        return [x * scale + ws[0] * ws[1], spec]

    ir = xl.Ir()
    with ir.main_graph:
        x = xl.constant(np.ones(2, np.float32))
        w0, w1 = xl.constant(np.full(2, 2.0, np.float32)), xl.constant(np.full(2, 3.0,
                                                                                  np.float32))
        graph = ir.create_graph(body, x, [w0, w1], 4.0, xl.TensorSpec((5,), xl.int32))
        assert [(t.shape, t.dtype) for t in graph.inputs] == [
            ((2,), xl.float32)] * 3 + [((5,), xl.int32)]
        assert graph.outputs[1] is graph.inputs[3] and len(graph.outputs) == 2
        with pytest.raises(ValueError, match="is not a tensor of"):
            ir.create_graph(lambda t: x, x)  # an outside tensor returned


def test_session_runs_only_inside_its_context_with_exactly_its_inputs():
    ir = xl.Ir()
    with ir.main_graph:
        stream = xl.h2d_stream((2,), xl.float32, "x")
        out = xl.d2h_stream((2,), xl.float32, "y")
        xl.ops.host_store(out, xl.ops.host_load(stream) * 2.0)
    session = xl.Session(ir, "ipu_model")
    assert session.expected_inputs() == [stream]
    with pytest.raises(ValueError, match="attached"):
        session.run({stream: np.ones(2, np.float32)})
    with session:
        assert np.array_equal(session.run({stream: np.ones(2, np.float32)})[out], [2, 2])
        with pytest.raises(ValueError, match="expected inputs"):
            session.run({})
        with pytest.raises(ValueError, match="shape"):
            session.run({stream: np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="device_desc"):
        xl.Session(ir, "gpu")


def test_variables_keep_their_values_from_run_to_run_and_can_be_written():
    ir = xl.Ir()
    with ir.main_graph:
        total = xl.variable(np.zeros(2, np.float32), name="total")
        scale = xl.variable(np.int32(3), name="scale")
        xl.ops.var_updates.accumulate_(total, xl.constant(np.ones(2, np.float32)))
        computed = total + 1.0
    with xl.Session(ir) as session:
        session.run()
        session.run()
        assert np.array_equal(session.get_tensor_data(total), [2, 2])
        session.write_variable_data(total, np.full(2, 10, np.float32))
        session.write_variable_data(scale, 7)  # a number takes the variable's dtype
        session.run()
        data = session.get_tensors_data([total, scale])
        assert np.array_equal(data[total], [11, 11]) and data[scale] == 7
        with pytest.raises(TypeError, match="float32"):
            session.write_variable_data(total, np.zeros(2, np.float64))
        with pytest.raises(ValueError, match="shape"):
            session.write_variable_data(total, np.zeros(3, np.float32))
        with pytest.raises(TypeError):
            session.write_variable_data(computed, np.zeros(2, np.float32))
        with pytest.raises(TypeError, match="neither a Variable nor a Constant"):
            session.get_tensor_data(computed)


def test_keep_values_holds_every_value_of_the_last_run():
    ir = xl.Ir()
    with ir.main_graph:
        doubled = xl.constant(np.ones(2, np.float32)) * 2.0
        tripled = doubled * 1.5
    session = xl.Session(ir)
    with session:
        session.run()
        assert session.values == {}
        session.keep_values = True
        session.run()
    assert np.array_equal(session.values[tripled].numpy(), [3, 3])
    assert np.array_equal(session.values[doubled].numpy(), [2, 2])


def test_in_sequence_is_a_context_that_changes_nothing_here():
    def build(ir):
        with xl.in_sequence(False):
            a = xl.constant(np.ones(1, np.float32)) + 1.0
        with xl.in_sequence():
            return {"a": a * 3.0}

    assert np.array_equal(_run(build)["a"], [6.0])


def test_tensors_are_dictionary_keys_by_identity():
    ir = xl.Ir()
    with ir.main_graph:
        a, b = xl.constant(np.ones(1, np.float32)), xl.constant(np.ones(1, np.float32))
    assert len({a: 1, b: 2}) == 2 and a != b and a == a  # noqa: PLR0124
