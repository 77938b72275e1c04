"""The host library's block kernels (one scale per row, tile, column tile or block): each SIMD
level against the portable loops, and group_cast's host path against its torch path, bit for
bit, over ragged shapes and the edge values (zeros, subnormals, huge values, inf, NaN)."""
from __future__ import annotations

import pytest
import torch

from ipu_unit_scaling.fp8 import NonFiniteAmaxError, get_format
from ipu_unit_scaling.fp8 import host_library as _host
from ipu_unit_scaling.fp8.group_cast import Grouping, group_cast, group_cast_pair

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

# (rows of whole 32- and 128-element tiles take AVX-512's contiguous-tile loop: (64, 128),
# (200, 96), (41, 384))
SHAPES = [(1, 1), (1, 33), (7, 1), (31, 45), (64, 128), (129, 257), (200, 96), (41, 384)]
# (group rows, group cols) as functions of the shape: tiles, column tiles, blocks, rows,
# columns, the whole tensor; sizes that leave ragged last groups in most shapes.
GROUPS = {
    "tile 32": lambda r, c: (1, 32), "tile 128": lambda r, c: (1, 128),
    "column tile 32": lambda r, c: (32, 1), "column tile 7": lambda r, c: (7, 1),
    "block 16": lambda r, c: (16, 16), "block 128": lambda r, c: (128, 128),
    "row": lambda r, c: (1, c), "column": lambda r, c: (r, 1), "tensor": lambda r, c: (r, c),
}
# (format name on the IPU grid, rule, format max, emax, margin, step): the AMAX rule with a
# margin, MX's two roundings, an OCP format run at half scale on the IPU grid.
RULES = [("F143", "amax", 240.0, 7, 2, 0), ("F152", "amax", 57344.0, 15, 0, 0),
         ("F143", "mx_floor", 448.0, 8, 0, 1), ("F152", "mx_up", 57344.0, 15, 0, 1),
         ("F143", "mx_up", 240.0, 7, 0, 0)]


