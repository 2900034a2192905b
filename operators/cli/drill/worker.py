"""The drill's Airflow worker inside the Airflow image (`--runtime podman`).

    python -m operators.cli.drill.worker --dag-id DAG --conf JSON [--dags /opt/airflow/dags]

The drill runs this as a podman container of the Airflow image `make images` built, against the
drill's servers: it prepares its own state dir (GANGFLOW_HOME: Airflow's DB and the training
pool), runs the DAG with dag.test() from the image's DAG folder, and prints `make demo`'s summary
as its last line. So validate, train (submitting the gang), evaluate and promote import and read
only what the image holds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

IMAGE_DAGS = "/opt/airflow/dags"  # docker/airflow.Dockerfile: COPY dags/ /opt/airflow/dags/


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dag-id", required=True, help="the DAG to run (a pipeline's dag_id)")
    parser.add_argument("--conf", default="{}", help="the DAG run conf, a JSON object")
    parser.add_argument("--dags", type=Path, default=Path(IMAGE_DAGS), help=f"the DAG folder (default {IMAGE_DAGS}, the image's)")
    args = parser.parse_args(argv)
    conf = json.loads(args.conf)
    if not isinstance(conf, dict):
        parser.error("--conf: must be a JSON object")

    from operators.config import embedded, settings

    embedded.apply()  # before Airflow is imported: it binds its settings at import
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(args.dags)
    from operators.cli import demo
    from operators.cli.drill.run import backport_dag_test_defer_kwargs
    from operators.cli.setup import prepare_airflow_db

    prepare_airflow_db(settings.pool_slots())
    backport_dag_test_defer_kwargs()
    dag_run = demo.run_dag(conf, args.dag_id, dags=args.dags)
    print(json.dumps(demo.summarize(dag_run, args.dag_id), default=str), flush=True)
    return 0


if __name__ == "__main__":
    from operators.utils.processes import exit_without_teardown

    exit_without_teardown(main())
