"""A DAG run's identity (run dir, failure record, gang name, MLflow run): collision-free, stable
across retries, distinct across deployments (issue 12 item 2)."""

from __future__ import annotations

import pytest

from operators import callbacks

from operators.config import settings

from operators.hooks import mlflow as tracking
from operators.training import gang_name

LOOKALIKES = ["retrain:v2", "retrain+v2", "retrain~v2", "retrain_v2", "retrain v2", "retrain/v2", "retrain\\v2"]


@pytest.fixture(autouse=True)
def deployment(monkeypatch, tmp_path):
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("GANGFLOW_DEPLOYMENT", "team-a")
    return tmp_path


def test_run_ids_that_sanitise_alike_get_distinct_run_dirs_and_gangs():
    dirs = {settings.run_dir("train_pipeline", r) for r in LOOKALIKES}
    assert len(dirs) == len(LOOKALIKES), sorted(map(str, dirs))
    assert len({gang_name("train_pipeline", r) for r in LOOKALIKES}) == len(LOOKALIKES)
    assert len({callbacks.failure_record_path("train_pipeline", r) for r in LOOKALIKES}) == len(LOOKALIKES)
    for run_id in LOOKALIKES:  # each one a direct child of the DAG's folder, readable
        path = settings.run_dir("train_pipeline", run_id)
        assert path.parent == settings.runs_dir() / "train_pipeline"
        assert path.name.startswith("retrain")


@pytest.mark.parametrize("run_id", [".", "..", "...", "/", "../../etc", "-", "_"])
def test_dot_and_separator_run_ids_stay_inside_the_dag_folder(run_id):
    dag_folder = settings.runs_dir() / "train_pipeline"
    path = settings.run_dir("train_pipeline", run_id)
    assert path.parent == dag_folder and path.name not in ("", ".", "..")
    assert path.resolve().parent == dag_folder.resolve()  # not the DAG folder itself, not a sibling
    failure = callbacks.failure_record_path("train_pipeline", run_id)
    assert failure.resolve().parent == (settings.state_dir() / "failures" / "train_pipeline").resolve()


@pytest.mark.parametrize("dag_id", ["", ".", "..", "a/b"])
def test_a_dag_id_that_cannot_be_a_folder_is_refused(dag_id):
    with pytest.raises(ValueError, match="dag_id"):
        settings.run_dir(dag_id, "manual__1")


@pytest.mark.parametrize("dag_id", ["", ".", "..", "...", "a/b", "train\n", None])
def test_one_rule_says_which_dag_ids_can_name_a_folder(dag_id):
    """The run dir, the failure record and the retry ledger all put the DAG id in a path."""
    with pytest.raises(ValueError, match="dag_id"):
        settings.dag_id_folder(dag_id)
    with pytest.raises(ValueError, match="dag_id"):
        callbacks.failure_record_path(dag_id, "manual__1")


@pytest.mark.parametrize("dag_id", ["train_pipeline", "a.b", ".hidden", "x..", "-", "_"])
def test_a_dag_id_with_other_characters_than_dots_names_a_folder(dag_id):
    assert settings.dag_id_folder(dag_id) == dag_id
    assert settings.run_dir(dag_id, "manual__1").parent == settings.runs_dir() / dag_id


def test_empty_run_id_is_refused():
    with pytest.raises(ValueError, match="run_id"):
        settings.run_key("train_pipeline", "")


def test_identity_is_stable_and_readable():
    run_id = "manual__2026-11-30T10:00:00+00:00"
    key = settings.run_key("train_pipeline", run_id)
    assert key == settings.run_key("train_pipeline", run_id)  # every try of the run finds it
    assert key.startswith("manual__2026-11-30T10_00_00_00_00-") and len(key.rsplit("-", 1)[1]) == 16
    name = gang_name("train_pipeline", run_id)
    assert name == gang_name("train_pipeline", run_id) and name.startswith("train-pipeline-") and len(name) <= 63
    assert settings.run_key("other_dag", run_id) != key  # the DAG is part of the identity


