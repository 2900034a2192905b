"""trainer.storage's local durable writes (the object-store side is in test_remote.py)."""

from __future__ import annotations

import os

import pytest

from trainer import storage


def test_write_folder_writes_in_order_and_fsyncs_every_file_and_the_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    seen_at_hook = []
    files = {"b.bin": b"\x00" * 300_000, "a.json": b"{}", "last": b"done"}
    storage.write_folder(tmp_path, files, before_last=lambda: seen_at_hook.append(sorted(p.name for p in tmp_path.iterdir())))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    assert seen_at_hook == [["a.json", "b.bin"]]  # the last file is written after the hook
    assert sorted(synced) == sorted([str(tmp_path / n) for n in files] + [str(tmp_path)])


def test_write_folder_reports_a_failed_fsync_after_all_have_finished(tmp_path, monkeypatch):
    real = os.fsync
    finished = []

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("bad"):
            raise OSError(5, "Input/output error")
        real(fd)
        finished.append(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error"):
        storage.write_folder(tmp_path, {"ok1": b"1", "bad": b"2", "ok2": b"3"})
    assert len(finished) == 3  # two files and the folder: none was abandoned on a closed fd


def test_write_json_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    """The one atomic write (the retry ledger, the failure records, the rank's error file use it)."""
    path = tmp_path / "new" / "record.json"
    storage.write_json(path, {"kind": "infra"})
    storage.write_json(path, {"kind": "user", "try": 2}, sort_keys=True)
    assert path.read_text() == '{"kind": "user", "try": 2}'
    with pytest.raises(ValueError), storage.replacing(path) as tmp:  # a writer that fails midway
        tmp.write_text("{half")
        raise ValueError("interrupted")
    assert path.read_text() == '{"kind": "user", "try": 2}' and os.listdir(path.parent) == ["record.json"]
