"""`make images` and `make cluster-drill RUNTIME=podman` (slow): the images are built once per session
with podman (`python -m operators.cli.images`; podman's layer cache makes a second session fast),
listed layer by layer, and the cluster drill runs every rendered pod as a container of the
training image. Without podman the tests skip, saying so (`make test` installs it: podman-deps).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from pipeline_runs import PROJECT_ROOT, pipeline_env, setup_state
from pipeline_runs import finish as finish_run

pytestmark = pytest.mark.slow

CONF = {"max_steps": 60, "checkpoint_every_steps": 10}
COMPILERS = ("gcc", "cc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-gcc-12", "ld")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def podman_env(home: Path) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(home / "images" / "containers.conf")}


@pytest.fixture(scope="session")
def images_home(tmp_path_factory) -> Path:
    """A state dir for the image tests (the images themselves live in podman's storage)."""
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("podman or mmdebstrap is not installed: the image tests need them; run `make podman-deps` (root: apt-get install podman buildah mmdebstrap runc)")
    home = tmp_path_factory.mktemp("gangflow-images-home")
    setup_state(home)
    return home


@pytest.fixture(scope="session")
def built(images_home) -> dict:
    """`python -m operators.cli.images` (both images), its record and how long it took."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "operators.cli.images"], cwd=PROJECT_ROOT, env=pipeline_env(images_home),
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"make images: {time.monotonic() - started:.0f}s", file=sys.stderr)
    return summary


def podman(home: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], env=podman_env(home), capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"podman {' '.join(args[:3])} ... exit {done.returncode}: {(done.stdout + done.stderr)[-4000:]}"
    return done


def run_in(home: Path, image: str, code: str, *, user: str = "10001:10001") -> str:
    """Python `code` in a container of `image` as the pods run it (non-root, read-only root)."""
    done = podman(home, "run", "--rm", "--pull=never", "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp",
                  "--user", user, "--network=none", "--entrypoint", "python", image, "-c", code, timeout=120)  # fmt: skip
    return done.stdout


def test_images_are_tagged_and_identified_by_digest(built, images_home):
    images = built["images"]
    assert set(images) == {"training", "airflow"}
    record = json.loads((images_home / "images" / "images.json").read_text())
    for name, image in images.items():
        assert image["digest"].startswith("sha256:") and len(image["digest"]) == 71
        assert image["reference"] == f"localhost/gangflow/{name}@{image['digest']}"
        assert record[name]["digest"] == image["digest"]
        inspected = podman(images_home, "image", "inspect", "--format", "{{.Digest}}", image["tag"]).stdout.strip()
        assert inspected == image["digest"]
    assert images["training"]["size_bytes"] < 2.5e9  # the CPU torch, not the CUDA one (about 6 GB)


def _save_layers(home: Path, ref: str, folder: Path) -> list[dict]:
    """Each layer of `ref`, the base's first (podman save: a docker-archive whose layers are tar
    files): its size, its files, and those of them that are a copy of the host's CA bundle."""
    archive = folder / "image.tar"
    podman(home, "save", "--format", "docker-archive", "--output", str(archive), ref, timeout=600)
    ca_size = HOST_CA.stat().st_size if HOST_CA.exists() else -1
    ca_sha = hashlib.sha256(HOST_CA.read_bytes()).hexdigest() if HOST_CA.exists() else ""
    layers = []
    with tarfile.open(archive) as outer:
        (manifest,) = json.load(outer.extractfile("manifest.json"))
        for layer in (outer.getmember(name) for name in manifest["Layers"]):  # the base's first
            files, ca_copies = [], []
            with tarfile.open(fileobj=outer.extractfile(layer)) as inner:
                for member in inner:
                    if member.isdir():  # an empty mount point (/run/secrets, /wheelhouse) holds nothing
                        continue
                    files.append(member.name.lstrip("./"))
                    if member.isfile() and member.size == ca_size and hashlib.sha256(inner.extractfile(member).read()).hexdigest() == ca_sha:
                        ca_copies.append(files[-1])
            layers.append({"name": layer.name, "size": layer.size, "files": files, "ca_copies": ca_copies})
    archive.unlink()
    assert layers, "podman save wrote no layers"
    return layers


