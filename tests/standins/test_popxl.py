"""The torch stand-in for PopXL (``ipu_standins/popxl/``) against
independent oracles (ml_dtypes, float64, exact fractions), and the FP8 pieces of the PopXL model on
it.

Every test here runs on the stand-in, not on PopXL.
"""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import ipu_standins.popxl as popxl_standin
from ipu_unit_scaling.backends.popxl import (
    popxl_cast_to_fp8,
    popxl_fp8_matmul,
    scaled,
    scaling_bias,
)
from ipu_unit_scaling.fp8 import F143, F152, FP8Config, log2_scale

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

xl = popxl_standin
ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz}


def run(build, inputs=None):
    """Build a main graph with ``build(ir) -> {name: tensor}`` on the stand-in, run it once
    and return the stored values by name."""
    ir = xl.Ir()
    with ir.main_graph, xl.in_sequence():
        outputs = build(ir)
        streams = {}
        for name, tensor in outputs.items():
            streams[name] = xl.d2h_stream(tensor.shape, tensor.dtype, name)
            xl.ops.host_store(streams[name], tensor)
    with xl.Session(ir, "ipu_model") as session:
        results = session.run(inputs or {})
    return {name: results[stream] for name, stream in streams.items()}


def exact_bias(amax: float, max_value: float, margin: int) -> int:
    """floor(log2(max / amax)) - margin clamped to [-31, 31], in exact rational arithmetic."""
    ratio = Fraction(max_value) / Fraction(amax)
    t = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while Fraction(2) ** t > ratio:
        t -= 1
    while Fraction(2) ** (t + 1) <= ratio:
        t += 1
    return max(-31, min(31, t - margin))


# ---------------------------------------------------------------------------- scaling biases


@pytest.mark.parametrize("fmt", [F143, F152], ids=lambda f: f.name)
@pytest.mark.parametrize("margin", [0, 3, 31])
def test_scaling_bias_equals_log2_scale_on_the_standin(fmt, margin):
    """Amaxes 2^-40..2^40, at and one float32 ulp around powers of two and around fmt.max
    times powers of two, and zero: the PopXL graph's bias is the package rule's."""
    amaxes = [0.0]
    for k in range(-40, 41):
        for base in (1.0, fmt.max / 2**7 if fmt is F143 else fmt.max / 2**15):
            centre = np.float32(math.ldexp(base, k))
            amaxes += [centre, np.nextafter(centre, np.float32(0)),
                       np.nextafter(centre, np.float32(np.inf))]
    amax = np.array(amaxes, np.float32)

    def build(ir):
        bias, flag = scaling_bias(xl, xl.constant(amax, xl.float32), fmt, margin)
        return {"bias": bias, "flag": xl.ops.cast(flag, xl.int32)}

    out = run(build)
    expected = [log2_scale(float(a), fmt, margin) for a in amax]
    exact = [0 if a == 0 else exact_bias(float(a), fmt.max, margin) for a in amax]
    assert out["bias"].dtype == np.int32
    assert out["bias"].tolist() == expected == exact
    assert not out["flag"].any()


def test_non_finite_amax_gives_bias_zero_and_the_flag_on_the_standin():
    amax = np.array([np.inf, np.nan, 1.0, 0.0, -np.inf], np.float32)

    def build(ir):
        bias, flag = scaling_bias(xl, xl.constant(amax, xl.float32), F143, 0)
        return {"bias": bias, "flag": xl.ops.cast(flag, xl.int32)}

    out = run(build)
    assert out["bias"].tolist() == [0, 0, 7, 0, 0]  # 240 / 1 -> floor(log2(240)) = 7
    assert out["flag"].tolist() == [1, 1, 0, 0, 1]


# ----------------------------------------------------------------------------------- casts


def _dtype(fmt):
    return xl.float8_143 if fmt is F143 else xl.float8_152


def _random(count, seed=0):
    gen = np.random.default_rng(seed)
    return gen.standard_normal(count) * 2.0 ** gen.integers(-20, 20, count)


