"""The training task's exporter (operators/hooks/prometheus.py) and its settings: a scrape target
file while it serves, gone once it closed; preemptions of earlier tries counted; bad settings refused
naming the variable. The real Prometheus scrape is tests/system/dags/test_prometheus.py."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from operators.config import settings
from operators.hooks.prometheus import GangExporter, metrics_query

LABELS = {"dag_id": "d", "dag_run_id": "r", "pipeline": "digits", "gang": "d-0123456789"}


def test_the_exporter_registers_a_target_serves_and_deregisters(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"event": "preempted", "step": 7}) + "\n{torn\n")
    exporter = GangExporter(LABELS, address=("127.0.0.1", 0), targets_dir=tmp_path / "targets", log=lambda m: None)
    exporter.read_earlier_tries(run_dir)
    exporter.begin(mlflow_run_id="run-1", attempt=2)
    exporter.observe([{"step": 3, "loss": 2.0}])
    [target] = json.loads(exporter.target_file.read_text())
    assert exporter.url == f"http://{target['targets'][0]}/metrics" and target["labels"] == {}
    body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    assert 'gangflow_preemptions_total{dag_id="d",dag_run_id="r",gang="d-0123456789",mlflow_run_id="run-1",pipeline="digits"} 1.0' in body
    assert 'gangflow_restarts{dag_id="d",dag_run_id="r",gang="d-0123456789",mlflow_run_id="run-1",pipeline="digits"} 1.0' in body
    assert 'gangflow_loss{' in body and 'rank="0"} 2.0' in body
    exporter.close()
    assert not exporter.target_file.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(exporter.url, timeout=2)


@pytest.mark.parametrize("value", ["9400", "host:port", "127.0.0.1:70000", ":1"])
def test_a_bad_metrics_address_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("GANGFLOW_METRICS", value)
    with pytest.raises(ValueError, match="GANGFLOW_METRICS=.*accepted values are off or HOST:PORT"):
        settings.metrics_address()


def test_metrics_are_off_unless_asked_and_the_linger_is_bounded(monkeypatch):
    monkeypatch.delenv("GANGFLOW_METRICS", raising=False)
    assert settings.metrics_address() is None and GangExporter.from_settings(LABELS) is None
    monkeypatch.setenv("GANGFLOW_METRICS", "127.0.0.1:0")
    assert settings.metrics_address() == ("127.0.0.1", 0)
    monkeypatch.setenv("GANGFLOW_METRICS", "[::1]:9400")  # it failed later, in getaddrinfo, as if the port were taken
    assert settings.metrics_address() == ("::1", 9400)
    monkeypatch.setenv("GANGFLOW_METRICS_LINGER_S", "-1")
    with pytest.raises(ValueError, match="GANGFLOW_METRICS_LINGER_S='-1': accepted values are seconds from 0 to 600"):
        settings.metrics_linger_s()


def test_the_link_back_selects_the_runs_series(monkeypatch):
    assert metrics_query("abc") == '{__name__=~"gangflow_.+",mlflow_run_id="abc"}'
    monkeypatch.setenv("GANGFLOW_DASHBOARD_URL", "https://grafana.example/d/gangflow-gangs/gangflow?orgId=1")
    assert settings.dashboard_url("abc") == "https://grafana.example/d/gangflow-gangs/gangflow?orgId=1&var-mlflow_run_id=abc"


def test_a_taken_port_is_an_oserror_the_task_turns_into_a_warning(tmp_path):
    first = GangExporter(LABELS, address=("127.0.0.1", 0), targets_dir=tmp_path, log=lambda m: None)
    try:
        port = int(first.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(OSError):
            GangExporter({**LABELS, "gang": "other"}, address=("127.0.0.1", port), targets_dir=tmp_path, log=lambda m: None)
    finally:
        first.close()


def test_close_lingers_until_a_scrape_reads_the_final_values_and_no_longer(tmp_path):
    exporter = GangExporter(LABELS, address=("127.0.0.1", 0), targets_dir=tmp_path, linger_s=30, log=lambda m: None)
    exporter.metrics.set_labels(mlflow_run_id="r1")
    exporter.metrics.promoted(model_name="m", model_version="3", promoted=True)
    bodies: list[str] = []

    def scrape_later():
        time.sleep(0.5)
        bodies.append(urllib.request.urlopen(exporter.url, timeout=10).read().decode())

    scraper = threading.Thread(target=scrape_later)
    started = time.monotonic()
    scraper.start()
    exporter.close()  # returns after that scrape, well before the 30 s linger
    waited = time.monotonic() - started
    scraper.join()
    assert 0.4 < waited < 10, waited
    assert 'model_version="3"' in bodies[0]
    assert not exporter.target_file.exists()

    quiet = GangExporter({**LABELS, "gang": "quiet"}, address=("127.0.0.1", 0), targets_dir=tmp_path, linger_s=0.3, log=lambda m: None)
    started = time.monotonic()
    quiet.close()  # nobody scrapes: the linger bounds the wait
    assert 0.25 < time.monotonic() - started < 5


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_earlier_tries_are_read_only_from_a_regular_metrics_file(tmp_path, plant):
    """It followed a link out of the run dir, and waited for ever on a FIFO before the retry's gang."""
    import os

    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"event": "preempted", "step": 7}) + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if plant == "link":
        (run_dir / "metrics.jsonl").symlink_to(outside)
    else:
        os.mkfifo(run_dir / "metrics.jsonl")
    exporter = GangExporter(LABELS, address=("127.0.0.1", 0), targets_dir=tmp_path / "targets", log=lambda m: None)
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (exporter.read_earlier_tries(run_dir), done.set()), daemon=True).start()
        assert done.wait(5), "read_earlier_tries blocked"
        assert exporter._earlier == []
    finally:
        exporter.close()


def test_a_promotion_whose_metrics_port_is_taken_only_warns(tmp_path, monkeypatch):
    """Promote published its series after moving @champion: a taken port failed the task then."""
    import socket

    from operators.hooks.prometheus import publish_promotion

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv("GANGFLOW_METRICS", f"127.0.0.1:{busy.getsockname()[1]}")
    monkeypatch.setenv("GANGFLOW_HOME", str(tmp_path))
    logged: list[str] = []
    try:
        publish_promotion(LABELS, mlflow_run_id="r", model_name="m", model_version="3", promoted=True, log=logged.append)
    finally:
        busy.close()
    assert len(logged) == 1 and "warning: no Prometheus metrics for this promotion" in logged[0]


def test_an_exporter_whose_target_cannot_be_written_does_not_stay_up(tmp_path):
    targets = tmp_path / "targets"
    targets.write_text("a file where the folder should be")
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(OSError):
        GangExporter(LABELS, address=("127.0.0.1", 0), targets_dir=targets, log=lambda m: None)
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name not in before and t.is_alive()]
