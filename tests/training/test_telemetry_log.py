"""telemetry.csv: whole rows appended, read back as numbers, a row cut short by a kill dropped,
and a damaged or foreign file refused in one line."""
from __future__ import annotations

import math

import pytest

from ipu_unit_scaling.training.telemetry_log import (
    TELEMETRY_FIELDS,
    TelemetryFileError,
    TelemetryLog,
    format_value,
    read_telemetry,
)


def test_rows_round_trip_and_a_cut_row_is_dropped(tmp_path):
    path = tmp_path / "telemetry.csv"
    log = TelemetryLog(path, fresh=True)
    log.write([dict(step=3, kind="cast", site="a.input", role="activation", format="F143",
                    log2_scale=-2, amax=1.5, sqnr_db=math.inf, note="x, y")])
    log.sync()
    log.close()
    with open(path, "ab") as handle:
        handle.write(b"4,cast,a.inp")  # a kill in the middle of a row
    (row,) = read_telemetry(path)
    assert row["step"] == 3 and row["log2_scale"] == -2.0 and row["amax"] == 1.5
    assert row["sqnr_db"] == math.inf and math.isnan(row["rms"]) and row["note"] == "x, y"
    # appending to the file again keeps what is there
    log = TelemetryLog(path, fresh=False)
    log.close()
    assert read_telemetry(path) == [row]


def test_a_log_without_a_path_writes_nothing(tmp_path, monkeypatch):
    # a distributed run's ranks other than 0 record and write no file
    monkeypatch.chdir(tmp_path)
    log = TelemetryLog(None, fresh=True)
    log.write([dict(step=1, kind="loss", site="loss", amax=2.0)])
    log.sync()
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_values_keep_seven_digits():
    assert format_value(1 / 3) == "0.3333333" and format_value(None) == ""
    assert format_value(7) == "7" and format_value(-math.inf) == "-inf"


@pytest.mark.parametrize("text, problem", [
    (b"step,loss\n1,2\n", "not a telemetry file"),
    (",".join(TELEMETRY_FIELDS).encode() + b"\n1,cast\n", "damaged at line 2"),
    (",".join(TELEMETRY_FIELDS).encode() + b"\nx" + b",a" * 16 + b"\n", "damaged at line 2"),
    (",".join(TELEMETRY_FIELDS).encode() + b"\n1,bogus" + b"," * 15 + b"\n", "unknown kind"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_a_damaged_file_is_one_line(tmp_path, text, problem):
    path = tmp_path / "telemetry.csv"
    path.write_bytes(text)
    with pytest.raises(TelemetryFileError, match=problem) as error:
        read_telemetry(path)
    assert "\n" not in str(error.value)


def test_a_missing_file(tmp_path):
    with pytest.raises(TelemetryFileError, match="does not exist"):
        read_telemetry(tmp_path / "none.csv")
