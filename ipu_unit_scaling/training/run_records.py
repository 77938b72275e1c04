"""What a run directory records as it trains: checkpoints (behind a checksum, with the
tokenizer they were trained with) and the metrics log, and the checks that a checkpoint is the
one its own metrics logged.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .run_directory import (
    CHECKPOINT_FILE,
    CHECKPOINT_MAGIC,
    METRIC_FIELDS,
    METRICS_FILE,
    TOKENIZER_FILE,
    RunError,
    atomic_write,
    error_naming,
    os_error_reason,
    read_regular_file,
)

__all__ = [
    "save_checkpoint", "load_checkpoint", "checkpoint_sha256", "tokenizer_sha256",
    "check_tokenizer", "MetricsLog", "UnwrittenMetricsLog", "read_metrics",
    "check_checkpoint_logged", "metrics_up_to", "keep_report_rows_up_to",
    "RECORDED_SECTIONS", "recorded_settings", "check_recorded_settings",
]



# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(path: Path, state: Dict[str, Any]) -> None:
    """Write ``state`` atomically, behind a header holding the SHA-256 of the payload."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    header = b"%s sha256=%s bytes=%d\n" % (CHECKPOINT_MAGIC, digest.encode(), len(payload))
    atomic_write(path, header + payload)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """The state saved by :func:`save_checkpoint`; RunError if missing, damaged or foreign."""
    path = Path(path)
    try:
        data = read_regular_file(path)
    except FileNotFoundError:
        raise RunError(f"no checkpoint at {path}") from None
    except OSError as error:
        raise RunError(f"cannot read checkpoint {path}: {os_error_reason(error)}") from None
    header, _, payload = data.partition(b"\n")
    fields = header.split(b" ")
    if not header.startswith(CHECKPOINT_MAGIC + b" ") or len(fields) != 5:
        raise RunError(f"{path} is not a checkpoint of this package")
    try:
        digest = fields[3].split(b"=", 1)[1].decode("ascii")
        size = int(fields[4].split(b"=", 1)[1])
    except (IndexError, ValueError, UnicodeDecodeError):
        raise RunError(f"{path} has a damaged header") from None
    if size != len(payload):
        raise RunError(f"{path} is truncated ({len(payload)} of {size} bytes)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise RunError(f"{path} is damaged: its checksum does not match its contents")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as error:  # checksum fine yet unreadable: written by something else
        raise RunError(f"{path} is not a readable checkpoint ({type(error).__name__})") from None
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise RunError(f"{path} is not a checkpoint of this package")
    return state


def checkpoint_sha256(path: Path) -> Optional[str]:
    """The SHA-256 a checkpoint's header records for its contents (None if it has none): names
    the exact checkpoint a result was computed from."""
    try:
        with open(path, "rb") as handle:
            header = handle.readline(256)
    except OSError:
        return None
    fields = header.split(b" ")
    if not header.startswith(CHECKPOINT_MAGIC + b" ") or len(fields) != 5:
        return None
    digest = fields[3].partition(b"=")[2].decode("ascii", "replace")
    return digest or None


def tokenizer_sha256(chars: Sequence[str]) -> str:
    """SHA-256 of a character vocabulary in id order: what a checkpoint records of its
    tokenizer."""
    return hashlib.sha256(json.dumps(list(chars), ensure_ascii=True).encode("ascii")).hexdigest()


def check_tokenizer(run_dir: Path, chars: Sequence[str], checkpoint: Dict[str, Any],
                    action: str) -> None:
    """RunError (`"cannot <action> ..."`) unless ``chars`` are the vocabulary ``checkpoint`` was
    trained with: the SHA-256 it records, or, in checkpoints written before it recorded one,
    the order every run's vocabulary has (the pretrained characters of a fine-tuning run, then
    sorted characters)."""
    refuse = (f"cannot {action} {run_dir}: {TOKENIZER_FILE} does not match its "
              f"{CHECKPOINT_FILE}, which was trained with another tokenizer")
    recorded = checkpoint.get("tokenizer_sha256")
    if recorded is not None:
        if recorded != tokenizer_sha256(chars):
            raise RunError(f"{refuse} (the checksums differ: the file was edited, or one of "
                           "them comes from another run)")
        return
    base = checkpoint.get("base_chars") or []
    if not isinstance(base, list):
        raise RunError(f"cannot {action} {run_dir}: its {CHECKPOINT_FILE} is damaged")
    added = list(chars[len(base):])
    if list(chars[:len(base)]) != base or added != sorted(added):
        raise RunError(f"{refuse} (its characters are out of their order: the file was "
                       "edited)")




# The config sections a checkpoint records: what its weights are (the model) and the
# arithmetic they were trained in. Every reader checks them against config.yaml.
RECORDED_SECTIONS = ("model", "precision")


def recorded_settings(config: Any) -> Dict[str, Any]:
    """What a checkpoint records of ``config`` (a run Config): its :data:`RECORDED_SECTIONS`."""
    settings = config.to_dict()
    return {section: settings[section] for section in RECORDED_SECTIONS}


def check_recorded_settings(run_dir: Path, config: Any, checkpoint: Dict[str, Any],
                            action: str) -> None:
    """RunError (`"cannot <action> ..."`) unless ``config`` (the run's config.yaml) holds the
    model and precision settings ``checkpoint`` records: a hand-edited config.yaml that keeps
    every weight's shape (``model.attn_tau``, ``model.unit_scaled``, ...) would otherwise load
    the weights into another model. Checkpoints of versions that recorded none pass."""
    recorded = checkpoint.get("settings")
    if recorded is None:
        return
    from .resume_policy import flat_settings

    if not isinstance(recorded, dict):
        raise RunError(f"cannot {action} {run_dir}: its {CHECKPOINT_FILE} is damaged "
                       "(settings)")
    saved = flat_settings({key: recorded.get(key) for key in RECORDED_SECTIONS})
    now = flat_settings(recorded_settings(config))
    differ = [key for key in now if key in saved and saved[key] != now[key]]
    differ += [key for key in saved if key not in now]
    if differ:
        key = differ[0]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise RunError(f"cannot {action} {run_dir}: its {CHECKPOINT_FILE} is not a checkpoint "
                       f"of this run: it was trained with {key} = {saved[key]!r}, where "
                       f"config.yaml says {now.get(key)!r}{more} (config.yaml was edited, or "
                       "the checkpoint comes from another run); restore the file")


# ------------------------------------------------------------------------------ metrics


class MetricsLog:
    """``metrics.csv``, appended one whole row per write call; ``sync`` makes rows durable.
    ``fields`` are its columns: ``METRIC_FIELDS``, then any a task adds."""

    def __init__(self, path: Path, fresh: bool, fields: Sequence[str] = METRIC_FIELDS) -> None:
        self.path = Path(path)
        self.fields = tuple(fields)
        if fresh:
            atomic_write(self.path, _csv_line(self.fields))
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as error:
            raise RunError(f"cannot write {self.path}: {os_error_reason(error)}") from None

    def write(self, row: Dict[str, Any]) -> None:
        line = _csv_line([row.get(name, "") for name in self.fields])
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as error:
            raise error_naming(self.path, error) from None

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as error:
            raise error_naming(self.path, error) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class UnwrittenMetricsLog(MetricsLog):
    """The metrics log of a process that writes no run files (a distributed run's ranks
    other than 0, whose rows rank 0 writes)."""

    def __init__(self) -> None:  # (no file)
        self._fd = -1

    def write(self, row: Dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass


def _csv_line(values: Sequence[Any]) -> bytes:
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(values)
    return text.getvalue().encode("utf-8")


def read_metrics(run_dir: Path) -> List[Dict[str, str]]:
    """The rows of a run's metrics.csv, as strings."""
    text = read_regular_file(Path(run_dir) / METRICS_FILE).decode("utf-8")
    return list(csv.DictReader(io.StringIO(text, newline="")))


def check_checkpoint_logged(run_dir: Path, checkpoint: Dict[str, Any], action: str) -> None:
    """RunError ("cannot <action> ...") unless ``checkpoint`` is one this run saved: its
    ``metrics.csv`` logged the checkpoint's training loss at the checkpoint's step. A checkpoint
    copied in from another run of the same model on the same text passes every other check.
    A directory without ``metrics.csv`` (a checkpoint shared without its log) is not checked,
    nor is a checkpoint that records no training loss (one saved before the first step)."""
    step, loss = checkpoint.get("step"), checkpoint.get("last_train_loss")
    path = Path(run_dir) / METRICS_FILE
    if not isinstance(step, int) or not isinstance(loss, float) or not os.path.lexists(path):
        return
    column = METRIC_FIELDS.index("train_loss")
    logged = None
    try:
        text = read_regular_file(path).decode("utf-8", "replace")
        for row in csv.reader(io.StringIO(text, newline="")):
            if len(row) > column and row[0] == str(step):
                logged = row[column]
    except (OSError, csv.Error) as error:
        raise RunError(f"cannot {action} {run_dir}: cannot read {METRICS_FILE}: "
                       f"{getattr(error, 'strerror', None) or error}") from None
    refuse = f"cannot {action} {run_dir}: its {CHECKPOINT_FILE} is not one this run saved"
    if logged is None:
        raise RunError(f"{refuse}: it is at step {step}, which {METRICS_FILE} does not log "
                       "(a checkpoint of another run, or a damaged log)")
    try:
        same = float(logged) == loss
    except ValueError:
        same = False
    if not same:
        raise RunError(f"{refuse}: its training loss at step {step} is {loss!r}, where "
                       f"{METRICS_FILE} logs {logged} (a checkpoint of another run)")




def metrics_up_to(run_dir: Path, step: int, fields: Sequence[str] = METRIC_FIELDS) -> bytes:
    """metrics.csv holding exactly the rows of steps 1..``step``, from the file in ``run_dir``
    whose columns are ``fields``.

    Rows after ``step`` (written after the last checkpoint, the last maybe cut short by a kill)
    are dropped; a file without all of 1..``step`` is a RunError naming it.
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        data = read_regular_file(path)
    except FileNotFoundError:
        raise RunError(f"cannot resume {run_dir}: {METRICS_FILE} is missing") from None
    except OSError as error:
        raise RunError(f"cannot resume {run_dir}: cannot read {METRICS_FILE}: "
                       f"{os_error_reason(error)}") from None
    damaged = RunError(
        f"cannot resume {run_dir}: {METRICS_FILE} is damaged (it must hold one complete row "
        f"for each of steps 1 to {step} of the checkpoint)"
    )
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise damaged from None
    if lines[0] != ",".join(fields):
        raise damaged
    kept = [lines[0] + "\n"]
    for expected, line in enumerate(lines[1:step + 1], start=1):
        complete = expected < len(lines) - 1  # the last piece has no newline after it
        cells = next(csv.reader([line]), [])
        if not complete or len(cells) != len(fields) or cells[0] != str(expected):
            raise damaged
        try:
            [float(cell) for cell in cells[1:4] if cell]
        except ValueError:
            raise damaged from None
        kept.append(line + "\n")
    if len(kept) != step + 1:
        raise damaged
    return "".join(kept).encode("utf-8")


def keep_report_rows_up_to(path: Path, step: int) -> None:
    """Drop rows after ``step`` from a CSV whose first column is the step (the scale report)."""
    try:
        lines = read_regular_file(path).decode("utf-8", "replace").split("\n")
    except FileNotFoundError:
        return
    except OSError as error:
        raise RunError(f"cannot read {path}: {os_error_reason(error)}") from None
    kept = lines[:1]
    for line in lines[1:-1]:  # the last piece is empty or a row cut short
        head = line.split(",", 1)[0]
        if head.isdigit() and int(head) <= step:
            kept.append(line)
    atomic_write(path, ("\n".join(kept) + "\n").encode("utf-8"))
