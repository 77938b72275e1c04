"""Scale tracking, reports and plots, checked against direct counts and independent casts."""
from __future__ import annotations

import csv
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import Tensor, nn

from ipu_unit_scaling.analysis import (
    ScaleReporter,
    analyse,
    cast_fractions,
    range_format,
    record_scales,
    role_summary,
)
from ipu_unit_scaling.models import GPTConfig, build_gpt

pytestmark = pytest.mark.usefixtures("one_thread")

ORACLE_DTYPES = {
    "F143": ml_dtypes.float8_e4m3fnuz,
    "F152": ml_dtypes.float8_e5m2fnuz,
    "FP16": np.float16,
}


def oracle_fractions(values: np.ndarray, name: str):
    """Cast with ml_dtypes / numpy and count zeros from non-zeros, and non-finite results."""
    with np.errstate(over="ignore"):
        cast = values.astype(ORACLE_DTYPES[name]).astype(np.float64)
    underflow = np.count_nonzero((cast == 0) & (values != 0))
    overflow = np.count_nonzero(~np.isfinite(cast))
    return underflow / values.size, overflow / values.size


def hand_made(name: str) -> np.ndarray:
    """Values around both ends of a format's range, including the rounding ties."""
    fmt = range_format(name)
    tiny, top = fmt.min_subnormal, fmt.max
    edges = [0.0, tiny / 2, tiny / 2 * 1.01, tiny / 4, tiny, tiny * 0.49, top,
             fmt.overflow_threshold, fmt.overflow_threshold * 0.999, top * 1.01, top * 4]
    edges += [-e for e in edges]
    spread = np.exp2(np.random.default_rng(0).uniform(-30, 20, 500)) * np.sign(
        np.random.default_rng(1).standard_normal(500))
    return np.concatenate([np.array(edges), spread]).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("name", ["F143", "F152", "FP16"])
def test_cast_fractions_agree_with_real_casts(name: str) -> None:
    values = hand_made(name)
    got = cast_fractions(torch.tensor(values, dtype=torch.float32), name)
    expected = oracle_fractions(values, name)
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[0] > 0 and got[1] > 0  # both ends are exercised


def test_format_ranges() -> None:
    assert range_format("F143").max == 240.0
    assert range_format("F143").min_subnormal == 2.0**-10
    assert range_format("F152").max == 57344.0
    assert range_format("F152").min_subnormal == 2.0**-17
    assert range_format("FP16").max == 65504.0
    assert range_format("FP16").min_subnormal == 2.0**-24


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.relu(self.first(x)))


def test_record_scales_matches_direct_computation() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    x = torch.randn(64, 16) * 3
    records = record_scales(model, x, formats=("F143", "FP16"), seed=5)
    assert all(p.grad is None for p in model.parameters())

    by_key = {(r.op, r.role): r for r in records}
    assert [r.op for r in records if r.role == "activation"] == ["first", "relu", "second"]

    hidden = model.first(x)
    activated = torch.relu(hidden)
    out = model.second(activated)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out, [hidden, model.second.weight], grad_out)

    def check(key, tensor: Tensor) -> None:
        record = by_key[key]
        values = tensor.detach().double()
        assert record.std == pytest.approx(values.std(unbiased=False).item(), rel=1e-9)
        assert record.absmax == pytest.approx(values.abs().max().item(), rel=1e-9)
        assert record.numel == values.numel()
        for fmt in ("F143", "FP16"):
            expected = oracle_fractions(values.numpy(), fmt)
            assert (record.underflow[fmt], record.overflow[fmt]) == pytest.approx(expected)

    check(("first", "activation"), hidden)
    check(("relu", "activation"), activated)
    check(("second", "activation"), out)
    check(("first", "gradient"), grads[0])
    check(("second.weight", "weight"), model.second.weight)
    check(("second.weight", "gradient"), grads[1])
    # A gradient record shares its activation's index.
    assert by_key[("first", "gradient")].index == by_key[("first", "activation")].index


def test_record_scales_with_labels_uses_the_returned_loss() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, seq_len=16, depth=1, hidden_size=32, heads=2)
    model = build_gpt(config)
    ids = torch.randint(0, 65, (4, 16))
    records = record_scales(model, ids, ids)
    head = next(r for r in records if r.op == "head" and r.role == "gradient")
    logits = model(ids)
    loss = model.loss(logits, ids)
    (grad,) = torch.autograd.grad(loss, [logits])
    assert head.std == pytest.approx(grad.double().std(unbiased=False).item(), rel=1e-6)


def test_scale_reporter_writes_only_on_reporting_steps(tmp_path) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, seq_len=16, depth=1, hidden_size=32, heads=2)
    model = build_gpt(config)
    ids = torch.randint(0, 65, (4, 16))
    reporter = ScaleReporter(tmp_path, every=3)
    for step in range(7):
        reporter.maybe_record(step, model, ids, ids)
    with (tmp_path / "scale_report.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted({int(r["step"]) for r in rows}) == [0, 3, 6]
    assert {r["role"] for r in rows} == {"activation", "weight", "gradient"}
    assert set(rows[0]) == {
        "step", "role", "min_log2_std", "max_log2_std",
        "underflow_F143", "overflow_F143", "underflow_F152", "overflow_F152",
    }
    expected = role_summary(record_scales(model, ids, ids, formats=("F143", "F152")),
                            ("F143", "F152"))
    first = {r["role"]: r for r in rows if r["step"] == "0"}
    for role, row in expected.items():
        assert float(first[role]["max_log2_std"]) == pytest.approx(row["max_log2_std"])
        assert float(first[role]["underflow_F152"]) == pytest.approx(row["underflow_F152"])
    assert all(math.isfinite(float(r["min_log2_std"])) for r in rows)


def test_analyse_writes_a_png_and_a_table(tmp_path) -> None:
    config = GPTConfig(vocab_size=65, seq_len=32, depth=2, hidden_size=64, heads=2)
    table, png = analyse(config, tmp_path, batch_size=4)
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = table.splitlines()
    assert "log2 std" in lines[0]
    assert any(line.startswith("plain") for line in lines)
    assert any(line.startswith("unit-scaled") for line in lines)
    # The plain model's worst tensor sits far further from unit than the unit-scaled one's.
    plain_worst = float(next(line for line in lines if line.startswith("plain")).split()[3])
    unit_worst = float(next(line for line in lines if line.startswith("unit-scaled")).split()[3])
    assert abs(plain_worst) > 8 > 1 > abs(unit_worst)
