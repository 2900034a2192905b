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
