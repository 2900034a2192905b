"""operators.hooks.dvc against a real git + DVC repository, a real local remote, a temp state dir.

The module builds one project the way a fresh clone looks (dvc.yaml and the committed dvc.lock,
no data, empty cache and remote) and publishes it once; the tests then resolve, fetch, corrupt
and refuse versions in it.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from operators.hooks import dvc as dataset
from trainer.datastore import file_md5
from operators.exceptions import (
    DatasetHashMismatch,
    DatasetVersionNotFound,
    InfraError,
    StorageUnavailable,
    UserError,
)

PROJECT_ROOT = Path(__file__).resolve().parents[4]
PROJECT_FILES = ("data/prepare.py", "params.yaml", "dvc.yaml", "dvc.lock", ".gitignore")


@dataclass(frozen=True)
class Project:
    root: Path
    home: Path
    version: str


def make_project(root: Path) -> Path:
    """A git + DVC repo holding the project's pipeline files (as a fresh clone has them)."""
    for rel in PROJECT_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PROJECT_ROOT / rel, root / rel)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    from dvc.repo import Repo

    Repo.init(str(root)).close()
    return root


def committed_version() -> str:
    lock = yaml.safe_load((PROJECT_ROOT / "dvc.lock").read_text())
    return lock["stages"]["prepare"]["outs"][0]["md5"].removesuffix(".dir")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("project"))
    home = tmp_path_factory.mktemp("state")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GANGFLOW_HOME", str(home))
        mp.delenv(dataset.REMOTE_ENV, raising=False)
        version = dataset.publish(root)
        yield Project(root=root, home=home, version=version)


def cache_dir(project: Project) -> Path:
    return project.home / "dvc-cache"


def test_publish_rebuilds_the_pinned_version_and_pushes_it(project):
    # deterministic stage: a fresh clone rebuilds the bytes pinned in the committed dvc.lock
    assert project.version == committed_version() == dataset.pinned_version(project.root)
    assert (project.root / "dvc.lock").read_text() == (PROJECT_ROOT / "dvc.lock").read_text()
    remote = project.home / "dvc-remote" / "files" / "md5"
    manifest = remote / project.version[:2] / f"{project.version[2:]}.dir"
    entries = json.loads(manifest.read_text())
    assert sorted(e["relpath"] for e in entries) == ["test.parquet", "train.parquet"]
    for entry in entries:
        assert (remote / entry["md5"][:2] / entry["md5"][2:]).is_file()
    # nothing about the state dir was written into the repository's DVC config
    assert not (project.root / ".dvc" / "config.local").exists()
    assert str(project.home) not in (project.root / ".dvc" / "config").read_text()


def test_publish_is_idempotent(project):
    train = project.root / "data" / "digits" / "train.parquet"
    before = train.stat().st_mtime_ns
    assert dataset.publish(project.root) == project.version
    assert train.stat().st_mtime_ns == before  # the stage did not run again


def test_dvc_config_follows_gangflow_home(project, monkeypatch, tmp_path):
    config = dataset.dvc_config()
    assert config["cache"]["dir"] == str(project.home / "dvc-cache")
    assert config["core"]["remote"] == "gangflow"
    assert config["remote"]["gangflow"]["url"] == str(project.home / "dvc-remote")
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    assert dataset.dvc_config()["cache"]["dir"] == str(tmp_path / "dvc-cache")
    monkeypatch.setenv(dataset.REMOTE_ENV, "s3://bucket/gangflow")
    assert dataset.dvc_config()["remote"] == {"gangflow": {"url": "s3://bucket/gangflow"}}
    monkeypatch.setenv(dataset.REMOTE_ENV, "storage")  # a remote named in .dvc/config
    assert dataset.dvc_config()["core"]["remote"] == "storage" and "remote" not in dataset.dvc_config()


