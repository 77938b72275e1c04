"""The custom op's Python side off the IPU: same numerics as cast_to_fp8, clear errors."""
from __future__ import annotations

import pytest
import torch

from ipu_unit_scaling.backends.poptorch import fp8_custom_op as custom_op
from ipu_unit_scaling.fp8 import F143, F152, NonFiniteAmaxError, cast_to_fp8_reference

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


def test_off_ipu_it_runs_the_host_path():
    if custom_op.running_on_ipu():
        pytest.skip("this checks the host path")
    x = torch.randn(4, 1000) * 7
    for fmt in (F143, F152):
        out = custom_op.fp8_amax_cast(x, fmt, margin=1, overflow="nan")
        expected = cast_to_fp8_reference(x, fmt, margin=1, overflow="nan")
        assert torch.equal(out.codes, expected.codes)
        assert out.log2_scale.dtype == torch.int32 and int(out.log2_scale) == expected.log2_scale
        assert int(out.non_finite) == 0


def test_given_scale_and_non_finite_amax():
    x = torch.tensor([1.0, 500.0, -3.0])
    out = custom_op.fp8_amax_cast(x, "F143", log2_scale=-1)
    assert torch.equal(out.codes, cast_to_fp8_reference(x, F143, log2_scale=-1).codes)
    with pytest.raises(NonFiniteAmaxError):
        custom_op.fp8_amax_cast(torch.tensor([1.0, float("nan")]), "F143")


def test_only_ipu_formats_and_known_policies():
    with pytest.raises(ValueError, match="F143 and F152"):
        custom_op.fp8_amax_cast(torch.ones(3), "E4M3FN")
    with pytest.raises(ValueError, match="overflow"):
        custom_op.fp8_amax_cast(torch.ones(3), "F143", overflow="wrap")


def test_missing_library_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(custom_op.LIBRARY_ENV, str(tmp_path / "libfp8_custom_ops.so"))
    assert custom_op.custom_op_library_path() == tmp_path / "libfp8_custom_ops.so"
    with pytest.raises(FileNotFoundError, match="cmake -S custom_ops"):
        custom_op.load_custom_op_library()
