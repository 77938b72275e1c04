"""The host build of the FP8 codelets: loading it, and the fused CPU cast.

``codelets/`` holds C++ Poplar vertices; ``setup.py`` also compiles them with the host
compiler, through a small stand-in for ``poplar/Vertex.hpp``, into ``_fp8_host.so`` next to
this file (a plain C ABI library, loaded with ctypes). It gives two things:

* the fast CPU path of :func:`ipu_unit_scaling.fp8.cast_to_fp8`: one pass for the amax and
  one for scale + round + store, over all threads, bit-identical to the torch reference;
* the CPU kernel of the FP8 quantise custom ops (:func:`fused_quantise`, used by
  :mod:`ipu_unit_scaling.fp8.cast_ops`), and :func:`quantise_float32`, the same rounding straight
  to float32 values in one pass, for FP8 simulation;
* :func:`group_quantise`, the block forms of that rounding: one scale per row, 1 x n tile,
  n x 1 column tile or n x n block, for the grouped FP8 recipes, and the casts to FP4 and FP6
  elements (:func:`nvfp4_quantise`, :func:`mx_subbyte_quantise`);
* the vertices themselves, which :mod:`ipu_unit_scaling.fp8.codelets_on_host` runs tile by tile.

Over 600 lines because it is the one binding of the library's C ABI: every entry point's
signature, argument checks and status codes sit beside the version check that guards them.

This module sits below everything else in the package and imports none of it: it reports
with its own types (:class:`NonFiniteAmax`, :class:`HostLibraryUnavailable`) and plain values.

When the library is missing (no C++ compiler at install time) or disabled with
``IPU_UNIT_SCALING_HOST_LIB=0``, everything still works on the torch path, and
:func:`fast_path_status` says why the fast path is off.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

__all__ = [
    "HostLibraryUnavailable", "NonFiniteAmax", "MISALIGNED", "LIBRARY_PATH", "DISABLE_ENV",
    "library", "fast_path_status", "fused_cast_available", "disabled", "fused_amax",
    "fused_cast_to_fp8", "host_decode",
    "fused_cast_from_fp8", "fused_quantise", "quantise_float32", "fused_tuning", "fast_selftest",
    "exponent_bits", "partition", "partition_grain", "dtype_code", "num_threads",
    "group_quantise", "group_quantise_pair", "rowwise_quantise_pair", "nvfp4_quantise",
    "mx_subbyte_quantise", "cast_figures",
    "value_figures", "GROUP_RULES",
]

LIBRARY_PATH = Path(__file__).with_name("_fp8_host.so")
DISABLE_ENV = "IPU_UNIT_SCALING_HOST_LIB"
_ABI_VERSION = 6
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1}
# The IPU formats the codelets implement, by FP8Format.name, keyed to their exponent bits.
_EXPONENT_BITS = {"F143": 4, "F152": 5}
# Status of a vertex entry point whose field was connected to memory breaking its alignment.
MISALIGNED = -2

_c_int64 = ctypes.c_int64
_c_int = ctypes.c_int
_c_uint = ctypes.c_uint
_c_void_p = ctypes.c_void_p
_SIGNATURES = {
    "ius_abi_version": (_c_int, []),
    "ius_partition_grain": (_c_uint, []),
    "ius_partition": (None, [_c_int64, _c_uint, _c_uint, _c_void_p]),
    "ius_vertex_partial_amax": (_c_int, [_c_void_p, _c_int64, _c_int, _c_uint, _c_void_p]),
    "ius_vertex_scaling_bias": (
        _c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_void_p, _c_void_p]),
    "ius_vertex_cast_to_fp8": (
        _c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_int, _c_uint, _c_int, _c_void_p]),
    "ius_vertex_cast_from_fp8": (
        _c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_uint, _c_int, _c_void_p]),
    "ius_fused_cast_to_fp8": (
        _c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int,
                 _c_void_p, _c_void_p, _c_void_p]),
    "ius_fused_quantise": (
        _c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int,
                 _c_void_p, _c_void_p, _c_void_p]),
    "ius_fused_tuning": (_c_int, [_c_int64, _c_int]),
    "ius_fast_selftest": (_c_int64, [ctypes.c_uint32, ctypes.c_uint32, _c_int64, _c_int]),
    "ius_fused_amax": (_c_int, [_c_void_p, _c_int64, _c_int, _c_int, _c_void_p]),
    "ius_group_quantise": (
        _c_int, [_c_void_p, _c_int64, _c_int64, _c_int64, _c_int64, _c_int, _c_int, _c_int,
                 ctypes.c_float, _c_int, _c_int, _c_int, _c_int, _c_void_p, _c_void_p]),
    "ius_group_quantise_pair": (
        _c_int, [_c_void_p, _c_int64, _c_int64, _c_int64, _c_int, _c_int, _c_int,
                 ctypes.c_float, _c_int, _c_int, _c_int, _c_int, _c_void_p, _c_void_p,
                 _c_void_p, _c_void_p]),
    "ius_rowwise_quantise_pair": (
        _c_int, [_c_void_p, _c_int64, _c_int64, _c_int, _c_int, _c_int, ctypes.c_float, _c_int,
                 _c_int, _c_int, _c_int, _c_void_p, _c_void_p, _c_void_p, _c_void_p]),
    "ius_nvfp4_quantise": (
        _c_int, [_c_void_p, _c_int64, _c_int64, _c_int64, _c_int64, _c_void_p, _c_void_p,
                 _c_void_p]),
    "ius_mx_subbyte_quantise": (
        _c_int, [_c_void_p, _c_int64, _c_int64, _c_int64, _c_int64, _c_int, _c_int,
                 ctypes.c_float, _c_int, _c_int, _c_void_p, _c_void_p]),
    "ius_cast_figures": (
        _c_int, [_c_void_p, _c_void_p, _c_int64, _c_void_p, _c_int, ctypes.c_float,
                 _c_void_p]),
    "ius_value_figures": (
        _c_int, [_c_void_p, _c_void_p, _c_int64, _c_int, ctypes.c_float, _c_void_p]),
}
# The scale rules of group_quantise, by the names group_cast uses.
GROUP_RULES = {"amax": 0, "mx_floor": 1, "mx_up": 2}


class HostLibraryUnavailable(RuntimeError):
    """The compiled host library is not there (or not usable); the message says why."""


class NonFiniteAmax(ValueError):
    """The amax of a cast's input is inf or NaN, so no scale follows from it.

    The host library's own report; :mod:`ipu_unit_scaling.fp8` turns it into its
    ``NonFiniteAmaxError``.
    """

    def __init__(self, amax: float, fmt_name: str):
        super().__init__(f"amax is {amax}; cannot choose an FP8 scale for {fmt_name}")
        self.amax = amax
        self.fmt_name = fmt_name


_library: Optional[ctypes.CDLL] = None
_reason: Optional[str] = None


def _missing_reason() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return (f"{LIBRARY_PATH.name} was not built: no C++ compiler (c++ or g++) was found. "
                "Install one and reinstall, or run `python setup.py build_ext --inplace`")
    return (f"{LIBRARY_PATH.name} was not built (install without build step, or the build "
            "failed; see the install log). Run `python setup.py build_ext --inplace`")


_disabled = 0


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block the library counts as missing, as on an install without a C++
    compiler: every caller takes its torch path (benchmarks and tests compare the two)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def _load() -> Tuple[Optional[ctypes.CDLL], str]:
    global _library, _reason
    if _disabled:
        return None, "switched off by ipu_unit_scaling.fp8.host_library.disabled()"
    if _library is not None or _reason is not None:
        return _library, _reason or ""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        _reason = f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    elif not LIBRARY_PATH.exists():
        _reason = _missing_reason()
    else:
        try:
            lib = ctypes.CDLL(str(LIBRARY_PATH))
            version = lib.ius_abi_version()
            if version != _ABI_VERSION:
                raise OSError(f"ABI version {version}, expected {_ABI_VERSION}; rebuild it")
            for name, (restype, argtypes) in _SIGNATURES.items():
                function = getattr(lib, name)
                function.restype = restype
                function.argtypes = argtypes
            _library = lib
        except (OSError, AttributeError) as error:
            _reason = f"{LIBRARY_PATH} could not be loaded: {error}"
    return _library, _reason or ""


def library() -> ctypes.CDLL:
    """The loaded host library; raises :class:`HostLibraryUnavailable` saying why not."""
    lib, reason = _load()
    if lib is None:
        raise HostLibraryUnavailable(f"FP8 host library unavailable: {reason}")
    return lib


def fast_path_status() -> str:
    """One line: whether the fused host cast is on, and if not, why."""
    lib, reason = _load()
    if lib is None:
        return f"off: {reason}; FP8 casts use the torch path"
    return f"on: fused host cast from {LIBRARY_PATH.name}, {num_threads()} threads"


def fused_cast_available() -> bool:
    return _load()[0] is not None


def exponent_bits(fmt_name: str) -> int:
    """4 for F143, 5 for F152; ValueError for formats the codelets do not implement."""
    bits = _EXPONENT_BITS.get(fmt_name.upper())
    if bits is None:
        raise ValueError(f"the FP8 codelets implement {sorted(_EXPONENT_BITS)}, not {fmt_name!r}")
    return bits


def dtype_code(dtype: torch.dtype) -> int:
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"the FP8 codelets take float32 or float16, not {dtype}")
    return code


def num_threads() -> int:
    """Threads for the fused cast: torch's intra-op setting, so users have one knob."""
    return max(1, torch.get_num_threads())


