"""trainer.datastore: a dataset version fetched by content address from a DVC 3 remote, md5-verified.

The remote here is laid out with dvc_data's own Tree (what `dvc push` writes); the digest is
checked against dvc_data's. The same remote is served over S3 by a moto server on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from trainer_fixtures import DATASET_FILES

from trainer.datastore import (
    ChecksumMismatch,
    DatasetNotFound,
    dir_listing,
    fetch_dataset,
    listing_digest,
    object_path,
)
from trainer.errors import DataError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def remote(tmp_path, make_remote):
    root = tmp_path / "remote"
    return root, make_remote(root, DATASET_FILES)


def test_version_is_dvc_datas_digest_and_files_arrive_verified(remote, tmp_path):
    root, version = remote
    listing = dir_listing(f"file://{root}", version)
    assert sorted(e["relpath"] for e in listing) == sorted(DATASET_FILES)
    assert listing_digest(listing) == version
    got = fetch_dataset(str(root), version, tmp_path / "scratch")
    assert set(got) == {"train.parquet", "test.parquet"}
    assert got["train.parquet"] == tmp_path / "scratch" / version / "train.parquet"
    assert got["train.parquet"].read_bytes() == DATASET_FILES["train.parquet"]
    assert not [p for p in got["train.parquet"].parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_a_changed_object_is_refused_naming_expected_and_actual(remote, tmp_path):
    root, version = remote
    md5 = hashlib.md5(DATASET_FILES["train.parquet"]).hexdigest()
    Path(object_path(str(root), md5)).write_bytes(b"tampered")
    with pytest.raises(ChecksumMismatch) as info:
        fetch_dataset(str(root), version, tmp_path / "scratch")
    message = str(info.value)
    assert f"dataset version {version} file train.parquet: md5 mismatch: expected {md5}, actual " \
           f"{hashlib.md5(b'tampered').hexdigest()}" in message
    assert isinstance(info.value, DataError)
    assert not (tmp_path / "scratch" / version / "train.parquet").exists()  # never lands under its name


def test_a_changed_listing_is_refused(remote):
    root, version = remote
    path = Path(object_path(str(root), version, ".dir"))
    entries = json.loads(path.read_text())
    entries[0]["md5"] = "0" * 32
    path.write_text(json.dumps(entries))
    with pytest.raises(ChecksumMismatch, match=f"the listing .* has md5 [0-9a-f]{{32}}, expected {version}"):
        dir_listing(str(root), version)


def test_missing_version_and_missing_file_are_clear(remote, tmp_path):
    root, version = remote
    with pytest.raises(DatasetNotFound, match=f"dataset version {'f' * 32} is not on the remote"):
        dir_listing(str(root), "f" * 32)
    with pytest.raises(DatasetNotFound, match=f"dataset version {version} has no valid.parquet; its files are: "
                                              "README, test.parquet, train.parquet"):
        fetch_dataset(str(root), version, tmp_path, relpaths=("train.parquet", "valid.parquet"))
    with pytest.raises(DataError, match="data.version='v1' is invalid"):
        dir_listing(str(root), "v1")
    with pytest.raises(DataError, match=r"data.version='f{32}\\n' is invalid"):  # `$` matches before a final newline
        dir_listing(str(root), "f" * 32 + "\n")


def test_concurrent_fetches_into_one_scratch_do_not_corrupt(remote, tmp_path):
    """Ranks on one machine share $TMPDIR: unique temporaries + atomic rename."""
    root, version = remote
    code = ("import sys; from trainer.datastore import fetch_dataset; "
            "print(fetch_dataset(sys.argv[1], sys.argv[2], sys.argv[3])['train.parquet'])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), version, str(tmp_path / "scratch")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(fetch_dataset(str(root), version, tmp_path / "scratch")["test.parquet"]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert (tmp_path / "scratch" / version / "train.parquet").read_bytes() == DATASET_FILES["train.parquet"]
    assert all(r.read_bytes() == DATASET_FILES["test.parquet"] for r in results)


@pytest.mark.parametrize("sendfile", ["copies", "cannot copy between files here"])
def test_a_local_object_is_copied_in_the_kernel_in_chunks_and_the_copy_is_what_is_verified(remote, tmp_path, monkeypatch, sendfile):
    """From a local remote the kernel copies (sendfile), a chunk at a time, and the md5 is taken of
    the copy; where sendfile cannot copy a file to a file, the copy goes through the process."""
    import errno
    import os

    from trainer import datastore

    root, version = remote
    calls = []
    real = os.sendfile

    def fake_sendfile(out, source, offset, count):
        calls.append(count)
        if sendfile != "copies" and len(calls) > 1:  # after a first part is copied
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(out, source, offset, min(count, 100))  # short copies, as the kernel may make

    monkeypatch.setattr(os, "sendfile", fake_sendfile)
    monkeypatch.setattr(datastore, "_COPY_CHUNK", 256)  # train.parquet (1100 bytes) in 5 chunks
    got = fetch_dataset(f"file://{root}", version, tmp_path / "scratch")
    assert {name: path.read_bytes() for name, path in got.items()} == {n: DATASET_FILES[n] for n in got}
    assert len(calls) > 5 if sendfile == "copies" else calls
    md5 = hashlib.md5(DATASET_FILES["train.parquet"]).hexdigest()
    Path(object_path(str(root), md5)).write_bytes(b"x" * 1100)  # same size, other bytes
    with pytest.raises(ChecksumMismatch, match="md5 mismatch"):
        fetch_dataset(f"file://{root}", version, tmp_path / "again")
    assert not (tmp_path / "again" / version / "train.parquet").exists()


def test_a_local_object_that_ends_before_its_size_is_refused_not_waited_on(remote, tmp_path, monkeypatch):
    """sendfile copying nothing (the object was cut short since it was opened) ends the copy; what
    the copy holds then does not hash to the md5, and the file is refused."""
    import os

    root, version = remote
    monkeypatch.setattr(os, "sendfile", lambda out, source, offset, count: 0)
    with pytest.raises(ChecksumMismatch, match="md5 mismatch"):
        fetch_dataset(f"file://{root}", version, tmp_path / "scratch")


def test_the_module_is_torch_and_airflow_free():
    code = "import sys, trainer.datastore; print(sorted(m for m in ('torch', 'airflow', 'mlflow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_fetch_from_s3(s3, remote, tmp_path):
    import fsspec

    root, version = remote
    bucket = s3.bucket("gangflow-dvc-unit")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)  # not an instance cached by an earlier test of this process
    fs.put(str(root) + "/", bucket.removeprefix("s3://") + "/dvc/", recursive=True)
    got = fetch_dataset(f"{bucket}/dvc", version, tmp_path / "scratch")
    assert got["test.parquet"].read_bytes() == DATASET_FILES["test.parquet"]
    with pytest.raises(DatasetNotFound, match="is not on the remote s3://"):
        dir_listing(f"{bucket}/dvc", "e" * 32)


def test_a_rank_imports_only_what_it_needs():
    """No mlflow (rank 0 imports it only with a tracking URI), no fsspec/s3fs for a local run dir
    and local data, no Airflow: what the entry point and the loop import by themselves."""
    code = ("import sys, trainer.__main__, trainer.loop; "
            "print(sorted(m for m in ('mlflow', 'fsspec', 's3fs', 'boto3', 'airflow', 'dvc', 'dvc_data') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --- issue 28.2: listing names stay inside the dataset folder; scratch is private ----------------------


@pytest.mark.parametrize("relpath", ["../../escape.parquet", "/tmp/abs.parquet", "a/../../b", "x\x00y", "./train.parquet", ""])
def test_a_listing_with_a_name_that_is_not_a_plain_relative_path_is_refused(tmp_path, relpath):
    """A listing is data: a name that could leave dest_dir/<version>/ is refused before any
    download, even when the listing hashes to its version."""
    root = tmp_path / "remote"
    md5 = hashlib.md5(b"data").hexdigest()
    Path(object_path(str(root), md5)).parent.mkdir(parents=True)
    Path(object_path(str(root), md5)).write_bytes(b"data")
    entries = [{"md5": md5, "relpath": relpath}, {"md5": md5, "relpath": "train.parquet"}, {"md5": md5, "relpath": "test.parquet"}]
    version = listing_digest(entries)
    Path(object_path(str(root), version, ".dir")).parent.mkdir(parents=True, exist_ok=True)
    Path(object_path(str(root), version, ".dir")).write_text(json.dumps(entries))
    with pytest.raises(DataError, match="is not a plain relative name"):
        dir_listing(str(root), version)
    with pytest.raises(DataError, match="is not a plain relative name"):
        fetch_dataset(str(root), version, tmp_path / "scratch", relpaths=[relpath] if relpath else ["train.parquet"])
    assert not (tmp_path / "escape.parquet").exists()


def test_a_dataset_folder_linked_elsewhere_is_not_written_through(remote, tmp_path):
    root, version = remote
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / version).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DataError, match="outside"):
        fetch_dataset(str(root), version, tmp_path / "scratch")
    assert list(elsewhere.iterdir()) == []


def test_scratch_is_private_to_the_user_and_the_run(tmp_path, monkeypatch):
    """Issue 28: a fixed /tmp/gangflow-data was shared by every user of a host."""
    import os
    import stat
    import tempfile

    from trainer.data import scratch_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a, b = scratch_dir("/runs/a"), scratch_dir("s3://bucket/runs/b")
    assert a != b and a == scratch_dir("/runs/a")  # the ranks of one run on one machine share it
    for folder in (a, b, a.parent):
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert str(os.getuid()) in a.parent.name


def test_scratch_refuses_a_planted_link_or_a_folder_others_can_write(tmp_path, monkeypatch):
    import os
    import tempfile

    from trainer.data import scratch_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = scratch_dir("/runs/a").parent
    run = scratch_dir("/runs/a")
    run.rmdir()
    run.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(DataError, match="not a private folder"):
        scratch_dir("/runs/a")
    run.unlink()
    os.chmod(base, 0o777)
    with pytest.raises(DataError, match="not a private folder"):
        scratch_dir("/runs/a")


@pytest.mark.parametrize("kind", ["fifo", "device", "listing-device"])
def test_an_object_that_is_not_a_regular_file_on_a_local_remote_is_refused_not_read(tmp_path, kind):
    """Whoever can write the remote's volume can put a FIFO (a read that never ends) or a link to
    /dev/zero (one that fills the disk) where an object belongs: refused before a byte is read."""
    root = tmp_path / "remote"
    md5 = hashlib.md5(b"data").hexdigest()
    entries = [{"md5": md5, "relpath": "train.parquet"}, {"md5": md5, "relpath": "test.parquet"}]
    version = listing_digest(entries)
    listing, obj = Path(object_path(str(root), version, ".dir")), Path(object_path(str(root), md5))
    for path in (listing, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps(entries))
    if kind == "fifo":
        os.mkfifo(obj)
    elif kind == "device":
        obj.symlink_to("/dev/zero")
    else:
        listing.unlink()
        listing.symlink_to("/dev/zero")
    code = ("import sys; from trainer.datastore import fetch_dataset\n"
            "try:\n    fetch_dataset(sys.argv[1], sys.argv[2], sys.argv[3])\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)")
    done = subprocess.run([sys.executable, "-c", code, root.as_uri(), version, str(tmp_path / "scratch")], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.startswith("DataError") and "is not a regular file" in done.stdout, done.stdout + done.stderr[-2000:]
