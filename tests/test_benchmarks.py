"""The benchmark harness: every row present, ratios positive and finite, memory counted right.

No timing thresholds: timings on a shared machine say nothing about correctness.
"""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import transformers_with_torch

from benchmarks.heap import DEFAULT
from benchmarks.measure import instances, peak_step_bytes, time_interleaved
from benchmarks.report import cpu_model, markdown, text_table
from benchmarks.suite import Settings, run_suite
from benchmarks.variants import OURS, PUBLISHED, TORCH, Shape, build_model, published_version

TINY = Shape(vocab_size=32, seq_len=8, depth=1, hidden_size=16, heads=2, batch_size=2)

ROW_KEYS = {
    "step_eager_ours",
    "step_eager_published",
    "step_eager_ours_vs_published",
    "step_eager_two_functions",
    "step_eager_native_layers",
    "step_compiled_ours",
    "step_compiled_published",
    "step_compiled_ours_vs_published",
    "fp8_static_ours",
    "fp8_amax_ours",
    "fp8_static_two_functions",
    "fp8_static_native_layers",
    "fp8_static_published",
    "cast_throughput",
    "cast_melem",
    "memory_ours",
    "memory_published",
    "fp8_static_no_host",
    "fp8_amax_no_host",
    "step_eager_ours_second",
    "fp8_static_second",
    "copy_bandwidth",
    "cast_fraction",
    "gpu_scaled_mm",
    "gpu_fp8_static_vs_amax",
    "traced_ops_ours",
    "traced_ops_vs_torch",
    "fp8_block_ours",
    "fp8_mx_ours",
    "fp8_rowwise_ours",
    "fp8_delayed_ours",
    "telemetry_cost",
    "cast_fraction_tile128",
    "cast_fraction_block128",
    "cast_fraction_column128",
    "cast_fraction_mx32",
    "cast_fraction_mx_column32",
    "cast_fraction_mx_pair32",
}
SWEEP_WIDTHS = (8, 16)


@pytest.fixture(scope="module")
def tiny_run():
    threads = torch.get_num_threads()
    settings = Settings(
        shape=TINY, rounds=2, min_run_time=0.01, threads=1, compile=False, cast_elements=1 << 10,
        second_shape=TINY, sweep_widths=SWEEP_WIDTHS, sweep_shape=TINY, sweep_rounds=1,
        heap=DEFAULT,  # (the test process's heap left as it is: see test_the_kept_heap_...)
    )
    try:
        yield settings, run_suite(settings, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)


def test_every_row_is_present_once(tiny_run):
    _, results = tiny_run
    keys = [row.key for row in results.rows]
    sweep = {f"sweep_{kind}_{width}" for width in SWEEP_WIDTHS for kind in ("unit", "fp8")}
    assert sorted(keys) == sorted(ROW_KEYS | sweep)


def test_measured_ratios_are_positive_and_finite(tiny_run):
    _, results = tiny_run
    for row in results.rows:
        if row.value is not None:
            assert math.isfinite(row.value) and row.value > 0, row
        if row.value is not None and row.key.startswith(("step_", "fp8_")):
            low, high = row.spread
            assert low <= row.value <= high, row  # the median lies between the quartiles


def test_rows_are_skipped_only_for_a_stated_reason(tiny_run):
    _, results = tiny_run
    for row in results.rows:
        if row.value is None:
            assert row.note, row
    always_measured = {"step_eager_ours", "fp8_static_ours", "fp8_amax_ours", "memory_ours"}
    assert all(results.row(key).value is not None for key in always_measured)
    assert all(results.row(key).value is None for key in ROW_KEYS if "compiled" in key)
    published_measured = results.row("step_eager_published").value is not None
    assert published_measured == (published_version() is not None)


