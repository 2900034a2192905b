"""docs/extending.md's hand-wired DAG runs (issue 23, item 4): gangflow's operators in a DAG of
one's own, wired by their outputs' keys (`train.output["model_uri"]`), validate -> train ->
evaluate -> promote on the digits data."""

from __future__ import annotations

import json
import subprocess
import sys

from doc_commands import blocks

from pipeline_runs import PROJECT_ROOT, pipeline_env

RUN = """
import json, os, sys
from operators.config import embedded
embedded.apply()
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = sys.argv[1]  # a DAG of one's own, in a DAGs folder of one's own
from airflow.dag_processing.dagbag import DagBag
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
dag = bag.dags["digits_by_hand"]
run = dag.test()
with create_session() as session:
    xcoms = {(x.task_id, x.key): x.value for x in session.query(XComModel).filter_by(dag_id=dag.dag_id, run_id=run.run_id)}
print(json.dumps({"state": str(run.state), "promoted": xcoms.get(("promote", "promoted")),
                  "model_uri": xcoms.get(("train", "model_uri")), "accuracy": xcoms.get(("evaluate", "accuracy"))}))
"""


def test_the_guides_hand_wired_dag_runs_end_to_end(pipeline_home, tmp_path):
    (body,) = [body for kind, path, body in blocks() if path == "dags/digits_by_hand.py"]
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "digits_by_hand.py").write_text(body)
    done = subprocess.run([sys.executable, "-c", RUN, str(dags)], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300, env=pipeline_env(pipeline_home))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["state"].endswith("success"), (result, done.stderr[-4000:])
    assert str(result["model_uri"]).startswith("models:/") and result["accuracy"] > 0.8
    assert result["promoted"] in (True, False)  # decided by the gate, pushed under its own key