@pytest.fixture(scope="session")
def image_layers(built, images_home, tmp_path_factory):
    """`_save_layers` of the image named, saved once a session."""
    saved: dict[str, list[dict]] = {}

    def layers(name: str) -> list[dict]:
        if name not in saved:
            saved[name] = _save_layers(images_home, built["images"][name]["reference"], tmp_path_factory.mktemp(f"layers-{name}"))
        return saved[name]

    return layers


@pytest.mark.parametrize("name", ["training", "airflow"])
def test_no_layer_holds_a_secret_the_ca_bundle_or_a_pip_config(image_layers, name):
    findings = []
    for layer in image_layers(name):
        findings += [f"{layer['name']}: {f}" for f in layer["files"]
                     if f.startswith("run/secrets") or f.endswith(("pip.conf", "pip/pip.ini")) or "/wheelhouse/" in "/" + f]
        findings += [f"{layer['name']}: {f} is the host's CA bundle" for f in layer["ca_copies"]]
    assert findings == []


def test_a_code_change_rebuilds_only_a_small_layer_of_the_training_image(image_layers):
    """The gangflow package is a layer of its own above the platform's venv (torch and the other
    wheels), so a commit pushes and pulls about 12 MB (the package with its CRD schemas and failure
    corpus), not the venv's 1.5 GB."""
    layers = image_layers("training")

    def holding(suffix: str) -> list[dict]:
        return [layer for layer in layers if any(f.endswith(suffix) for f in layer["files"])]

    (package,) = holding("site-packages/trainer/__init__.py")
    (torch,) = holding("site-packages/torch/__init__.py")
    assert package["name"] != torch["name"] and package["size"] < 20e6, f"gangflow's layer: {package['size']} bytes, torch's {torch['size']}"
    assert layers.index(package) > layers.index(torch)  # above it: the venv's layer stays cached across commits


def test_training_image_has_no_compiler_no_airflow_its_frameworks_and_the_files_the_pods_name(built, images_home):
    from operators.config.pipelines import pipeline_files

    expected = {"/app/params.yaml"}
    for config in pipeline_files().configs.values():
        if config.trainer_config_in_project:
            expected.add("/app/" + config.trainer_config_in_project)
        expected |= {"/app/" + root for root in config.training_kwargs().get("package_roots", ())}
    code = (
        "import importlib.util, json, os, shutil, sys\n"
        f"print(json.dumps({{'compilers': [c for c in {list(COMPILERS)!r} if shutil.which(c)],"
        " 'airflow': importlib.util.find_spec('airflow') is not None,"
        " 'torch': __import__('torch').__version__, 'uid': os.getuid(),"
        " 'frameworks': [m for m in ('transformers', 'accelerate', 'lightning', 's3fs') if importlib.util.find_spec(m) is None],"
        f" 'missing': [p for p in {sorted(expected)!r} if not os.path.exists(p)],"
        " 'writable_root': os.access('/app', os.W_OK)}))"
    )
    found = json.loads(run_in(images_home, built["images"]["training"]["reference"], code).strip().splitlines()[-1])
    assert found == {"compilers": [], "airflow": False, "torch": "2.13.0+cpu", "uid": 10001, "frameworks": [], "missing": [],
                     "writable_root": False}  # fmt: skip


def test_airflow_image_parses_every_dag_with_its_own_packages_and_files(built, images_home):
    """The DAG processor's view: every DAG file imports inside the Airflow image (the gangflow
    package, its Kubernetes extra, the pipeline files under GANGFLOW_PROJECT), as the image's user."""
    from operators.config.pipelines import pipeline_files

    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        "bag = DagBag(dag_folder='/opt/airflow/dags')\n"
        "import kubernetes_asyncio, os\n"
        "print(json.dumps({'errors': {k: v[-300:] for k, v in bag.import_errors.items()}, 'dags': sorted(bag.dags), 'uid': os.getuid()}))"
    )
    done = podman(images_home, "run", "--rm", "--pull=never", "--network=none", "--tmpfs", "/tmp", "--env", "AIRFLOW__CORE__LOAD_EXAMPLES=False",
                  "--entrypoint", "python", built["images"]["airflow"]["reference"], "-c", code, timeout=300)  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {} and found["uid"] == 50000
    expected = {c.dag_id for c in pipeline_files().configs.values()}
    assert expected <= set(found["dags"]), found["dags"]


