"""A real Prometheus server scrapes a demo DAG run's gang and the series come back by MLflow run id
through the PromQL HTTP API (issue 26 item 1, docs/observability.md); the same run logs its ranks'
lines as JSON carrying that run id (item 2). Debian's `prometheus`
(`make prometheus-deps`) started on 127.0.0.1 by the test, with file-based discovery of the
targets the training task writes under the state dir."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from pipeline_runs import FAST, run_pipeline

from operators.utils.ports import free_port

PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def prometheus(pipeline_home, tmp_path):
    if PROMETHEUS is None:
        pytest.fail("Debian's prometheus is not installed: run `make prometheus-deps` (apt-get install prometheus, as root)")
    targets = pipeline_home / "prometheus" / "targets"
    targets.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "gangflow", "file_sd_configs": [{"files": [str(targets / "*.json")], "refresh_interval": "1s"}]}],
    }))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-3000:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _query(url: str, promql: str) -> list[dict]:
    body = _get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_a_gang_is_scraped_and_its_series_are_found_by_mlflow_run_id(pipeline_home, prometheus, tmp_path):
    summary, output, code = run_pipeline(pipeline_home, {**FAST, "max_steps": 40}, tmp_path / "run.log",
                                         GANGFLOW_METRICS="127.0.0.1:0", GANGFLOW_METRICS_LINGER_S="60",
                                         GANGFLOW_LOG_FORMAT="json")
    assert code == 0, output[-6000:]
    assert "Prometheus metrics of this gang at http://127.0.0.1:" in output
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    runs = client.search_runs(client.get_experiment_by_name("gangflow").experiment_id,
                              filter_string=f"tags.`gangflow.dag_run_id` = '{summary['dag_run_id']}'")
    assert len(runs) == 1, [r.data.tags for r in runs]
    run_id, tags = runs[0].info.run_id, runs[0].data.tags
    query = tags["gangflow.metrics_query"]  # the MLflow run's link to its series
    assert run_id in query
    # the exporter has stopped: the series are stale now, so look back over the run
    series = _get(f"{prometheus}/api/v1/series?{urllib.parse.urlencode({'match[]': query})}")["data"]
    names = {s["__name__"] for s in series}
    assert {"gangflow_loss", "gangflow_samples_per_second", "gangflow_step_seconds", "gangflow_startup_seconds",
            "gangflow_queue_wait_seconds", "gangflow_checkpoint_bytes", "gangflow_checkpoint_save_seconds_count",
            "gangflow_restarts", "gangflow_gang_running"} <= names, sorted(names)
    for s in series:
        assert (s["dag_id"], s["dag_run_id"], s["pipeline"], s["mlflow_run_id"]) == ("train_pipeline", summary["dag_run_id"], "digits", run_id)
    step = _query(prometheus, f'max_over_time(gangflow_step{{mlflow_run_id="{run_id}"}}[10m])')
    assert [float(r["value"][1]) for r in step] == [40.0]
    loss = _query(prometheus, f'last_over_time(gangflow_loss{{mlflow_run_id="{run_id}",rank="0"}}[10m])')
    assert len(loss) == 1 and 0 < float(loss[0]["value"][1]) < 10
    ended = _query(prometheus, f'last_over_time(gangflow_gang_running{{mlflow_run_id="{run_id}"}}[10m])')
    assert [float(r["value"][1]) for r in ended] == [0.0]  # the final value was scraped (the linger)
    model = _query(prometheus, f'last_over_time(gangflow_model_version{{mlflow_run_id="{run_id}"}}[10m])')
    assert [r["metric"]["model_version"] for r in model] == [summary["model_version"]]  # promote's series
    # item 2: the ranks' lines in the task log are JSON with the job and rank, the run id included
    rank_lines = [json.loads(m.group(1)) for line in output.splitlines() if (m := re.search(r"\[rank \d+\] (\{.*\})", line))]
    assert 0 in {r["rank"] for r in rank_lines}  # rank 1 prints nothing when all goes well
    assert {(r["mlflow_run_id"], r["dag_run_id"], r["pipeline"]) for r in rank_lines} == {(run_id, summary["dag_run_id"], "digits")}
    assert "rank logs: " in output
    assert not list((pipeline_home / "prometheus" / "targets").glob("*.json"))  # deregistered
