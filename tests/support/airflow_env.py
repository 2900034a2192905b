"""A throwaway, isolated Airflow for tests: its own AIRFLOW_HOME and SQLite DB, DAGs run in a
subprocess so no Airflow state (config, ORM session, settings) bleeds between tests.

    def test_x(migrated_airflow: AirflowEnv, tmp_path):
        dag_file = migrated_airflow.write_dag("my_dag.py", SOURCE)     # into its DAGs folder
        result = migrated_airflow.dag_test(dag_file, "my_dag")        # dag.test() in a subprocess
        assert result.tasks["t"].state == "success" and result.tasks["t"].try_number == 2
        assert "some log line" in result.output                       # stdout+stderr of the run

Also: `AirflowEnv.create(path)` (no DB yet), `.env` (the environment for any subprocess:
AIRFLOW_HOME, SQLite URL, DAGs folder, no examples, LocalExecutor with parallelism 2, inherited
`AIRFLOW__*` variables dropped), `.migrate()` (`airflow db migrate`, ~3 s), `.run(args)` (a
command under that environment), `.python(code)` (a Python snippet under it), and
`isolate_in_process(path)` to point *this* process's Airflow config at a scratch home before
anything imports `airflow` (a no-op when AIRFLOW_HOME is already set).

A test module imports the fixture from here (tests/support is on pytest's pythonpath):

    from airflow_env import migrated_airflow  # makes the session fixture visible in the module
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RESULT_MARK = "GANGFLOW_DAG_TEST_RESULT "


def airflow_environ(home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables of an isolated Airflow rooted at `home`."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AIRFLOW")}
    home = Path(home)
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def isolate_in_process(home: Path) -> bool:
    """Point this process's Airflow at `home` if nothing chose a home yet and airflow is not imported.

    Returns True when it did. Call it before the first `import airflow...` of a test session.
    """
    if os.environ.get("AIRFLOW_HOME") or "airflow" in sys.modules:
        return False
    for key, value in airflow_environ(Path(home), base={}).items():
        if key.startswith("AIRFLOW"):
            os.environ[key] = value
    Path(home, "dags").mkdir(parents=True, exist_ok=True)
    return True


@dataclass
class TaskResult:
    state: str | None
    try_number: int
    max_tries: int


@dataclass
class DagTestResult:
    returncode: int
    output: str  # stdout + stderr of the dag.test() process: the task logs land here
    dag_run_state: str | None = None
    tasks: dict[str, TaskResult] = field(default_factory=dict)


_RUNNER = textwrap.dedent(
    """
    import json, runpy, sys
    from airflow.sdk import DAG
    namespace = runpy.run_path(sys.argv[1], run_name="gangflow_dag_under_test")
    dag = next((v for v in namespace.values() if isinstance(v, DAG) and v.dag_id == sys.argv[2]), None)
    if dag is None:  # `with DAG(...):` without `as`: parse the file the way the DAG processor does
        from airflow.dag_processing.dagbag import DagBag
        dag = DagBag(dag_folder=sys.argv[1]).dags[sys.argv[2]]
    dr = dag.test()
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    with create_session() as session:
        tis = session.query(TaskInstance).filter(
            TaskInstance.dag_id == dr.dag_id, TaskInstance.run_id == dr.run_id
        ).all()
        tasks = {
            ti.task_id: {"state": str(ti.state.value if hasattr(ti.state, "value") else ti.state),
                         "try_number": ti.try_number, "max_tries": ti.max_tries}
            for ti in tis
        }
    state = dr.state.value if hasattr(dr.state, "value") else dr.state
    print("%s" + json.dumps({"dag_run_state": state, "tasks": tasks}), flush=True)
    """
    % RESULT_MARK
)


@dataclass
class AirflowEnv:
    home: Path
    env: dict[str, str]

    @classmethod
    def create(cls, home: Path) -> AirflowEnv:
        home = Path(home)
        (home / "dags").mkdir(parents=True, exist_ok=True)
        return cls(home=home, env=airflow_environ(home))

    @property
    def dags_folder(self) -> Path:
        return self.home / "dags"

    def run(self, args: list[str], *, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            args, env=self.env, cwd=self.home, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def python(self, code: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.run([sys.executable, "-c", code, *args], timeout=timeout, check=check)

    def migrate(self, timeout: float = 300) -> None:
        """Create/upgrade the metadata DB (`airflow db migrate`)."""
        self.run([str(VENV_BIN / "airflow"), "db", "migrate"], timeout=timeout)

    def write_dag(self, name: str, source: str) -> Path:
        path = self.dags_folder / name
        path.write_text(textwrap.dedent(source))
        return path

    def dag_test(self, dag_file: Path, dag_id: str, *, timeout: float = 300) -> DagTestResult:
        """Run `dag.test()` for `dag_id` from `dag_file` in a fresh interpreter."""
        proc = self.run([sys.executable, "-c", _RUNNER, str(dag_file), dag_id], timeout=timeout, check=False)
        output = proc.stdout + proc.stderr
        result = DagTestResult(returncode=proc.returncode, output=output)
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_MARK):
                data = json.loads(line[len(RESULT_MARK) :])
                result.dag_run_state = data["dag_run_state"]
                result.tasks = {k: TaskResult(**v) for k, v in data["tasks"].items()}
        return result


@pytest.fixture(scope="session")
def migrated_airflow(tmp_path_factory: pytest.TempPathFactory) -> AirflowEnv:
    """One migrated, isolated Airflow per test session (see the module docstring)."""
    env = AirflowEnv.create(tmp_path_factory.mktemp("airflow-home"))
    env.migrate()
    return env

