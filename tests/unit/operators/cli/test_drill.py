"""Units of `make cluster-drill` (operators/cli/drill): Kubernetes `$(VAR)` expansion, env
resolution from Secrets/ConfigMaps/the downward API, the drill's rewrites, the image read from
the Dockerfile, and the path audit hook."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from operators.cli.drill import audit_hook
from operators.cli.drill.image import build_image, parse_runtime_stage
from operators.cli.drill.pods import ContainerConfigError, Rewrites, expand, expand_argv, field_ref, process_env, resolve_env


# --- $(VAR) expansion: the cases of Kubernetes' expansion_test.go ------------------------------------

ENV = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": "", "JOB_COMPLETION_INDEX": "1"}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$(VAR_A)", "A"),
        ("___$(VAR_B)___", "___B___"),
        ("$(VAR_A)-$(VAR_A)", "A-A"),
        ("$(VAR_A)-1", "A-1"),
        ("$(VAR_A)_$(VAR_B)_$(VAR_C)", "A_B_C"),
        ("$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),  # escaped operator
        ("$$(VAR_A)_$$(VAR_B)", "$(VAR_A)_$(VAR_B)"),
        ("f000-$$VAR_A", "f000-$VAR_A"),
        ("foo\\$(VAR_C)bar", "foo\\Cbar"),
        ("foo\\\\$(VAR_C)bar", "foo\\\\Cbar"),
        ("$(VAR_REF)", "$(VAR_A)"),  # values are not expanded twice
        ("$(VAR_EMPTY)", ""),
        ("$(UNKNOWN)", "$(UNKNOWN)"),  # undefined: kept as written
        ("$(VAR_A", "$(VAR_A"),  # incomplete reference
        ("$VAR_A", "$VAR_A"),  # not Kubernetes syntax
        ("$", "$"),
        ("$$", "$"),
        ("$()", "$()"),  # the empty name is looked up like any other: undefined here
        ("--node-rank=$(JOB_COMPLETION_INDEX)", "--node-rank=1"),
    ],
)
def test_expand_matches_kubernetes(text, expected):
    assert expand(text, ENV) == expected


# --- env resolution ---------------------------------------------------------------------------------


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def store(objects):
    def lookup(kind, namespace, name):
        return objects.get((kind, namespace, name))

    return lookup


POD = {
    "metadata": {"name": "g-t1-rank-0-1-abcde", "namespace": "ml", "uid": "u-1", "annotations": {"batch.kubernetes.io/job-completion-index": "1"}, "labels": {"gangflow.io/gang": "g"}},
    "spec": {"nodeName": "node-7", "serviceAccountName": "trainer"},
    "status": {"podIP": "10.0.0.7"},
}
SECRETS = {
    ("Secret", "ml", "s3"): {"data": {"AWS_ACCESS_KEY_ID": b64("AKIA-drill"), "AWS_SECRET_ACCESS_KEY": b64("s3cr3t"), "bad key": b64("x")}},
    ("Secret", "ml", "mlflow"): {"data": {"token": b64("tok-123")}},
    ("ConfigMap", "ml", "cm"): {"data": {"LEVEL": "debug"}},
}


def test_env_resolves_secrets_configmaps_fields_in_order_with_expansion():
    container = {
        "envFrom": [{"secretRef": {"name": "s3"}}, {"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "RANK_DIR", "value": "/tmp/rank-$(INDEX)-$(LATER)"},  # LATER is defined after: kept
            {"name": "LATER", "value": "x"},
            {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "AWS_ACCESS_KEY_ID", "value": "overridden-by-env"},  # env wins over envFrom
            {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
        ],
    }
    env = resolve_env(container, POD, store(SECRETS))
    assert env["INDEX"] == "1"
    assert env["RANK_DIR"] == "/tmp/rank-1-$(LATER)"
    assert env["MLFLOW_TRACKING_TOKEN"] == "tok-123"
    assert env["AWS_SECRET_ACCESS_KEY"] == "s3cr3t" and env["AWS_ACCESS_KEY_ID"] == "overridden-by-env"
    assert env["CM_LEVEL"] == "debug" and "bad key" not in env
    assert env["POD"] == "g-t1-rank-0-1-abcde" and env["NODE"] == "node-7"
    assert "GONE" not in env


@pytest.mark.parametrize(
    "container, message",
    [
        ({"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "token"}}}]}, 'secret "nope" not found'),
        ({"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "nokey"}}}]}, "couldn't find key nokey in Secret ml/mlflow"),
        ({"envFrom": [{"secretRef": {"name": "absent"}}]}, 'secret "absent" not found'),
        ({"env": [{"name": "T", "valueFrom": {"fieldRef": {"fieldPath": "status.nonsense"}}}]}, "unsupported fieldRef"),
    ],
)
def test_env_errors_are_create_container_config_errors(container, message):
    with pytest.raises(ContainerConfigError, match=message):
        resolve_env(container, POD, store(SECRETS))


def test_args_expand_against_the_container_env_not_the_image_env():
    container = {
        "command": ["torchrun"],
        "args": ["--node-rank=$(JOB_COMPLETION_INDEX)", "--x=$(PATH)", "--y=$$(JOB_COMPLETION_INDEX)"],
        "env": [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}],
    }
    env = resolve_env(container, POD, store(SECRETS))
    assert expand_argv(container, env) == ["torchrun", "--node-rank=1", "--x=$(PATH)", "--y=$(JOB_COMPLETION_INDEX)"]
    assert process_env({"PATH": "/opt/venv/bin", "HOME": "/root"}, {"HOME": "/tmp"}) == {"PATH": "/opt/venv/bin", "HOME": "/tmp"}


def test_volcano_task_index_expands_like_any_variable():
    container = {"args": ["--node-rank=$(VC_TASK_INDEX)"], "env": [{"name": "VC_TASK_INDEX", "value": "3"}]}
    assert expand_argv(container, resolve_env(container, POD, store({}))) == ["--node-rank=3"]


def test_field_ref_labels_and_pod_ip():
    assert field_ref(POD, "metadata.labels['gangflow.io/gang']") == "g"
    assert field_ref(POD, "status.podIP") == "10.0.0.7"


# --- rewrites -----------------------------------------------------------------------------------------


def test_rewrites_map_only_the_rendezvous_host_and_mounted_paths():
    rw = Rewrites(
        hosts={"g-t1-rank-0-0.g-t1": "127.0.0.1"},
        mounts={"/tmp": "/x/pod/tmp", "/dev/termination-log": "/x/pod/termination-log", "/app": "/x/image/app"},
    )
    argv = [
        "torchrun", "--rdzv-endpoint=g-t1-rank-0-0.g-t1:29500", "--rdzv-id=g-t1", "--config", "/app/params.yaml",
        "--run-dir", "s3://b/checkpoints/g", "--set", "data.remote=s3://b/dvc", "/application", "/tmpfoo",
    ]  # fmt: skip
    assert rw.argv(argv) == [
        "torchrun", "--rdzv-endpoint=127.0.0.1:29500", "--rdzv-id=g-t1", "--config", "/x/image/app/params.yaml",
        "--run-dir", "s3://b/checkpoints/g", "--set", "data.remote=s3://b/dvc", "/application", "/tmpfoo",
    ]  # fmt: skip
    env = rw.env({"HOME": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache", "GANGFLOW_TERMINATION_LOG": "/dev/termination-log", "GANGFLOW_GANG": "g"})
    assert env == {"HOME": "/x/pod/tmp", "XDG_CACHE_HOME": "/x/pod/tmp/.cache", "GANGFLOW_TERMINATION_LOG": "/x/pod/termination-log", "GANGFLOW_GANG": "g"}


# --- the image ----------------------------------------------------------------------------------------


def test_image_env_and_files_come_from_the_training_dockerfile(tmp_path, project_root):
    env, copies, workdir = parse_runtime_stage((project_root / "docker" / "training.Dockerfile").read_text())
    assert workdir == "/app" and copies == {"/app/params.yaml": "params.yaml", "/app/pipelines/trainer/": "pipelines/trainer/",
                                          "/app/examples/": "examples/"}
    assert env["HOME"] == "/tmp" and env["PATH"].startswith("/opt/venv/bin:")
    image = build_image(tmp_path / "image", project_root)
    assert image.mounts["/opt/venv"] == sys.prefix
    copy = tmp_path / "image" / "app" / "params.yaml"
    assert copy.read_bytes() == (project_root / "params.yaml").read_bytes()
    assert not os.access(copy, os.W_OK) or os.geteuid() == 0  # read-only by mode (root ignores modes)
    assert oct(copy.stat().st_mode & 0o777) == "0o444"
    assert image.env["PATH"].split(os.pathsep)[0] == f"{sys.prefix}/bin"
    # `COPY pipelines/trainer/ /app/pipelines/trainer/`: the folder's contents, not a nested folder
    copied = tmp_path / "image" / "app" / "pipelines" / "trainer" / "diabetes.yaml"
    assert copied.read_bytes() == (project_root / "pipelines" / "trainer" / "diabetes.yaml").read_bytes()


def test_stage_parser_handles_continuations_and_other_stages():
    text = """