def test_two_deployments_never_share_a_run_dir_gang_or_identity(monkeypatch):
    run_id = "scheduled__2026-11-30T00:00:00+00:00"  # the same scheduled run in two installs
    a = (settings.run_dir("train_pipeline", run_id), gang_name("train_pipeline", run_id), settings.run_identity("train_pipeline", run_id))
    monkeypatch.setenv("GANGFLOW_DEPLOYMENT", "team-b")
    b = (settings.run_dir("train_pipeline", run_id), gang_name("train_pipeline", run_id), settings.run_identity("train_pipeline", run_id))
    assert all(x != y for x, y in zip(a, b)), (a, b)


def test_default_deployment_is_the_metadata_db_location_without_credentials(monkeypatch):
    monkeypatch.delenv("GANGFLOW_DEPLOYMENT")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://airflow:s3cret@db.team-a:5432/airflow?sslmode=require")
    first = settings.deployment_id()
    assert first == "postgresql://db.team-a:5432/airflow" and "s3cret" not in first
    key = settings.run_key("train_pipeline", "manual__1")
    # A rotated password is the same deployment: the runs in flight keep their identity.
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://airflow:rotated@db.team-a:5432/airflow")
    assert settings.run_key("train_pipeline", "manual__1") == key
    # Another Airflow in the same namespace has its own metadata database.
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://airflow:s3cret@db.team-a:5432/airflow_b")
    assert settings.run_key("train_pipeline", "manual__1") != key


def test_mlflow_run_is_keyed_on_the_identity(home, client, monkeypatch):
    """Two deployments sharing an MLflow server: neither adopts the other's run for the same
    DAG run id; a retry within one deployment reuses its own."""
    monkeypatch.setenv("GANGFLOW_HOME", str(home))
    exp = tracking.ensure_experiment(client, "gangflow-identity")
    run_id = "scheduled__2026-11-30T00:00:00+00:00"
    first = tracking.ensure_run(client, exp, dag_id="train_pipeline", dag_run_id=run_id)
    assert tracking.ensure_run(client, exp, dag_id="train_pipeline", dag_run_id=run_id) == first
    monkeypatch.setenv("GANGFLOW_DEPLOYMENT", "team-b")
    other = tracking.ensure_run(client, exp, dag_id="train_pipeline", dag_run_id=run_id)
    assert other != first
    tags = client.get_run(other).data.tags
    assert tags["gangflow.dag_run_id"] == run_id and tags["gangflow.run_identity"] == settings.run_identity("train_pipeline", run_id)
    # Look-alike run ids are distinct runs too.
    assert tracking.ensure_run(client, exp, dag_id="train_pipeline", dag_run_id="retrain+v2") != tracking.ensure_run(
        client, exp, dag_id="train_pipeline", dag_run_id="retrain:v2"
    )


def test_gang_names_and_object_names_carry_64_bits_of_the_run_identity():
    """Issue 28.5: the Kubernetes backend used run_identity[:10] (40 bits) for gang names and
    in-cluster run dirs, and shortened object names kept 20 bits; 5000 runs of one long-named DAG
    must give 5000 distinct names at every level, each within Kubernetes' 63 characters."""
    from operators.kubernetes.builders import gang_object_name

    dag = "a_very_long_dag_identifier_for_the_vision_team_nightly_training"
    runs = [f"scheduled__2026-12-{i:05d}" for i in range(5000)]
    gangs = [gang_name(dag, r) for r in runs]
    assert all(settings.run_identity(dag, r)[:16] in g for r, g in zip(runs, gangs))
    for kind, world in (("JobSet", 1), ("JobSet", 1024), ("VolcanoJob", 64), ("TrainJob", 8)):
        names = {gang_object_name(g, 3, kind, world) for g in gangs}
        assert len(names) == len(gangs), kind
        assert max(map(len, names)) <= 63