def test_compiled_rows_say_why_where_torch_compile_cannot_run(monkeypatch):
    """Torch 2.0 refuses torch.compile on Python 3.11: the compiled rows are skipped, not lost."""
    import torch._dynamo

    refusal = "Python 3.11+ not yet supported for torch.compile"

    def refuse() -> None:
        raise RuntimeError(refusal)

    monkeypatch.setattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", refuse)
    threads = torch.get_num_threads()
    settings = Settings(
        shape=TINY, rounds=1, min_run_time=0.01, threads=1, compile=True, cast_elements=1 << 10,
        heap=DEFAULT,
    )
    try:
        results = run_suite(settings, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    for key in ("step_compiled_ours", "step_compiled_published", "step_compiled_ours_vs_published"):
        row = results.row(key)
        assert row.value is None and row.status == "skipped"
        assert row.note == f"torch.compile unavailable: {refusal}"
    assert results.row("step_eager_ours").value is not None
    # The published simulate_fp8 goes through TorchDynamo too: skipped with the reason.
    published_fp8 = results.row("fp8_static_published")
    assert published_fp8.value is None and published_fp8.status == "skipped"
    assert refusal in published_fp8.note or published_fp8.note == "unit-scaling not installed"


def test_status_follows_the_target(tiny_run):
    _, results = tiny_run
    for row in results.rows:
        if row.value is None:
            assert row.status == "skipped"
        elif row.target is None:
            assert row.status == "-"
        else:
            met = row.value >= row.target if row.higher_is_better else row.value <= row.target
            assert row.status == ("met" if met else "MISSED")


def test_reports_name_every_row_and_the_command(tiny_run):
    settings, results = tiny_run
    table = text_table(results)
    report = markdown(results, settings, "python -m benchmarks --quick")
    for row in results.rows:
        assert row.label in table
        assert row.label in report
    assert "python -m benchmarks --quick" in report
    assert "torch " + torch.__version__ in report


def test_traced_op_rows_are_the_counts_of_the_traced_graphs(tiny_run):
    settings, results = tiny_run
    counts = results.op_counts
    ours, dropped = counts["ours (ScaledIdentity)"], counts["ours, scales dropped"]
    row = results.row("traced_ops_ours")
    assert row.value == ours / dropped and row.target == 1.1
    assert f"{ours} ops" in row.note and f"against {dropped}" in row.note
    assert results.row("traced_ops_vs_torch").value == ours / counts["plain torch"]
    # The one-op scales remove the composite form's extra ops; the plain GPT has no scales.
    assert counts["ours, composite scales"] > ours > counts["plain torch"]
    report = markdown(results, settings, "python -m benchmarks --quick")
    assert f"| ours (ScaledIdentity) | {ours} |" in report


def test_the_three_builds_have_the_same_parameters():
    names = [TORCH, OURS] + ([PUBLISHED] if published_version() else [])
    shapes = {
        name: [(key, tuple(p.shape)) for key, p in build_model(name, TINY).named_parameters()]
        for name in names
    }
    assert all(shapes[name] == shapes[TORCH] for name in names)


def test_peak_memory_counts_a_known_allocation():
    size = 1 << 18  # float32 elements: 1 MiB

    def step() -> float:
        first = torch.ones(size)
        second = torch.ones(size)  # both held at once: 2 MiB peak
        total = float(first.sum() + second.sum())
        del first, second
        return total

    peak = peak_step_bytes(step)
    assert 2 * 4 * size <= peak < 2 * 4 * size + 4096


def test_interleaved_ratio_is_per_round_median():
    calls = {"a": 0, "b": 0}

    def count(name: str):
        def step() -> None:
            calls[name] += 1
        return step

    timings = time_interleaved({"a": count("a"), "b": count("b")}, rounds=3, min_run_time=0.001)
    assert len(timings.seconds["a"]) == len(timings.seconds["b"]) == 3
    assert calls["a"] > 0 and calls["b"] > 0
    timings.seconds = {"a": [1.0, 2.0, 9.0], "b": [2.0, 1.0, 3.0]}
    assert timings.ratio("a", "b") == 2.0  # per-round ratios 0.5, 2, 3
    assert timings.spread("a", "b") == (1.25, 2.5)  # inclusive quartiles of 0.5, 2, 3
    assert timings.median_ms("a") == 2000.0


def test_a_variant_of_several_instances_times_the_next_in_each_round():
    """Each round times one instance of a many-instance variant, in turn (each warmed up
    first), so its figure is no one instance's; a one-function variant is timed every round."""
    timed: list = []

    def instance(index: int):
        def step() -> None:
            timed.append(index)
        return step

    timings = time_interleaved({"a": [instance(0), instance(1), instance(2)], "b": instance(9)},
                               rounds=5, min_run_time=0.001, warmup=1)
    assert len(timings.seconds["a"]) == len(timings.seconds["b"]) == 5
    assert timed[:4] == [0, 1, 2, 9]  # the warm-up calls
    runs = [index for position, index in enumerate(timed[4:])
            if index != 9 and (position == 0 or timed[4 + position - 1] != index)]
    assert runs == [0, 1, 2, 0, 1]  # one instance per round, the next in each
    assert len(instances(lambda: instance(5), 3)) == 3


def test_the_report_says_which_form_the_layers_ran_in(tiny_run):
    from ipu_unit_scaling.ops import native_layers

    settings, results = tiny_run
    note = f"Transformer layers in eager mode: {native_layers.status()}"
    assert note in results.notes
    assert note in markdown(results, settings, "python -m benchmarks")


def test_telemetry_on_and_off_alternate_step_by_step(monkeypatch):
    """Each round is one sampling period of each, their steps alternating and which goes
    first alternating too (so that both meet the same machine), each round's figure the
    mean step time: with "on" steps taking 3 units and "off" steps 2, the ratio is 1.5."""
    from benchmarks import measure, telemetry_cost

    now = [0.0]
    order: list = []

    def step(name: str, cost: float):
        def run() -> None:
            order.append(name)
            now[0] += cost
        return run

    interval = 4
    monkeypatch.setattr(telemetry_cost, "_steps",
                        lambda shape: ({"on": step("on", 3.0), "off": step("off", 2.0)}, interval))
    monkeypatch.setitem(measure.CLOCKS, "units", lambda: now[0])
    timings, _ = telemetry_cost.telemetry_timings(TINY, rounds=3, clock="units")
    assert timings.seconds == {"on": [3.0] * 3, "off": [2.0] * 3}
    assert timings.ratio("on", "off") == 1.5
    warmup, timed = order[:2 * interval], order[2 * interval:]
    assert warmup.count("on") == warmup.count("off") == interval
    assert timed[:8] == ["on", "off", "off", "on", "on", "off", "off", "on"]
    assert len(timed) == 3 * 2 * interval


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
def test_the_kept_heap_takes_almost_no_page_faults_a_step():
    """glibc's defaults took a median of 500 to 960 faults a step here (2-core AMD EPYC),
    varying with the order of the frees; the kept heap 0 to 1. Each heap as
    `python -m benchmarks.heap` measures it: ten steps of each variant after two to warm up.
    On a 2-core Intel Xeon VM about one measuring process in ten under the kept heap took 32
    or 64 faults in every FP32 step, the next process none: the kept heap is measured in a
    second process where the first took more than 16."""
    root = str(Path(__file__).resolve().parent.parent)

    def measured(heap: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.heap", "--measure", heap, "--steps", "10"],
            capture_output=True, text=True, check=True, cwd=root).stdout
        return json.loads(out.splitlines()[-1])

    got = {heap: measured(heap) for heap in ("kept", "default")}
    if got["kept"]["steps"]["fp32"]["faults"] > 16:
        got["kept, second process"] = got["kept"] = measured("kept")
    assert got["kept"]["steps"]["fp32"]["faults"] <= 16, got
    assert got["kept"]["heap"].startswith("glibc's heap kept between steps")
    assert "`--heap default`" in got["default"]["heap"]


# Torch eager's amax + cast of 16M elements, whose temporaries are 64 MiB each: glibc maps
# memory that large afresh at every allocation (its mmap threshold is at most 32 MiB), so each
# call faults their pages in again unless every allocation comes from the kept heap.
_EAGER_CALLS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from benchmarks.cast_throughput import torch_eager_amax_cast
from benchmarks.heap import keep_heap
if {reuse}:
    assert keep_heap(no_mappings=True) is not None
x = torch.randn(16 << 20)
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch_eager_amax_cast(x)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[-10:])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fnuz"), reason="torch eager's cast needs it")
def test_memory_reused_gives_torch_eagers_temporaries_no_fresh_pages():
    """What `python -m benchmarks.cast_throughput --reuse-memory` changes."""
    root = str(Path(__file__).resolve().parent.parent)
    got = {}
    for reuse in (True, False):
        out = subprocess.run([sys.executable, "-c", _EAGER_CALLS.format(root=root, reuse=reuse)],
                             capture_output=True, text=True, check=True).stdout
        got[reuse] = [int(n) for n in out.split()]
    pages = (64 << 20) // 4096
    # The kept heap holds every temporary in freed chunks once their layout has settled, which
    # took from one to seven calls in runs here (a call that grows the heap faults in one
    # temporary afresh); glibc's defaults fault in at least two at every call.
    settled = [n for n in got[True] if n < pages // 100]
    assert len(settled) >= 8, got
    assert min(got[False]) >= 2 * pages, got


def test_the_heap_measurement_prints_each_heaps_steps():
    """`python -m benchmarks.heap`: a row per heap and step, with medians inside their
    quartiles; too few steps is one line."""
    root = str(Path(__file__).resolve().parent.parent)
    run = subprocess.run([sys.executable, "-m", "benchmarks.heap", "--quick", "--steps", "4"],
                         capture_output=True, text=True, check=True, cwd=root)
    rows = [line.split(" | ") for line in run.stdout.splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [
        (f"| {heap}", step) for heap in ("kept", "default") for step in ("fp32", "static", "mx")]
    for row in rows:
        median, quartiles = row[2].split(" ")
        low, high = quartiles.strip("()").split("-")
        assert 0 < float(low) <= float(median) <= float(high)
    bad = subprocess.run([sys.executable, "-m", "benchmarks.heap", "--steps", "1"],
                         capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1].endswith("--steps must be at least 2; got 1")


def test_an_unknown_heap_is_one_line():
    from benchmarks.heap import set_heap

    with pytest.raises(ValueError, match="heap must be one of kept, default; got 'big'"):
        set_heap("big")


def test_emulate_fp16_times_float32_and_both_float16_forms(capsys):
    """`python -m benchmarks.emulate_fp16 --quick`: a tiny BERT's training step through the
    PopTorch stand-in in float32, float16 with half partials and float16 with float partials,
    each timed, both ratios to float32 positive and finite, the half-partials target named;
    the half-partials form really rounds its partial sums (its steps part from the other's)."""
    transformers_with_torch()  # its BERT: transformers 5 has no PyTorch models before torch 2.6
    from benchmarks import emulate_fp16

    threads = torch.get_num_threads()
    assert emulate_fp16.main(["--quick"]) == 0
    assert torch.get_num_threads() == threads
    lines = capsys.readouterr().out.splitlines()
    for form in emulate_fp16.FORMS:
        assert any(line.startswith(f"{form}: ") and line.endswith(" ms a step") for line in lines)
    ratios = [float(line.split(": ")[1].split("x")[0]) for line in lines if " / float32: " in line]
    assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios), lines
    assert any("target at most 2.0x" in line for line in lines)
    logits = {}
    for form in (emulate_fp16.HALF_PARTIALS, emulate_fp16.FLOAT_PARTIALS):
        step = emulate_fp16.training_step(form, emulate_fp16.QUICK)
        for _ in range(3):
            logits[form], _ = step()
    assert logits[emulate_fp16.HALF_PARTIALS].dtype == torch.float16
    assert not torch.equal(logits[emulate_fp16.HALF_PARTIALS],
                           logits[emulate_fp16.FLOAT_PARTIALS])


@pytest.mark.parametrize("block, expected", [
    ("model name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx2 avx512f "
     "hypervisor\n", "AMD EPYC (family 26 model 2, AVX-512, virtual machine)"),
    ("model name\t: Intel(R) Xeon(R) Processor\ncpu family\t: 6\nmodel\t\t: 207\nflags\t\t: "
     "fpu avx2\n", "Intel(R) Xeon(R) Processor (family 6 model 207, AVX2)"),
])
def test_the_report_names_the_cpus_family_model_and_simd(tmp_path, block, expected):
    # A second processor's block, with other values, must not be read: the first describes all.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(block + "\nmodel name\t: other\ncpu family\t: 1\nmodel\t\t: 1\n")
    assert cpu_model(str(cpuinfo)) == expected
