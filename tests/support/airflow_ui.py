"""A running Airflow as the UI tests and the standalone tests talk to it: its REST API with a
token for admin (`AirflowUI`), and polling (`wait_for`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAG_ID = "train_pipeline"
MLFLOW_UI_URL = "http://127.0.0.1:5000"
DASHBOARD_URL = "http://127.0.0.1:3000/d/gangflow-gangs/gangflow"
REQUEST_TIMEOUT_S = 30
GET_ATTEMPTS = 3


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
        # A GET is asked again when the api-server does not answer in time: on a loaded 2-core CI
        # machine it once took over 30 s while the UI loaded a run page (stop 35's CI). A POST is
        # never repeated, so a timeout there fails at once.
        attempts = GET_ATTEMPTS if method == "GET" else 1
        for _ in range(attempts):
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
                    return resp.status, json.load(resp)
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read() or b"{}")
            except (TimeoutError, urllib.error.URLError) as exc:
                if isinstance(exc, urllib.error.URLError) and not isinstance(exc.reason, TimeoutError):
                    raise
                last = exc
        raise TimeoutError(
            f"{method} {path}: no answer in {attempts} x {REQUEST_TIMEOUT_S} s\n--- airflow log ---\n{self.log_tail()}"
        ) from last

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
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            return json.load(resp)["access_token"]

    def runs(self) -> list[dict]:
        return self.get(f"dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]

    def run(self, run_id: str) -> dict:
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}")

    def task_states(self, run_id: str) -> dict[str, tuple[str | None, int]]:
        tis = self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances")["task_instances"]
        return {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in tis}

    def links(self, run_id: str, task_id: str) -> dict:
        """The task's extra links as the API gives them (`extra_links`): {name: url}."""
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/links")["extra_links"]

    def xcom(self, run_id: str, task_id: str, key: str = "return_value"):
        return self.get(f"dags/{DAG_ID}/dagRuns/{quote(run_id)}/taskInstances/{task_id}/xcomEntries/{key}")["value"]

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
