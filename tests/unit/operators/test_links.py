"""Progress and links where the user looks (issue 26 item 3): the training task keeps rank 0's latest
progress line as its XCom `progress`, throttled, from text or JSON rank lines; its extra links take the
URLs it pushed (MLflow run, dashboard, Kubernetes object), none when no URL is configured."""

from __future__ import annotations

import json

from operators.config import settings
from operators.links import DashboardLink, KubernetesObjectLink, MlflowRunLink
from operators.training import GangTrainingOperator, ProgressNote

LINE = "[rank 0] gangflow: progress: step 30/60 (50%), loss 1.2345, 640 samples/s, ETA 0:00:03, last checkpoint step 20"


class _TI:
    def __init__(self):
        self.pushed: list[tuple[str, object]] = []

    def xcom_push(self, *, key, value):
        self.pushed.append((key, value))


def test_progress_lines_become_the_progress_xcom_throttled():
    ti, logged = _TI(), []
    note = ProgressNote(ti, logged.append, every_s=3600)
    note("[rank 1] something else")
    note(LINE)
    note(LINE.replace("step 30/60", "step 40/60"))  # within every_s: logged, not pushed
    assert len(logged) == 3
    assert ti.pushed == [("progress", {"step": 30, "total": 60, "percent": 50, "loss": 1.2345, "samples_per_sec": 640,
                                       "eta": "0:00:03", "last_checkpoint_step": 20})]


def test_json_rank_lines_are_read_too():
    ti = _TI()
    message = "gangflow: progress: step 5/60 (8%), loss -, 10 samples/s, ETA -, last checkpoint step none"
    ProgressNote(ti, lambda line: None, every_s=0)("[rank 0] " + json.dumps({"rank": 0, "message": message}))
    assert ti.pushed == [("progress", {"step": 5, "total": 60, "percent": 8, "loss": None, "samples_per_sec": 10,
                                       "eta": "-", "last_checkpoint_step": None})]


def test_the_task_has_the_three_links_and_pushes_their_urls(monkeypatch):
    names = [link.name for link in GangTrainingOperator.operator_extra_links]
    assert names == ["MLflow run", "Dashboard", "Kubernetes object"]
    ti = _TI()
    op = GangTrainingOperator(task_id="train", world_size=1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x.db")
    monkeypatch.delenv("GANGFLOW_MLFLOW_UI_URL", raising=False)
    MlflowRunLink().push(op, ti, settings.mlflow_run_url("1", "abc"))  # a local store has no UI: no link
    assert ti.pushed == []
    monkeypatch.setenv("GANGFLOW_MLFLOW_UI_URL", "http://127.0.0.1:5000/")
    MlflowRunLink().push(op, ti, settings.mlflow_run_url("1", "abc"))
    monkeypatch.setenv("GANGFLOW_KUBERNETES_URL", "https://console.example/k8s/ns/{namespace}/{kind}/{name}")
    KubernetesObjectLink().push(op, ti, settings.kubernetes_object_url("team-a", "JobSet", "train-pipeline-0123456789"))
    DashboardLink().push(op, ti, None)
    assert ti.pushed == [("_link_MlflowRunLink", "http://127.0.0.1:5000/#/experiments/1/runs/abc"),
                         ("_link_KubernetesObjectLink", "https://console.example/k8s/ns/team-a/jobset/train-pipeline-0123456789")]
    # what the task runner stores at the end of the try: the same URLs, "" for a link never known
    assert [link.get_link(op, ti_key=None) for link in op.operator_extra_links] == [
        "http://127.0.0.1:5000/#/experiments/1/runs/abc", "", "https://console.example/k8s/ns/team-a/jobset/train-pipeline-0123456789"]


def test_the_last_line_sets_done_even_within_the_throttle():
    ti = _TI()
    note = ProgressNote(ti, lambda line: None, every_s=3600)
    note(LINE)
    note("[rank 0] gangflow: done: 60 steps on 2 rank(s); test accuracy 0.9; final weights at /x/model.safetensors")
    assert ti.pushed[-1] == ("progress", {"step": 60, "total": 60, "percent": 100, "done": True})


def test_a_user_loops_progress_in_steps_is_kept_too():
    """trainer.runtime's Run has no global batch: its rate is in steps/s, and its total may be unknown."""
    ti = _TI()
    ProgressNote(ti, lambda line: None, every_s=0)(
        "[rank 0] gangflow: progress: step 12/40 (30%), loss 0.5000, 49 steps/s, ETA 0:00:02, last checkpoint step 10")
    ProgressNote(ti, lambda line: None, every_s=0)(
        "[rank 0] gangflow: progress: step 7, loss -, 3 steps/s, ETA -, last checkpoint step none")
    assert ti.pushed == [
        ("progress", {"step": 12, "total": 40, "percent": 30, "loss": 0.5, "steps_per_sec": 49, "eta": "0:00:02",
                      "last_checkpoint_step": 10}),
        ("progress", {"step": 7, "total": None, "percent": None, "loss": None, "steps_per_sec": 3, "eta": "-",
                      "last_checkpoint_step": None})]


def test_only_rank_0_sets_progress_and_an_unreadable_line_is_only_logged():
    ti, logged = _TI(), []
    note = ProgressNote(ti, logged.append, every_s=0)
    note(LINE.replace("[rank 0]", "[rank 1]").replace("step 30/60", "step 999/1000"))
    note(LINE.replace("[rank 0]", "[rank 1]").replace("done", "x") + " gangflow: done: 5 steps on 1 rank")
    note(LINE.replace("loss 1.2345", "loss n/a"))
    note(LINE)
    assert len(logged) == 4 and ti.pushed == [("progress", {
        "step": 30, "total": 60, "percent": 50, "loss": 1.2345, "samples_per_sec": 640, "eta": "0:00:03",
        "last_checkpoint_step": 20})]


def test_link_settings_carry_no_credentials_and_keep_their_own_syntax(monkeypatch):
    import pytest

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cr3t@mlflow.example.com")
    monkeypatch.delenv("GANGFLOW_MLFLOW_UI_URL", raising=False)
    assert settings.mlflow_run_url("7", "abc") == "https://mlflow.example.com/#/experiments/7/runs/abc"
    for name in ("GANGFLOW_MLFLOW_UI_URL", "GANGFLOW_DASHBOARD_URL", "GANGFLOW_KUBERNETES_URL"):
        monkeypatch.setenv(name, "https://admin:grafana-pw@grafana.example/d/x")
        with pytest.raises(ValueError, match=f"{name}=.*must not carry credentials") as info:
            (settings.mlflow_run_url("7", "abc") if name == "GANGFLOW_MLFLOW_UI_URL" else settings.dashboard_url("abc")
             if name == "GANGFLOW_DASHBOARD_URL" else settings.kubernetes_object_url("ns", "JobSet", "n"))
        assert "grafana-pw" not in str(info.value)
        monkeypatch.delenv(name)
    monkeypatch.setenv("GANGFLOW_DASHBOARD_URL", "https://grafana.example/d/g/gangflow?orgId=1#viewPanel=3")
    assert settings.dashboard_url("abc") == "https://grafana.example/d/g/gangflow?orgId=1&var-mlflow_run_id=abc#viewPanel=3"
    monkeypatch.setenv("GANGFLOW_KUBERNETES_URL", 'https://console.example/explore?left={"queries":[{"expr":"{name}"}]}&ns={namespace}')
    assert settings.kubernetes_object_url("team-a", "JobSet", "train-1") == (
        'https://console.example/explore?left={"queries":[{"expr":"train-1"}]}&ns=team-a')