@pytest.mark.parametrize("fmt", [F143, F152], ids=lambda f: f.name)
@pytest.mark.parametrize("bias", [-5, 0, 9])
def test_pow2scale_cast_to_fp8_matches_ml_dtypes_on_the_standin(fmt, bias):
    """cast(x * 2^s): round to nearest even; overflow and inf to NaN, like ml_dtypes' fnuz."""
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, fmt.max, 2 * fmt.max, -3 * fmt.max]
    x = np.concatenate([_random(3000), special]).astype(np.float32)

    def build(ir):
        return {"x8": xl.ops.pow2scale_cast_to_fp8(xl.constant(x, xl.float32),
                                                    xl.constant(bias, xl.int32), _dtype(fmt))}

    codes = run(build)["x8"]
    expected = (x.astype(np.float64) * 2.0**bias).astype(np.float32).astype(ML_DTYPES[fmt.name])
    assert np.array_equal(codes, expected.view(np.uint8))


@pytest.mark.parametrize("bias", [-9, 0, 4])
def test_matmul_pow2scaled_is_the_float16_of_the_exact_product_on_the_standin(bias):
    """matmul_pow2scaled(a, b, s) = (a @ b) * 2^s in float16, from the FP8 values (float64
    oracle; the float32 sum of these small products is exact)."""
    gen = np.random.default_rng(1)
    a = gen.standard_normal((5, 7)).astype(ml_dtypes.float8_e4m3fnuz)
    b = (gen.standard_normal((7, 3)) * 100).astype(ml_dtypes.float8_e5m2fnuz)

    def build(ir):
        a8 = xl.ops.pow2scale_cast_to_fp8(xl.constant(a.astype(np.float32), xl.float32),
                                          xl.constant(0, xl.int32), xl.float8_143)
        b8 = xl.ops.pow2scale_cast_to_fp8(xl.constant(b.astype(np.float32), xl.float32),
                                          xl.constant(0, xl.int32), xl.float8_152)
        return {"y": xl.ops.matmul_pow2scaled(a8, b8, xl.constant(bias, xl.int32))}

    y = run(build)["y"]
    exact = a.astype(np.float64) @ b.astype(np.float64) * 2.0**bias
    assert y.dtype == np.float16
    assert np.array_equal(y, exact.astype(np.float16))


def test_matmul_pow2scaled_refuses_a_bias_outside_its_range_on_the_standin():
    def build(ir):
        ones = xl.ops.pow2scale_cast_to_fp8(xl.constant(np.ones((2, 2), np.float32), xl.float32),
                                            xl.constant(0, xl.int32), xl.float8_143)
        return {"y": xl.ops.matmul_pow2scaled(ones, ones, xl.constant(32, xl.int32))}

    with pytest.raises(RuntimeError, match="outside"):
        run(build)


def test_fp8_matmul_undoes_biases_beyond_the_fused_range_on_the_standin():
    """Tiny operands get biases near 31 each; their sum (-62) exceeds matmul_pow2scaled's
    range, and the rest is applied exactly: the product is that of the FP8 values."""
    gen = np.random.default_rng(2)
    a = (gen.standard_normal((4, 6)) * 2.0**-36).astype(np.float32)
    b = (gen.standard_normal((6, 3)) * 2.0**-36).astype(np.float32)
    config = FP8Config()

    def build(ir):
        a8, sa, _ = popxl_cast_to_fp8(xl, xl.constant(a, xl.float32), F143, 0, config)
        b8, sb, _ = popxl_cast_to_fp8(xl, xl.constant(b, xl.float32), F143, 0, config)
        return {"y": popxl_fp8_matmul(xl, a8, sa, b8, sb, 1.0), "sa": sa, "sb": sb}

    out = run(build)
    assert out["sa"] + out["sb"] > 32
    fp8 = ml_dtypes.float8_e4m3fnuz
    codes_a = (a * 2.0 ** int(out["sa"])).astype(fp8).astype(np.float64) * 2.0 ** -int(out["sa"])
    codes_b = (b * 2.0 ** int(out["sb"])).astype(fp8).astype(np.float64) * 2.0 ** -int(out["sb"])
    exact = codes_a @ codes_b
    scale = 2.0 ** (int(out["sa"]) + int(out["sb"]) - 32)  # what the float16 holds
    assert out["y"].dtype == np.float32
    assert np.array_equal(out["y"], ((exact * scale).astype(np.float16).astype(np.float64)
                                     / scale).astype(np.float32))


