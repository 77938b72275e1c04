"""The BERT-style encoder and its masked-LM training: masking, padding, unit scales, the
PopTorch form, and the comparison behind `compare --model bert`."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

import ipu_unit_scaling as uu
from ipu_unit_scaling.apps.mlm import (
    MLMConfig,
    build_encoder,
    run_mlm_compare,
    train_mlm,
)
from ipu_unit_scaling.ipu import trace_like_poptorch
from ipu_unit_scaling.loop.masked_lm import mask_tokens
from ipu_unit_scaling.models.encoder import BertStyleEncoder
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.training.run_directory import METRIC_FIELDS
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = MLMConfig().with_overrides([
    "mlm.hidden_size=32", "mlm.depth=1", "mlm.heads=2", "mlm.seq_len=24", "mlm.min_len=8",
    "mlm.batch_size=8", "mlm.steps=30", "mlm.warmup_steps=5", "mlm.eval_interval=10",
    "mlm.eval_batches=2"])


def _encoder(ops=uu.UNIT_OPS, seed: int = 0) -> BertStyleEncoder:
    torch.manual_seed(seed)
    return BertStyleEncoder(60, 64, 2, 4, 32, pad_id=58, ops=ops)


def _random_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 58, (16, 32), generator=gen)
    real = torch.arange(32)[None, :] < torch.randint(16, 33, (16, 1), generator=gen)
    ids = torch.where(real, ids, torch.full_like(ids, 58))
    return mask_tokens(ids, real, 59, 58, 0.15, gen)


def test_unit_scaled_encoder_gradients_are_unit_plain_ones_tiny():
    inputs, labels = _random_batch()
    stds = {}
    for name, ops in (("unit", uu.UNIT_OPS), ("plain", uu.TORCH_OPS)):
        model = _encoder(ops)
        model(inputs, labels).backward()
        stds[name] = [p.grad.std().item() for p in model.parameters()]
    assert all(0.5 <= s <= 2 for s in stds["unit"]), stds["unit"]
    assert statistics.median(stds["plain"]) < 1e-2


def test_padding_is_invisible_to_real_tokens():
    model = _encoder().eval()
    inputs, _ = _random_batch()
    row = inputs[:1, :20].clone()
    row[row == 58] = 7  # twenty real tokens
    padded = torch.cat([row, torch.full((1, 12), 58)], dim=1)
    torch.testing.assert_close(model(padded)[:, :20], model(row), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unit_scaled", [True, False], ids=["unit", "plain"])
def test_encoder_traced_like_poptorch_has_eager_loss_and_gradients(unit_scaled):
    model = _encoder(uu.UNIT_OPS if unit_scaled else uu.TORCH_OPS)
    inputs, labels = _random_batch(1)
    eager = model(inputs, labels)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    with torch_numerics():  # GELU as torch defines it (an IPU runs PopART's; test_ipu_lowering.py)
        trace = trace_like_poptorch(model, inputs, labels)
    assert trace.report.ok, str(trace.report)
    traced = trace(inputs, labels)
    traced_grads = torch.autograd.grad(traced, list(model.parameters()))
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)
    # Unit-scaled gradients are of order 1: an absolute 1e-5 is a relative 1e-5 at the tensor's
    # scale. Eager folds scales into the GEMMs, the trace multiplies after them; elements near
    # cancellation differ by float32 rounding (torch 2.0.1 shows one of 4096 at 1.6e-6).
    for e, t in zip(eager_grads, traced_grads):
        torch.testing.assert_close(t, e, rtol=1e-4, atol=1e-5)


def test_regimes_build_the_right_model_and_precision():
    from ipu_unit_scaling.training.precision import FP16Linear

    unit_fp8 = build_encoder(TINY, 40, "unit-fp8")
    assert any(type(m).__name__ == "FP8UnitScaledLinear" for m in unit_fp8.modules())
    plain_fp16 = build_encoder(TINY, 40, "fp16")
    assert any(isinstance(m, FP16Linear) for m in plain_fp16.modules())
    # FP16Linear replaces uu.Linear too: the plain build shows in what the linears wrap, in
    # the other modules and in the ops.
    assert not any(m.unit_scaled for m in plain_fp16.modules() if isinstance(m, FP16Linear))
    assert not any(isinstance(m, (uu.LayerNorm, uu.Embedding)) for m in plain_fp16.modules())
    assert plain_fp16.ops is uu.TORCH_OPS
    assert build_encoder(TINY, 40, "unit-fp16").ops is uu.UNIT_OPS


def test_train_mlm_learns_and_writes_its_run_through_the_training_loop(tmp_path):
    run_dir = tmp_path / "run"
    summary = train_mlm(TINY, "unit-fp32", 0, run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["task"] == "masked-lm" and summary["model"] == "unit"
    curve = summary["val_curve"]
    assert [step for step, _ in curve] == [10, 20, 30]
    # Below uniform guessing over the characters, and improving.
    assert curve[-1][1] < summary["uniform_baseline"] and curve[-1][1] < curve[0][1]
    assert 0 < summary["final_val_metrics"]["accuracy"] < 1
    rows = read_metrics(run_dir)
    assert list(rows[0]) == [*METRIC_FIELDS, "val_accuracy"] and len(rows) == 30
    evaluated = [row for row in rows if row["val_loss"]]
    assert [int(row["step"]) for row in evaluated] == [10, 20, 30]
    assert all(row["val_accuracy"] for row in evaluated)
    assert not any(row["val_accuracy"] for row in rows if not row["val_loss"])
    assert float(evaluated[-1]["val_loss"]) == summary["final_val_loss"] == curve[-1][1]
    assert float(evaluated[-1]["val_accuracy"]) == summary["final_val_metrics"]["accuracy"]
    # The loop's run directory: the task recorded, a checkpoint at the end, the figure.
    assert json.loads((run_dir / "task.json").read_text()) == {
        "name": "masked-lm", "min_len": TINY.min_len, "mask_prob": TINY.mask_prob}
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 30
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_runs_every_regime_and_seed_and_reuses_finished_runs(tmp_path, capsys):
    rows = run_mlm_compare(TINY, ["fp32", "unit-fp8"], [0, 1], tmp_path)
    assert [r["regime"] for r in rows] == ["fp32", "unit-fp8"]
    assert rows[0]["gap_to_fp32_percent"] == 0 and rows[0]["completed"] == 2
    assert rows[1]["val_loss"] is not None and rows[1]["gap_std"] is not None
    table = (tmp_path / "compare.md").read_text()
    assert "| unit-fp8 | unit-scaled | fp8 static |" in table and "seeds 0, 1" in table
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["seeds"] == [0, 1] and len(data["regimes"]) == 2
    capsys.readouterr()
    again = run_mlm_compare(TINY, ["fp32", "unit-fp8"], [0, 1], tmp_path)
    assert capsys.readouterr().out.count("reusing the finished run") == 4
    assert again == rows


def test_overrides_apply_and_bad_ones_are_named():
    config = MLMConfig().with_overrides(["mlm.steps=50", "hidden_size=64",
                                         "mlm.learning_rates.unit-fp8=0.05"])
    assert config.steps == 50 and config.hidden_size == 64
    assert config.learning_rates["unit-fp8"] == 0.05
    with pytest.raises(ValueError, match="not an mlm setting"):
        MLMConfig().with_overrides(["mlm.stepz=3"])
    with pytest.raises(ValueError, match="heads"):
        MLMConfig().with_overrides(["mlm.heads=3"])


def test_a_run_of_the_earlier_host_loop_is_trained_again_through_the_loop(tmp_path, capsys):
    """Earlier versions trained each run in a loop of their own, which left only metrics.csv
    and a summary.json without checkpoint: nothing to resume, so the run is trained again."""
    old = tmp_path / "fp32-seed0"
    old.mkdir()
    (old / "metrics.csv").write_text("step,lr,train_loss,val_loss,val_accuracy\n")
    (old / "summary.json").write_text(json.dumps({
        "regime": "fp32", "model": "plain", "seed": 0, "status": "completed", "steps": 30}))
    rows = run_mlm_compare(TINY, ["fp32"], [0], tmp_path)
    assert "holds a run of an earlier version" in capsys.readouterr().out
    assert rows[0]["completed"] == 1
    summary = json.loads((old / "summary.json").read_text())
    assert summary["checkpoint_step"] == 30 and summary["task"] == "masked-lm"


def test_a_diverging_regime_is_recorded_and_reused_and_the_others_still_run(tmp_path, capsys):
    config = TINY.with_overrides(["mlm.steps=6", "mlm.warmup_steps=0",
                                  "mlm.learning_rates.unit-fp8=1000"])
    rows = run_mlm_compare(config, ["fp32", "unit-fp8"], [0], tmp_path)
    assert "unit-fp8 seed 0: loss became" in capsys.readouterr().out
    assert [(row["completed"], row["runs"]) for row in rows] == [(1, 1), (0, 1)]
    assert rows[1]["val_loss"] is None and "divergence" in rows[1]["messages"][0]
    summary = json.loads((tmp_path / "unit-fp8-seed0" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] < 6
    assert run_mlm_compare(config, ["fp32", "unit-fp8"], [0], tmp_path) == rows
    assert capsys.readouterr().out.count("reusing the finished run") == 2