def _pointer(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _output(x: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=dtype)
    if out.dtype != dtype or out.numel() != x.numel() or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {x.numel()} elements")
    return out


def _fused_cast(x: torch.Tensor, fmt_name: str, log2_scale: Optional[int], margin: int,
                saturate: bool, out: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, int, Optional[float]]:
    """(codes, scale used, the amax when it was not finite, else None); codes are
    unspecified in the non-finite case."""
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("the fused host cast needs a contiguous CPU tensor")
    lib = library()
    codes = _output(x, torch.uint8, out)
    used = ctypes.c_int(0)
    amax = ctypes.c_float(0.0)
    status = lib.ius_fused_cast_to_fp8(
        _pointer(x), x.numel(), dtype_code(x.dtype), exponent_bits(fmt_name), int(saturate),
        int(log2_scale is not None), int(log2_scale or 0), int(margin), num_threads(),
        _pointer(codes), ctypes.byref(used), ctypes.byref(amax))
    if status == 1:
        return codes, 0, amax.value
    if status != 0:
        raise ValueError(f"fused host cast rejected its arguments (log2_scale={log2_scale})")
    return codes, used.value, None


def fused_cast_to_fp8(
    x: torch.Tensor,
    fmt_name: str,
    log2_scale: Optional[int],
    margin: int,
    saturate: bool,
    out: Optional[torch.Tensor] = None,
) -> Optional[Tuple[torch.Tensor, int]]:
    """Scale, round to nearest even and encode ``x`` in one fused multi-threaded host pass.

    ``x`` is a contiguous CPU float32/float16 tensor. ``log2_scale=None`` derives the scale
    from the amax with ``margin`` (raising :class:`NonFiniteAmax` for an inf/NaN amax).
    Returns (uint8 codes shaped like ``x``, the log2 scale used), or None for a format the
    codelets do not implement (the OCP formats), so the caller takes its torch path. ``out``:
    a contiguous uint8 tensor to write the codes to (returned as it is).
    """
    if fmt_name.upper() not in _EXPONENT_BITS:
        return None
    codes, used, non_finite_amax = _fused_cast(x, fmt_name, log2_scale, margin, saturate, out)
    if non_finite_amax is not None:
        raise NonFiniteAmax(non_finite_amax, fmt_name.upper())
    return codes, used


def fused_quantise(
    x: torch.Tensor,
    fmt_name: str,
    log2_scale: Optional[int],
    margin: int,
    saturate: bool,
) -> Tuple[torch.Tensor, int, bool]:
    """``decode(cast(x * 2**s)) * 2**-s`` in x's dtype and shape, as the Fp8Quantise custom op.

    ``x`` is a contiguous CPU float32/float16 tensor; the format is F143 or F152. ``s`` is
    ``log2_scale``, or comes from the amax with ``margin``. As on the IPU, where a vertex
    cannot raise, a non-finite amax gives ``s = 0`` and the cast goes on (NaN stays NaN,
    inf follows the overflow policy). Returns (values, s, whether the amax was non-finite).
    The decode runs the CastFromFp8 vertex code, half output included.
    """
    codes, used, non_finite_amax = _fused_cast(x, fmt_name, log2_scale, margin, saturate)
    if non_finite_amax is not None:
        codes, used, _ = _fused_cast(x, fmt_name, 0, margin, saturate)
    values = torch.empty(x.shape, dtype=x.dtype)
    status = library().ius_vertex_cast_from_fp8(
        _pointer(codes), codes.numel(), dtype_code(x.dtype), exponent_bits(fmt_name), 1, used,
        _pointer(values))
    if status != 0:
        raise ValueError(f"host decode rejected its arguments (status {status})")
    return values, used, non_finite_amax is not None


def quantise_float32(
    x: torch.Tensor,
    fmt_name: str,
    log2_scale: Optional[int],
    margin: int,
    saturate: bool,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, int, Optional[float]]:
    """``decode(cast(x * 2**s)) * 2**-s`` as a float32 tensor (new, or ``out``), in one pass
    with no codes.

    ``x`` is a contiguous CPU float32 tensor; the format is F143 or F152 (see
    :func:`exponent_bits`). ``s`` is ``log2_scale`` (-31..31), or comes from the amax with
    ``margin``. Returns (values, s, None), or (unspecified values, 0, the amax) when the amax
    is not finite, for the caller to decide what that means.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("quantise_float32 needs a contiguous CPU float32 tensor")
    lib = library()
    out = _output(x, torch.float32, out)
    used = ctypes.c_int(0)
    amax = ctypes.c_float(0.0)
    status = lib.ius_fused_quantise(
        _pointer(x), x.numel(), exponent_bits(fmt_name), int(saturate),
        int(log2_scale is not None), int(log2_scale or 0), int(margin), num_threads(),
        _pointer(out), ctypes.byref(used), ctypes.byref(amax))
    if status == 1:
        return out, 0, amax.value
    if status != 0:
        raise ValueError(f"host quantise rejected its arguments (log2_scale={log2_scale})")
    return out, used.value, None


def fused_amax(x: torch.Tensor) -> float:
    """max |x| of a contiguous CPU float32/float16 tensor by the fast path's amax loop (NaN
    wins), over :func:`num_threads` threads."""
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("fused_amax needs a contiguous CPU tensor")
    amax = ctypes.c_float(0.0)
    status = library().ius_fused_amax(_pointer(x), x.numel(), dtype_code(x.dtype), num_threads(),
                                      ctypes.byref(amax))
    if status != 0:
        raise ValueError(f"fused_amax rejected its arguments (status {status})")
    return amax.value


def fused_tuning(block_elements: int = -1, simd: int = -1) -> int:
    """Set the fused kernels' block size (elements, at least 1024) and the widest SIMD kernels
    they may use: 2 AVX-512 (the default), 1 AVX2, 0 only the portable loops; -1 leaves a knob
    as it is. Returns the level in use (the widest allowed that the CPU has: 2, 1 or 0; true
    when SIMD kernels are in use). Process-wide; for benchmarks."""
    return int(library().ius_fused_tuning(int(block_elements), int(simd)))


def fast_selftest(start: int, stride: int, count: int, log2_scale: int = 0) -> int:
    """Mismatches between the fast path's rounding (portable loops, AVX2 and AVX-512 kernels,
    codes and values, F143 and F152, both overflow policies) and the vertex functions, over
    ``count``
    float32 bit patterns ``start, start + stride, ...`` (mod 2**32) at scale ``2**log2_scale``.
    ``fast_selftest(0, 1, 2**32)`` checks every pattern (minutes)."""
    return int(library().ius_fast_selftest(start % 2**32, stride % 2**32, count, log2_scale))


def fused_cast_from_fp8(
    codes: torch.Tensor, fmt_name: str, log2_scale: int
) -> Optional[torch.Tensor]:
    """``decode(codes) * 2**-log2_scale`` as float32 through the CastFromFp8 vertex code.

    ``codes`` is a CPU uint8 tensor (made contiguous here). Returns None for a format the
    codelets do not implement, so the caller takes its torch path.
    """
    if fmt_name.upper() not in _EXPONENT_BITS:
        return None
    flat = codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    status = library().ius_vertex_cast_from_fp8(
        _pointer(flat), flat.numel(), dtype_code(torch.float32), exponent_bits(fmt_name), 1,
        int(log2_scale), _pointer(out))
    if status != 0:
        raise ValueError(f"host decode rejected its arguments (log2_scale={log2_scale})")
    return out


def host_decode(codes: torch.Tensor, fmt_name: str, log2_scale: int) -> Optional[torch.Tensor]:
    """:func:`fused_cast_from_fp8` where the library is built and takes ``codes`` (a CPU uint8
    tensor) and the format; else None, and the caller takes its torch path."""
    if codes.device.type != "cpu" or codes.dtype != torch.uint8 or not fused_cast_available():
        return None
    return fused_cast_from_fp8(codes, fmt_name, log2_scale)


def partition_grain() -> int:
    """Slices start on multiples of this many elements (see codelets/partition.hpp)."""
    return int(library().ius_partition_grain())


def partition(numel: int, tiles: int, workers: int) -> torch.Tensor:
    """The C++ split of ``numel`` elements: int64 ``[tiles, workers, 2]`` of [begin, end).

    This is the function the custom op uses to map the input and the vertices to tiles,
    and the MultiVertex codelets use to pick each worker's slice.
    """
    if numel < 0 or tiles < 1 or workers < 1:
        raise ValueError(f"bad partition: numel={numel}, tiles={tiles}, workers={workers}")
    bounds = torch.empty((tiles, workers, 2), dtype=torch.int64)
    library().ius_partition(numel, tiles, workers, _pointer(bounds))
    return bounds


def _check_group_input(x: torch.Tensor, group_rows: int, group_cols: int, rule: str,
                       name: str) -> int:
    """The rule's code, after checking the arguments the block kernels share."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or not x.is_contiguous()):
        raise ValueError(f"{name} needs a contiguous 2-D CPU float32 tensor")
    if group_rows < 1 or group_cols < 1:
        raise ValueError(f"{name} needs groups of at least 1 x 1, got {group_rows} x "
                         f"{group_cols}")
    code = GROUP_RULES.get(rule)
    if code is None:
        raise ValueError(f"{name} rule {rule!r}; allowed: {', '.join(GROUP_RULES)}")
    return code


