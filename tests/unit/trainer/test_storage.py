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


def test_write_folder_writes_buffer_lists_without_fsync_and_syncs_files_another_wrote(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    storage.write_folder(tmp_path, {"parts.bin": [b"ab", memoryview(b"cd"), b""], "one": b"1"}, durable=False)
    assert synced == [] and (tmp_path / "parts.bin").read_bytes() == b"abcd"
    storage.write_folder(tmp_path, {"last": b"done"}, written=["parts.bin", "one"])
    assert sorted(synced) == sorted([*(str(tmp_path / n) for n in ("parts.bin", "one", "last")), str(tmp_path)])


def test_mapped_regular_maps_a_regular_file_of_the_size_and_refuses_anything_else(tmp_path):
    (tmp_path / "f").write_bytes(b"content")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with storage.mapped_regular(tmp_path / "f", size=7) as data, storage.mapped_regular(tmp_path / "empty") as empty:
        assert bytes(data) == b"content" and empty == b""
    with pytest.raises(storage.SizeMismatch):
        storage.mapped_regular(tmp_path / "f", size=8).__enter__()
    with pytest.raises(storage.NotRegularFile):
        storage.mapped_regular(tmp_path / "link").__enter__()


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


# --- issue 28.2: never follow a link for writing or deleting ---------------------------------------


def _outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    return outside


def test_remove_of_a_link_removes_the_link_never_what_it_points_at(tmp_path):
    outside = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "dir-link").symlink_to(outside, target_is_directory=True)
    (run / "file-link").symlink_to(outside / "keep.txt")
    store = storage.Storage(run)
    store.remove("dir-link")
    store.remove("file-link")
    assert sorted(os.listdir(run)) == []
    assert (outside / "keep.txt").read_text() == "precious"


def test_write_folder_refuses_a_folder_or_a_file_that_is_a_link(tmp_path):
    outside = _outside(tmp_path)
    link = tmp_path / "folder-link"
    link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(OSError):
        storage.write_folder(link, {"new.bin": b"x"})
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep.txt").symlink_to(outside / "keep.txt")
    with pytest.raises(OSError):
        storage.write_folder(folder, {"keep.txt": b"overwritten"})
    assert sorted(os.listdir(outside)) == ["keep.txt"] and (outside / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "a\x00b", "", ".", "..", "./a", "a//b", "a/", 7])
def test_plain_names_refuse_anything_that_could_leave_the_root(name):
    with pytest.raises(storage.UnsafePath, match="field-x"):
        storage.plain_name(name, "field-x")


def test_plain_names_accept_relative_names_and_inside_resolves_within_the_root(tmp_path):
    assert storage.plain_name("train.parquet", "f") == "train.parquet"
    assert storage.plain_name("shards/part-0.parquet", "f") == "shards/part-0.parquet"
    assert storage.inside(tmp_path, "shards/a.parquet", "f") == tmp_path / "shards" / "a.parquet"
    (tmp_path / "shards").symlink_to(tmp_path.parent, target_is_directory=True)
    with pytest.raises(storage.UnsafePath, match="outside"):
        storage.inside(tmp_path, "shards/a.parquet", "f")


def test_a_run_dir_folder_or_file_linked_outside_is_never_written_or_read_through(tmp_path):
    """Every path below a run dir is taken without following a link: `errors -> /some/dir` or
    `tracking.json -> a secret` is refused (OSError), never written or read through."""
    outside = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "errors").symlink_to(outside, target_is_directory=True)
    (run / "tracking.json").symlink_to(outside / "keep.txt")
    store = storage.Storage(run)
    with pytest.raises(OSError):
        store.write_bytes("errors/rank-0.json", b"{}")
    with pytest.raises(OSError):
        store.read_bytes("tracking.json")
    assert sorted(os.listdir(outside)) == ["keep.txt"]


def test_a_checkpoints_folder_linked_outside_the_run_dir_is_refused(tmp_path):
    from trainer.checkpoint import Checkpointer
    from trainer.config import CheckpointConfig
    from trainer.errors import CheckpointError

    outside = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises((CheckpointError, OSError), match="checkpoints"):
        Checkpointer(storage.Storage(run).child("checkpoints"), CheckpointConfig(async_save=False)).cleanup_stale()
    assert sorted(os.listdir(outside)) == ["keep.txt"]


def test_metrics_are_never_appended_through_a_link(tmp_path):
    from trainer.tracking import Tracker

    outside = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside / "keep.txt")
    with pytest.raises(OSError):
        Tracker(run, enabled=True).step(1, loss=1.0)
    assert (outside / "keep.txt").read_text() == "precious"


def test_write_folder_never_writes_into_a_file_with_another_link(tmp_path):
    """A file already in the folder is overwritten in place only when it has no other name: a hard
    link's inode (a file outside, a backup made with `cp -al`) is left as it was and the name gets a new file."""
    outside = _outside(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    os.link(outside / "keep.txt", folder / "keep.txt")
    (folder / "own.bin").write_bytes(b"old bytes, longer")
    own = (folder / "own.bin").stat().st_ino
    storage.write_folder(folder, {"keep.txt": b"new", "own.bin": b"new"})
    assert (outside / "keep.txt").read_text() == "precious" and (outside / "keep.txt").stat().st_nlink == 1
    assert (folder / "keep.txt").read_bytes() == b"new" and (folder / "keep.txt").stat().st_nlink == 1
    assert (folder / "own.bin").read_bytes() == b"new" and (folder / "own.bin").stat().st_ino == own  # reused in place


def test_a_json_record_is_read_only_when_it_is_a_plain_regular_object(tmp_path):
    """A run dir is not trusted: a record nested past the parser's depth raised RecursionError
    (not a ValueError) out of the reader, in the task that reads failure records."""
    good = tmp_path / "good.json"
    good.write_text('{"exit_code": 1}')
    assert storage.read_json_record(good) == {"exit_code": 1}
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    assert storage.read_json_record(nested) == {}
    (tmp_path / "link.json").symlink_to(good)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "list.json").write_text("[1]")
    for name in ("link.json", "fifo.json", "list.json", "missing.json"):
        assert storage.read_json_record(tmp_path / name) == {}


def test_write_folder_replaces_a_fifo_it_finds_never_waiting_on_it(tmp_path):
    """A recycled checkpoint folder is written in place: a FIFO planted under a file's name made the
    write wait for ever for a reader (O_WRONLY on a FIFO blocks)."""
    import threading

    os.mkfifo(tmp_path / "model.safetensors")
    done = threading.Event()
    threading.Thread(target=lambda: (storage.write_folder(tmp_path, {"model.safetensors": b"weights"}, durable=False),
                                     done.set()), daemon=True).start()
    assert done.wait(5), "write_folder blocked on the FIFO"
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "model.safetensors").read_bytes() == b"weights"
