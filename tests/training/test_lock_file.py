"""A run directory at rest holds no ``.lock``: the lock file lives while someone holds it."""
from __future__ import annotations

import pytest

from ipu_unit_scaling.training.run_directory import LOCK_FILE, RunError, RunLock

fcntl = pytest.importorskip("fcntl")


def test_a_writer_removes_its_lock_file_when_it_ends(tmp_path):
    with RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).exists()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_last_reader_out_removes_the_lock_file(tmp_path):
    first, second = RunLock(tmp_path, shared=True), RunLock(tmp_path, shared=True)
    first.acquire()
    second.acquire()
    first.release()
    assert (tmp_path / LOCK_FILE).exists()  # the second still reads
    with pytest.raises(RunError, match="in use by"):
        RunLock(tmp_path).acquire()  # and a writer is still refused
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_file_removed_between_open_and_lock_is_not_the_one_taken(tmp_path,
                                                                        monkeypatch):
    # The holder ends just after a newcomer opened the lock file and before it locks it: the
    # newcomer must lock the file at the path, not the removed one, or a third process could
    # lock a new file and both would write the directory.
    holder = RunLock(tmp_path)
    holder.acquire()
    opened = RunLock._open_writing
    calls = []

    def open_then_holder_ends(self):
        fd = opened(self)
        if not calls:
            holder.release()
        calls.append(fd)
        return fd

    monkeypatch.setattr(RunLock, "_open_writing", open_then_holder_ends)
    newcomer = RunLock(tmp_path)
    newcomer.acquire()
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # it opened again
        assert newcomer._still_the_lock_file(newcomer._fd)
        with pytest.raises(RunError, match="in use by"):
            RunLock(tmp_path).acquire()
    finally:
        newcomer.release()
    assert not (tmp_path / LOCK_FILE).exists()
