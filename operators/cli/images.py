"""`make images`: build the training and Airflow images from docker/ with podman, here.

    python -m operators.cli.images [--image training|airflow] [--python-image REF] [--airflow-image REF]

Each Dockerfile's base is a build argument whose default is the official image (pinned by digest,
for users who can pull it). Without `--python-image` / `--airflow-image` the bases are built here:
a Debian bookworm root filesystem (mmdebstrap, Python 3.11) imported as `localhost/gangflow/base`,
and docker/airflow-base.Dockerfile on it (apache-airflow at the constraints.txt pin). Every pip in
a build trusts the host's CA bundle, the build secret `ca` (never in a layer); the training and
Airflow images' pip also take the wheels this machine's pip resolves (a wheelhouse under the state
dir, mounted read-only: the CPU torch; PyPI's is the CUDA build, several GB).
podman runs with the state dir's containers.conf (CONTAINERS_CONF): nothing global is changed.
The last line is JSON: per image its tag, image id, `sha256:` digest, reference by digest and size,
also written to <state dir>/images/images.json (read by `make cluster-drill RUNTIME=podman`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from operators.config import settings

LOCAL_BASE = "localhost/gangflow/base:bookworm"
# what the local base holds: Python 3.11 (bookworm's), `python` on PATH as the official image has
# it, venv, CA certificates, and useradd/groupadd for the Dockerfiles' users
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "passwd")
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
# pip itself and what `pip install .` builds the gangflow package with (pyproject's build-system)
BUILD_TOOLS = ("pip==25.3", "setuptools>=68", "wheel")
WHEELHOUSE = "/wheelhouse"  # where a build sees the wheelhouse
CONTAINERS_CONF = """\
# Written by `make images` (operators/cli/images.py); podman reads it through CONTAINERS_CONF.
# runc and cgroupfs: crun fails on hosts with cgroups in hybrid mode and on raising the limits.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
DEPS_HINT = "run `make podman-deps` (as root it installs Debian's podman buildah mmdebstrap runc)"


class ImagesError(RuntimeError):
    """An image could not be built; the message says what is missing."""


@dataclass(frozen=True)
class ImageSpec:
    """One image of docker/: its Dockerfile, the build argument naming its base, where it is tagged."""

    name: str
    dockerfile: str
    base_arg: str
    repository: str

    @property
    def ignorefile(self) -> str:
        return self.dockerfile + ".dockerignore"


IMAGES = {
    "training": ImageSpec("training", "docker/training.Dockerfile", "PYTHON_IMAGE", "localhost/gangflow/training"),
    "airflow": ImageSpec("airflow", "docker/airflow.Dockerfile", "AIRFLOW_IMAGE", "localhost/gangflow/airflow"),
}
AIRFLOW_BASE = ImageSpec("airflow-base", "docker/airflow-base.Dockerfile", "PYTHON_IMAGE", "localhost/gangflow/airflow-base")


def images_dir() -> Path:
    return settings.state_dir() / "images"


def record_path() -> Path:
    return images_dir() / "images.json"


def podman_env() -> dict[str, str]:
    """This process's environment plus CONTAINERS_CONF naming the state dir's containers.conf."""
    conf = images_dir() / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def require(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise ImagesError(f"{', '.join(missing)} not found: {DEPS_HINT}")


def podman(*args: str, capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    require("podman")
    return subprocess.run(["podman", *args], env=podman_env(), check=check, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)  # fmt: skip


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def inspect(ref: str) -> dict[str, Any]:
    """Id, sha256 digest and size of a local image (`podman image inspect`)."""
    out = podman("image", "inspect", "--format", "{{json .}}", ref, capture=True, check=False)
    if out.returncode != 0:
        raise ImagesError(f"image {ref} is not in podman's storage: run `make images`")
    data = json.loads(out.stdout)
    data = data[0] if isinstance(data, list) else data  # podman 4 prints a list of one
    return {"id": "sha256:" + data["Id"].removeprefix("sha256:"), "digest": data["Digest"], "size_bytes": int(data["Size"])}


def local_base(*, rebuild: bool = False) -> str:
    """The Debian bookworm base, built with mmdebstrap and imported once (kept in podman's storage)."""
    if not rebuild and image_exists(LOCAL_BASE):
        return LOCAL_BASE
    require("mmdebstrap")
    tar = images_dir() / "base.tar"
    started = time.monotonic()
    print(f"images: building the base {LOCAL_BASE} with mmdebstrap (Debian bookworm, minbase + {' '.join(BASE_PACKAGES)})", flush=True)
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES), "bookworm", str(tar)], check=True)
    changes = [arg for env in BASE_ENV for arg in ("--change", f"ENV {env}")]
    podman("import", *changes, "--change", 'CMD ["/bin/bash"]', str(tar), LOCAL_BASE, capture=True)
    tar.unlink()
    print(f"images: base {LOCAL_BASE} built in {time.monotonic() - started:.0f}s", flush=True)
    return LOCAL_BASE


def requirements(name: str, project: Path) -> list[str]:
    """What the image's pip takes from the wheelhouse, as requirement strings (versions:
    constraints.txt): the training image's packages; for the Airflow image torch only (the
    gangflow package needs it: evaluate runs the model), the rest from the index (some of DVC's
    dependencies have no wheel for `pip download --only-binary`)."""
    if name != "training":
        return [*BUILD_TOOLS, "torch"]
    lines = (project / "docker" / "training-requirements.txt").read_text().splitlines()
    return [*BUILD_TOOLS, *[line.strip() for line in lines if line.strip() and not line.startswith("#")]]