FROM python AS builder
ENV NOT_THIS=1
FROM python AS runtime
WORKDIR /app
COPY --from=builder /opt/venv /opt/venv
COPY a.yaml b.txt /app/
ENV A=1 \\
    B=/x:$PATH
"""
    env, copies, workdir = parse_runtime_stage(text)
    assert env == {"A": "1", "B": "/x:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"}
    assert copies == {"/app/a.yaml": "a.yaml", "/app/b.txt": "b.txt"} and workdir == "/app"


# --- the audit hook -----------------------------------------------------------------------------------


def test_audit_hook_records_what_a_process_opens_lists_and_runs(tmp_path):
    hook_dir = tmp_path / "audit"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(Path(audit_hook.__file__).read_text())
    secret_dir = tmp_path / "state"
    secret_dir.mkdir()
    (secret_dir / "mlflow.db").write_text("x")
    log = tmp_path / "audit.paths"
    code = (
        "import os, subprocess, sys\n"
        f"open({str(secret_dir / 'mlflow.db')!r}).read()\n"
        f"os.listdir({str(secret_dir)!r})\n"
        "os.chdir('/')\n"
        "open('etc/hostname').close()\n"  # relative: recorded as absolute
        "subprocess.run([sys.executable, '-c', 'open(\"/etc/hosts\").close()'], check=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(hook_dir), audit_hook.ENV: str(log)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    paths = audit_hook.read(log)
    assert str(secret_dir / "mlflow.db") in paths and str(secret_dir) in paths
    assert "/etc/hostname" in paths
    assert "/etc/hosts" in paths  # a child process inherits the hook through PYTHONPATH
    assert str(log) not in paths and len(paths) == len(set(paths))



# --- dag.test() resume kwargs (apache/airflow#69942 backport) ----------------------------------------


def test_dag_test_resume_keeps_defer_kwargs_with_the_event(monkeypatch):
    from types import SimpleNamespace

    from airflow.sdk.definitions import dag as dag_module
    from airflow.sdk.execution_time.supervisor import InProcessTestSupervisor

    from operators.cli.drill.run import backport_dag_test_defer_kwargs

    monkeypatch.setattr(dag_module, "_run_inline_trigger", dag_module._run_inline_trigger)  # restored after the test
    payload = {"status": "success", "name": "g-t1"}
    monkeypatch.setattr(InProcessTestSupervisor, "run_trigger_in_process", classmethod(lambda cls, trigger, ti: SimpleNamespace(payload=payload)))
    applied = backport_dag_test_defer_kwargs()
    if not applied:
        pytest.skip("the installed Airflow's dag.test() keeps defer kwargs itself")

    def run_task_like():  # what dag.test's _run_task does around the call
        msg = SimpleNamespace(next_kwargs={"handle": {"name": "g-t1"}, "spec": {"attempt": 1}})
        event = dag_module._run_inline_trigger(object(), object())
        return {"event": event.payload} if event else msg.next_kwargs

    assert run_task_like() == {"handle": {"name": "g-t1"}, "spec": {"attempt": 1}, "event": payload}


def test_isolation_findings_name_every_state_dir_access(tmp_path):
    from types import SimpleNamespace

    from operators.cli.drill.run import isolation_findings

    state = tmp_path / "state"
    audit = tmp_path / "audit.paths"
    audit.write_text(f"/usr/lib/x.so\n{state}/mlflow.db\n{state}-other/file\n{state}\n")
    clean = SimpleNamespace(name="p0", audit_path=tmp_path / "none.paths", argv=["torchrun", f"--x={state}-other"], env={"HOME": "/tmp"})
    dirty = SimpleNamespace(name="p1", audit_path=audit, argv=["torchrun", "--run-dir", f"{state}/runs/g"], env={"A": "1"})
    findings = isolation_findings([clean, dirty], state)
    assert findings == [f"pod p1 opened {state}/mlflow.db", f"pod p1 opened {state}", f"pod p1 was started with '{state}/runs/g'"]


def test_differences_list_what_was_rewritten():
    from operators.cli.drill.pods import differences

    assert differences(["a", "--h=x:1", "/app/p"], ["a", "--h=127.0.0.1:1", "/i/app/p"]) == [("--h=x:1", "--h=127.0.0.1:1"), ("/app/p", "/i/app/p")]
    assert differences({"HOME": "/tmp", "A": "1"}, {"HOME": "/p/tmp", "A": "1", "EXTRA": "x"}) == [("HOME=/tmp", "HOME=/p/tmp")]


def test_a_killed_drills_ray_temp_folder_is_swept_and_a_live_ones_stays(tmp_path):
    # CI ran on a machine where a killed drill had left /var/tmp/gf-ray-*: the next drill tidies it
    from operators.cli.drill.run import sweep_ray_temp

    pods = tmp_path / "pods"
    (pods / "head").mkdir(parents=True)
    base = tmp_path / "var-tmp"
    dead, live, old_empty, new_empty, foreign = (base / f"gf-ray-{n}" for n in ("dead", "live", "old", "new", "file"))
    for folder in (dead, live, old_empty, new_empty, foreign):
        folder.mkdir(parents=True)
    (dead / "0").symlink_to(tmp_path / "gone", target_is_directory=True)
    (live / "0").symlink_to(pods / "head", target_is_directory=True)
    (live / "1").symlink_to(tmp_path / "gone-too", target_is_directory=True)  # one live link keeps it
    (foreign / "notes.txt").write_text("not a link: not ours to judge")
    os.utime(old_empty, (0, 0))
    (base / "gf-ray-link").symlink_to(live, target_is_directory=True)  # never followed

    assert sorted(p.name for p in sweep_ray_temp(base)) == ["gf-ray-dead", "gf-ray-old"]
    assert sorted(p.name for p in base.iterdir()) == ["gf-ray-file", "gf-ray-link", "gf-ray-live", "gf-ray-new"]
    assert (pods / "head").is_dir() and (live / "0").is_symlink()
