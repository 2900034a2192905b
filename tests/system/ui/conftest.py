"""Fixtures for the UI tests: one real `airflow standalone` (as `make ui` starts it) on a temp
state dir and a free port, and headless Debian chromium driven by playwright.

Screenshots go to each test's tmp dir (printed on failure); Airflow's own log to
`<tmp>/airflow-ui*/airflow.log`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow_ui import DAG_ID, DASHBOARD_URL, MLFLOW_UI_URL, AirflowUI, wait_for
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


@pytest.fixture(scope="session")
def airflow_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowUI]:
    """`make ui` on a temp GANGFLOW_HOME: setup, `airflow standalone` on a free port, healthy,
    train_pipeline parsed. Stops every Airflow process at the end, whatever happened."""
    from operators.cli import ui
    from operators.utils.ports import free_port

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
        proc, url = ui.start(free_port(), log)
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


@pytest.fixture(scope="module")
def browser():
    """Chromium for one module's tests. Module scope, not session: between calls Playwright's sync API
    leaves its loop marked running in this thread, and every later `asyncio.run()` on the worker (the
    Airflow and Ray clients of other test files) failed while a session-wide browser stayed open."""
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
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    # Actions and assertions alike wait up to 30 s: expect()'s own default (5 s) was too short for
    # the DAG page's first render on a loaded 2-core machine (CI: a test failed on it).
    context.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)
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