def wheelhouse(name: str, project: Path) -> Path:
    """`pip download` of the image's requirements with this machine's pip and its configuration
    (its indexes and find-links: the CPU torch here), so the build installs what the host resolves."""
    folder = images_dir() / "wheelhouse" / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(folder),
                    "-c", str(project / "constraints.txt"), *requirements(name, project)], check=True)  # fmt: skip
    print(f"images: wheelhouse {folder} ({len(list(folder.glob('*.whl')))} wheels, {time.monotonic() - started:.0f}s)", flush=True)
    return folder


def ca_bundle() -> Path | None:
    """The CA bundle this machine's pip trusts (PIP_CERT, else OpenSSL's default file)."""
    for candidate in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def git_commit(project: Path) -> tuple[str, str]:
    """(commit, "true"/"false" dirty) of the checkout, as the Airflow image records them."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown", "unknown"
    return commit, "true" if dirty else "false"


def build_argv(spec: ImageSpec, *, base: str, tags: list[str], wheels: Path | None, ca: Path | None,
               build_args: dict[str, str], iidfile: Path, project: Path) -> list[str]:  # fmt: skip
    """The `podman build` arguments for one image (user values as separate arguments, no shell)."""
    argv = ["build", "--file", str(project / spec.dockerfile), "--ignorefile", str(project / spec.ignorefile),
            "--layers", "--pull=never", "--iidfile", str(iidfile), "--build-arg", f"{spec.base_arg}={base}"]  # fmt: skip
    if wheels is not None:
        argv += ["--volume", f"{wheels}:{WHEELHOUSE}:ro", "--build-arg", f"WHEELHOUSE={WHEELHOUSE}"]
    if ca is not None:
        argv += ["--secret", f"id=ca,src={ca}"]
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    for tag in tags:
        argv += ["--tag", tag]
    return [*argv, str(project)]


def build(spec: ImageSpec, *, base: str, project: Path, ca: Path | None, use_wheelhouse: bool = True,
          build_args: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    commit, _ = git_commit(project)
    tags = [f"{spec.repository}:{commit[:12] if commit != 'unknown' else 'dev'}", f"{spec.repository}:local"]
    wheels = wheelhouse(spec.name, project) if use_wheelhouse else None
    iidfile = images_dir() / f"{spec.name}.iid"
    started = time.monotonic()
    print(f"images: building {tags[0]} from {spec.dockerfile} ({spec.base_arg}={base})", flush=True)
    argv = build_argv(spec, base=base, tags=tags, wheels=wheels, ca=ca, build_args=build_args or {}, iidfile=iidfile, project=project)
    if podman(*argv, check=False).returncode != 0:
        raise ImagesError(f"podman build of {spec.dockerfile} failed (its output is above)")
    seconds = time.monotonic() - started
    info = inspect(iidfile.read_text().strip())
    record = {"tag": tags[0], **info, "reference": f"{spec.repository}@{info['digest']}", "base": base, "build_seconds": round(seconds, 1)}
    print(f"images: {spec.name} {record['reference']} ({info['size_bytes'] / 1e6:.0f} MB, {seconds:.0f}s)", flush=True)
    return record


def read_record() -> dict[str, Any]:
    """What the last `make images` built ({} when it never ran)."""
    try:
        return json.loads(record_path().read_text())
    except (FileNotFoundError, ValueError):
        return {}


def build_images(names: list[str], *, python_image: str | None = None, airflow_image: str | None = None,
                 rebuild_base: bool = False, project: Path | None = None) -> dict[str, Any]:  # fmt: skip
    project = Path(project or settings.PROJECT_ROOT)
    require("podman")
    ca = ca_bundle()
    base = python_image or local_base(rebuild=rebuild_base)
    commit, dirty = git_commit(project)
    built = read_record()
    for name in names:
        spec = IMAGES[name]
        if name == "training":
            built[name] = build(spec, base=base, project=project, ca=ca)
        else:
            af_base = airflow_image
            if af_base is None:
                built["airflow-base"] = build(AIRFLOW_BASE, base=base, project=project, ca=ca, use_wheelhouse=False)
                af_base = built["airflow-base"]["id"]
            built[name] = build(spec, base=af_base, project=project, ca=ca,
                                build_args={"GANGFLOW_GIT_COMMIT": commit, "GANGFLOW_GIT_DIRTY": dirty})  # fmt: skip
    record_path().parent.mkdir(parents=True, exist_ok=True)
    record_path().write_text(json.dumps(built, indent=1))
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", action="append", choices=sorted(IMAGES), help="build only this image (repeatable; default: both)")
    parser.add_argument("--python-image", help="the training image's base (PYTHON_IMAGE), e.g. an official python:3.11-slim-bookworm@sha256:...; "
                        f"default: {LOCAL_BASE}, built here with mmdebstrap")
    parser.add_argument("--airflow-image", help="the Airflow image's base (AIRFLOW_IMAGE), e.g. apache/airflow:3.3.2-python3.11@sha256:...; "
                        "default: localhost/gangflow/airflow-base, built here from docker/airflow-base.Dockerfile")
    parser.add_argument("--rebuild-base", action="store_true", help=f"rebuild {LOCAL_BASE} even if podman has it")
    args = parser.parse_args(argv)
    names = args.image or list(IMAGES)
    try:
        built = build_images(names, python_image=args.python_image, airflow_image=args.airflow_image, rebuild_base=args.rebuild_base)
    except (ImagesError, subprocess.CalledProcessError) as exc:
        print(json.dumps({"state": "failed", "reason": str(exc)}), flush=True)
        return 1
    print(json.dumps({"state": "success", "images": {k: v for k, v in built.items() if k in names}, "record": str(record_path())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
