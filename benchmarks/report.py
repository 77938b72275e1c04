"""Render benchmark results: a console table and docs/BENCHMARKS.md."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Dict, List, Sequence

import torch

from . import recorded_runs
from .measure import INSTANCES
from .suite import Results, Row, Settings, block_form_keys
from .variants import published_version

# Why a missed target is missed, keyed by row; shown in the table's notes when it is.
OBSTACLES: Dict[str, str] = {
    "step_eager_ours": (
        "what remains is per-call overhead, not arithmetic: the embedding, the readout and the "
        "loss still run as Python autograd Functions (and the layers too, where their C++ nodes "
        "are not built: see the notes), plus one elementwise pass each way per layer for the "
        "attention row scale; at this small width a step is short enough for that to show, and "
        "it shrinks as the model grows (see the width sweep)"
    ),
    "step_eager_ours_second": (
        "as for the first shape: per-call overhead and the row-scale passes, a smaller share of "
        "the longer step"
    ),
    "step_eager_ours_vs_published": (
        "both libraries add similar elementwise passes; within the noise of a shared machine"
    ),
    "step_compiled_ours": (
        "the scale multiplies that Inductor cannot fuse into a neighbouring kernel (those next "
        "to a matmul or attention) remain separate passes over activations"
    ),
    "step_compiled_ours_vs_published": (
        "both compile to similar graphs; within the noise of a shared machine"
    ),
    "fp8_static_ours": (
        "FP8 is simulated on a CPU without FP8 matmuls: each FP8 linear rounds its input, weight "
        "and output gradient to FP8 values (one pass each) around float32 GEMMs, into buffers "
        "the layers' and the readout's C++ nodes keep between steps; the passes and the calls "
        "around them are work the FP32 step does not do"
    ),
    "fp8_static_second": (
        "the rounding passes of FP8 simulation, as for the first shape"
    ),
    "fp8_static_no_host": (
        "without the host library the rounding is torch's float8 round trip: a clamp, a cast to "
        "float8 and back by a table lookup (int32 indices, then a gather), four passes per "
        "operand instead of one, and the layers run as Python Functions"
    ),
    "memory_ours": (
        "the tensors unit scaling adds that are held for the backward pass"
    ),
    "cast_fraction": (
        "the fused amax + cast waits on the loads of the block whose amax it takes (prefetched "
        "2 KiB ahead) and on the rounding's arithmetic; under load the two cores also share the "
        "copy's bandwidth unevenly"
    ),
    "fp8_block_ours": (
        "each GEMM operand is rounded twice, once per orientation, with an amax per group "
        "(the one-read pair kernel on a cached 512 x 128 operand rounds it both ways at about "
        "1.3 Gelem/s per core), where the static step rounds each operand once with a fixed "
        "scale; see the FP8 static row's note for the rest"
    ),
    "fp8_mx_ours": "as for the block recipe",
    **{key: (
        "the two passes over each band (amax, then round; the second finds the band in "
        "cache) and, for the pair, two roundings per element; on a VM the memory bandwidth "
        "the copy and the kernel get moves between their rounds"
    ) for key, _ in block_form_keys()},
}


CLOCK_WORDS = {
    "cpu": "the process's CPU time (time spent switched out for other programs not counted)",
    "wall": "wall-clock time",
}

COMPARISON_NOTES = [
    "One `GPT` class (pre-norm, causal, bias-free, GELU MLP) built from three "
    "`Ops` tables: `TORCH_OPS`, `UNIT_OPS`, and one from `unit_scaling` (`benchmarks/"
    "variants.py`). `unit_scaling.LayerNorm` is asked for its affine parameters so that all "
    "three have the same parameters; everything else uses each library's defaults.",
    "A training step is forward with loss, backward, `torch.optim.AdamW` step and "
    "`zero_grad`, the same optimizer for every build. Compiled rows wrap the model in "
    "`torch.compile` (default Inductor backend); the optimizer stays eager.",
    "FP8 rows: ours is `simulate_fp8(model, FP8Config(scaling=...))` on the unit-scaled "
    "build (F143 forward, F152 gradients, round to nearest), against the same build in FP32. "
    "`unit_scaling.transforms.simulate_fp8` has one mode, without per-tensor scaling (E4M3 "
    "forward, E5M2 backward, stochastic rounding, through a TorchDynamo graph rewrite), so it "
    "is the counterpart of the static row only, against its own FP32 build.",
    "FP8 rows with the host library off run the same step inside "
    "`ipu_unit_scaling.fp8.host_library.disabled()`, as an install without a C++ compiler "
    "would: FP8 values come from torch's float8 round trip instead of the fused kernel.",
    "The width sweep builds the same GPT at each width with its other sizes fixed (depth, "
    "sequence, batch as stated in the row), fewer rounds than the main rows: it shows the trend "
    "of the unit-scaling and FP8 overheads with the model's size, not a target.",
    "Peak memory is counted by the profiler, not the process RSS: the running sum of the "
    "allocator's allocation and free events during one step, after a warm-up step.",
    "Unit-scaled ops run as one autograd Function each in eager mode (scales inside the GEMMs, "
    "no scaled weight copies); a `uu.TransformerBlock` runs as two Functions around torch's "
    "attention kernel (residual join, norm and QKV projection; the row-scaled join of the "
    "heads, output projection, join, norm and MLP), FP8-simulated linears included, and the "
    "decoder's embedding as one, where nothing observes their parts. The two Functions are "
    "C++ autograd nodes (`ipu_unit_scaling.ops.native_layers`, built on first use) where a "
    "compiler is at hand, FP8 layers included (the nodes call the host library's cast kernels "
    "themselves); the notes say which form ran. Under "
    "`torch.compile` the ops are composed from `scale()` as before.",
    "GPU rows run only where a CUDA device exists; otherwise they are skipped with the reason.",
]


def machine_info(settings: Settings) -> List[str]:
    return [
        f"CPU: {cpu_model()}, {os.cpu_count()} logical cores, "
        f"{settings.threads} torch thread(s)",
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"unit-scaling {published_version() or 'not installed'}",
        f"OS: {platform.platform()}",
        f"Load average (1, 5, 15 min) when the report was written: {_load()} (other programs "
        "share the cores; the step ratios count this process's CPU time only, the cast rows "
        "are wall clock)",
    ]


def _load() -> str:
    try:
        return ", ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "not available"


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's name with its family and model, widest SIMD and whether it is virtual: a name
    such as "AMD EPYC" alone covers generations whose kernels run at different speeds."""
    fields: Dict[str, str] = {}
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                if not line.strip():
                    break  # the first processor's block describes them all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = fields.get("flags", "").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    if simd:
        details.append(simd)
    if "hypervisor" in flags:
        details.append("virtual machine")
    return f"{name} ({', '.join(details)})" if details else name


