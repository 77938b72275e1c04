"""What run telemetry costs: a training step with telemetry at its default cadence against the
same step with telemetry off, over whole sampling periods (one sampled step in each), side by
side in one run."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from .measure import CLOCKS, Timings
from .variants import OURS, Shape, build_model, make_batch

TELEMETRY_TARGET = 1.02
# Counted from here, a period of `interval` steps holds exactly one sampled step (the powers
# of two below the interval, sampled at the start of a run, are behind).
_FIRST_STEP = 1 << 20


def _steps(shape: Shape) -> Tuple[Dict[str, Callable[[], object]], int]:
    """One training step of the default run's model (unit-scaled, FP8 AMAX) with telemetry
    ("on") and one without ("off"), and the sampling interval. Both train one model with one
    optimizer, so that only the telemetry differs (two instances of one model can differ in
    speed by their memory layout)."""
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.training.run_health import TelemetryConfig
    from ipu_unit_scaling.training.telemetry import Telemetry
    from ipu_unit_scaling.transforms import simulate_fp8

    model = simulate_fp8(build_model(OURS, shape), FP8Config(scaling="amax"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(shape)
    interval = TelemetryConfig().interval

    def step_of(telemetry: Telemetry) -> Callable[[], object]:
        state: Dict[str, int] = {"step": _FIRST_STEP}

        def step() -> object:
            state["step"] += 1
            with telemetry.step(state["step"]):
                loss = model(batch["input_ids"], batch["labels"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    steps = {name: step_of(Telemetry(model, optimizer, None, interval=every, log=None))
             for name, every in (("on", interval), ("off", 0))}
    return steps, interval


def telemetry_timings(shape: Shape, rounds: int, clock: str) -> Tuple[Timings, Dict[str, Any]]:
    """Mean step time with telemetry on and off, each round one sampling period of each.

    The two alternate step by step (which goes first alternates too), so that both periods
    of a round meet the same machine: periods timed one after the other, seconds apart, were
    up to 10% apart on a shared 2-core VM, against a cost of about 2%."""
    steps, interval = _steps(shape)
    timer = CLOCKS[clock]
    names = list(steps)
    for _ in range(interval):  # a whole period each, sampled step included, before timing
        for name in names:
            steps[name]()
    timings = Timings({name: [] for name in names})
    for _ in range(rounds):
        totals = dict.fromkeys(names, 0.0)
        for index in range(interval):
            for name in names if index % 2 == 0 else names[::-1]:
                start = timer()
                steps[name]()
                totals[name] += timer() - start
        for name in names:
            timings.seconds[name].append(totals[name] / interval)
    return timings, {}
