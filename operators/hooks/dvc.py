"""Dataset versions: publish them with DVC, resolve a version to read-only files, verify their bytes.

A version is the md5 DVC gives the dataset directory; DVC is configured here, in code, and
imported only when used (docs/data.md).

    python -m operators.hooks.dvc pinned            # the version pinned in dvc.lock
    python -m operators.hooks.dvc publish           # dvc repro prepare + dvc push; prints the version
    python -m operators.hooks.dvc resolve [VERSION] # fetch + verify; prints the manifest as JSON
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.config import settings
from operators.exceptions import (
    DatasetHashMismatch,
    DatasetVersionNotFound,
    StorageUnavailable,
    UserError,
)
from operators.config.settings import PROJECT_ROOT
from trainer.storage import plain_name
from trainer.urls import credentials_refusal, has_credentials, redact_url
from trainer.checks import is_integer

if TYPE_CHECKING:
    from dvc.repo import Repo

log = logging.getLogger(__name__)

DEFAULT_STAGE = "prepare"
DEFAULT_OUT = "data/digits"
#: Name of the local remote under the state dir, as DVC sees it.
LOCAL_REMOTE = "gangflow"
#: A URL or the name of a remote in .dvc/config; overrides the local remote under the state dir.
REMOTE_ENV = "GANGFLOW_DVC_REMOTE"
#: What `dataset_version` may say instead of a hash to mean "the version pinned in dvc.lock".
PINNED = "pinned"

_VERSION_RE = re.compile(r"[0-9a-f]{32}")
_CWD_LOCK = threading.Lock()


class InvalidDatasetVersion(UserError, ValueError):
    """`dataset_version` is not a dataset version (32 hex digits) nor 'pinned'."""


@dataclass(frozen=True)
class ResolvedDataset:
    """One dataset version, resolved to read-only files in the DVC cache.

    `files` and `md5s` are keyed by the file's path inside the dataset directory
    (`train.parquet`, `test.parquet`). `manifest_path` is the cached `.dir` object whose md5 is
    the version; `uri` locates that object in the DVC remote.
    """

    version: str
    files: Mapping[str, Path]
    md5s: Mapping[str, str]
    manifest_path: Path
    uri: str

    @property
    def splits(self) -> dict[str, Path]:
        """Parquet files by split name, train first: {"train": path, "test": path, ...}."""
        splits = {name.removesuffix(".parquet"): path for name, path in self.files.items() if name.endswith(".parquet")}
        return dict(sorted(splits.items(), key=lambda item: (item[0] != "train", item[0] != "test", item[0])))


# --------------------------------------------------------------------------------------------
# DVC configuration


def remote_spec() -> tuple[str, str | None]:
    """(remote name, URL or None): None means a remote already configured in .dvc/config."""
    value = os.environ.get(REMOTE_ENV, "").strip()
    if has_credentials(value):  # it becomes the ranks' data.remote: argv, task log, MLflow params
        raise UserError(credentials_refusal(REMOTE_ENV, value))
    if not value:
        return LOCAL_REMOTE, str(settings.dvc_remote())
    if "://" in value or value.startswith(("/", ".", "~")):
        return LOCAL_REMOTE, value
    return value, None


def remote_url() -> str:
    """The DVC remote as an fsspec URL (`file:///...` for a folder): what a rank is given as
    `data.remote` to fetch a version by content address (`trainer.datastore`)."""
    name, url = remote_spec()
    if url is None:  # a named remote of .dvc/config: DVC resolves its URL
        with open_repo() as repo:
            url = _remote_url(repo)
        if has_credentials(url):
            raise UserError(credentials_refusal(f"the URL of DVC remote {name!r} (.dvc/config)", url,
                                                "from the remote's own credential settings (.dvc/config.local) or AWS_*"))
        return url
    return url if "://" in url else Path(url).expanduser().resolve().as_uri()


def dvc_config() -> dict[str, Any]:
    """The DVC config gangflow merges over the repository's own (`Repo(root, config=...)`).

    Built from `operators.config.settings` on every call, so a different `GANGFLOW_HOME` (tests use
    temporary state dirs) takes effect without editing `.dvc/config` or `.dvc/config.local`,
    and concurrent processes never race on a config file.
    """
    name, url = remote_spec()
    config: dict[str, Any] = {
        "cache": {"dir": str(settings.dvc_cache())},
        "core": {
            "remote": name,
            "analytics": False,
            "site_cache_dir": str(settings.state_dir() / "dvc-site-cache"),
        },
    }
    if url is not None:
        config["remote"] = {name: {"url": url}}
    return config


def in_git_work_tree(root: str | os.PathLike) -> bool:
    """Whether `root` or a folder above it holds `.git` (where DVC would look for git)."""
    path = Path(root).resolve()
    return any((folder / ".git").exists() for folder in (path, *path.parents))


@contextlib.contextmanager
def open_repo(root: str | os.PathLike = PROJECT_ROOT) -> Iterator[Repo]:
    """A `dvc.repo.Repo` for `root` with gangflow's cache and remote merged into its config."""
    from dvc.config import ConfigError
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    config = dvc_config()
    if not in_git_work_tree(root):  # an image holds the project's DVC files without .git/
        config["core"]["no_scm"] = True
    try:
        repo = Repo(os.fspath(root), config=config)
    except NotDvcRepoError as exc:
        raise UserError(f"{root} is not a DVC repository (no .dvc/ folder): {exc}") from exc
    except ConfigError as exc:
        raise UserError(f"DVC configuration of {root} is invalid: {exc}") from exc
    try:
        yield repo
    finally:
        repo.close()


