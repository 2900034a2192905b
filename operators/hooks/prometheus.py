"""The training task's Prometheus exporter for a local gang (`GangExporter`), docs/observability.md.

While the gang runs the task serves `trainer.prometheus.GangMetrics` on `GANGFLOW_METRICS`
(HOST:PORT) and writes a Prometheus `file_sd_configs` target file for it under the state dir
(`prometheus/targets/<gang>.json`), removed when the exporter closes. The relay feeds it the
ranks' metrics.jsonl lines; the task adds how the gang ended (failure kind, per-rank exit codes).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from operators.config import settings
from trainer.prometheus import GangMetrics, serve
from trainer.storage import read_regular, write_json
from trainer.tracking import METRICS

# An earlier try's metrics.jsonl larger than this is not read for its preemptions (a bound, not a budget).
METRICS_READ_LIMIT = 1 << 30


def metrics_query(mlflow_run_id: str) -> str:
    """The PromQL selector of one run's series: the link the MLflow run carries back."""
    return f'{{__name__=~"gangflow_.+",mlflow_run_id="{mlflow_run_id}"}}'


class _ScrapeCounter:
    """A collector of no series that counts the scrapes of its registry."""

    def __init__(self) -> None:
        self.scrapes = 0
        self.scraped = threading.Condition()

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        with self.scraped:
            self.scrapes += 1
            self.scraped.notify_all()
        return []

    def wait_for_one_more(self, seen: int, timeout: float) -> bool:
        with self.scraped:
            return self.scraped.wait_for(lambda: self.scrapes > seen, timeout)


class GangExporter:
    """Serve one gang's metrics from this process; `close()` lingers, then stops and deregisters."""

    def __init__(self, labels: Mapping[str, str], *, address: tuple[str, int], targets_dir: Path,
                 linger_s: float = 0.0, log: Callable[[str], None] = print):
        self.metrics = GangMetrics(labels)
        self._scrapes = _ScrapeCounter()
        self.metrics.registry.register(self._scrapes)
        self.linger_s = linger_s
        self.log = log
        self._server, (host, port) = serve(self.metrics, *address)
        self.url = f"http://{host}:{port}/metrics"
        name = self.metrics.labels.get("gang") or f"gang-{port}"
        self.target_file = Path(targets_dir) / f"{name}.json"
        self._closed = threading.Event()
        self._earlier: list[dict] = []
        try:
            self._write_target(f"{host}:{port}")
        except BaseException:  # no target, no exporter: the server does not stay up behind the caller's back
            self._server.shutdown()
            self._server.server_close()
            raise
        log(f"gangflow: Prometheus metrics of this gang at {self.url} (scrape target in {self.target_file})")

    @classmethod
    def from_settings(cls, labels: Mapping[str, str], *, log: Callable[[str], None] = print) -> GangExporter | None:
        """The exporter `GANGFLOW_METRICS` asks for, or None when it is off."""
        address = settings.metrics_address()
        if address is None:
            return None
        return cls(labels, address=address, targets_dir=settings.metrics_targets_dir(),
                   linger_s=settings.metrics_linger_s(), log=log)

    def _write_target(self, target: str) -> None:
        # No target labels: the series carry the gang's own, and a target label of the same name
        # would rename theirs to exported_<name>.
        write_json(self.target_file, [{"targets": [target], "labels": {}}])

    def read_earlier_tries(self, run_dir: str | Path) -> None:
        """Keep the preemptions of earlier tries of this run dir (the relay reads only this try's
        lines); call before the relay starts. They are counted at `begin`."""
        try:  # a run dir is not trusted: no link followed, no FIFO waited on, bounded
            lines = read_regular(Path(run_dir) / METRICS, limit=METRICS_READ_LIMIT).decode(errors="replace").splitlines()
        except OSError:
            return
        for line in lines:
            if '"preempted"' in line:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == "preempted":
                    self._earlier.append(record)

    def begin(self, *, mlflow_run_id: str, attempt: int) -> None:
        """The MLflow run is open: the series start, labelled with its id."""
        self.metrics.set_labels(mlflow_run_id=mlflow_run_id)
        self.metrics.started(attempt)
        self.observe(self._earlier)

    def observe(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.metrics.observe(record)

    def close(self) -> None:
        """Stay up until one scrape has read the final values, at most `linger_s`; then stop and
        remove the target file."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.linger_s > 0:
            seen = self._scrapes.scrapes
            self.log(f"gangflow: metrics stay at {self.url} until the next scrape, at most {self.linger_s:g}s (GANGFLOW_METRICS_LINGER_S)")
            self._scrapes.wait_for_one_more(seen, self.linger_s)
        self.target_file.unlink(missing_ok=True)
        self._server.shutdown()
        self._server.server_close()


def publish_promotion(labels: Mapping[str, str], *, mlflow_run_id: str, model_name: str, model_version: str | None,
                      promoted: bool, log: Callable[[str], None] = print) -> None:
    """Promote's series (`gangflow_model_version`), served for one linger when `GANGFLOW_METRICS` is on.
    A port taken or a target file not written costs the series only (a warning): the promotion is done."""
    try:
        exporter = GangExporter.from_settings(labels, log=log)
    except OSError as exc:
        log(f"gangflow: warning: no Prometheus metrics for this promotion ({type(exc).__name__}: {exc})")
        return
    if exporter is None:
        return
    exporter.metrics.set_labels(mlflow_run_id=mlflow_run_id)
    exporter.metrics.promoted(model_name=model_name, model_version=model_version, promoted=promoted)
    exporter.close()
