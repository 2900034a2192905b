"""operators.utils.processes: the one way the UI runner, the drill's servers and the local backend stop what they
started, and how the command-line programs that ran a DAG end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from operators.utils.processes import stop_group, stop_group_nowait, stop_tree, tagged_env

# A leader whose child ignores SIGTERM and outlives it: only the group SIGKILL stops the child.
CODE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_stop_group_terms_then_kills_the_whole_group():
    proc = subprocess.Popen([sys.executable, "-c", CODE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "up"
    started = time.monotonic()
    stop_group(proc, grace=1.0)
    assert proc.returncode is not None

    def child_gone() -> bool:
        try:
            return psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 5  # SIGKILL is delivered at once; the kernel may take a moment on a loaded machine
    while not child_gone() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 8


def test_stop_group_of_an_exited_process_is_quiet():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    stop_group(proc, grace=0.1)
    assert proc.returncode == 0

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def test_stop_group_nowait_returns_at_once_and_kills_the_group_after_the_grace():
    """The local backend's stop: its `run` reaps torchrun while reading its output."""
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "up"
    started = time.monotonic()
    timer = stop_group_nowait(proc, grace=1.5)
    assert time.monotonic() - started < 1.0 and timer.daemon  # a stop that waited would take the 1.5 s grace
    assert proc.wait(8) == -signal.SIGKILL  # SIGTERM ignored: the timer's SIGKILL ended it
    assert time.monotonic() - started >= 1.5


def test_stop_group_nowait_timer_can_be_called_off():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    proc.stdout.readline()
    stop_group_nowait(proc, grace=0.3).cancel()
    time.sleep(0.6)
    assert proc.poll() is None  # SIGTERM ignored, SIGKILL called off
    stop_group(proc, grace=0.1)


# A leader that, when told to stop, starts a new worker in a session of its own and exits (as a
# task that retries while being stopped starts a new gang): no snapshot of its tree holds it.
RESPAWN = """
import signal, subprocess, sys, time
def respawn(*_):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    print(child.pid, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, respawn)
print("up", flush=True)
time.sleep(60)
"""


def test_stop_tree_ends_a_process_the_tree_started_while_it_was_being_stopped():
    env = tagged_env(dict(os.environ))
    proc = subprocess.Popen([sys.executable, "-c", RESPAWN], stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    assert proc.stdout.readline().strip() == "up"
    stop_tree(proc, grace=5.0, env=env)
    late = int(proc.stdout.readline())
    assert not psutil.pid_exists(late) or psutil.Process(late).status() == psutil.STATUS_ZOMBIE


def test_pids_with_env_finds_a_process_by_exact_value_or_prefix():
    from operators.utils.processes import pids_with_env

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "GANGFLOW_PROBE": "drill-7/pod-0"})
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in pids_with_env("GANGFLOW_PROBE", "drill-7/", prefix=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in pids_with_env("GANGFLOW_PROBE", "drill-7/", prefix=True)
        assert proc.pid in pids_with_env("GANGFLOW_PROBE", "drill-7/pod-0")
        assert proc.pid not in pids_with_env("GANGFLOW_PROBE", "drill-7/")  # exact: not a prefix
        assert os.getpid() not in pids_with_env("PATH", os.environ["PATH"])
    finally:
        proc.kill()
        proc.wait()


EXITING = """
import atexit, logging, sys
from operators.utils.processes import exit_without_teardown
logging.basicConfig(filename=sys.argv[1])
logging.warning("a log line, buffered until the end")
atexit.register(lambda: print("teardown ran"))
print("the summary", end="")  # no newline: still in stdout's buffer
exit_without_teardown(3)
"""


def test_exit_without_teardown_keeps_the_code_the_output_and_the_log_and_skips_the_teardown(tmp_path):
    log = tmp_path / "run.log"
    done = subprocess.run([sys.executable, "-c", EXITING, str(log)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[4])  # the project root: operators importable
    assert done.returncode == 3, done.stderr
    assert done.stdout == "the summary"  # flushed; atexit's line never printed
    assert "a log line, buffered until the end" in log.read_text()


def test_bounded_lines_cut_a_huge_line_and_keep_the_rest():
    import io

    from operators.utils.processes import bounded_lines

    stream = io.StringIO("ok\n" + "x" * 100 + "\n" + "y" * 25 + "\n" + "z" * 8 + "\nlast")
    assert list(bounded_lines(stream, limit=10)) == [
        "ok\n", "x" * 10 + " ... (90 characters cut)\n", "y" * 10 + " ... (15 characters cut)\n", "z" * 8 + "\n", "last"]


def test_a_rank_printing_one_huge_line_costs_the_task_no_memory(tmp_path):
    """The training task read the gang's output line by line: one 150 MiB line without a newline grew
    it by about 600 MB (and went into the task log whole)."""
    import resource
    import subprocess
    import sys

    from operators.utils.processes import LINE_LIMIT, bounded_lines

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('[rank 0] ' + 'x' * (64 << 20)); "
                             "print(); print('[rank 0] done')"], stdout=subprocess.PIPE, text=True)
    lines = list(bounded_lines(proc.stdout))
    proc.wait()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert [len(line) <= LINE_LIMIT + 40 for line in lines] == [True, True] and lines[-1] == "[rank 0] done\n"
    assert "characters cut" in lines[0]
    assert grown_mb < 32, f"the reader grew by {grown_mb:.0f} MB"
