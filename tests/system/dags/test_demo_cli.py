"""`make demo` / `python -m operators.cli.demo` as a user runs it (issue 23): it stops on SIGTERM
and SIGINT at any moment, ending the gang; it prints a short account of the run before the JSON
line and sends Airflow's own lines to a log file it names; a failed validation names the version."""

from __future__ import annotations

import json
import re
import signal
import textwrap
import time
from pathlib import Path

import psutil
import yaml

from pipeline_runs import FAST, PROJECT_ROOT, finish, start_pipeline


def _wait_for(log: Path, pattern: str, proc, timeout: float) -> str:
    """The demo's output and its Airflow log, once `pattern` appears in either."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        named = re.search(r"Airflow's log: (\S+)", text)
        if named and Path(named.group(1)).is_file():
            text += Path(named.group(1)).read_text(errors="replace")
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, f"the demo ended before {pattern!r}:\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout}s:\n{text[-4000:]}")


def _torchruns_of(home: Path) -> list[psutil.Process]:
    """The gang's launcher and ranks on state dir `home` (`python -m trainer.launch`, or `torchrun ... -m trainer`)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            words = p.info["cmdline"] or []
            gang = "trainer.launch" in words or "torch.distributed.run" in words or any(w.endswith("/torchrun") for w in words)
            if gang and (p.info["environ"] or {}).get("GANGFLOW_HOME") == str(home):
                found.append(p)
        except (psutil.Error, TypeError):
            continue
    return found


def _stopped(proc, log: Path, home: Path, within: float) -> dict:
    started = time.monotonic()
    summary, output, code = finish(proc, log, timeout=within + 30)
    took = time.monotonic() - started
    assert took < within, f"the demo took {took:.0f}s to stop:\n{output[-3000:]}"
    assert code != 0 and summary["state"] == "failed" and summary["failure"]["kind"] == "interrupted", summary
    deadline = time.monotonic() + 10
    while _torchruns_of(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _torchruns_of(home), "a gang outlived the demo"
    return summary


def _end(proc) -> None:
    """A test that failed early still ends its run: the demo's own SIGTERM handling ends its gang."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - last resort
            proc.kill()


def test_sigterm_while_a_task_waits_for_its_retry_stops_the_demo(pipeline_home, tmp_path):
    log = tmp_path / "run.log"
    # An infra failure retried after 120 s: the run sits waiting for the retry when SIGTERM comes.
    proc = start_pipeline(pipeline_home, FAST, log, GANGFLOW_FAULT="kill@step=20,rank=1", GANGFLOW_RETRY_BASE_DELAY="120")
    try:
        _wait_for(log, r"infra failure, retrying in", proc, timeout=150)
        proc.send_signal(signal.SIGTERM)
        _stopped(proc, log, pipeline_home, within=30)
    finally:
        _end(proc)


def test_sigint_while_the_gang_trains_ends_the_gang(pipeline_home, tmp_path):
    log = tmp_path / "run.log"
    proc = start_pipeline(pipeline_home, {**FAST, "max_steps": 100000}, log)
    try:
        _wait_for(log, r"step\s+\d+", proc, timeout=150)
        assert _torchruns_of(pipeline_home), "no gang running"
        proc.send_signal(signal.SIGINT)
        _stopped(proc, log, pipeline_home, within=30)
    finally:
        _end(proc)


def test_the_demo_tells_what_happened_and_a_failed_validation_names_the_version(pipeline_home, tmp_path):
    """A suite from a package outside the project (package_roots) refuses the data: the account
    says validation failed, the summary names the version validated, Airflow's lines are in the
    log file the demo names, not in its output."""
    pkg = tmp_path / "outside" / "strictsuites"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "suites.py").write_text(textwrap.dedent("""
        import great_expectations as gx
        import great_expectations.expectations as gxe


        def too_strict(split):
            return gx.ExpectationSuite(name=f"strict.{split}", expectations=[
                gxe.ExpectTableRowCountToBeBetween(min_value=10**9, max_value=10**10)])
    """))
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    digits = yaml.safe_load((PROJECT_ROOT / "pipelines" / "digits.yaml").read_text())
    digits["dataset"]["suite"] = "strictsuites.suites:too_strict"
    digits["package_roots"] = [str(tmp_path / "outside")]
    (pipelines / "digits.yaml").write_text(yaml.safe_dump(digits))
    log = tmp_path / "run.log"
    summary, output, code = finish(start_pipeline(pipeline_home, FAST, log, GANGFLOW_PIPELINES=str(pipelines)), log, timeout=240)
    assert code == 1 and summary["failure"]["task_id"] == "validate_dataset", summary
    assert re.fullmatch(r"[0-9a-f]{32}", summary["dataset_version"] or ""), summary
    own = log.read_text()
    account = own.strip().splitlines()[:-1]
    assert any(line.startswith("validated: no") and summary["dataset_version"] in line for line in account), own
    assert any(line.startswith("not trained") for line in account), own
    named = re.search(r"Airflow's log: (\S+)", own)
    assert named and Path(named.group(1)).is_file(), own
    airflow_lines = Path(named.group(1)).read_text()
    assert "validate_dataset" in airflow_lines and "Filling up the DagBag" not in own
    assert len(own.splitlines()) < 20, own
    json.loads(own.strip().splitlines()[-1])


def test_no_tasks_to_run_is_logged_once_per_change_not_once_a_second():
    import logging

    from operators.cli.demo import quiet_waits

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("airflow.sdk.definitions.dag")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with quiet_waits():
            for _ in range(30):
                logger.warning("No tasks to run. unrunnable tasks: %s", {"<TI train_local_2 up_for_retry>"})
            logger.warning("No tasks to run. unrunnable tasks: %s", {"<TI evaluate scheduled>"})
            logger.warning("Dag run %s finished", "x")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "No tasks to run. unrunnable tasks: {'<TI train_local_2 up_for_retry>'}",
        "No tasks to run. unrunnable tasks: {'<TI evaluate scheduled>'}",
        "Dag run x finished",
    ]