def test_resolve_and_verify_the_pinned_version(project):
    resolved = dataset.resolve("pinned", project.root)
    assert resolved.version == project.version
    assert resolved.manifest_path == cache_dir(project) / "files" / "md5" / project.version[:2] / f"{project.version[2:]}.dir"
    entries = {e["relpath"]: e["md5"] for e in json.loads(resolved.manifest_path.read_text())}
    assert dict(resolved.md5s) == entries
    for name, path in resolved.files.items():
        md5 = entries[name]
        assert path == cache_dir(project) / "files" / "md5" / md5[:2] / md5[2:]
        assert not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), "cache objects are read-only"
    assert resolved.splits == {"train": resolved.files["train.parquet"], "test": resolved.files["test.parquet"]}
    assert resolved.uri == (project.home / "dvc-remote" / "files" / "md5" / project.version[:2]).as_uri() + f"/{project.version[2:]}.dir"
    assert dataset.verify(resolved) is resolved
    # the same version under its other spellings
    assert dataset.resolve("", project.root) == resolved
    assert dataset.resolve(f"{project.version.upper()}.dir", project.root) == resolved


def test_manifest_is_json_and_describes_the_files(project):
    resolved = dataset.verify(dataset.resolve(project.version, project.root))
    manifest = json.loads(json.dumps(dataset.manifest(resolved, data_docs="/x/index.html")))
    assert set(manifest) >= {"version", "uri", "train_path", "test_path", "train_md5", "test_md5", "rows", "schema", "data_docs"}
    assert manifest["version"] == project.version
    assert manifest["train_md5"] == file_md5(manifest["train_path"]) == resolved.md5s["train.parquet"]
    assert manifest["test_md5"] == file_md5(manifest["test_path"]) == resolved.md5s["test.parquet"]
    assert manifest["rows"] == {"train": 1347, "test": 450}
    assert manifest["schema"] == {**{f"pixel_{i:02d}": "float32" for i in range(64)}, "label": "int64"}
    assert manifest["data_docs"] == "/x/index.html"
    assert manifest["uri"].endswith(f"/files/md5/{project.version[:2]}/{project.version[2:]}.dir")


def test_resolve_fetches_from_the_remote_when_the_cache_is_gone(project):
    shutil.rmtree(cache_dir(project))
    resolved = dataset.verify(dataset.resolve(project.version, project.root))
    assert resolved.manifest_path.is_file()
    assert all(path.is_file() for path in resolved.files.values())


def test_a_project_without_git_as_the_airflow_image_holds_it_fetches_and_verifies(project, monkeypatch, tmp_path):
    """docker/airflow.Dockerfile copies dvc.yaml, dvc.lock and .dvc/config, not .git/: DVC must not need git."""
    image_root = tmp_path / "opt-gangflow"
    for rel in ("dvc.yaml", "dvc.lock", "params.yaml", ".dvc/config"):
        (image_root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project.root / rel, image_root / rel)
    assert not dataset.in_git_work_tree(image_root) and dataset.in_git_work_tree(project.root)
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path / "worker-state"))  # an empty cache
    monkeypatch.setenv(dataset.REMOTE_ENV, str(project.home / "dvc-remote"))
    resolved = dataset.verify(dataset.resolve(project.version, image_root))
    assert all(path.is_file() and str(path).startswith(str(tmp_path / "worker-state")) for path in resolved.files.values())


def test_changed_bytes_are_refused_against_the_pinned_hash(project):
    resolved = dataset.resolve(project.version, project.root)
    path = resolved.files["train.parquet"]
    original = path.read_bytes()
    path.chmod(0o644)  # DVC makes cache objects read-only
    try:
        path.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
        actual = file_md5(path)
        with pytest.raises(DatasetHashMismatch) as info:
            dataset.verify(dataset.resolve(project.version, project.root))
        message = str(info.value)
        assert "train.parquet" in message
        assert resolved.md5s["train.parquet"] in message and actual in message
        assert not info.value.retryable
    finally:
        path.write_bytes(original)
        path.chmod(0o444)
    dataset.verify(dataset.resolve(project.version, project.root))