def group_quantise(
    x: torch.Tensor,
    group_rows: int,
    group_cols: int,
    fmt_name: str,
    rule: str,
    format_max: float,
    emax: int = 0,
    margin: int = 0,
    step_log2: int = 0,
    saturate: bool = True,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """Round the rows x cols matrix ``x`` to the F143/F152 grid ``fmt_name`` with one scale
    ``2**s`` per ``group_rows x group_cols`` group (ragged last groups are smaller), in one
    pass per group over :func:`num_threads` threads.

    ``rule`` (:data:`GROUP_RULES`): "amax" is the AMAX rule against ``format_max`` with
    ``margin``; "mx_floor" and "mx_up" are OCP MX's E8M0 exponent ``e`` (``s = -e``) from
    ``emax`` or ``format_max``. ``step_log2=1`` rounds an OCP format on the IPU grid at half
    scale, clamped to ``format_max / 2`` first. Returns (float32 values shaped like ``x``, new
    or ``out``; int32 scales ``[ceil(rows / group_rows), ceil(cols / group_cols)]``; whether
    every group's amax was finite: where not, values and that group's scale are unspecified).
    """
    code = _check_group_input(x, group_rows, group_cols, rule, "group_quantise")
    rows, cols = x.shape
    out = _output(x, torch.float32, out)
    scales = torch.empty((-(-rows // group_rows), -(-cols // group_cols)), dtype=torch.int32)
    status = library().ius_group_quantise(
        _pointer(x), rows, cols, group_rows, group_cols, exponent_bits(fmt_name),
        int(saturate), code, float(format_max), int(emax), int(margin), int(step_log2),
        num_threads(), _pointer(out), _pointer(scales))
    if status not in (0, 1):
        raise ValueError(f"group_quantise rejected its arguments (status {status})")
    return out.view(x.shape), scales, status == 0


def pair_kernel_args(fmt_name: str, rule: str, format_max: float, emax: int = 0,
                     margin: int = 0, step_log2: int = 0,
                     saturate: bool = True) -> Tuple[int, int, int, float, int, int, int]:
    """:func:`group_quantise_pair`'s format and rule arguments as the kernel takes them, for
    :func:`pair_values`: prepared once per recipe rather than at every cast."""
    code = GROUP_RULES.get(rule)
    if code is None:
        raise ValueError(f"group_quantise_pair rule {rule!r}; allowed: {', '.join(GROUP_RULES)}")
    return (exponent_bits(fmt_name), int(saturate), code, float(format_max), int(emax),
            int(margin), int(step_log2))


def rowwise_quantise_pair(
    x: torch.Tensor,
    fmt_name: str,
    rule: str,
    format_max: float,
    emax: int = 0,
    margin: int = 0,
    step_log2: int = 0,
    saturate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`group_quantise` of the matrix ``x`` with one scale per row (``1 x cols``
    groups) and with one per column (``rows x 1``), both from two reads of ``x`` (arguments
    as there). Returns (row-scaled values, their scales [rows, 1], column-scaled values,
    their scales [1, cols], whether every amax was finite)."""
    code = _check_group_input(x, 1, 1, rule, "rowwise_quantise_pair")
    rows, cols = x.shape
    row_values, col_values = torch.empty((rows, cols)), torch.empty((rows, cols))
    row_scales = torch.empty((rows, 1), dtype=torch.int32)
    col_scales = torch.empty((1, cols), dtype=torch.int32)
    status = library().ius_rowwise_quantise_pair(
        _pointer(x), rows, cols, exponent_bits(fmt_name), int(saturate), code,
        float(format_max), int(emax), int(margin), int(step_log2), num_threads(),
        _pointer(row_values), _pointer(row_scales), _pointer(col_values),
        _pointer(col_scales))
    if status not in (0, 1):
        raise ValueError(f"rowwise_quantise_pair rejected its arguments (status {status})")
    return row_values, row_scales, col_values, col_scales, status == 0


def nvfp4_quantise(x: torch.Tensor, group_rows: int, group_cols: int,
                   out: Optional[torch.Tensor] = None
                   ) -> Optional[Tuple[torch.Tensor, torch.Tensor, float]]:
    """The NVFP4 cast of the matrix ``x`` (round to nearest) with one E4M3 scale per
    ``group_rows x group_cols`` group (ragged last groups are smaller) and one float32 scale
    for the tensor, as `group_cast`'s "nvfp4" rule makes it. Returns (float32 values shaped
    like ``x``, new or ``out``, which may be ``x`` itself; the groups' E4M3 scales as float32
    ``[ceil(rows / group_rows), ceil(cols / group_cols)]``; the tensor scale), or None where
    the tensor's amax is not finite or its scale underflows (nothing written)."""
    _check_group_input(x, group_rows, group_cols, "amax", "nvfp4_quantise")
    rows, cols = x.shape
    out = _output(x, torch.float32, out)
    block_scales = torch.empty((-(-rows // group_rows), -(-cols // group_cols)))
    tensor_scale = ctypes.c_float(1.0)
    status = library().ius_nvfp4_quantise(_pointer(x), rows, cols, group_rows, group_cols,
                                          _pointer(out), _pointer(block_scales),
                                          ctypes.byref(tensor_scale))
    if status not in (0, 1):
        raise ValueError(f"nvfp4_quantise rejected its arguments (status {status})")
    return None if status else (out.view(x.shape), block_scales, tensor_scale.value)


def mx_subbyte_quantise(x: torch.Tensor, group_rows: int, group_cols: int,
                        mantissa_bits: int, min_exponent: int, format_max: float, emax: int,
                        round_up: bool = False, out: Optional[torch.Tensor] = None
                        ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """MX's cast of the matrix ``x`` (round to nearest, saturating) to a sub-byte element
    format (E2M1, E2M3 or E3M2: its mantissa bits, smallest normal exponent and max) with one
    E8M0 scale ``2**e`` per ``group_rows x group_cols`` group, ``e`` from ``emax`` (OCP's floor
    rule) or, with ``round_up``, from ``format_max``, as `group_cast`'s "mx" rule makes it.
    Returns (float32 values shaped like ``x``, new or ``out``; int32 log2 scales ``s = -e``
    ``[ceil(rows / group_rows), ceil(cols / group_cols)]``), or None where an element is not
    finite (nothing written)."""
    _check_group_input(x, group_rows, group_cols, "amax", "mx_subbyte_quantise")
    rows, cols = x.shape
    out = _output(x, torch.float32, out)
    scales = torch.empty((-(-rows // group_rows), -(-cols // group_cols)), dtype=torch.int32)
    status = library().ius_mx_subbyte_quantise(
        _pointer(x), rows, cols, group_rows, group_cols, int(mantissa_bits), int(min_exponent),
        float(format_max), int(emax), int(round_up), _pointer(out), _pointer(scales))
    if status not in (0, 1):
        raise ValueError(f"mx_subbyte_quantise rejected its arguments (status {status})")
    return None if status else (out.view(x.shape), scales)


def pair_values(x: torch.Tensor, size: int,
                kernel_args: Tuple[int, int, int, float, int, int, int],
                out: Optional[torch.Tensor] = None
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The values alone of :func:`group_quantise_pair` (``1 x size`` tiles, then ``size x 1``
    column tiles, both in ``x``'s shape; ``size`` -1: those of :func:`rowwise_quantise_pair`,
    per row then per column), for a contiguous 2-D CPU float32 ``x`` its caller has checked
    and ``kernel_args`` from :func:`pair_kernel_args`: a training step casts each GEMM
    operand this way, and the per-call work around the kernel is a visible share of it at
    small widths. ``out``: where to write the first (a contiguous float32 tensor of ``x``'s
    shape). None where the library is off or a group's amax is not finite."""
    lib = _load()[0]
    if lib is None:
        return None
    rows, cols = x.shape
    row_values = (torch.empty((rows, cols)) if out is None
                  else _output(x, torch.float32, out).view(rows, cols))
    col_values = torch.empty((rows, cols))
    if size < 0:
        scales = torch.empty(rows + cols, dtype=torch.int32)
        status = lib.ius_rowwise_quantise_pair(
            x.data_ptr(), rows, cols, *kernel_args, num_threads(), row_values.data_ptr(),
            scales.data_ptr(), col_values.data_ptr(), scales.data_ptr() + 4 * rows)
        if status not in (0, 1):
            raise ValueError(f"rowwise_quantise_pair rejected its arguments (status {status})")
        return None if status == 1 else (row_values, col_values)
    row_scale_count = rows * -(-cols // size)
    scales = torch.empty(row_scale_count + -(-rows // size) * cols, dtype=torch.int32)
    scales_at = scales.data_ptr()
    status = lib.ius_group_quantise_pair(
        x.data_ptr(), rows, cols, size, *kernel_args, num_threads(), row_values.data_ptr(),
        scales_at, col_values.data_ptr(), scales_at + 4 * row_scale_count)
    if status == 1:
        return None
    if status != 0:
        raise ValueError(f"group_quantise_pair rejected its arguments (status {status})")
    return row_values, col_values


def group_quantise_pair(
    x: torch.Tensor,
    size: int,
    fmt_name: str,
    rule: str,
    format_max: float,
    emax: int = 0,
    margin: int = 0,
    step_log2: int = 0,
    saturate: bool = True,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Both tile casts of the matrix ``x`` from one read of it: :func:`group_quantise` with
    ``1 x size`` tiles and with ``size x 1`` column tiles (arguments as there; ``out``: the
    two float32 tensors to write them to). Returns (row tile values, their scales, column tile
    values, their scales, whether every amax was finite)."""
    code = _check_group_input(x, size, size, rule, "group_quantise_pair")
    rows, cols = x.shape
    row_values = _output(x, torch.float32, None if out is None else out[0]).view(x.shape)
    col_values = _output(x, torch.float32, None if out is None else out[1]).view(x.shape)
    row_scales = torch.empty((rows, -(-cols // size)), dtype=torch.int32)
    col_scales = torch.empty((-(-rows // size), cols), dtype=torch.int32)
    status = library().ius_group_quantise_pair(
        _pointer(x), rows, cols, size, exponent_bits(fmt_name), int(saturate), code,
        float(format_max), int(emax), int(margin), int(step_log2), num_threads(),
        _pointer(row_values), _pointer(row_scales), _pointer(col_values),
        _pointer(col_scales))
    if status not in (0, 1):
        raise ValueError(f"group_quantise_pair rejected its arguments (status {status})")
    return row_values, row_scales, col_values, col_scales, status == 0


def cast_figures(scaled: torch.Tensor, codes: torch.Tensor, table: torch.Tensor,
                 negative_zero: Optional[int], format_max: float
                 ) -> Optional[Tuple[float, ...]]:
    """The figures of a cast for its statistics, in one pass: (finite values, nonzero finite
    values, zero codes (0, and ``negative_zero``), values past ``format_max`` (inf
    included), the finite values' energy, their rounding errors' energy, the finite values'
    amax), from ``scaled`` (contiguous CPU float32) and its ``codes`` (uint8, as many),
    decoded by ``table`` (256 float32 values). None where the library is off."""
    lib = _load()[0]
    if lib is None:
        return None
    figures = (ctypes.c_double * 7)()
    status = lib.ius_cast_figures(
        scaled.data_ptr(), codes.data_ptr(), scaled.numel(), table.data_ptr(),
        -1 if negative_zero is None else int(negative_zero), float(format_max), figures)
    if status != 0:
        raise ValueError(f"cast_figures rejected its arguments (status {status})")
    return tuple(figures)


def value_figures(x: torch.Tensor, values: torch.Tensor, log2_scale: int, format_max: float
                  ) -> Optional[Tuple[float, ...]]:
    """:func:`cast_figures`' figures of the cast of ``x`` (contiguous CPU float32) with scale
    ``2**log2_scale`` (``|log2_scale| <= 31``) to the FP8 ``values`` it gave (as many, float32,
    :func:`quantise_float32`'s output), in one pass and without codes. None where the library
    is off."""
    lib = _load()[0]
    if lib is None:
        return None
    figures = (ctypes.c_double * 7)()
    status = lib.ius_value_figures(x.data_ptr(), values.data_ptr(), x.numel(), int(log2_scale),
                                   float(format_max), figures)
    if status != 0:
        raise ValueError(f"value_figures rejected its arguments (status {status})")
    return tuple(figures)
