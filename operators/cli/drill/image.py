"""The training image as the drill provides it on this machine, read from docker/training.Dockerfile.

The runtime stage's `ENV` lines become every emulated container's base environment, its
`COPY <file> /app/...` lines read-only copies under `<drill>/image/app/`, and `/opt/venv` is this
environment's `sys.prefix` (the same pins). Reading the Dockerfile keeps the drill from drifting.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from operators.config import settings

DOCKERFILE = "docker/training.Dockerfile"
RUNTIME_STAGE = "runtime"
IMAGE_VENV = "/opt/venv"
BASE_PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"  # python:3.11-slim's PATH


class ImageError(ValueError):
    """docker/training.Dockerfile does not have what the drill reads from it."""


@dataclass
class Image:
    """`env`: the image's ENV (paths mapped); `mounts`: image path -> local folder; `workdir`."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    copied: dict[str, str] = field(default_factory=dict)  # image path -> repository source


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append((current + line).strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def parse_runtime_stage(text: str, stage: str = RUNTIME_STAGE) -> tuple[dict[str, str], dict[str, str], str]:
    """(ENV, {image path: source} of plain COPY lines, WORKDIR) of the stage named `stage`."""
    env: dict[str, str] = {}
    copies: dict[str, str] = {}
    workdir = "/"
    inside = False
    for line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            inside = bool(re.search(rf"\sAS\s+{re.escape(stage)}\s*$", " " + rest, re.IGNORECASE))
            continue
        if not inside:
            continue
        if word == "ENV":
            for item in shlex.split(rest):
                if "=" not in item:
                    raise ImageError(f"{DOCKERFILE}: ENV {item!r}: the drill reads only ENV NAME=value")
                name, _, value = item.partition("=")
                env[name] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), BASE_PATH if m.group(1) == "PATH" else ""), value)
        elif word == "COPY":
            parts = shlex.split(rest)
            if any(p.startswith("--from") for p in parts):
                continue  # the venv and the package from earlier stages, i.e. IMAGE_VENV
            *sources, dest = [p for p in parts if not p.startswith("--")]
            for src in sources:
                # `COPY dir/ /target/` puts the folder's contents in /target (as Docker does)
                target = dest if not dest.endswith("/") or src.endswith("/") else dest + Path(src).name
                copies[target] = src
        elif word == "WORKDIR":
            workdir = rest.strip()
    if not env and not copies:
        raise ImageError(f"{DOCKERFILE}: no stage `FROM ... AS {stage}` with ENV or COPY lines")
    return env, copies, workdir


def _map_path_list(value: str, mounts: dict[str, str]) -> str:
    out = []
    for part in value.split(os.pathsep):
        for src, dst in mounts.items():
            if part == src or part.startswith(src + "/"):
                part = dst + part[len(src) :]
                break
        out.append(part)
    return os.pathsep.join(out)


def build_image(root: Path, project: Path | None = None) -> Image:
    """Lay out the image's files under `root` (read-only) and return how to run in it."""
    project = Path(project or settings.PROJECT_ROOT)
    env, copies, workdir = parse_runtime_stage((project / DOCKERFILE).read_text())
    mounts = {IMAGE_VENV: sys.prefix}
    top_dirs = {"/" + Path(p).parts[1] for p in copies}
    for top in sorted(top_dirs):
        mounts[top] = str(root / top.lstrip("/"))
    for target, src in copies.items():
        local = root / target.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        if (project / src).is_dir():  # `COPY dir/ /target/`: the folder's contents
            shutil.copytree(project / src, local, dirs_exist_ok=True)
            files = [p for p in local.rglob("*") if p.is_file()]
        else:
            shutil.copyfile(project / src, local)
            files = [local]
        for file in files:
            file.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    for top in top_dirs:  # read-only like the image's layers (mode bits; root ignores them)
        for folder in [root / top.lstrip("/"), *[p for p in (root / top.lstrip("/")).rglob("*") if p.is_dir()]]:
            folder.chmod(0o555)
    mapped = {k: _map_path_list(v, mounts) if k == "PATH" else v for k, v in env.items()}
    return Image(env=mapped, mounts=mounts, workdir=workdir, copied=copies)


def make_writable(root: Path) -> None:
    """Undo the read-only modes so the drill dir can be removed."""
    for path in [root, *root.rglob("*")]:
        try:
            path.chmod(0o755 if path.is_dir() else 0o644)
        except OSError:
            pass
