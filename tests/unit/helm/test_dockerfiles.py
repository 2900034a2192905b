"""The two Dockerfiles cannot be built here (no Docker engine); these checks keep them consistent
with constraints.txt, pyproject.toml, the chart and the hardening rules."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current = f"{current} {line[:-1].strip()}" if line.endswith("\\") else f"{current} {line}"
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def stages(steps):
    out, stage = [], None
    for instruction, args in steps:
        if instruction == "FROM":
            stage = []
            out.append(stage)
        if stage is not None:
            stage.append((instruction, args))
    return out


@pytest.fixture(scope="module")
def docker_dir(project_root):
    return project_root / "docker"


@pytest.fixture(scope="module")
def constraints(project_root):
    pins = {}
    for line in (project_root / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


@pytest.fixture(scope="module")
def pyproject(project_root):
    return tomllib.loads((project_root / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def training(docker_dir):
    return instructions(docker_dir / "training.Dockerfile")


@pytest.fixture(scope="module")
def airflow(docker_dir):
    return instructions(docker_dir / "airflow.Dockerfile")


def arg_default(steps, name):
    (value,) = [a.split("=", 1)[1] for i, a in steps if i == "ARG" and a.startswith(name + "=")]
    return value


@pytest.mark.parametrize("name", ["training.Dockerfile", "airflow.Dockerfile"])
def test_base_images_are_pinned_by_digest_and_never_latest(docker_dir, name):
    text = (docker_dir / name).read_text()
    assert ":latest" not in text
    steps = instructions(docker_dir / name)
    for _, image in [s for s in steps if s[0] == "ARG" and "_IMAGE=" in s[1]]:
        assert re.search(r"@sha256:[0-9a-f]{64}$", image), image
    earlier_stages = set()
    for _, args in [s for s in steps if s[0] == "FROM"]:
        base = args.split()[0]
        assert base.startswith("${") or base in earlier_stages, f"FROM {args}: use the digest-pinned ARG or an earlier stage"
        earlier_stages.add(args.split()[-1])


def test_python_version_matches_pyproject_and_constraints(training, airflow, pyproject, project_root):
    requires = pyproject["project"]["requires-python"]
    assert ">=3.11" in requires and "<3.13" in requires
    assert "Python 3.11" in (project_root / "constraints.txt").read_text().splitlines()[1]
    assert arg_default(training, "PYTHON_IMAGE").startswith("python:3.11-")
    assert arg_default(airflow, "AIRFLOW_IMAGE").startswith("apache/airflow:3.3.2-python3.11@")


def test_training_image_is_multi_stage_with_a_venv_and_no_build_tools_at_runtime(training):
    platform, project, venv, runtime = stages(training)
    assert [stage[0][1].split()[-1] for stage in (platform, project, venv, runtime)] == ["platform", "project", "venv", "runtime"]
    platform_runs = " ".join(a for i, a in platform if i == "RUN")
    assert "python -m venv /opt/venv" in platform_runs
    assert "-c constraints.txt" in platform_runs and "-r training-requirements.txt" in platform_runs
    # the package apart from the venv, both from the platform stage: a code change leaves the venv's layer cached
    assert project[0][1] == "platform AS project" and venv[0][1] == "platform AS venv"
    project_runs = " ".join(a for i, a in project if i == "RUN")
    assert "pip install --no-deps --no-build-isolation --target /opt/gangflow ." in project_runs  # offline: setuptools is in the venv (torch needs it)
    assert "pip uninstall -y setuptools wheel pip" in " ".join(a for i, a in venv if i == "RUN")
    runtime_runs = " ".join(a for i, a in runtime if i == "RUN")
    assert not re.search(r"apt-get|apk |gcc|build-essential|pip install", runtime_runs)
    copies = [a for i, a in runtime if i == "COPY"]
    assert copies.index("--from=venv /opt/venv /opt/venv") < copies.index("--from=project /opt/gangflow/ /opt/venv/lib/python3.11/site-packages/")
    assert ("WORKDIR", "/app") in runtime
    assert ("COPY", "params.yaml /app/params.yaml") in runtime
    assert ("ENTRYPOINT", '["torchrun"]') in runtime


def test_training_image_runs_as_the_uid_the_chart_expects(training, chart):
    *_, runtime = stages(training)
    users = [a for i, a in runtime if i == "USER"]
    assert users == ["10001:10001"]
    assert "--uid 10001" in " ".join(a for i, a in runtime if i == "RUN")
    values = chart.values["training"]
    assert (values["runAsUser"], values["runAsGroup"], values["fsGroup"]) == (10001, 10001, 10001)


def test_training_requirements_are_all_pinned_in_constraints(docker_dir, constraints):
    names = [line.strip() for line in (docker_dir / "training-requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "torch" in names
    for name in names:
        assert re.sub(r"[-_.]+", "-", name).lower() in constraints, f"{name} is not pinned in constraints.txt"
    assert constraints["torch"] == "2.13.0"


def test_airflow_image_installs_the_package_with_constraints_and_copies_dags(airflow, pyproject, constraints):
    runs = " ".join(a for i, a in airflow if i == "RUN")
    assert "-c /opt/gangflow/constraints.txt" in runs
    assert f'"apache-airflow=={constraints["apache-airflow"]}"' in runs
    # dependencies (the package's and its Kubernetes extra's, from pyproject.toml) in a layer before
    # the source, the package itself after it: a code change does not reinstall every dependency
    assert '["optional-dependencies"]["kubernetes"]' in runs and "kubernetes" in pyproject["project"]["optional-dependencies"]
    steps = [(i, a) for i, a in airflow if i in ("RUN", "COPY")]
    deps = next(n for n, (i, a) in enumerate(steps) if i == "RUN" and "-r /tmp/gangflow-requirements.txt" in a)
    source = next(n for n, (i, a) in enumerate(steps) if i == "COPY" and "operators/" in a)
    package = next(n for n, (i, a) in enumerate(steps) if i == "RUN" and "--no-deps /opt/gangflow" in a)
    assert deps < source < package
    assert not any("operators" in a or "trainer" in a or "README" in a for i, a in steps[:deps] if i == "COPY")
    assert constraints["apache-airflow"] == "3.3.2"
    copies = [a for i, a in airflow if i == "COPY"]
    assert "--chown=airflow:0 dags/ /opt/airflow/dags/" in copies
    assert any("constraints.txt" in c for c in copies)
    users = [a for i, a in airflow if i == "USER"]
    assert users and users[-1] == "airflow"


def test_project_layer_copies_what_pyproject_packages(training, airflow, pyproject):
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert packages == ["operators*", "trainer*"]
    for steps in (training, airflow):
        copied = " ".join(a for i, a in steps if i == "COPY")
        for package in ("operators/", "trainer/"):
            assert package in copied
        assert "pyproject.toml" in copied and "README.md" in copied


@pytest.mark.parametrize("dockerfile", ["training.Dockerfile", "airflow.Dockerfile"])
def test_dockerignore_lets_every_copied_path_in(docker_dir, project_root, dockerfile):
    ignore = (docker_dir / f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert "*" in ignore  # allow-list
    for instruction, args in instructions(docker_dir / dockerfile):
        if instruction != "COPY" or "--from=" in args:
            continue
        sources = [a for a in args.split()[:-1] if not a.startswith("--")]
        for source in sources:
            source = source.rstrip("/")
            assert source in allowed, f"{dockerfile}: COPY {source} is excluded by its .dockerignore"
            assert (project_root / source).exists(), f"{dockerfile}: COPY {source} does not exist"
