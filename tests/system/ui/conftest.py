"""Fixtures for the UI tests: one real `airflow standalone` (as `make ui` starts it) on a temp
state dir and a free port, and headless Debian chromium driven by playwright.

Screenshots go to each test's tmp dir (printed on failure); Airflow's own log to
`<tmp>/airflow-ui*/airflow.log`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pipeline_runs import pipeline_env, setup_state

CHROMIUM = os.environ.get("GANGFLOW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DAG_ID = "train_pipeline"
MLFLOW_UI_URL = "http://127.0.0.1:5000"
DASHBOARD_URL = "http://127.0.0.1:3000/d/gangflow-gangs/gangflow"


@dataclass
class AirflowUI:
    """A running `airflow standalone` and what a test needs to talk to it."""

    url: str
    home: Path
    log: Path
    password: str
    mlflow_ui_url: str = MLFLOW_UI_URL  # what the training task's links point to (GANGFLOW_MLFLOW_UI_URL)
    dashboard_url: str = DASHBOARD_URL  # (GANGFLOW_DASHBOARD_URL)
    _token: str = field(default="", repr=False)

    def api(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """Call the REST API (`/api/v2/...`) with a token for admin; returns (status, JSON)."""
        if not self._token:
            self._token = self.token("admin", self.password)
        request = urllib.request.Request(
            f"{self.url}/api/v2/{path.lstrip('/')}", method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def get(self, path: str) -> dict:
        status, body = self.api("GET", path)
        assert status == 200, f"GET {path}: {status} {body}"
        return body

    def token(self, username: str, password: str) -> str:
        """A JWT from the simple auth manager's `/auth/token` (raises HTTPError 401 when wrong)."""
        request = urllib.request.Request(
            f"{self.url}/auth/token", method="POST",
            data=json.dumps({"username": username, "password": password}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.load(resp)["access_token"]

    def runs(self) -> list[dict]:
        return self.get(f"dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]

    def run(self, run_id: str) -> dict:
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}")

    def task_states(self, run_id: str) -> dict[str, tuple[str | None, int]]:
        tis = self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances")["task_instances"]
        return {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in tis}

    def xcom(self, run_id: str, task_id: str, key: str = "return_value"):
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/xcomEntries/{key}")["value"]

    def links(self, run_id: str, task_id: str) -> dict:
        """The task's extra links as the API gives them: {name: url}."""
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/links")

    def wait_finished(self, run_id: str, timeout_s: float) -> dict:
        """Poll the run until it succeeds or fails; returns the run as the API gives it."""

        def finished():
            run = self.run(run_id)
            return run if run["state"] in ("success", "failed") else None

        return wait_for(f"run {run_id} to finish", finished, timeout_s, 2)

    def page_url(self, *parts: str) -> str:
        """A UI address under this DAG, e.g. page_url("runs", run_id) (run ids quoted)."""
        return "/".join([self.url, "dags", DAG_ID, *(quote(p) for p in parts)])

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"


def quote(run_id: str) -> str:
    return urllib.parse.quote(run_id, safe="")


def wait_for(what: str, probe, timeout_s: float, interval_s: float = 1.0):
    """Call probe() until it returns something truthy; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="session")
def airflow_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowUI]:
    """`make ui` on a temp GANGFLOW_HOME: setup, `airflow standalone` on a free port, healthy,
    train_pipeline parsed. Stops every Airflow process at the end, whatever happened."""
    from operators.cli import ui

    base = tmp_path_factory.mktemp("airflow-ui")
    home, log = base / "state", base / "airflow.log"
    setup_state(home)
    with pytest.MonkeyPatch.context() as mp:
        # The environment `make ui` would see for this state dir, nothing from the outer shell.
        for key in [k for k in os.environ if k.startswith(("AIRFLOW", "MLFLOW", "GANGFLOW"))]:
            mp.delenv(key)
        # URLs the training task's extra links point to (never opened: the test checks the links)
        links = {"GANGFLOW_MLFLOW_UI_URL": MLFLOW_UI_URL, "GANGFLOW_DASHBOARD_URL": DASHBOARD_URL}
        for key, value in pipeline_env(home, **links).items():
            mp.setenv(key, value)
        proc, url = ui.start(ui.free_port(), log)
    try:
        try:
            ui.wait_healthy(url, proc, timeout_s=180)
        except (TimeoutError, RuntimeError) as exc:
            pytest.fail(f"{exc}\n--- airflow log ---\n{log.read_text(errors='replace')[-6000:]}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GANGFLOW_HOME", str(home))
            password = ui.admin_password(timeout_s=30)
        airflow = AirflowUI(url=url, home=home, log=log, password=password)
        # The dag-processor may still be parsing: the UI shows the DAG once it is serialized.
        wait_for(f"DAG {DAG_ID} in the API", lambda: airflow.api("GET", f"dags/{DAG_ID}")[0] == 200, 120, 2)
        yield airflow
    finally:
        ui.stop(proc)


@pytest.fixture(scope="session")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.fail(f"no chromium at {CHROMIUM}: `make browser-deps` (Debian: apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Shots:
    """Numbered full-page screenshots in the test's tmp dir."""

    def __init__(self, page, folder: Path):
        self.page, self.folder, self.count = page, folder, 0

    def __call__(self, name: str) -> Path:
        self.count += 1
        path = self.folder / f"{self.count:02d}-{name}.png"
        try:
            self.page.screenshot(path=str(path), full_page=True)
        except Exception as exc:  # a screenshot must never hide the real failure
            path.with_suffix(".txt").write_text(f"screenshot failed: {exc}")
        return path


@pytest.fixture
def page(browser, tmp_path: Path, request: pytest.FixtureRequest):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.shots = Shots(page, tmp_path)
    try:
        yield page
    finally:
        page.shots("final")
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"\nscreenshots of {request.node.name}: {tmp_path}")
        context.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.rep_call = rep
    return rep
