"""Two promote tasks racing from separate processes leave the better model as champion: on the
real SQLite store (issue 12.4) and through `mlflow server` on 127.0.0.1 (issue 28.6). The
candidates are tests/support/promotion_candidates.py's; each racer is tests/support/promotion_race.py
in a spawned process."""

from __future__ import annotations

import json
import queue
import time

import pytest
from promotion_candidates import make, manifest, weights  # noqa: F401 (fixtures)

from operators.hooks import mlflow as tracking
from operators.registry import versions as registry

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("digits")]


def test_two_promotions_racing_from_separate_processes_leave_the_better_champion(client, make, home, monkeypatch):
    """12.4: the champion alias moves by compare-and-set. Two promote tasks in two processes on
    the real SQLite store both decide against the same old champion; the worse one's alias
    write comes last. The better model must end as champion, and the loser says why."""
    _race(client, make, home, monkeypatch, "digits-race")


def test_two_promotions_racing_through_an_mlflow_server_leave_the_better_champion(make, home, monkeypatch,
                                                                                    tmp_path):
    """Issue 28.6: the same race through `mlflow server` on 127.0.0.1 (no flock reaches it): the
    champion lock is a registered model whose creation the server makes atomic."""
    from operators.cli.drill.servers import MlflowServer

    server = MlflowServer(tmp_path / "mlflow-server").start()
    try:
        _race(tracking.get_client(server.url), make, home, monkeypatch, "digits-server-race", tracking_uri=server.url)
    finally:
        server.stop()


def _race(client, make, home, monkeypatch, name, tracking_uri=None):
    import multiprocessing

    import promotion_race

    factory = "model_cards:tiny_mlp"  # the same module, importable by name in a fresh process
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", factory)

    def candidate(label, which):
        return make(label, which, factory=factory, client=client)

    candidate("race-bad", "bad").promote(name, floor=0.0, tracking_uri=tracking_uri)  # the old champion both beat
    racers = {"better": candidate("race-good", "good"), "worse": candidate("race-ok", "ok")}
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    delays = {"better": (0.0, 0.5), "worse": (0.3, 3.0)}  # (start after the barrier, alias write)
    procs = []
    for label, cand in racers.items():
        args = {"home": str(home), "allowed": factory, "name": name, "model_uri": cand.model_uri,
                "dataset": manifest(), "run_id": cand.mlflow_run_id, "metrics": cand.metrics, "label": label,
                "start_delay_s": delays[label][0], "set_delay_s": delays[label][1], "tracking_uri": tracking_uri}
        procs.append(ctx.Process(target=promotion_race.promote, args=(args, barrier, out)))
    for p in procs:
        p.start()
    results = _collect(out, procs, timeout_s=600)
    for p in procs:
        p.join(timeout=60)
    results = {k: json.loads(v) for k, v in results.items()}
    assert "error" not in results["better"] and "error" not in results["worse"], results

    champion = registry.current_champion(client, name)
    better = results["better"]
    assert better["promoted"] is True and str(champion.version) == better["model_version"], results
    # The loser found the alias moved, decided again against the new champion, and says why.
    worse = results["worse"]
    assert worse["promoted"] is False, results
    assert worse["champion_version"] == better["model_version"]
    assert f"does not beat champion v{better['model_version']}" in worse["reason"]
    tags = client.get_model_version(name, worse["model_version"]).tags
    assert tags["gangflow.decision"] == "rejected" and tags["gangflow.champion_version"] == better["model_version"]


def _collect(out, procs, *, timeout_s: float) -> dict:
    """Each racer's (label, result); a racer that dies first fails the test at once, not at the timeout."""
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            label, value = out.get(timeout=1)
            results[label] = value
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a promoting process died (exit codes {dead}); its traceback is in the captured stderr"
            assert time.monotonic() < deadline, f"the promotions did not finish in {timeout_s} s"
    return results
