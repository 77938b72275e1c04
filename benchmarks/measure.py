"""How the benchmarks measure: interleaved paired timings and profiler-counted peak memory.

Timing. Every variant of one comparison is built and warmed up first; then, round after round,
each variant is timed once with `torch.utils.benchmark.Timer.blocked_autorange`, in turn, by
wall time or by the process's CPU time (see `CLOCKS`). A ratio is taken within each round
(both sides measured seconds apart, under the same machine load) and the reported ratio is
the median over rounds. On a shared machine this cancels most of the drift that separate
runs would put into a ratio.

Memory. `torch.profiler` with `profile_memory=True` records every allocation and free of the
CPU allocator as a signed byte count. Summing them in time order gives the bytes held by
tensors created during the step; the peak of that running sum is the step's peak memory above
what was already held before it (parameters, optimizer state). Interpreter and library memory
is not counted, so the figure is the same on any machine and independent of import order.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple, Union

import torch
from torch.utils.benchmark import Timer


@dataclass
class Timings:
    """Per-round median seconds of each variant, measured interleaved."""

    seconds: Dict[str, List[float]] = field(default_factory=dict)

    def median_ms(self, name: str) -> float:
        return 1e3 * statistics.median(self.seconds[name])

    def ratios(self, numerator: str, denominator: str) -> List[float]:
        """Per-round ratios numerator / denominator."""
        return [a / b for a, b in zip(self.seconds[numerator], self.seconds[denominator])]

    def ratio(self, numerator: str, denominator: str) -> float:
        """Median over rounds of the per-round ratio numerator / denominator."""
        return statistics.median(self.ratios(numerator, denominator))

    def spread(self, numerator: str, denominator: str) -> Tuple[float, float]:
        """Lower and upper quartile of the per-round ratios."""
        ratios = sorted(self.ratios(numerator, denominator))
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
        return quartiles[0], quartiles[2]


CLOCKS: Dict[str, Callable[[], float]] = {
    # CPU time of this process (user + system, all threads): time the process was switched out
    # for other programs does not count. It equals wall time on an idle machine for a
    # single-threaded step, so it is the default with one torch thread.
    "cpu": time.process_time,
    "wall": time.perf_counter,
}


Step = Callable[[], object]


def time_interleaved(
    steps: Mapping[str, Union[Step, Sequence[Step]]],
    rounds: int,
    min_run_time: float,
    warmup: int = 2,
    clock: str = "wall",
) -> Timings:
    """Time each step function, interleaving the variants round by round. A variant given as
    several functions (instances of one model: see :func:`instances`) times the next of them
    in each round, so that no one instance's memory layout sets its figure."""
    variants = {name: [step] if callable(step) else list(step) for name, step in steps.items()}
    for instances_of_variant in variants.values():
        for step in instances_of_variant:
            for _ in range(warmup):
                step()
    timers = {
        name: [Timer(stmt="step()", globals={"step": step}, timer=CLOCKS[clock],
                     num_threads=torch.get_num_threads(), label=name)
               for step in instances_of_variant]
        for name, instances_of_variant in variants.items()
    }
    timings = Timings({name: [] for name in steps})
    names = list(timers)
    for round_index in range(rounds):
        # Rotate who goes first, so no variant always runs right after the same neighbour.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timer = timers[name][round_index % len(timers[name])]
            measurement = timer.blocked_autorange(min_run_time=min_run_time)
            timings.seconds[name].append(measurement.median)
    return timings


# Instances of each model that the step rows rotate through, round by round: identical
# models built one after another ran up to about 2% apart (2-core AMD EPYC, width 128), by
# where their tensors fell in memory.
INSTANCES = 3


def instances(make: Callable[[], Step], count: int = INSTANCES) -> List[Step]:
    """``count`` step functions, each of a model of its own from ``make()``."""
    return [make() for _ in range(count)]


def peak_step_bytes(step: Callable[[], object], warmup: int = 1) -> int:
    """Peak bytes allocated by tensors during one call of `step`, above what it started with.

    Warm-up calls first, so one-off allocations (optimizer state on the first step) are
    already held and do not count.
    """
    for _ in range(warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    events = _memory_events(prof)
    held = peak = 0
    # By time only: a stable sort keeps the recorded order of events within one time stamp.
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        held += nbytes
        peak = max(peak, held)
    return peak


def _memory_events(prof: torch.profiler.profile) -> Sequence[tuple]:
    """(time in ns, signed bytes) of every CPU allocation (+) and free (-) in the profile."""
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    events: List[Any] = [event for event in results.events() if event.name() == "[memory]"]
    if events and not hasattr(events[0], "start_ns"):  # torch < 2.1 times events in us only
        return [(1000 * event.start_us(), event.nbytes()) for event in events]
    return [(event.start_ns(), event.nbytes()) for event in events]
