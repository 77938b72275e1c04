"""The training loop's scalars for TensorBoard, where it is installed (the ``tensorboard`` extra).

Every run then writes event files into ``<run_dir>/tensorboard/``, so ``tensorboard --logdir
runs`` shows all runs side by side: ``train/loss``, ``train/lr`` and ``train/tokens_per_s`` at
every step, ``val/loss`` (and a task's other validation metrics, e.g. ``val/accuracy``) at
every evaluation. ``metrics.csv`` holds the same numbers, exactly; TensorBoard stores them as
float32. With telemetry on, each sampled step adds ``telemetry/<site>/...`` scalars (a cast
site's flushed and saturated fractions, scaling bias and SQNR, a parameter's update/weight
ratio, an attention layer's largest logit) and two histograms: the scaling biases of every
cast site, and the log10 update/weight ratios of every parameter.

A resumed run continues at its checkpoint's step: it tells TensorBoard to hide what the killed
process logged after that step (the events' purge step), so each step shows once.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .run_directory import TENSORBOARD_DIR

__all__ = ["TensorBoardLog"]


class TensorBoardLog:
    """Scalars of one run for TensorBoard, or nothing when TensorBoard does not import.

    ``note`` says, for the run to print, where the scalars go, or why they are not written
    (TensorBoard not installed, or installed but broken); ``problem`` is that reason ("" when
    they are written). A ``run_dir`` of None (a distributed run's ranks other than 0) writes
    nothing and says nothing.
    """

    def __init__(self, run_dir: Optional[Path], step: int) -> None:
        self.writer: Optional[Any] = None
        self.problem = ""
        self.note = ""
        if run_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # not installed: metrics.csv is the record
            self.problem = self.note = (
                f"{TENSORBOARD_DIR}/ not written: TensorBoard is not installed (pip install "
                "tensorboard, or the package's [tensorboard] extra); metrics.csv holds the "
                "same scalars")
            return
        except Exception as error:  # installed but broken (a protobuf it cannot use, ...)
            self.problem = self.note = (f"{TENSORBOARD_DIR}/ not written: "
                                        f"{' '.join(str(error).split())}")
            return
        log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.note = f"TensorBoard scalars in {log_dir}/ (tensorboard --logdir {log_dir})"
        if step:
            _wait_for_a_later_name(log_dir)
        # A fresh run starts from an empty directory; a resumed one hides steps > ``step``.
        self.writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)

    def log(self, step: int, scalars: Dict[str, Optional[float]]) -> None:
        """``scalars`` at ``step``; None values are left out."""
        if self.writer is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def histogram(self, step: int, tag: str, values: Sequence[float]) -> None:
        """A histogram of ``values`` at ``step`` (non-finite values left out)."""
        finite = [v for v in values if math.isfinite(v)]
        if self.writer is None or not finite:
            return
        import numpy

        self.writer.add_histogram(tag, numpy.asarray(finite, dtype=numpy.float64), step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _wait_for_a_later_name(log_dir: Path) -> None:
    """Wait, if need be, until a new event file's name sorts after those in ``log_dir``.

    TensorBoard reads a directory's event files in name order, and a name starts with the
    second its writer was made in, then the host and process id: a resume within the second
    the killed process started in could sort first, and its steps be hidden by the older ones.
    """
    seconds = [int(part[3]) for part in (path.name.split(".") for path in
                                         log_dir.glob("events.out.tfevents.*"))
               if len(part) > 3 and part[3].isdigit()]
    if seconds:
        delay = max(seconds) + 1 - time.time()
        if delay > 0:
            time.sleep(delay)