def test_static_cast_saturates_before_the_cast_on_the_standin():
    x = np.array([1.0, 300.0, -1e6, np.inf], np.float32)

    def build(ir):
        x8, bias, flag = popxl_cast_to_fp8(xl, xl.constant(x, xl.float32), F143, 0,
                                     FP8Config(scaling="static"))
        assert flag is None
        return {"x8": x8, "bias": bias}

    out = run(build)
    assert int(out["bias"]) == 0
    values = out["x8"].view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    assert values.tolist() == [1.0, 240.0, -240.0, 240.0]


# ---------------------------------------------------------------- autodiff and the detach form


def test_detach_form_has_the_forward_value_and_the_backward_scale_on_the_standin():
    """scaled(x, a, b): the value x*a exactly; autodiff's gradient b times the incoming one."""
    x = _random(12, seed=3).astype(np.float32).reshape(3, 4)
    incoming = _random(12, seed=4).astype(np.float32).reshape(3, 4)

    def build(ir):
        value = xl.constant(x, xl.float32)
        graph = ir.create_graph(lambda t: scaled(xl, t, 0.375, 5.0), value)
        grad = xl.transforms.autodiff(graph)
        info = xl.ops.call_with_info(graph, value)
        (dx,) = xl.ops.call(grad.graph, xl.constant(incoming, xl.float32),
                            inputs_dict=grad.inputs_dict(info))
        return {"y": info.outputs[0], "dx": dx}

    out = run(build)
    assert np.array_equal(out["y"], x * np.float32(0.375))
    assert np.array_equal(out["dx"], incoming * np.float32(5.0))


def test_autodiff_refuses_fp8_ops_like_popart_on_the_standin():
    def cast(t):
        return xl.ops.pow2scale_cast_to_fp8(t, xl.constant(0, xl.int32), xl.float8_143)

    ir = xl.Ir()
    with ir.main_graph:
        graph = ir.create_graph(cast, xl.constant(np.ones(3, np.float32), xl.float32))
        with pytest.raises(RuntimeError, match="Floating point 8 is not supported"):
            xl.transforms.autodiff(graph)


def test_graphs_refuse_outside_tensors_and_wrong_inputs_on_the_standin():
    ir = xl.Ir()
    with ir.main_graph:
        outside = xl.constant(np.ones(3, np.float32), xl.float32)
        with pytest.raises(ValueError, match="not in the current graph"):
            ir.create_graph(lambda t: t + outside, outside)
        graph = ir.create_graph(lambda t: t * 2.0, outside)
        with pytest.raises(ValueError, match="needs"):
            xl.ops.call(graph, xl.constant(np.ones(4, np.float32), xl.float32))
        with pytest.raises(TypeError, match="same dtype"):
            outside + xl.constant(np.ones(3, np.int32), xl.int32)


def test_host_transfers_feed_one_row_per_load_on_the_standin():
    ir = xl.Ir()
    ir.num_host_transfers = 2
    with ir.main_graph, xl.in_sequence():
        stream = xl.h2d_stream((3,), xl.float32, "x")
        out = xl.d2h_stream((3,), xl.float32, "y")
        total = xl.variable(np.zeros(3, np.float32), xl.float32, "total")
        for _ in range(2):
            x = xl.ops.host_load(stream)
            xl.ops.var_updates.accumulate_(total, x, 2.0)
            xl.ops.host_store(out, x + total)
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    with xl.Session(ir, "ipu_model") as session:
        result = session.run({stream: rows})[out]
        with pytest.raises(ValueError, match="shape"):
            session.run({stream: rows[0]})
    assert np.array_equal(result, [rows[0] * 3, rows[1] + 2 * (rows[0] + rows[1])])
    assert np.array_equal(session.get_tensor_data(total), 2 * rows.sum(0))