# --- the cluster drill with podman -------------------------------------------------------------


def start_drill(home: Path, keep: Path, log: Path, **env: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "operators.cli.drill", "--runtime", "podman", "--keep", str(keep), "--conf", json.dumps(CONF)]
    return subprocess.Popen(argv, cwd=PROJECT_ROOT, env=pipeline_env(home, **env), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def drill(home: Path, tmp_path_factory, label: str, **env: str) -> dict:
    keep = tmp_path_factory.mktemp(f"podman-drill-{label}")
    log = keep.parent / f"podman-drill-{label}.log"
    started = time.monotonic()
    summary, output, code = finish_run(start_drill(home, keep, log, **env), log, 1200)
    print(f"podman drill {label}: {time.monotonic() - started:.0f}s", file=sys.stderr)
    report = json.loads((keep / "report.json").read_text()) if (keep / "report.json").exists() else {}
    return {"code": code, "summary": summary, "output": output, "report": report, "keep": keep}


@pytest.fixture(scope="module")
def podman_fault(built, images_home, tmp_path_factory) -> dict:
    return drill(images_home, tmp_path_factory, "fault", GANGFLOW_FAULT="kill@step=30,rank=1", GANGFLOW_RETRY_BASE_DELAY="1")


def _containers_left(home: Path, drill_id_prefix: str = "drill-") -> list[str]:
    return podman(home, "ps", "--all", "--format", "{{.Names}}", "--filter", f"name=^{drill_id_prefix}").stdout.split()


def test_podman_drill_runs_every_pod_in_the_training_image_and_a_killed_rank_resumes(podman_fault, built, images_home):
    """One drill with a rank killed at step 30: both tries' pods ran as containers of the image just
    built (by digest, read-only, non-root), the retry resumed from the committed checkpoint."""
    summary, report = podman_fault["summary"], podman_fault["report"]
    assert podman_fault["code"] == 0, podman_fault["output"][-8000:]
    assert summary["state"] == "success" and summary["runtime"] == "podman" and summary["train_attempts"] == 2
    assert summary["resumed_from_step"] == 30
    digest = built["images"]["training"]["digest"]
    assert summary["image_digest"] == digest
    # the DAG's own tasks ran in the Airflow image just built, as its user, with their own state dir
    assert summary["worker_image_digest"] == built["images"]["airflow"]["digest"]
    worker_lines = [line for line in podman_fault["output"].splitlines() if line.startswith("airflow-worker| ")]
    for task_id in ("validate_dataset", "evaluate", "promote"):
        assert any(f"task_id={task_id}" in line and "end task" in line for line in worker_lines), task_id
    worker_state = podman_fault["keep"] / "airflow-worker"
    assert (worker_state / "airflow" / "airflow.db").stat().st_uid == 50000
    assert any((worker_state / "reports").iterdir())  # validate's data docs
    assert summary["promoted"] is True and summary["model_version"] == "1"
    assert report["runtime"]["image"] == f"localhost/gangflow/training@{digest}"  # what the pods were rendered with
    assert "is not pinned by digest" not in podman_fault["output"]
    pods = report["pods"]
    assert len(pods) == 4
    for pod in pods:
        argv = pod["argv"]
        assert argv[0] == "run" and f"localhost/gangflow/training@{digest}" in argv
        assert "--read-only" in argv and ["--user", "10001:10001"] == argv[argv.index("--user") : argv.index("--user") + 2]
        # the S3 Secret's values went to the container by name only
        assert not any(pod["env"]["AWS_SECRET_ACCESS_KEY"] in a for a in argv)
    assert any(p["exit_code"] not in (0, None) for p in pods if "-t1-" in p["pod"])
    assert all(p["exit_code"] == 0 for p in pods if "-t2-" in p["pod"])
    assert _containers_left(images_home) == []