@contextlib.contextmanager
def _in_repo_dir(root: Path) -> Iterator[None]:
    """DVC resolves stage paths (and its run cache) against the working directory."""
    with _CWD_LOCK:
        before = os.getcwd()
        os.chdir(root)
        try:
            yield
        finally:
            os.chdir(before)


@contextlib.contextmanager
def _this_python_first_on_path() -> Iterator[None]:
    """Stage commands say `python`: make it this interpreter, which has the project's deps."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


# --------------------------------------------------------------------------------------------
# Versions


def pinned_version(root: str | os.PathLike = PROJECT_ROOT, out: str = DEFAULT_OUT) -> str:
    """The version of `out` pinned in `<root>/dvc.lock` (its DVC md5 without `.dir`)."""
    import yaml

    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        raise DatasetVersionNotFound(
            f"{lock} does not exist, so no dataset version is pinned: run `dvc repro` "
            "(or `python -m operators.hooks.dvc publish`) and commit dvc.lock"
        )
    data = yaml.safe_load(lock.read_text()) or {}
    wanted = os.path.normpath(out)
    for stage in (data.get("stages") or {}).values():
        for entry in stage.get("outs") or []:
            if os.path.normpath(entry.get("path", "")) != wanted:
                continue
            md5 = str(entry.get("md5") or "")
            if not md5.endswith(".dir"):
                raise DatasetVersionNotFound(
                    f"{lock}: out {out!r} has md5 {md5!r}, not a directory hash ('<md5>.dir'); "
                    "a gangflow dataset is a DVC-tracked directory"
                )
            return md5.removesuffix(".dir")
    raise DatasetVersionNotFound(f"{lock} pins no out named {out!r}: is it listed under `outs` in dvc.yaml?")


def normalize_version(
    value: str | None, root: str | os.PathLike = PROJECT_ROOT, *, out: str = DEFAULT_OUT
) -> str:
    """A dataset version from user input: '' / None / 'pinned' mean the dvc.lock pin.

    Accepts 32 hex digits (any case, an optional `.dir` suffix as in dvc.lock); anything else
    raises `InvalidDatasetVersion` naming the field `dataset_version`.
    """
    if is_integer(value) and 0 <= value < 10**32:
        value = f"{value:032d}"  # an all-digit md5 that native template rendering made an int
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", PINNED):
        return pinned_version(root, out)
    version = text.lower().removesuffix(".dir")
    if _VERSION_RE.fullmatch(version):
        return version
    try:
        example = f", e.g. {pinned_version(root, out)} (pinned in dvc.lock)"
    except DatasetVersionNotFound:
        example = ""
    raise InvalidDatasetVersion(
        f"dataset_version={value!r} is not a dataset version: expected 32 hexadecimal digits "
        f"(the DVC md5 of the dataset directory, as in dvc.lock without '.dir'){example}, "
        f"or {PINNED!r} (or empty) for the version pinned in dvc.lock"
    )


# --------------------------------------------------------------------------------------------
# Publish


def publish(
    root: str | os.PathLike = PROJECT_ROOT, *, stage: str = DEFAULT_STAGE, out: str = DEFAULT_OUT
) -> str:
    """`dvc repro <stage>` then `dvc push <out>` to the configured remote; returns the version.

    Idempotent: when nothing changed, DVC skips the stage and the push transfers nothing.
    On a fresh clone (no workspace data, empty cache) DVC reruns the deterministic stage,
    which gives the same bytes, hence the version already pinned in dvc.lock.
    """
    root = Path(root).resolve()
    lock = root / "dvc.lock"
    with _one_publisher(root):
        before = lock.read_text() if lock.is_file() else None
        version, pushed, url = _reproduce_and_push(root, stage, out)
    if before is not None and lock.read_text() != before:
        log.warning(
            "dvc repro changed %s: %s is now version %s; commit dvc.lock to pin it", lock, out, version
        )
    log.info("Published %s version %s (%d object(s) pushed; %s)", out, version, pushed, redact_url(url))
    return version


#: How long a publish waits for another one in the same project (two `make demo`s, two test workers).
PUBLISH_WAIT_S = 900.0


@contextlib.contextmanager
def _one_publisher(root: Path) -> Iterator[None]:
    """One `publish` at a time per project: DVC refuses a second `repro` whose outputs another
    holds ("... is busy, it is being blocked by"); the second waits for the first instead."""
    import fcntl

    path = root / ".dvc" / "tmp" / "gangflow-publish.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"another dataset publish in {root} held {path} for {PUBLISH_WAIT_S:.0f} s: "
                                    "is a `dvc repro` stuck? stop it, then retry") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _reproduce_and_push(root: Path, stage: str, out: str) -> tuple[str, int, str]:
    """(version, objects pushed, the version's remote URL)."""
    from dvc.exceptions import DvcException, ReproductionError, UploadError

    from trainer.failure_catalogue import transient_exception

    with _in_repo_dir(root), _this_python_first_on_path(), open_repo(root) as repo:
        try:
            repo.reproduce(f"dvc.yaml:{stage}")
        except ReproductionError as exc:
            raise UserError(f"`dvc repro {stage}` failed in {root}: {exc.__cause__ or exc}") from exc
        version = pinned_version(root, out)
        name, _ = remote_spec()
        try:
            pushed = repo.push(targets=[out], remote=name)
        except UploadError as exc:
            raise StorageUnavailable(f"`dvc push {out}` to remote {name!r} failed: {exc}") from exc
        except DvcException as exc:
            if transient_exception(exc):  # unreachable (the one catalogue)
                raise StorageUnavailable(f"`dvc push {out}` to remote {name!r} failed: {exc}") from exc
            raise
        except OSError as exc:
            raise StorageUnavailable(f"`dvc push {out}` to remote {name!r} failed: {exc}") from exc
        url = _remote_url(repo, f"{version}.dir")
    return version, pushed, url


# --------------------------------------------------------------------------------------------
# Resolve and verify


def resolve(
    version: str, root: str | os.PathLike = PROJECT_ROOT, *, out: str = DEFAULT_OUT
) -> ResolvedDataset:
    """Resolve a version to its read-only files in the DVC cache, fetching them when absent.

    Raises InvalidDatasetVersion (bad string), DatasetVersionNotFound (in neither the cache nor
    the remote) or StorageUnavailable (the remote could not be reached).
    """
    root = Path(root)
    version = normalize_version(version, root, out=out)
    dir_oid = f"{version}.dir"
    with open_repo(root) as repo:
        cache = repo.cache.local
        manifest_path = Path(cache.oid_to_path(dir_oid))
        if not manifest_path.is_file():
            _fetch(repo, [dir_oid])
            if not manifest_path.is_file():
                raise DatasetVersionNotFound(_not_found_message(repo, root, out, version))
        entries = _read_dir_manifest(manifest_path, version)
        md5s = {entry["relpath"]: entry["md5"] for entry in entries}
        files = {name: Path(cache.oid_to_path(md5)) for name, md5 in md5s.items()}
        absent = [name for name, path in files.items() if not path.is_file()]
        if absent:
            _fetch(repo, [md5s[name] for name in absent])
            still = [name for name in absent if not files[name].is_file()]
            if still:
                raise DatasetVersionNotFound(
                    f"dataset version {version} is incomplete: {', '.join(still)} "
                    f"(md5 {', '.join(md5s[n] for n in still)}) are in neither the DVC cache "
                    f"{cache.path} nor the remote {_remote_url(repo)}; push them again with "
                    "`python -m operators.hooks.dvc publish` from a checkout that has them"
                )
        uri = _remote_url(repo, dir_oid)
    return ResolvedDataset(version=version, files=files, md5s=md5s, manifest_path=manifest_path, uri=uri)


def verify(resolved: ResolvedDataset) -> ResolvedDataset:
    """Recompute the md5 of the manifest and of every file; raise DatasetHashMismatch on any change."""
    from trainer.datastore import file_md5  # a file's md5 as DVC 3 computes it (`hash: md5`)

    checks = [(f"{resolved.version}.dir (the manifest)", resolved.manifest_path, resolved.version)]
    checks += [(name, resolved.files[name], md5) for name, md5 in sorted(resolved.md5s.items())]
    for name, path, expected in checks:
        try:
            actual = file_md5(path)
        except FileNotFoundError as exc:
            raise DatasetVersionNotFound(
                f"dataset version {resolved.version}: {name} vanished from the DVC cache ({path})"
            ) from exc
        if actual != expected:
            raise DatasetHashMismatch(
                f"dataset version {resolved.version}: {name} has md5 {actual}, but the version pins "
                f"{expected}: its bytes changed after the version was published ({path}). "
                "Refusing to validate or train on it. Delete that cache object to fetch it again "
                "from the DVC remote, or publish the changed data as a new version."
            )
    return resolved


def manifest(
    resolved: ResolvedDataset,
    *,
    data_docs: str | os.PathLike | None = None,
    rows: Mapping[str, int] | None = None,
    schema: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The validated-dataset manifest passed downstream by XCom (JSON-serialisable).

    Keys: version, uri, train_path, test_path, train_md5, test_md5, rows {split: n},
    schema {column: dtype} (of the train split), data_docs (path or None), files {name: md5}.
    `rows` and `schema` are read from the Parquet footers when not given.
    """
    splits = resolved.splits
    for split in ("train", "test"):
        if split not in splits:
            raise UserError(
                f"dataset version {resolved.version} has no {split}.parquet (files: {sorted(resolved.files)})"
            )
    if rows is None or schema is None:
        import pyarrow.parquet as pq

        if rows is None:
            rows = {split: pq.read_metadata(path).num_rows for split, path in splits.items()}
        if schema is None:
            arrow = pq.read_schema(splits["train"])
            schema = {field.name: _dtype_name(field.type) for field in arrow}
    return {
        "version": resolved.version,
        "uri": resolved.uri,
        "train_path": str(splits["train"]),
        "test_path": str(splits["test"]),
        "train_md5": resolved.md5s["train.parquet"],
        "test_md5": resolved.md5s["test.parquet"],
        "rows": {str(k): int(v) for k, v in rows.items()},
        "schema": {str(k): str(v) for k, v in schema.items()},
        "data_docs": None if data_docs is None else str(data_docs),
        "files": dict(sorted(resolved.md5s.items())),
    }


# --------------------------------------------------------------------------------------------
# Internals


def _dtype_name(arrow_type: Any) -> str:
    try:
        import numpy as np

        return str(np.dtype(arrow_type.to_pandas_dtype()))
    except (NotImplementedError, TypeError):
        return str(arrow_type)


def _read_dir_manifest(path: Path, version: str) -> list[dict[str, str]]:
    """The listing of `version`, checked before any path is built from it: each md5 names a cache
    path and each relpath a file under the version's folder."""
    from trainer.datastore import file_md5

    try:
        entries = json.loads(path.read_bytes())
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "md5" in e and "relpath" in e for e in entries):
            raise ValueError("entries lack md5/relpath")
        for entry in entries:
            if not isinstance(entry["md5"], str) or not _VERSION_RE.fullmatch(entry["md5"]):
                raise ValueError(f"md5 {entry['md5']!r} is not 32 hexadecimal digits")
            plain_name(entry["relpath"], "relpath")
    except (ValueError, TypeError) as exc:  # UnsafePath is a ValueError
        raise DatasetHashMismatch(
            f"dataset version {version}: the cached manifest {path} is not a DVC .dir manifest ({exc}); "
            "delete it to fetch it again from the DVC remote"
        ) from exc
    if (actual := file_md5(path)) != version:
        raise DatasetHashMismatch(
            f"dataset version {version}: the cached manifest {path} has md5 {actual}, not the version's: it was "
            "changed after the version was published; nothing was fetched. Delete it to fetch it again from the DVC remote"
        )
    return entries


def _remote_url(repo: Repo, oid: str | None = None) -> str:
    """URL of the remote (or of one object in it), without touching the network."""
    try:
        odb = repo.cloud.get_remote_odb(remote_spec()[0], "fetch")
    except Exception as exc:  # noqa: BLE001 - a locator for messages only
        return f"<no usable DVC remote: {exc}>"
    url = odb.fs.unstrip_protocol(odb.oid_to_path(oid) if oid else odb.path)
    return url if "://" in url else Path(url).as_uri()  # fsspec strips user info from a path




def _fetch(repo: Repo, oids: Iterable[str]) -> None:
    """Fetch objects (`<md5>` or `<md5>.dir`) from the DVC remote into the cache, through DVC.

    Absent objects are left absent (the caller reports them); an unreachable remote raises
    StorageUnavailable.
    """
    from dvc.exceptions import DvcException
    from dvc_data.hashfile.hash_info import HashInfo

    from trainer.failure_catalogue import transient_exception

    oids = list(oids)
    name, _ = remote_spec()
    try:
        odb = repo.cloud.get_remote_odb(name, "fetch")
    except DvcException as exc:
        raise UserError(f"DVC remote {name!r} is not usable: {exc}") from exc
    url = odb.fs.unstrip_protocol(odb.path)
    # A cheap probe tells "unreachable" from "absent" before DVC folds both into "missing". The
    # catalogue walks the cause chain: fsspec's HTTP filesystem reports a refused connection as a
    # FileNotFoundError caused by an aiohttp connection error.
    try:
        odb.fs.info(odb.oid_to_path(oids[0]))
    except Exception as exc:  # noqa: BLE001 - classified below
        if transient_exception(exc):
            raise StorageUnavailable(f"DVC remote {name!r} ({url}) is unreachable: {_root_cause(exc)}") from exc
        if not isinstance(exc, FileNotFoundError):
            raise
    log.info("Fetching %d object(s) from DVC remote %s", len(oids), url)
    try:
        result = repo.cloud.pull([HashInfo("md5", oid) for oid in oids], remote=name)
    except Exception as exc:
        if transient_exception(exc):
            raise StorageUnavailable(f"fetching from DVC remote {name!r} ({url}) failed: {_root_cause(exc)}") from exc
        raise
    if result.failed:
        failed = ", ".join(sorted(h.value for h in result.failed))
        raise StorageUnavailable(f"fetching from DVC remote {name!r} ({url}) failed for {failed}")


def _root_cause(exc: BaseException) -> str:
    from trainer.failure_catalogue import causes

    last = list(causes(exc, depth=None))[-1]
    return f"{type(last).__name__}: {last}"


def _not_found_message(repo: Repo, root: Path, out: str, version: str) -> str:
    try:
        pinned = f"The version pinned in {root / 'dvc.lock'} is {pinned_version(root, out)}."
    except DatasetVersionNotFound as exc:
        pinned = f"No version is pinned: {exc}."
    remote = _remote_url(repo)
    try:
        odb = repo.cloud.get_remote_odb(remote_spec()[0], "fetch")
        empty = "" if odb.fs.exists(odb.path) else " (the remote holds nothing yet)"
    except Exception:  # noqa: BLE001 - a hint only
        empty = ""
    return (
        f"dataset version {version} not found: it is in neither the DVC cache {repo.cache.local.path} "
        f"nor the DVC remote {remote}{empty}. {pinned} Publish a version with "
        "`python -m operators.hooks.dvc publish` (dvc repro + dvc push), then commit dvc.lock."
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m operators.hooks.dvc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=PROJECT_ROOT, help="project root (a git + DVC repo)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pinned", help="print the version pinned in dvc.lock")
    sub.add_parser("publish", help="dvc repro + dvc push; print the version")
    p_resolve = sub.add_parser("resolve", help="fetch and verify a version; print its manifest")
    p_resolve.add_argument("version", nargs="?", default=PINNED)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "pinned":
        print(pinned_version(args.root))
    elif args.command == "publish":
        print(publish(args.root))
    else:
        print(json.dumps(manifest(verify(resolve(args.version, args.root))), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