_PLAIN_NUMBERS = {"cast_melem": "{:.0f}", "copy_bandwidth": "{:.1f}", "cast_fraction": "{:.2f}",
                  **{key: "{:.2f}" for key, _ in block_form_keys()}}


def _unit(row: Row) -> str:
    return "" if row.key in _PLAIN_NUMBERS else "x"


def _format_value(row: Row) -> str:
    if row.value is None:
        return "-"
    return _PLAIN_NUMBERS.get(row.key, "{:.2f}x").format(row.value)


def _format_spread(row: Row) -> str:
    return "" if row.spread is None else f"{row.spread[0]:.2f}-{row.spread[1]:.2f}"


def _format_target(row: Row) -> str:
    if row.target is None:
        return ""
    return f"{'>=' if row.higher_is_better else '<='} {row.target:.2f}{_unit(row)}"


def _row_note(row: Row) -> str:
    if row.status == "MISSED" and row.key in OBSTACLES:
        return f"{row.note}; {OBSTACLES[row.key]}" if row.note else OBSTACLES[row.key]
    return row.note


def text_table(results: Results) -> str:
    header = ("measurement", "ratio", "quartiles", "target", "status")
    lines = [
        (row.label, _format_value(row), _format_spread(row), _format_target(row), row.status)
        for row in results.rows
    ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]
    out = [_join(header, widths), _join(tuple("-" * w for w in widths), widths)]
    out += [_join(line, widths) for line in lines]
    for row in results.rows:
        note = _row_note(row)
        if note:
            out.append(f"  {row.label}: {note}")
    return "\n".join(out)