def test_unknown_version_is_not_found(project):
    unknown = "0123456789abcdef0123456789abcdef"
    with pytest.raises(DatasetVersionNotFound) as info:
        dataset.resolve(unknown, project.root)
    message = str(info.value)
    assert unknown in message
    assert f"pinned in {project.root / 'dvc.lock'} is {project.version}" in message
    assert not info.value.retryable


@pytest.mark.parametrize("bad", ["latest", "5bda544a", "z" * 32, "../../etc/passwd", "{{ params.dataset_version }}"])
def test_bad_version_string_is_rejected_naming_the_field(project, bad):
    with pytest.raises(dataset.InvalidDatasetVersion) as info:
        dataset.resolve(bad, project.root)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"dataset_version={bad!r} is not a dataset version")
    assert "32 hexadecimal digits" in message and "'pinned'" in message and project.version in message


def test_unreachable_remote_is_storage_unavailable(project, monkeypatch, tmp_path):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))  # an empty cache: resolve must fetch
    monkeypatch.setenv(dataset.REMOTE_ENV, "http://127.0.0.1:9/dvc")  # nothing listens on port 9
    with pytest.raises(StorageUnavailable) as info:
        dataset.resolve(project.version, project.root)
    assert isinstance(info.value, InfraError) and info.value.retryable
    assert "http://127.0.0.1:9/dvc" in str(info.value) and "unreachable" in str(info.value)


def test_pinned_version_errors_name_the_lock(tmp_path):
    with pytest.raises(DatasetVersionNotFound, match="dvc.lock does not exist"):
        dataset.pinned_version(tmp_path)
    shutil.copy2(PROJECT_ROOT / "dvc.lock", tmp_path / "dvc.lock")
    assert dataset.pinned_version(tmp_path) == committed_version()
    with pytest.raises(DatasetVersionNotFound, match="pins no out named 'data/other'"):
        dataset.pinned_version(tmp_path, out="data/other")



@pytest.mark.parametrize("relpath", ["../../secret.parquet", "/etc/passwd", "a/../../b", "x\x00y", ""])
def test_a_cached_listing_with_a_name_that_could_leave_its_folder_is_refused(tmp_path, relpath):
    """Issue 28.2: a DVC listing is data; its names are plain relative names or it is refused."""
    listing = tmp_path / "0123.dir"
    listing.write_text(json.dumps([{"md5": "0" * 32, "relpath": relpath}, {"md5": "1" * 32, "relpath": "train.parquet"}]))
    with pytest.raises(DatasetHashMismatch, match="is not a plain relative name"):
        dataset._read_dir_manifest(listing, "0" * 32)


@pytest.mark.parametrize("md5", ["..md5/../../../airflow/dags/pwned.py", "xx/etc/passwd", "0" * 31, "A" * 32, 7])
def test_a_cached_listing_whose_md5_is_not_32_hex_digits_is_refused_before_any_path_is_built(tmp_path, md5):
    """A listing's md5 names a cache path (`oid_to_path`): `..md5/../../../airflow/dags/x.py` would
    have DVC fetch a remote object into the scheduler's DAG folder."""
    listing = tmp_path / "0123.dir"
    listing.write_text(json.dumps([{"md5": md5, "relpath": "train.parquet"}]))
    with pytest.raises(DatasetHashMismatch, match="32 hexadecimal digits"):
        dataset._read_dir_manifest(listing, "0" * 32)


def test_a_cached_listing_that_is_not_the_versions_is_refused_before_any_object_is_fetched(tmp_path):
    listing = tmp_path / "0123.dir"
    listing.write_text(json.dumps([{"md5": "1" * 32, "relpath": "train.parquet"}]))
    with pytest.raises(DatasetHashMismatch, match=r"has md5 [0-9a-f]{32}, not the version's"):
        dataset._read_dir_manifest(listing, "0" * 32)
