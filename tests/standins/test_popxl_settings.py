"""The PopXL stand-in's own setting, ``fp8_matmul_output``: inside it ``matmul_pow2scaled``
returns its float32 sum of exact FP8 products instead of rounding it to float16, as PopXL
does. The setting is read when the session runs, and it unwinds like a stack."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ipu_standins.popxl as xl
from ipu_standins.popxl_settings import fp8_matmul_output, fp8_matmul_output_dtype

# FP8 E4M3 (bias 8) holds 1 and 2**-6 exactly; [1, 2**-6] . [1, 2**-6] = 1 + 2**-12, which
# float32 holds and float16 (spacing 2**-10 at 1) rounds to 1.
VALUES = np.float32([[1.0, 2.0 ** -6]])


def _session():
    ir = xl.Ir()
    with ir.main_graph:
        zero = xl.constant(np.int32(0))
        lhs = xl.ops.pow2scale_cast_to_fp8(xl.constant(VALUES), zero, xl.float8_143)
        rhs = xl.ops.pow2scale_cast_to_fp8(xl.constant(VALUES.T), zero, xl.float8_143)
        product = xl.ops.matmul_pow2scaled(lhs, rhs, zero)
        assert product.dtype is xl.float16
        stream = xl.d2h_stream(product.shape, product.dtype, "product")
        xl.ops.host_store(stream, product)
    return xl.Session(ir), stream


def test_the_default_is_popxl_s_float16():
    assert fp8_matmul_output_dtype() == torch.float16
    session, stream = _session()
    with session:
        out = session.run()[stream]
    assert out.dtype == np.float16 and out[0, 0] == 1.0


def test_inside_the_sum_comes_back_unrounded_when_the_session_runs_there():
    session, stream = _session()  # built outside: the setting is read at run time
    with fp8_matmul_output(torch.float32), session:
        out = session.run()[stream]
    assert out.dtype == np.float32 and out[0, 0] == 1.0 + 2.0 ** -12


def test_the_setting_nests_and_unwinds_after_an_exception():
    with fp8_matmul_output(torch.float32):
        with fp8_matmul_output(torch.float64):
            assert fp8_matmul_output_dtype() == torch.float64
        assert fp8_matmul_output_dtype() == torch.float32
        with pytest.raises(RuntimeError, match="inside"):
            with fp8_matmul_output(torch.bfloat16):
                raise RuntimeError("inside")
        assert fp8_matmul_output_dtype() == torch.float32
    assert fp8_matmul_output_dtype() == torch.float16