def _join(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def markdown(results: Results, settings: Settings, command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        "The same GPT built three ways (plain `torch.nn.functional`, our unit-scaled `U`, and the",
        "published `unit_scaling.functional`), so that only the ops differ. Every number is a",
        "ratio measured within one run; timings are interleaved round by round and each ratio",
        "is the median of per-round ratios (see `benchmarks/measure.py`). Each eager step row",
        f"rotates through {INSTANCES} instances of each model, one per round, so that no one",
        "instance's memory layout sets it.",
        "",
        "Produced by:",
        "",
        "```",
        command,
        "```",
        "",
        f"on {datetime.date.today().isoformat()}:",
        "",
    ]
    lines += [f"- {line}" for line in machine_info(settings)]
    lines += [
        f"- Model: {settings.shape.describe()}; AdamW; {settings.rounds} interleaved rounds of "
        f"`blocked_autorange(min_run_time={settings.min_run_time})` per variant, "
        f"timed by {CLOCK_WORDS[settings.clock]}",
        f"- Heap: {results.heap}",
        f"- Whole run: {results.seconds:.0f} s",
        "",
        "## Ratios",
        "",
    ]
    lines += _markdown_table(
        ("measurement", "ratio", "per-round quartiles", "target", "status", "note"),
        [
            (
                row.label, _format_value(row), _format_spread(row), _format_target(row),
                row.status, _row_note(row),
            )
            for row in results.rows
        ],
    )
    lines += ["", "## Step times (median ms)", ""]
    lines += _markdown_table(
        ("variant", "ms"), [(name, f"{ms:.1f}") for name, ms in results.step_ms.items()]
    )
    lines += ["", "## Peak memory of a training step", ""]
    lines += _markdown_table(
        ("variant", "MiB"),
        [(name, f"{nbytes / 2**20:.2f}") for name, nbytes in results.peak_bytes.items()],
    )
    lines += [
        "",
        "Bytes held by tensors allocated during one step (after a warm-up step), counted from",
        "the allocation and free events of `torch.profiler` with `profile_memory=True`.",
    ]
    if results.op_counts:
        lines += ["", "## Ops in the traced GPT", ""]
        lines += [
            "The graph PopTorch gets for the model (`trace_like_poptorch(...).ops()`, fake "
            "tensors): each unit-scaling scale one `ScaledIdentity` custom op, or in the "
            "composite form `x.detach() * f + (x - x.detach()) * b` (an IPU without the "
            "custom-op library), or dropped to a plain multiply (what PopTorch made of the "
            "eager form, with wrong gradients); and the plain torch GPT.",
            "",
        ]
        lines += _markdown_table(("build", "ops"), list(results.op_counts.items()))
    if results.roofline_rows:
        from .roofline import HEADER

        lines += ["", "## Roofline of the host cast kernels", ""]
        lines += [
            f"{settings.cast_elements} float32 elements (more than the caches hold), outputs "
            "allocated once. A kernel's bound is the copy bandwidth measured in the same run "
            "(`copy_`, 8 bytes per element) divided by the bytes it must move per element: 4 for "
            "the amax, 5 for a cast to codes, 8 for a quantise to float32 values (12 for the "
            "pair's two). The group kernels write outputs of 16 MiB or more with streaming "
            "stores, which skip the read of each line a plain store makes first; `copy_` "
            "writes with plain stores, so a group kernel can pass 1.00. Fractions are "
            "medians of per-round ratios (wall clock), with quartiles. `AVX-512` and `AVX2` are "
            "the host library's intrinsics kernels (it runs the widest the CPU has), "
            "`portable` the compiler-vectorised loop used where a CPU has neither; `block` is "
            "the fused "
            "amax + cast's block size in elements (default 32768).",
            "",
        ]
        lines += _markdown_table(HEADER, [row.cells() for row in results.roofline_rows])
    if results.cast_rows:
        lines += ["", "## amax + cast throughput", ""]
        header = list(results.cast_rows[0])
        lines += _markdown_table(
            header, [[_cell(row.get(key)) for key in header] for row in results.cast_rows]
        )
    lines += [""] + recorded_runs.markdown_lines()
    lines += ["", "## What is compared", ""]
    lines += [f"- {line}" for line in COMPARISON_NOTES]
    if results.notes:
        lines += ["", "## Notes from this run", ""]
        lines += [f"- {note}" for note in results.notes]
    return "\n".join(lines) + "\n"


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def command_line() -> str:
    args = " ".join(sys.argv[1:])
    return f"python -m benchmarks {args}".rstrip()
