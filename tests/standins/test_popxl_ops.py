"""``popxl.ops`` of the PopXL stand-in against the semantics PopXL documents for each op
(popart: python/popxl/python_files/ops/*.py), with NumPy (float64 where rounding matters) as
the oracle: reductions, elementwise and logical ops, casts, shapes, the neural-net ops, calls
of subgraphs, host I/O, variable updates and the FP8 ops' argument checks.

Float32 results are compared with float64 references to within ``n * u * scale``, u = 2**-24
float32's unit roundoff and n a bound on the roundings on the op's path (stated per test)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ipu_standins.popxl as xl

U32 = 2.0 ** -24


def _run(build):
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
        results = session.run()
    return {name: results[stream] for name, stream in streams.items()}


def _assert_close(actual, expected, roundings):
    expected = np.asarray(expected, np.float64)
    bound = roundings * U32 * max(1.0, float(np.max(np.abs(expected))))
    assert np.max(np.abs(actual.astype(np.float64) - expected)) <= bound


X = np.array([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]], np.float32)


def test_reductions_over_axes_keep_the_input_dtype():
    half = X.astype(np.float16)
    out = _run(lambda ir: {
        "sum": xl.ops.sum(xl.constant(X)), "sum0": xl.ops.sum(xl.constant(X), 0),
        "sum_keep": xl.ops.sum(xl.constant(X), [-1], keepdims=True),
        "max1": xl.ops.max(xl.constant(X), 1), "half": xl.ops.sum(xl.constant(half), 1)})
    # Small integers: every sum is exact.
    assert out["sum"] == X.sum() and np.array_equal(out["sum0"], X.sum(0))
    assert out["sum_keep"].shape == (2, 1) and np.array_equal(out["sum_keep"][:, 0], X.sum(1))
    assert np.array_equal(out["max1"], X.max(1))
    assert out["half"].dtype == np.float16 and np.array_equal(out["half"], half.sum(1))


def test_elementwise_and_logical_ops():
    values = np.array([-1.0, 0.0, 2.0, np.inf, np.nan], np.float32)

    def build(ir):
        v, zero = xl.constant(values), xl.constant(np.zeros(5, np.float32))
        positive = xl.ops.greater(v, zero)
        return {"abs": xl.ops.abs(v), "sqrt": xl.ops.sqrt(xl.constant(np.float32([4, -1]))),
                "pow": xl.ops.pow(xl.constant(np.float32([1, 2, 3])), 2),
                "finite": xl.ops.isfinite(v), "positive": positive,
                "both": xl.ops.logical_and(positive, xl.ops.isfinite(v)),
                "not": xl.ops.logical_not(positive),
                "where": xl.ops.where(positive, v, zero)}

    out = _run(build)
    assert np.array_equal(out["abs"], np.abs(values), equal_nan=True)
    assert out["sqrt"][0] == 2 and np.isnan(out["sqrt"][1])
    assert np.array_equal(out["pow"], [1, 4, 9])
    assert out["finite"].tolist() == [True, True, True, False, False]
    assert out["positive"].tolist() == [False, False, True, True, False]  # NaN > 0 is false
    assert out["both"].tolist() == [False, False, True, False, False]
    assert out["not"].tolist() == [True, True, False, False, True]
    assert np.array_equal(out["where"], [0, 0, 2, np.inf, 0])


def test_cast_truncates_towards_zero_and_clip_keeps_integers_integral():
    values = np.array([-1.7, -0.5, 1.7, 2.5], np.float32)

    def build(ir):
        v = xl.constant(values)
        ints = xl.constant(np.array([-3, -1, 2, 5], np.int32))
        with pytest.raises(TypeError, match="pow2scale_cast_to_fp8"):
            xl.ops.cast(v, xl.float8_143)
        return {"int": xl.ops.cast(v, xl.int32), "half": xl.ops.cast(v, xl.float16),
                "clip_int": xl.ops.clip(ints, -1.5, 2.5),
                "clip": xl.ops.clip(xl.constant(np.float32([-5, 0.25, np.nan])), -1, 1)}

    out = _run(build)
    assert out["int"].tolist() == [-1, 0, 1, 2]
    assert np.array_equal(out["half"], values.astype(np.float16))
    assert out["clip_int"].dtype == np.int32 and out["clip_int"].tolist() == [-1, -1, 2, 2]
    assert np.array_equal(out["clip"], [-1, 0.25, np.nan], equal_nan=True)


def test_split_and_gather_follow_numpy():
    table = np.arange(24, dtype=np.float32).reshape(4, 6)
    indices = np.array([[3, 0], [1, 1]], np.int32)

    def build(ir):
        t = xl.constant(table)
        with pytest.raises(ValueError, match="does not divide"):
            xl.ops.split(t, 4, axis=1)
        halves = xl.ops.split(t, 2, axis=-1)
        parts = xl.ops.split(t, [1, 3])
        return {"h0": halves[0], "h1": halves[1], "p1": parts[1],
                "rows": xl.ops.gather(t, xl.constant(indices)),
                "cols": xl.ops.gather(t, xl.constant(indices), axis=1)}

    out = _run(build)
    assert np.array_equal(out["h0"], table[:, :3]) and np.array_equal(out["h1"], table[:, 3:])
    assert np.array_equal(out["p1"], table[1:])
    assert np.array_equal(out["rows"], np.take(table, indices, axis=0))
    assert np.array_equal(out["cols"], np.take(table, indices, axis=1))


def test_layer_norm_softmax_and_geluerf():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    w, b = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    out = _run(lambda ir: {
        "ln": xl.ops.layer_norm(xl.constant(x), xl.constant(w), xl.constant(b), eps=1e-3),
        "softmax": xl.ops.softmax(xl.constant(x), axis=1),
        "gelu": xl.ops.geluerf(xl.constant(x))})
    # Bounds: layer norm's 5-term mean and variance, rsqrt, scale and shift take under 64
    # roundings; softmax's exp, 5-term sum and division under 32; GELU's erf and products 16.
    x64 = x.astype(np.float64)
    mean, var = x64.mean(1, keepdims=True), x64.var(1, keepdims=True)  # biased variance
    _assert_close(out["ln"], (x64 - mean) / np.sqrt(var + 1e-3) * w + b, 64)
    exp = np.exp(x64 - x64.max(1, keepdims=True))
    _assert_close(out["softmax"], exp / exp.sum(1, keepdims=True), 32)
    erf = np.vectorize(math.erf)
    _assert_close(out["gelu"], x64 * 0.5 * (1 + erf(x64 / math.sqrt(2))), 16)


def test_nll_loss_of_probabilities_and_its_popart_gradient():
    probs = np.array([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5], [0.125, 0.125, 0.75]], np.float32)
    labels = np.array([0, 0, 2], np.int32)
    # -log(max(p, 1e-7)) at each label: row 1's zero probability is clamped.
    losses = -np.log(np.maximum(probs[np.arange(3), labels].astype(np.float64), 1e-7))

    def build(ir):
        p, y = xl.constant(probs), xl.constant(labels)
        with pytest.raises(NotImplementedError):
            xl.ops.nll_loss(p, y, ignore_index=0)
        with pytest.raises(ValueError, match="reduction"):
            xl.ops.nll_loss(p, y, reduction="max")
        graph = ir.create_graph(lambda q, t: xl.ops.nll_loss(q, t, reduction="sum"), p, y)
        grad = xl.transforms.autodiff(graph, grads_required=[graph.inputs[0]])
        info = xl.ops.call_with_info(graph, p, y)
        (dp,) = xl.ops.call(grad.graph, xl.constant(np.float32(1.0)),
                            inputs_dict=grad.inputs_dict(info))
        return {"mean": xl.ops.nll_loss(p, y), "none": xl.ops.nll_loss(p, y, reduction="none"),
                "sum": info.outputs[0], "dp": dp}

    out = _run(build)
    # log and negation: 4 roundings; then a 3-term sum (and a division): 8.
    _assert_close(out["none"], losses, 4)
    _assert_close(out["mean"], losses.mean(), 8)
    _assert_close(out["sum"], losses.sum(), 8)
    # PopART's gradient: -1 / max(p, 1e-10) at the label, zero elsewhere (1e-10 rounded to
    # float32, then one division: 2 roundings).
    expected = np.zeros((3, 3))
    expected[np.arange(3), labels] = -1 / np.maximum(probs[np.arange(3), labels], 1e-10)
    _assert_close(out["dp"], expected, 2)


def test_calls_map_graph_tensors_to_the_caller_s():
    def build(ir):
        a = xl.constant(np.float32([1, 2]))
        b = xl.constant(np.float32([10, 20]))
        graph = ir.create_graph(lambda x, y: [x + y, x * y], a, b)
        info = xl.ops.call_with_info(graph, a, inputs_dict={graph.inputs[1]: b})
        assert info.graph_to_parent(graph.inputs[0]) is a
        assert info.graph_to_parent(graph.outputs[1]) is info.outputs[1]
        with pytest.raises(ValueError, match="neither an input nor an output"):
            info.graph_to_parent(a)
        with pytest.raises(ValueError, match="missing inputs"):
            xl.ops.call(graph, a)
        with pytest.raises(ValueError, match="given twice"):
            xl.ops.call(graph, a, b, inputs_dict={graph.inputs[0]: a})
        with pytest.raises(ValueError, match="has 2 inputs"):
            xl.ops.call(graph, a, b, a)
        (scaled, _) = xl.ops.call(graph, a, np.float32([3, 3]))  # a number: a constant
        return {"sum": info.outputs[0], "product": info.outputs[1], "scaled": scaled}

    out = _run(build)
    assert out["sum"].tolist() == [11, 22] and out["product"].tolist() == [10, 40]
    assert out["scaled"].tolist() == [4, 5]


def test_variable_updates_and_host_store_checks():
    ir = xl.Ir()
    with ir.main_graph:
        total = xl.variable(np.float32([1, 1]), name="total")
        copied = xl.variable(np.float32([0, 0]), name="copied")
        step = xl.constant(np.float32([1, 2]))
        updated = xl.ops.var_updates.accumulate_(total, step, xl.constant(np.float32(0.5)))
        xl.ops.var_updates.accumulate_(total, step, 2.0)
        xl.ops.var_updates.copy_var_update_(copied, updated)
        with pytest.raises(ValueError, match="no broadcasting"):
            xl.ops.var_updates.accumulate_(total, xl.constant(np.float32(1)))
        with pytest.raises(TypeError, match="only updates variables"):
            xl.ops.var_updates.accumulate_(step, step)
        with pytest.raises(ValueError, match="does not match"):
            xl.ops.host_store(xl.d2h_stream((3,), xl.float32), step)
    with xl.Session(ir) as session:
        session.run()
        data = session.get_tensors_data([total, copied])
    # total = 1 + 0.5 * step (the value `updated` aliases), then + 2 * step.
    assert data[copied].tolist() == [1.5, 2.0] and data[total].tolist() == [3.5, 6.0]


def test_the_fp8_ops_check_their_arguments():
    ir = xl.Ir()
    with ir.main_graph:
        x = xl.constant(np.float32([1, 2]))
        zero = xl.constant(np.int32(0))
        with pytest.raises(ValueError, match="scalar"):
            xl.ops.pow2scale_cast_to_fp8(x, xl.constant(np.int32([0])), xl.float8_143)
        with pytest.raises(TypeError, match="int32"):
            xl.ops.pow2scale_cast_to_fp8(x, xl.constant(np.float32(0)), xl.float8_143)
        with pytest.raises(TypeError, match="not supported"):
            xl.ops.pow2scale_cast_to_fp8(x, zero, xl.float16)
        with pytest.raises(TypeError, match="float16 or float32"):
            xl.ops.pow2scale_cast_to_fp8(xl.constant(np.int32([1])), zero, xl.float8_152)
        codes = xl.ops.pow2scale_cast_to_fp8(x, zero, xl.float8_143)
        assert codes.dtype is xl.float8_143
        with pytest.raises(TypeError, match="float8_143 or float8_152"):
            xl.ops.matmul_pow2scaled(codes, x, zero)
