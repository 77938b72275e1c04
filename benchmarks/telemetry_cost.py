"""What run telemetry costs: a training step with telemetry at its default cadence against the
same step with telemetry off, over whole sampling periods (one sampled step in each), side by
side in one run."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from .measure import Timings, time_interleaved
from .variants import OURS, Shape, build_model, make_batch

TELEMETRY_TARGET = 1.03
# Counted from here, a period of `interval` steps holds exactly one sampled step (the powers
# of two below the interval, sampled at the start of a run, are behind).
_FIRST_STEP = 1 << 20


def _periods(shape: Shape) -> Dict[str, Callable[[], object]]:
    """`interval` training steps of the default run's model (unit-scaled, FP8 AMAX) with
    telemetry ("on") and without ("off"): one model and optimizer for both, so that only the
    telemetry differs (two instances of one model can differ in speed by their memory
    layout)."""
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.training.run_health import TelemetryConfig
    from ipu_unit_scaling.training.telemetry import Telemetry
    from ipu_unit_scaling.transforms import simulate_fp8

    model = simulate_fp8(build_model(OURS, shape), FP8Config(scaling="amax"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(shape)
    interval = TelemetryConfig().interval

    def period_of(telemetry: Telemetry) -> Callable[[], object]:
        state: Dict[str, int] = {"step": _FIRST_STEP}

        def period() -> object:
            for _ in range(interval):
                state["step"] += 1
                with telemetry.step(state["step"]):
                    loss = model(batch["input_ids"], batch["labels"])
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return period

    return {name: period_of(Telemetry(model, optimizer, None, interval=every, log=None))
            for name, every in (("on", interval), ("off", 0))}


def telemetry_timings(shape: Shape, rounds: int, clock: str) -> Tuple[Timings, Dict[str, Any]]:
    """Interleaved timings of a sampling period with telemetry on and off."""
    timings = time_interleaved(_periods(shape), rounds, min_run_time=0.0, warmup=1, clock=clock)
    return timings, {}
