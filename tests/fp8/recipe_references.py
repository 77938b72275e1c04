"""Independent references of the FP8 recipes for the tests: gfloat's MX block quantiser, an
NVFP4 quantiser on gfloat's rounding, and the package's per-tensor AMAX cast."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ipu_unit_scaling.fp8 import cast_from_fp8, cast_to_fp8_reference

try:
    import gfloat
    from gfloat import formats as gf
except ImportError:  # the tests that need it skip, naming it
    gfloat = gf = None

# The MX element formats, by this package's names (gfloat's block formats where it is there).
MX_NAMES = {"E4M3FN": "format_info_mxfp8_e4m3", "E5M2": "format_info_mxfp8_e5m2",
            "E2M3": "format_info_mxfp6_e2m3", "E3M2": "format_info_mxfp6_e3m2",
            "E2M1": "format_info_mxfp4_e2m1"}


def need_gfloat() -> None:
    if gfloat is None:
        pytest.skip("gfloat (test extra) is the MX and NVFP4 reference; not installed")
ML_ELEMENTS = {
    "E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2", "E2M3": "float6_e2m3fn",
    "E3M2": "float6_e3m2fn", "E2M1": "float4_e2m1fn", "F143": "float8_e4m3fnuz",
    "F152": "float8_e5m2fnuz",
}


def wide_tensor(rows: int, cols: int, seed: int, spread: int = 12) -> torch.Tensor:
    """Normal samples over many binades, with a zero run, a float32 subnormal and a tie."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x = x * torch.exp2(torch.randint(-spread, spread, (rows, cols), generator=generator).float())
    flat = x.view(-1)
    flat[: min(40, flat.numel()) // 2] = 0.0
    if flat.numel() > 41:
        flat[40] = 3e-39  # a float32 subnormal
        flat[41] = -0.0
    return x


def gfloat_mx(x: torch.Tensor, name: str) -> np.ndarray:
    """gfloat's MX quantiser per 32-element block of each row (the last block ragged)."""
    need_gfloat()
    fi = getattr(gf, MX_NAMES[name])
    rows = []
    for row in x.double().numpy():
        blocks = [gfloat.quantize_block(fi, row[i:i + 32], gfloat.compute_scale_amax)
                  for i in range(0, row.size, 32)]
        rows.append(np.concatenate(blocks))
    return np.stack(rows)


def per_tensor_reference(x: torch.Tensor, fmt, margin: int) -> torch.Tensor:
    return cast_from_fp8(cast_to_fp8_reference(x.contiguous(), fmt, margin=margin))


def gfloat_nvfp4(x: torch.Tensor) -> np.ndarray:
    """NVFP4 (16 E2M1 elements per E4M3 scale, one float32 tensor scale), each step in float32
    with gfloat's rounding."""
    need_gfloat()
    from gfloat import RoundMode
    from gfloat.round_ndarray import round_ndarray

    f32 = np.float32
    v = x.numpy().astype(f32)
    amax = f32(np.abs(v).max())
    g = f32(amax / f32(6.0 * 448.0)) if amax > 0 else f32(1.0)
    out = np.zeros_like(v)
    for r in range(v.shape[0]):
        for c in range(0, v.shape[1], 16):
            block = v[r, c:c + 16]
            wanted = f32(np.abs(block).max() / f32(f32(6.0) * g))
            d = f32(round_ndarray(gf.format_info_ocp_e4m3, np.array([min(wanted, f32(448))]),
                                  RoundMode.TiesToEven, sat=True)[0])
            scale = f32(d * g)
            if scale == 0:
                continue
            elements = round_ndarray(gf.format_info_ocp_e2m1, (block / scale).astype(f32),
                                     RoundMode.TiesToEven, sat=True).astype(f32)
            out[r, c:c + 16] = elements * scale
    return out
