"""README's shell commands are run by tests (issue 13.9). Every command of a ```bash block is
listed in COVERED with the test that runs it; a README command not listed fails the test.

`make data`, the trainer's torchrun line and `--help` run as written, in a clone of the repository
with the project's venv, in tests/system/docs/test_readme_commands.py."""

from __future__ import annotations

import json
import re

from doc_commands import PROJECT_ROOT, canonical, readme_commands

RUN_ELSEWHERE = "tests/system/docs/test_readme_commands.py::test_make_data_uses_the_projects_interpreter_and_a_failed_repro_keeps_the_data"
# The test that runs each command (a clone, a DAG run, the browser; `make test` would run the suite itself)
# (`make demo` is `make setup` + `python -m operators.cli.demo`, the recipe checked by
# tests/unit/docs/test_extending.py::test_readme_commands_exist_in_the_makefile).
COVERED = {
    "make data": RUN_ELSEWHERE,
    ".venv/bin/torchrun --standalone --nproc-per-node 2 -m trainer --run-dir /tmp/run1 --set train.max_steps=300": RUN_ELSEWHERE,
    ".venv/bin/python -m trainer --help": RUN_ELSEWHERE,
    "make demo": "tests/system/dags/test_train_pipeline.py::test_first_run_promotes_and_registry_has_lineage",
    "make test": "tests/unit/docs/test_extending.py::test_readme_commands_exist_in_the_makefile",
    'GANGFLOW_FAULT="kill@step=130,rank=1" make demo':
        "tests/system/dags/test_train_pipeline.py::test_kill_is_retried_resumes_and_matches_uninterrupted_run",
    'GANGFLOW_FAULT="raise@step=5" make demo': "tests/system/dags/test_train_pipeline.py::test_user_error_fails_after_one_attempt_saying_why",
    """.venv/bin/python -m operators.cli.demo --conf '{"world_size": 1, "max_steps": 300}'""":
        "tests/unit/docs/test_readme.py::test_the_demo_conf_in_readme_passes_the_dags_params",
    "make ui": "tests/system/ui/test_trigger_form.py::test_airflow_is_ready",
}  # fmt: skip


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    covered = {canonical(c): t for c, t in COVERED.items()}
    missing = sorted(set(commands) - set(covered))
    assert not missing, f"README commands no test runs (run them in a test and list it in COVERED): {missing}"
    stale = sorted(set(covered) - set(commands))
    assert not stale, f"listed here but no longer in README.md: {stale}"
    for command, test in covered.items():
        path, _, name = test.partition("::")
        source = PROJECT_ROOT / path
        assert source.is_file() and re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M), f"{command}: {test} does not exist"


def test_the_demo_conf_in_readme_passes_the_dags_params():
    """The `--conf` README shows is accepted by train_pipeline's Params (a run with --conf is
    tests/dags' baseline; this one's 300 steps at world size 1 are left to the reader)."""
    import importlib.util

    from operators.config.pipelines import check_params

    (words,) = [w for w in readme_commands().values() if w[1:4] == ["-m", "operators.cli.demo", "--conf"]]
    conf = json.loads(words[4])
    spec = importlib.util.spec_from_file_location("train_pipeline_dag", PROJECT_ROOT / "dags" / "train_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert conf and set(conf) <= set(module.PARAMS)
    for name, value in conf.items():
        module.PARAMS[name].resolve(value)  # the form's JSON Schema (raises ParamValidationError)
    check_params({name: param.value for name, param in module.PARAMS.items()} | conf, module.SCHEMAS)
