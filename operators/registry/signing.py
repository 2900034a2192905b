"""The platform's signature on the models gangflow logs: an HMAC-SHA256, with a key only the platform
holds, over the sha256 of every file of the model and the model factory the pipeline allowed.

A loader verifies it before importing anything from the model (`verify_model_dir`), so a version
planted or altered through MLflow's API is refused, and the signed factory needs no allow-list
setting where the model is served. docs/security.md, "The registry".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

from operators.config import settings
from operators.exceptions import UserError

SIGNATURE_FILE = "gangflow_signature.json"
SIGNATURE_FORMAT = "gangflow-signature/1"
KEY_FILE_ENV = "GANGFLOW_REGISTRY_KEY_FILE"
_CHUNK = 1 << 20
#: Files MLflow itself adds to a downloaded copy (`models:/<name>@alias` writes the first).
_ADDED_BY_MLFLOW = frozenset({"registered_model_meta"})


class UnsignedModel(UserError):
    """A model without a valid platform signature, or whose files differ from what was signed:
    nothing of it is imported."""


def key_file() -> Path:
    """Where the key is: `GANGFLOW_REGISTRY_KEY_FILE` (e.g. a mounted Secret), else
    `<state dir>/registry.key`."""
    return Path(os.environ.get(KEY_FILE_ENV) or settings.state_dir() / "registry.key")


def registry_key(*, create: bool = False) -> bytes:
    """The signing key; with `create`, a new random one is written (0600) when none exists."""
    path = key_file()
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        if not create:
            raise UnsignedModel(f"no registry key at {path} ({KEY_FILE_ENV} or the state dir's registry.key): "
                                "cannot verify that gangflow logged this model; nothing was loaded") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another task created it meanwhile
            return registry_key()
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_hex(32).encode())
        return registry_key()
    if len(key) < 32:
        raise UnsignedModel(f"the registry key at {path} is shorter than 32 bytes")
    return key


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(model_dir: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `model_dir` but the signature; links refused."""
    found = {}
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir).as_posix()
        if path.is_symlink():
            raise UnsignedModel(f"{rel} is a symbolic link: a model is plain files; nothing was loaded")
        if path.is_file() and rel != SIGNATURE_FILE and rel not in _ADDED_BY_MLFLOW:
            found[rel] = _sha256(path)
    return found


def _mac(key: bytes, record: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sign_model_dir(model_dir: str | Path, *, factory: str | None) -> dict[str, Any]:
    """Write `gangflow_signature.json` in `model_dir`: the files' sha256 and `factory`, the model
    factory the platform allowed for it (None: the loader's own allow-list decides)."""
    model_dir = Path(model_dir)
    record = {"format": SIGNATURE_FORMAT, "files": _files(model_dir), "factory": factory}
    record["hmac"] = _mac(registry_key(create=True), record)
    (model_dir / SIGNATURE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def verify_model_dir(model_dir: str | Path) -> dict[str, Any]:
    """The signed record of `model_dir`, after checking its HMAC and that the files are exactly
    those signed; `UnsignedModel` otherwise (call it before importing anything of the model)."""
    model_dir = Path(model_dir)
    try:
        record = json.loads((model_dir / SIGNATURE_FILE).read_text())
    except FileNotFoundError:
        raise UnsignedModel(f"{model_dir} is not signed by this platform (no {SIGNATURE_FILE}): it was not logged "
                            "by gangflow's training task; nothing was loaded") from None
    except ValueError as exc:
        raise UnsignedModel(f"{model_dir}: unreadable {SIGNATURE_FILE} ({exc}); nothing was loaded") from None
    if not isinstance(record, dict) or record.get("format") != SIGNATURE_FORMAT:
        raise UnsignedModel(f"{model_dir}: {SIGNATURE_FILE} is not a {SIGNATURE_FORMAT} record; nothing was loaded")
    if not hmac.compare_digest(str(record.get("hmac", "")), _mac(registry_key(), record)):
        raise UnsignedModel(f"{model_dir} is not signed by this platform's registry key (the signature does not "
                            "match: altered, or signed elsewhere); nothing was loaded")
    signed, found = record.get("files") or {}, _files(model_dir)
    if found != signed:
        changed = sorted({*signed, *found} - {k for k in signed if found.get(k) == signed[k]})
        raise UnsignedModel(f"{model_dir} was altered after gangflow signed it ({', '.join(changed[:5])}); "
                            "nothing was loaded")
    return record