def edge_tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values over a wide range of magnitudes, with all-zero, subnormal and near-max
    stretches that fall in different groups."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.exp2(torch.randint(-30, 30, (rows, cols), generator=generator).float())
    flat = x.view(-1)
    n = flat.numel()
    flat[: n // 5] = 0.0
    flat[n // 5: n // 3] = torch.randn(n // 3 - n // 5, generator=generator) * 1e-40
    flat[n // 3: n // 3 + 2] = torch.tensor([3.0e38, -1.0e-45])[: max(0, n - n // 3)]
    return x


def levels() -> list:
    """The SIMD levels this CPU has: 2 AVX-512, 1 AVX2, 0 the portable loops."""
    widest = _host.fused_tuning(-1, 2)
    return list(range(widest + 1))


@pytest.fixture
def restore_tuning():
    yield
    _host.fused_tuning(-1, 2)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r[0]}-{r[1]}-step{r[5]}")
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_simd_level_gives_the_portable_loops_results(group, rule, restore_tuning):
    fmt_name, kernel_rule, fmt_max, emax, margin, step = rule
    for seed, (rows, cols) in enumerate(SHAPES):
        x = edge_tensor(rows, cols, seed)
        group_rows, group_cols = GROUPS[group](rows, cols)
        results = []
        for level in levels():
            _host.fused_tuning(-1, level)
            values, scales, finite = _host.group_quantise(
                x, group_rows, group_cols, fmt_name, kernel_rule, fmt_max, emax, margin, step)
            assert finite
            results.append((level, values, scales))
        _, portable_values, portable_scales = results[0]
        assert portable_scales.shape == (-(-rows // group_rows), -(-cols // group_cols))
        for level, values, scales in results[1:]:
            assert torch.equal(scales, portable_scales), (level, rows, cols)
            assert torch.equal(values.view(torch.int32), portable_values.view(torch.int32)), (
                level, rows, cols)


@pytest.mark.parametrize("rule", RULES + [("F152", "amax", 57344.0, 15, 0, 0),
                                   ("F143", "amax", 240.0, 7, 31, 0)],
                         ids=lambda r: f"{r[0]}-{r[1]}-margin{r[4]}-step{r[5]}")
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow-nan"])
def test_group_scales_at_every_amax_exponent_match_the_portable_loops(rule, saturate,
                                                                     restore_tuning):
    """Column tiles whose amaxes run through every float32 exponent, each with a significand
    below, at and above the format max's: the SIMD scale computation meets every clamp of
    the AMAX rule (+-31) and of MX's shared exponent (+-127), and every comparison; where a
    clamped scale leaves values past the format's max, they saturate or become NaN in every
    form alike."""
    fmt_name, kernel_rule, fmt_max, emax, margin, step = rule
    top = torch.tensor(fmt_max).frexp().mantissa.item() * 2  # the format max's significand
    significands = torch.tensor([1.0, top - 2.0 ** -20, top,
                                 min(top + 2.0 ** -20, 2.0 - 2.0 ** -23)])
    exponents = torch.arange(-126, 128, dtype=torch.float32)
    amax = (significands[:, None] * torch.exp2(exponents)[None, :]).reshape(-1)
    amax = amax[torch.isfinite(amax)]
    x = torch.rand(8, amax.numel(), generator=torch.Generator().manual_seed(3)) * amax
    x[5] = amax * torch.where(torch.arange(amax.numel()) % 2 == 0, 1.0, -1.0)
    x[:, ::17] = 0.0  # all-zero groups among them
    results = []
    for level in levels():
        _host.fused_tuning(-1, level)
        results.append(_host.group_quantise(x, 8, 1, fmt_name, kernel_rule, fmt_max, emax,
                                            margin, step, saturate))
    for values, scales, finite in results[1:]:
        assert finite
        assert torch.equal(scales, results[0][1])
        assert torch.equal(values.view(torch.int32), results[0][0].view(torch.int32))
    if kernel_rule == "amax":  # both clamps are met
        assert (int(results[0][1].min()), int(results[0][1].max())) == (-31, 31)
    if kernel_rule == "amax" and step == 0:  # values past the max at the -31 clamp
        assert bool(results[0][0].isnan().any()) != saturate


@pytest.mark.parametrize("size", [32, 128, 5])
def test_the_pair_kernel_is_the_two_tile_casts(size, restore_tuning):
    for level in levels():
        _host.fused_tuning(-1, level)
        for seed, (rows, cols) in enumerate(SHAPES):
            x = edge_tensor(rows, cols, seed)
            row_values, row_scales, col_values, col_scales, finite = _host.group_quantise_pair(
                x, size, "F143", "mx_floor", 448.0, 8, 0, 1)
            along_rows = _host.group_quantise(x, 1, size, "F143", "mx_floor", 448.0, 8, 0, 1)
            along_cols = _host.group_quantise(x, size, 1, "F143", "mx_floor", 448.0, 8, 0, 1)
            assert finite
            assert torch.equal(row_values.view(torch.int32), along_rows[0].view(torch.int32))
            assert torch.equal(row_scales, along_rows[1])
            assert torch.equal(col_values.view(torch.int32), along_cols[0].view(torch.int32))
            assert torch.equal(col_scales, along_cols[1])


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r[0]}-{r[1]}-step{r[5]}")
@pytest.mark.parametrize("threads", [1, 3])
def test_the_rowwise_pair_kernel_is_the_row_and_column_casts(rule, threads, restore_tuning,
                                                             monkeypatch):
    """Both casts of the rowwise recipe from two reads, at each SIMD level (forced) and over
    several threads (each takes its rows' column amaxes): the values and scales of the
    per-row and the per-column group casts, bit for bit; a NaN is reported as they do."""
    monkeypatch.setattr(_host, "num_threads", lambda: threads)
    fmt_name, kernel_rule, fmt_max, emax, margin, step = rule
    for level in levels():
        _host.fused_tuning(-1, level)
        for seed, (rows, cols) in enumerate(SHAPES + [(300, 2 ** 12 + 7)]):
            x = edge_tensor(rows, cols, seed)
            args = (fmt_name, kernel_rule, fmt_max, emax, margin, step)
            row_values, row_scales, col_values, col_scales, finite = (
                _host.rowwise_quantise_pair(x, *args))
            along_rows = _host.group_quantise(x, 1, cols, *args)
            along_cols = _host.group_quantise(x, rows, 1, *args)
            assert finite
            assert torch.equal(row_values.view(torch.int32), along_rows[0].view(torch.int32))
            assert torch.equal(row_scales, along_rows[1])
            assert torch.equal(col_values.view(torch.int32), along_cols[0].view(torch.int32))
            assert torch.equal(col_scales, along_cols[1]), (level, rows, cols)
            kernel_args = _host.pair_kernel_args(*args)
            values = _host.pair_values(x, -1, kernel_args)
            assert values is not None and torch.equal(values[0], row_values)
            assert torch.equal(values[1], col_values)
        x[-1, 0] = float("nan")
        assert not _host.rowwise_quantise_pair(x, *args)[-1]
        assert _host.pair_values(x, -1, kernel_args) is None


@pytest.mark.parametrize("size", [32, 128])
def test_a_non_finite_tile_is_reported_at_every_simd_level(size, restore_tuning):
    """NaN and inf in tiles of rows of whole tiles (the contiguous-tile loop): each SIMD level
    reports them, and rounds every finite tile as the portable loops do."""
    x = edge_tensor(37, 384, 5)
    x[3, 40], x[30, 300] = float("nan"), float("-inf")
    results = []
    for level in levels():
        _host.fused_tuning(-1, level)
        results.append(_host.group_quantise(x, 1, size, "F143", "mx_floor", 448.0, 8, 0, 1))
    finite_tiles = torch.ones(37, 384 // size, dtype=torch.bool)
    finite_tiles[3, 40 // size] = finite_tiles[30, 300 // size] = False
    rows = finite_tiles.repeat_interleave(size, dim=1)
    for values, scales, finite in results:
        assert not finite
        assert torch.equal(scales[finite_tiles], results[0][1][finite_tiles])
        assert torch.equal(values[rows].view(torch.int32), results[0][0][rows].view(torch.int32))


def test_the_pair_kernel_over_several_column_chunks(restore_tuning):
    """A band wider than one chunk (the kernels take at most 2^22 elements of a band at a
    time): each chunk's tiles land in their own rows' places, the last chunk ragged."""
    x = edge_tensor(130, 2 ** 16 + 48, 11)
    for level in levels():
        _host.fused_tuning(-1, level)
        row_values, row_scales, col_values, col_scales, finite = _host.group_quantise_pair(
            x, 128, "F143", "amax", 240.0)
        along_rows = _host.group_quantise(x, 1, 128, "F143", "amax", 240.0)
        along_cols = _host.group_quantise(x, 128, 1, "F143", "amax", 240.0)
        assert finite
        assert torch.equal(row_scales, along_rows[1]) and torch.equal(col_scales, along_cols[1])
        assert torch.equal(row_values.view(torch.int32), along_rows[0].view(torch.int32))
        assert torch.equal(col_values.view(torch.int32), along_cols[0].view(torch.int32))


# The kernels stream their stores past the caches from 2**24 bytes of output on.
STREAMED = 1 << 22  # float32 elements


@pytest.mark.parametrize("cols", [2048, 2047], ids=["aligned rows", "unaligned rows"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned output", "output 12 bytes in"])
def test_outputs_large_enough_to_stream_hold_the_portable_loops_values(cols, offset,
                                                                     restore_tuning):
    """Past the streaming threshold, each SIMD level writes the portable loops' values into
    an output at any alignment (rows at a 64-byte boundary stream, the others store plainly),
    for every form and for the pair, whose two outputs together cross the threshold."""
    rows = -(-STREAMED // cols)
    x = edge_tensor(rows, cols, 5)
    n = rows * cols
    forms = [(1, 32), (32, 1), (128, 1), (1, 128), (128, 128)]
    expected = {}
    _host.fused_tuning(-1, 0)
    for group in forms:
        expected[group] = _host.group_quantise(x, *group, "F143", "mx_floor", 448.0, 8, 0, 1)
    pair_x = x[: rows // 2 + 1]  # half the elements: only the pair's two outputs cross it
    expected_pair = _host.group_quantise_pair(pair_x, 32, "F143", "mx_floor", 448.0, 8, 0, 1)
    for level in levels()[1:]:
        _host.fused_tuning(-1, level)
        for group in forms:
            buffer = torch.full((n + offset,), float("nan"))
            out = buffer[offset:].view(rows, cols)
            values, scales, finite = _host.group_quantise(x, *group, "F143", "mx_floor", 448.0,
                                                          8, 0, 1, out=out)
            assert finite and values.data_ptr() == out.data_ptr()
            assert torch.equal(scales, expected[group][1]), (level, group)
            assert torch.equal(out.view(torch.int32), expected[group][0].view(torch.int32)), (
                level, group)
        got = _host.group_quantise_pair(pair_x, 32, "F143", "mx_floor", 448.0, 8, 0, 1)
        for value, want in zip(got[:4], expected_pair[:4]):
            assert torch.equal(value.view(torch.int32), want.view(torch.int32)), level


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_group_is_reported(value, restore_tuning):
    for level in levels():
        _host.fused_tuning(-1, level)
        x = torch.randn(40, 70)
        x[33, 65] = value
        for group_rows, group_cols in [(1, 32), (32, 1), (16, 16), (40, 70)]:
            _, scales, finite = _host.group_quantise(x, group_rows, group_cols, "F143", "amax",
                                                     240.0)
            assert not finite
            # The other groups keep their scales: only the group holding the value is off.
            bad = (scales == 1 << 30).nonzero().tolist()
            assert bad == [[33 // group_rows, 65 // group_cols]]


def test_bad_arguments_say_what_is_wrong():
    x = torch.randn(8, 8)
    with pytest.raises(ValueError, match="contiguous 2-D CPU float32"):
        _host.group_quantise(x.t(), 1, 4, "F143", "amax", 240.0)
    with pytest.raises(ValueError, match="contiguous 2-D CPU float32"):
        _host.group_quantise(x.double(), 1, 4, "F143", "amax", 240.0)
    with pytest.raises(ValueError, match="at least 1 x 1"):
        _host.group_quantise(x, 0, 4, "F143", "amax", 240.0)
    with pytest.raises(ValueError, match="rule 'mean'"):
        _host.group_quantise(x, 1, 4, "F143", "mean", 240.0)
    with pytest.raises(ValueError, match="implement"):
        _host.group_quantise(x, 1, 4, "E4M3FN", "amax", 448.0)
    with pytest.raises(ValueError, match="rejected its arguments"):
        _host.group_quantise(x, 1, 4, "F143", "amax", 240.0, margin=40)


# group_cast's groupings, rules and formats: its host path against its torch path.
GROUPINGS = [Grouping("tensor"), Grouping("row"), Grouping("tile", 32), Grouping("tile", 128),
             Grouping("block", 128), Grouping("block", 7)]
CASES = [("F143", "amax", "floor", 0), ("F152", "amax", "floor", 3), ("E4M3FN", "amax", "floor", 1),
         ("E4M3FN", "mx", "floor", 0), ("E5M2", "mx", "floor", 0), ("E4M3FN", "mx", "up", 0),
         ("F143", "mx", "floor", 0)]


def _same_cast(a, b) -> bool:
    return (torch.equal(a.values.view(torch.int32), b.values.contiguous().view(torch.int32))
            and a.log2_scales.shape == b.log2_scales.shape
            and torch.equal(a.log2_scales, b.log2_scales))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
def test_group_cast_host_path_is_its_torch_path(grouping, case):
    fmt_name, rule, scale_rounding, margin = case
    fmt = get_format(fmt_name)
    for seed, (rows, cols) in enumerate(SHAPES):
        x = edge_tensor(rows, cols, seed)
        # The contiguous operand, and a transposed view (cast with column groups in place).
        for operand in (x, x.t().contiguous().t()):
            host = group_cast(operand, fmt, grouping, rule, margin, scale_rounding=scale_rounding)
            with _host.disabled():
                reference = group_cast(operand, fmt, grouping, rule, margin,
                                       scale_rounding=scale_rounding)
            assert torch.equal(host.values.contiguous().view(torch.int32),
                               reference.values.contiguous().view(torch.int32)), (rows, cols)
            assert host.log2_scales.shape == reference.log2_scales.shape
            assert torch.equal(host.log2_scales, reference.log2_scales)


@pytest.mark.parametrize("grouping", [Grouping("tile", 32), Grouping("tile", 128),
                                      Grouping("row"), Grouping("block", 128)], ids=str)
def test_group_cast_pair_is_the_two_casts(grouping):
    fmt = get_format("E4M3FN")
    for seed, (rows, cols) in enumerate(SHAPES):
        x = edge_tensor(rows, cols, seed)
        along_rows, along_cols = group_cast_pair(x, fmt, grouping, "mx")
        with _host.disabled():
            assert _same_cast(group_cast(x, fmt, grouping, "mx"), along_rows)
            assert _same_cast(group_cast(x.t().contiguous(), fmt, grouping, "mx"), along_cols)


@pytest.mark.parametrize("grouping", [Grouping("tile", 32), Grouping("block", 16),
                                      Grouping("row")], ids=str)
def test_a_non_finite_group_raises_as_on_the_torch_path(grouping):
    fmt = get_format("F143")
    x = torch.randn(48, 80)
    x[20, 70] = float("nan")
    with _host.disabled(), pytest.raises(NonFiniteAmaxError) as reference:
        group_cast(x, fmt, grouping)
    with pytest.raises(NonFiniteAmaxError) as host:
        group_cast(x, fmt, grouping)
    assert str(host.value) == str(reference.value)
    with pytest.raises(NonFiniteAmaxError):
        group_cast_pair(x, fmt, grouping)


@pytest.mark.parametrize("group", ["tile 32", "column tile 32", "block 128", "row", "tensor"])
def test_threads_split_the_groups_without_changing_them(group):
    """A tensor large enough for several threads (the kernels give each at least 64K
    elements) gives what one thread gives."""
    x = edge_tensor(513, 1031, 7)
    group_rows, group_cols = GROUPS[group](*x.shape)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 3):
            torch.set_num_threads(count)
            results.append(_host.group_quantise(x, group_rows, group_cols, "F143", "amax", 240.0))
            results.append(_host.group_quantise_pair(x, 32, "F143", "mx_floor", 448.0, 8, 0, 1))
    finally:
        torch.set_num_threads(threads)
    for one, several in zip(results[:2], results[2:]):
        for a, b in zip(one, several):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))
            else:
                assert a == b
