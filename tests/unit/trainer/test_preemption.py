"""trainer.preemption under a launcher that runs the trainer in a thread (Ray Train's workers)."""

from __future__ import annotations

import signal
import threading

from trainer.preemption import Preemption


def test_install_in_a_worker_thread_leaves_the_handler_alone():
    before = signal.getsignal(signal.SIGTERM)
    errors = []

    def install():
        try:
            Preemption(1.0).install()
        except Exception as exc:  # noqa: BLE001 - signal.signal raises ValueError outside the main thread
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGTERM) is before


def test_install_in_the_main_thread_takes_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    try:
        preemption = Preemption(1.0)
        preemption.install()
        assert signal.getsignal(signal.SIGTERM) == preemption._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_arms_the_exit_watchdog_and_disarm_calls_it_off():
    """The watchdog ends the process `grace_s` after a SIGTERM (a rank whose final checkpoint
    hangs); a process that goes on after its trainer (a test) disarms it, or it is ended later."""
    import subprocess
    import sys

    code = (
        "import os, signal, time; from trainer.preemption import Preemption; p = Preemption(0.3); p.install(); "
        "os.kill(os.getpid(), signal.SIGTERM); {disarm}time.sleep(1.5); print('alive')"
    )
    armed = subprocess.run([sys.executable, "-c", code.format(disarm="")], capture_output=True, text=True, timeout=60)
    assert armed.returncode == 75 and "alive" not in armed.stdout and "grace period" in armed.stderr
    disarmed = subprocess.run([sys.executable, "-c", code.format(disarm="p.disarm(); ")], capture_output=True, text=True, timeout=60)
    assert disarmed.returncode == 0 and "alive" in disarmed.stdout, disarmed.stderr
