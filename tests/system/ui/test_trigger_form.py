"""End to end through the real Airflow 3.3 UI (`make ui`'s `airflow standalone`) in headless
chromium: log in as admin, open train_pipeline, trigger it from the Params form, watch the run
succeed with exactly the values typed, and see the registered model version in promote's XCom.
A value outside its schema is refused with a message naming the field, and creates no run.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.parse

import pytest
from playwright.sync_api import Page, expect

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

DAG_ID = "train_pipeline"

# A quick run (~1 min for the whole DAG on 2 cores): typed into the form, over the defaults.
TYPED = {"world_size": "1", "max_steps": "40", "checkpoint_every_steps": "10", "promotion_floor": "0.5"}
RUN_TIMEOUT_S = 480  # a hang guard, not a measurement: a loaded machine runs the DAG several times slower


def field(page: Page, param: str):
    """The trigger form's input for a DAG Param (the UI names them `element_<param>`)."""
    return page.get_by_role("dialog").locator(f'input[name="element_{param}"]')


def type_into(page: Page, param: str, value: str) -> None:
    box = field(page, param)
    box.fill(value)
    box.blur()  # number inputs commit (and clamp) on blur


def log_in(page: Page, airflow, path: str) -> None:
    """Open `path`; the simple auth manager sends us to its login page first."""
    page.goto(f"{airflow.url}{path}")
    expect(page.get_by_text("Sign into Airflow")).to_be_visible()
    page.shots("login")
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password").fill(airflow.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(re.escape(airflow.url + path)))


def open_trigger_form(page: Page, airflow) -> None:
    log_in(page, airflow, f"/dags/{DAG_ID}")
    expect(page.get_by_text("validate_dataset").first).to_be_visible()  # the DAG page, tasks listed
    page.shots("dag-page")
    page.get_by_role("button", name="Trigger Dag").click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    expect(dialog.get_by_text("Run Parameters")).to_be_visible()
    expect(field(page, "max_steps")).to_be_visible()  # Params are fetched after the dialog opens


def test_airflow_is_ready(airflow_ui):
    """What `make ui` promises before anyone clicks: healthy, the DAG parsed without import
    errors and unpaused, the gang-admission pool, admin's generated password works."""
    from operators.config.settings import TRAINING_POOL

    # (the fixture waited for the metadata DB, scheduler and dag-processor to report healthy)
    assert airflow_ui.get("monitor/health")["metadatabase"]["status"] == "healthy"
    assert airflow_ui.get("importErrors")["total_entries"] == 0, airflow_ui.get("importErrors")
    dag = airflow_ui.get(f"dags/{DAG_ID}")
    assert not dag["has_import_errors"] and not dag["is_paused"], dag
    pool = airflow_ui.get(f"pools/{TRAINING_POOL}")
    assert pool["slots"] >= 1, pool
    with pytest.raises(urllib.error.HTTPError) as refused:
        airflow_ui.token("admin", "not-the-password")
    assert refused.value.code == 401


def test_bad_value_is_refused_naming_the_field(airflow_ui, page: Page):
    runs_before = len(airflow_ui.runs())
    open_trigger_form(page, airflow_ui)

    # Below its schema minimum, world size is not even kept: the number field clamps to 1.
    type_into(page, "world_size", "0")
    expect(field(page, "world_size")).to_have_value("1")
    # A string Param's pattern is enforced by the API; the form shows the API's refusal.
    type_into(page, "dataset_version", "not-a-dvc-version")
    page.shots("bad-value-typed")
    with page.expect_response(lambda r: r.url.endswith(f"/dags/{DAG_ID}/dagRuns") and r.request.method == "POST") as posted:
        page.get_by_role("dialog").get_by_role("button", name="Trigger", exact=True).click()
    assert posted.value.status == 400, posted.value.text()

    error = page.get_by_role("dialog").get_by_text("Invalid input for param dataset_version")
    error.scroll_into_view_if_needed()
    expect(error).to_be_visible()
    expect(page.get_by_role("dialog")).to_contain_text("'not-a-dvc-version' does not match '^[0-9a-f]{32}$'")
    expect(page.get_by_text("Failed to Trigger Dag")).to_be_visible()  # the toast
    page.shots("bad-value-refused")
    assert len(airflow_ui.runs()) == runs_before, "a refused trigger must not create a run"


