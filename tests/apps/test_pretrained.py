"""Commands that read a trained run (evaluate, sample, train --init-from, --resume): they take
the run's lock, refuse an edited tokenizer or another run's checkpoint, and guard their data."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from helpers import ONE_IPU, ROOT, TEXT, one_line_error
from helpers import run as cli

import ipu_unit_scaling.apps.pretrained as pretrained
import ipu_unit_scaling.training.inference as inference
import ipu_unit_scaling.training.memory as memory
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.pretrained import evaluate_run, open_run
from ipu_unit_scaling.training.data import (
    BYTES_PER_TEXT_BYTE,
    CharTokenizer,
    DataError,
    embedded_corpus,
)
from ipu_unit_scaling.training.inference import encode_known, text_batches
from ipu_unit_scaling.training.run_directory import RunError, RunLock
from ipu_unit_scaling.training.run_records import (
    checkpoint_sha256,
    load_checkpoint,
    save_checkpoint,
    tokenizer_sha256,
)

FAST = [*ONE_IPU, "training.eval_batches=1", "training.steps=4", "training.eval_interval=4"]
pytestmark = pytest.mark.usefixtures("one_thread")


def train_cli(capsys, run_dir: Path, data: Path, *extra: str) -> tuple:
    return cli(capsys, "train", "--config", "tiny", "--data", data, "--run-dir", run_dir,
               "--quiet", "--set", *FAST, *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """A tiny run on TEXT, and one of another width: made once, copied by each test."""
    root = tmp_path_factory.mktemp("trained")
    data = root / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    result = {"data": data}
    for name, extra in (("run", []), ("narrow", ["model.hidden_size=16"])):
        assert main(["train", "--config", "tiny", "--data", str(data), "--run-dir",
                     str(root / name), "--quiet", "--set", *FAST, *extra]) == 0
        result[name] = root / name
    return result


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained["run"], copy)
    return copy


def swap_in_tokenizer(run_dir: Path, first: str, second: str) -> None:
    path = run_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    chars: List[str] = data["chars"]
    i, j = chars.index(first), chars.index(second)
    chars[i], chars[j] = chars[j], chars[i]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def files(run_dir: Path) -> Dict[str, bytes]:
    # (the tensorboard/ directory included, where TensorBoard is installed)
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# ---------------------------------------------------------------- an edited tokenizer.json


def test_checkpoints_record_the_tokenizer_they_were_trained_with(run_dir):
    state = load_checkpoint(run_dir / "checkpoint.pt")
    chars = json.loads((run_dir / "tokenizer.json").read_text(encoding="utf-8"))["chars"]
    assert state["tokenizer_sha256"] == tokenizer_sha256(chars)
    assert tokenizer_sha256(chars[::-1]) != tokenizer_sha256(chars)


def test_sample_refuses_an_edited_tokenizer(capsys, run_dir):
    swap_in_tokenizer(run_dir, "e", "t")
    status, out, err = cli(capsys, "sample", run_dir, "--tokens", "5")
    assert status == 2 and out == "" and one_line_error(err), err
    assert ("tokenizer.json does not match its checkpoint.pt, which was trained with another "
            "tokenizer") in err


def test_evaluate_refuses_an_edited_tokenizer_and_writes_nothing(capsys, run_dir, tmp_path):
    swap_in_tokenizer(run_dir, "e", "t")
    before = files(run_dir)
    status, out, err = cli(capsys, "evaluate", run_dir, "--precision", "fp32")
    assert status == 2 and out == "" and one_line_error(err), err
    assert "cannot evaluate" in err and "tokenizer.json does not match its checkpoint.pt" in err
    status, _, err = cli(capsys, "evaluate", run_dir, "--data", tmp_path / "none.txt")
    assert status == 2 and "tokenizer.json does not match its checkpoint.pt" in err
    assert files(run_dir) == before


def test_fine_tuning_refuses_an_edited_tokenizer(capsys, run_dir, trained, tmp_path):
    swap_in_tokenizer(run_dir, "e", "t")
    status, _, err = cli(capsys, "train", "--init-from", run_dir, "--data", trained["data"],
                         "--run-dir", tmp_path / "tuned", "--quiet", "--set", *FAST)
    assert status == 2 and one_line_error(err), err
    assert "cannot fine-tune from" in err
    assert "tokenizer.json does not match its checkpoint.pt" in err
    assert not (tmp_path / "tuned" / "checkpoint.pt").exists()


def test_resume_refuses_an_edited_tokenizer(capsys, run_dir):
    swap_in_tokenizer(run_dir, "e", "t")
    before = files(run_dir)
    status, _, err = cli(capsys, "train", "--resume", run_dir, "--quiet", "--set",
                         "training.steps=8")
    assert status == 2 and one_line_error(err) and "cannot resume" in err, err
    assert "tokenizer.json" in err
    assert files(run_dir) == before


def test_an_edit_that_keeps_the_characters_sorted_is_refused_by_the_checksum(run_dir):
    path = run_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["chars"][-1] < "~"
    data["chars"][-1] = "~"  # still sorted, one character replaced
    path.write_text(json.dumps(data), encoding="utf-8")
    for action in ("evaluate", "sample"):
        with pytest.raises(RunError, match=f"cannot {action} .*the checksums differ"):
            open_run(run_dir, action)


def test_checkpoints_without_a_tokenizer_checksum_still_refuse_reordered_characters(run_dir):
    state = load_checkpoint(run_dir / "checkpoint.pt")
    del state["tokenizer_sha256"]  # as written before checkpoints recorded it
    save_checkpoint(run_dir / "checkpoint.pt", state)
    assert open_run(run_dir, "sample").step == state["step"]
    swap_in_tokenizer(run_dir, "e", "t")
    with pytest.raises(RunError, match="out of their order"):
        open_run(run_dir, "sample")


# ---------------------------------------------------------------- another run's checkpoint


def test_a_checkpoint_of_another_model_is_not_a_checkpoint_of_this_run(capsys, run_dir,
                                                                        trained):
    shutil.copy(trained["narrow"] / "checkpoint.pt", run_dir / "checkpoint.pt")
    for command in ("evaluate", "sample"):
        status, out, err = cli(capsys, command, run_dir)
        assert status == 2 and out == "" and one_line_error(err), err
        assert "checkpoint.pt is not a checkpoint of this run" in err
        assert "changed since" not in err


def test_a_checkpoint_trained_on_other_text_says_it_may_not_be_this_runs(capsys, run_dir):
    state = load_checkpoint(run_dir / "checkpoint.pt")
    state["data_sha256"] = "0" * 64
    save_checkpoint(run_dir / "checkpoint.pt", state)
    status, _, err = cli(capsys, "evaluate", run_dir, "--precision", "fp32")
    assert status == 2 and one_line_error(err), err
    assert "checkpoint.pt was not trained on" in err and "not a checkpoint of this run" in err


# ---------------------------------------------------------------- the lock


def test_readers_are_refused_while_a_run_writes(capsys, run_dir):
    before = files(run_dir)
    with RunLock(run_dir):  # a run in progress
        for argv in (["evaluate", run_dir, "--precision", "fp32"], ["sample", run_dir]):
            status, out, err = cli(capsys, *argv)
            assert status == 2 and out == "" and one_line_error(err), err
            assert f"cannot {argv[0]} {run_dir}: it is in use by process {os.getpid()}" in err
        with pytest.raises(RunError, match="in use by process"):
            open_run(run_dir)
    assert files(run_dir) == before
    assert cli(capsys, "sample", run_dir, "--tokens", "3")[0] == 0  # released


def test_a_run_is_refused_while_readers_read_and_readers_share(capsys, run_dir):
    with RunLock(run_dir, shared=True, action="evaluate"):
        assert open_run(run_dir).step == 4  # a second reader
        status, _, err = cli(capsys, "train", "--resume", run_dir, "--quiet", "--set",
                             "training.steps=8")
        assert status == 2 and one_line_error(err) and "is in use by another process" in err
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 4


def test_evaluate_names_the_checkpoint_it_read(capsys, run_dir):
    status, out, _ = cli(capsys, "evaluate", run_dir, "--precision", "fp32")
    assert status == 0
    data = json.loads((run_dir / "evaluate.json").read_text(encoding="utf-8"))
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert data["step"] == state["step"] == 4
    digest = checkpoint_sha256(run_dir / "checkpoint.pt")
    assert digest is not None and data["checkpoint_sha256"] == digest
    assert f"sha256={digest} ".encode() in (run_dir / "checkpoint.pt").read_bytes()[:200]
    assert f"(step 4, sha256 {digest[:12]}," in out


def test_a_reader_of_a_directory_without_a_lock_file_needs_no_write_access(run_dir,
                                                                          monkeypatch):
    assert not (run_dir / ".lock").exists()  # a run at rest holds none
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with RunLock(run_dir, shared=True, action="sample"):
        pass
    with pytest.raises(RunError, match="cannot write to run directory"):
        RunLock(run_dir).acquire()


# ---------------------------------------------------------------- evaluate --data


def test_evaluate_refuses_a_data_file_too_big_before_reading_it(capsys, run_dir, tmp_path,
                                                               monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as handle:  # sparse: 64 MiB on paper, nothing on disk
        handle.truncate(64 * 2**20)
    monkeypatch.setattr(memory, "machine_memory", lambda: 2**30)
    read: List[Path] = []
    real_read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real_read_bytes(self))
    status, out, err = cli(capsys, "evaluate", run_dir, "--data", big, "--quiet")
    assert status == 2 and out == "" and one_line_error(err), err
    assert "has 64.0 MiB; reading and encoding it needs about 1.3 GiB, more than the 1.0 GiB" \
        in err
    assert big not in read


@pytest.mark.parametrize("command", ["evaluate", "train"])
def test_data_that_runs_out_of_memory_is_one_clear_line(capsys, run_dir, trained, tmp_path,
                                                        monkeypatch, command):
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 8589934592 bytes.")

    monkeypatch.setattr(pretrained, "encode_known", no_memory)
    monkeypatch.setattr(CharTokenizer, "encode", no_memory)
    if command == "evaluate":
        status, _, err = cli(capsys, "evaluate", run_dir, "--data", trained["data"], "--quiet")
    else:
        status, _, err = train_cli(capsys, tmp_path / "new", trained["data"])
    assert status == 2 and one_line_error(err), err
    assert "does not fit in the free memory of this machine" in err


def test_evaluate_reports_its_work_before_it_starts(capsys, run_dir, trained):
    status, _, err = cli(capsys, "evaluate", run_dir, "--data", trained["data"],
                         "--precision", "fp32", "fp16")
    config = open_run(run_dir).config
    batches = len(text_batches(torch.zeros(len(TEXT), dtype=torch.long), config.model.seq_len,
                               config.training.batch_size))
    assert status == 0
    lines = err.splitlines()
    assert lines[0] == f"evaluate: reading {trained['data']}"
    assert lines[1].startswith("evaluate: checkpoint at step 4; ")
    assert lines[1].endswith(f"{2 * batches} batches over 2 precision(s)")
    assert cli(capsys, "evaluate", run_dir, "--quiet", "--precision", "fp32")[2] == ""


def test_evaluate_calls_back_once_per_batch_it_announced(run_dir, trained):
    announced, calls = [], []
    evaluation = evaluate_run(open_run(run_dir), ["fp32", "fp8-amax"], str(trained["data"]),
                              on_start=lambda text, total: announced.append(total),
                              on_batch=lambda: calls.append(1))
    assert announced == [len(calls)] and evaluation.tokens == len(TEXT) - 1


def test_encoding_in_chunks_gives_the_tokenizers_ids_and_counts_every_unknown(monkeypatch):
    text = embedded_corpus()[:5000]
    tokenizer = CharTokenizer.from_text(text)
    monkeypatch.setattr(inference, "ENCODE_CHUNK", 7)
    assert torch.equal(encode_known(tokenizer, text, "x"), tokenizer.encode(text))
    ids = encode_known(tokenizer, text, "x", dtype=torch.int32)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), tokenizer.encode(text))
    with pytest.raises(DataError, match=r"2 character\(s\) .*'é' \(9x\), '€' \(2x\)"):
        encode_known(tokenizer, text + "é" * 9 + text + "€€", "x")


MEASURE = """
import os, resource, sys, torch
from ipu_unit_scaling.training.data import CharTokenizer, read_text_file
from ipu_unit_scaling.training.inference import encode_known, text_batches
path = sys.argv[1]
with open(path, encoding="utf-8") as handle:
    tokenizer = CharTokenizer.from_text(handle.read(1000))
encode_known(tokenizer, "a", "x")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# what evaluate --data does (pretrained._text_file_batches), then reads every batch
text = read_text_file(path)
ids = encode_known(tokenizer, text, "x", dtype=torch.int32)
del text
for inputs, labels in text_batches(ids, 64, 16):
    pass
used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(used / os.path.getsize(path))
"""


def test_evaluate_data_needs_less_memory_than_the_size_guard_assumes(tmp_path):
    # Characters beyond U+FFFF make Python hold 4 bytes for each: the worst case.
    path = tmp_path / "wide.txt"
    line = "the quick brown fox 😀 jumps over the lazy dog\n"
    path.write_text(line * (24 * 2**20 // len(line.encode("utf-8"))), encoding="utf-8")
    result = subprocess.run([sys.executable, "-c", MEASURE, str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    # The text (4 bytes a character here) and its 4-byte ids, plus the encoder's bounded
    # temporaries: about 9.5 bytes per byte of file. Holding the ids as a list, an int64 tensor
    # and a copy in windows, as evaluate once did, took about 16.
    assert float(result.stdout) < min(12, BYTES_PER_TEXT_BYTE), result.stdout
