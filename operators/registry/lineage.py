"""Lineage of a registered model: the code's git commit (and whether it was dirty), the run's
`gangflow.*` tags, and the version tags built from them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.config import settings
from operators.exceptions import UserError
from operators.hooks.mlflow import client_uri, mlflow_errors

if TYPE_CHECKING:
    from mlflow import MlflowClient


#: The commit an image was built from (its build arg: there is no .git in an image).
COMMIT_ENV = "GANGFLOW_GIT_COMMIT"
DIRTY_ENV = "GANGFLOW_GIT_DIRTY"
#: "1": register models whose code commit is unknown (local experiments outside a git checkout).
ALLOW_UNKNOWN_COMMIT_ENV = "GANGFLOW_ALLOW_UNKNOWN_COMMIT"


class UnknownCommit(UserError):
    """The code's commit is unknown: a registered model would have no code lineage."""


def run_lineage(client: MlflowClient, run_id: str) -> dict[str, str]:
    """The run's `gangflow.*` tags (lineage the training task, backend and evaluate recorded)."""
    with mlflow_errors(client_uri(client), f"read the tags of run {run_id}"):
        run_tags = client.get_run(run_id).data.tags
    return {k: str(v)[:5000] for k, v in sorted(run_tags.items()) if k.startswith("gangflow.")}


def _git(root: str | Path | None, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=str(root or settings.PROJECT_ROOT), capture_output=True, text=True,
                              timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(root: str | Path | None = None) -> str:
    """The commit of the code that trained the model: `GANGFLOW_GIT_COMMIT` (baked into an image
    by its build arg) when set, else `git rev-parse HEAD` of the project, else "unknown"."""
    baked = os.environ.get(COMMIT_ENV, "").strip()
    if baked and baked != "unknown":
        return baked
    out = _git(root, "rev-parse", "HEAD")
    sha = out.stdout.strip() if out is not None else ""
    return sha if out is not None and out.returncode == 0 and sha else "unknown"


def git_dirty(root: str | Path | None = None) -> str:
    """"true" when tracked files differ from that commit (uncommitted changes trained the
    model), "false" when not, "unknown" outside a git checkout (an image: its build arg)."""
    if os.environ.get(COMMIT_ENV, "").strip() not in ("", "unknown"):
        return os.environ.get(DIRTY_ENV, "unknown").strip().lower() or "unknown"
    out = _git(root, "status", "--porcelain", "--untracked-files=no")
    if out is None or out.returncode != 0:
        return "unknown"
    return "true" if out.stdout.strip() else "false"


def require_commit(commit: str) -> str:
    """`commit`, or UnknownCommit when it is "unknown" and `GANGFLOW_ALLOW_UNKNOWN_COMMIT` is not 1."""
    if commit == "unknown" and os.environ.get(ALLOW_UNKNOWN_COMMIT_ENV, "") != "1":
        raise UnknownCommit(
            "the code's git commit is unknown (no git checkout, and no GANGFLOW_GIT_COMMIT, the image's build arg): "
            "refusing to register a model without code lineage. Build the image with "
            "--build-arg GANGFLOW_GIT_COMMIT=$(git rev-parse HEAD), run from a git checkout, or set "
            f"{ALLOW_UNKNOWN_COMMIT_ENV}=1 for a local experiment. Nothing was registered."
        )
    return commit


def lineage_tags(lineage: Mapping[str, Any] | None, **defaults: Any) -> dict[str, str]:
    """Model-version tags `gangflow.<key>` from a lineage dict, `defaults` filling the gaps.

    Nested values are stored as JSON; None values are dropped.
    """
    merged: dict[str, Any] = {k: v for k, v in defaults.items() if v is not None}
    merged.update({k: v for k, v in (lineage or {}).items() if v is not None})
    out = {}
    for key, value in merged.items():
        key = str(key) if str(key).startswith("gangflow.") else f"gangflow.{key}"
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        out[key] = text[:5000]
    return out