def test_trigger_form_runs_the_pipeline(airflow_ui, page: Page):
    params = airflow_ui.get(f"dags/{DAG_ID}/details")["params"]
    defaults = {name: spec["value"] for name, spec in params.items()}
    expected_conf = defaults | {name: type(defaults[name])(value) for name, value in TYPED.items()}
    assert expected_conf != defaults, "the typed values must differ from the defaults to prove anything"

    open_trigger_form(page, airflow_ui)
    for name, value in TYPED.items():
        type_into(page, name, value)
    for name, value in TYPED.items():
        expect(field(page, name)).to_have_value(value)
    page.shots("form-filled")
    with page.expect_response(lambda r: r.url.endswith(f"/dags/{DAG_ID}/dagRuns") and r.request.method == "POST") as posted:
        page.get_by_role("dialog").get_by_role("button", name="Trigger", exact=True).click()
    assert posted.value.status == 200, posted.value.text()

    # The UI moves to the new run's page.
    page.wait_for_url(re.compile(rf"/dags/{DAG_ID}/runs/[^/?]+$"))
    run_id = urllib.parse.unquote(page.url.rsplit("/runs/", 1)[1])
    expect(page.get_by_text(run_id).first).to_be_visible()
    page.shots("run-page")
    assert run_id in {r["dag_run_id"] for r in airflow_ui.runs()}

    run = airflow_ui.wait_finished(run_id, RUN_TIMEOUT_S)
    page.reload()
    expect(page.get_by_text("Success").first).to_be_visible()
    page.shots("run-finished")
    assert run["state"] == "success", (
        f"run {run_id} {run['state']}: {airflow_ui.task_states(run_id)}\n--- airflow log ---\n{airflow_ui.log_tail()}"
    )
    assert run["conf"] == expected_conf, "the run did not get what was typed into the form"
    assert (run["triggered_by"], run["triggering_user_name"]) == ("ui", "admin")
    states = airflow_ui.task_states(run_id)
    assert states["train_local_1"] == ("success", 1), states  # world_size 1 from the form: one rank
    assert states["train_local_2"][0] == "skipped", states

    # promote's XCom: a registered model version, in the API and on the task's XCom tab.
    decision = airflow_ui.xcom(run_id, "promote")
    assert decision["model_name"] == "gangflow-digits" and decision["model_version"], decision
    assert decision["candidate_accuracy"] >= expected_conf["promotion_floor"], decision
    page.goto(airflow_ui.page_url("runs", run_id, "tasks", "promote", "xcom"))
    page.get_by_role("button", name="Expand all extra JSON").click()
    expect(page.get_by_text(f'"model_version": "{decision["model_version"]}"')).to_be_visible()
    page.shots("promote-xcom")

    # issue 26 item 3: the training task's progress (XCom) and its links to the MLflow run and the dashboard
    training = airflow_ui.xcom(run_id, "train_local_1")
    assert airflow_ui.xcom(run_id, "train_local_1", "progress") == {"step": 40, "total": 40, "percent": 100, "done": True}
    links = airflow_ui.links(run_id, "train_local_1")
    assert links["MLflow run"].startswith(f"{airflow_ui.mlflow_ui_url}/#/experiments/") and links["MLflow run"].endswith(training["mlflow_run_id"])
    assert links["Dashboard"] == f"{airflow_ui.dashboard_url}?var-mlflow_run_id={training['mlflow_run_id']}"
    # Airflow 3's task page shows extra links (as links named by the operator link) on its Details tab
    page.goto(airflow_ui.page_url("runs", run_id, "tasks", "train_local_1", "details"))
    for name, url in (("MLflow run", links["MLflow run"]), ("Dashboard", links["Dashboard"])):
        link = page.get_by_role("link", name=name, exact=True).first
        expect(link).to_be_visible(timeout=60_000)
        expect(link).to_have_attribute("href", url)
    page.shots("training-links")
    page.goto(airflow_ui.page_url("runs", run_id, "tasks", "train_local_1", "xcom"))
    expect(page.get_by_text("progress", exact=True).first).to_be_visible()
    page.shots("training-progress-xcom")

    from mlflow import MlflowClient

    registered = MlflowClient(f"sqlite:///{airflow_ui.home / 'mlflow.db'}").get_model_version(
        decision["model_name"], decision["model_version"]
    )
    assert registered.status == "READY", registered
