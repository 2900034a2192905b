"""SIGTERM = preemption: finish the step, agree on the boundary, commit a checkpoint, exit 75.

The handler only sets a flag; the loop all-reduces it every step so all ranks stop at the same
step boundary. A watchdog exits with EXIT_PREEMPTED anyway when the final checkpoint is not
committed within `checkpoint.grace_period_s`: the previous committed checkpoint stands.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from trainer import EXIT_PREEMPTED


class Preemption:
    def __init__(self, grace_s: float = 25.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.received_at: float | None = None
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        # Only the main thread may set a handler; a launcher that runs the trainer in a thread of
        # its own process (Ray Train's workers) stops it its own way.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested = True
        self.received_at = time.monotonic()
        self._watchdog = threading.Timer(self.grace_s, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def uninstall(self) -> None:
        """SIGTERM's default again (main thread, when the handler is still this one's): a rank whose
        training has ended has nothing to save, so a SIGTERM then ends it at once."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def disarm(self) -> None:
        """Call off the watchdog: for a process that goes on after its trainer (a test, an
        in-process run); a rank exits instead."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _expire(self) -> None:
        os.write(2, f"gangflow: grace period of {self.grace_s:g}s after SIGTERM exceeded; exiting "
                    f"{EXIT_PREEMPTED} (the last committed checkpoint stands)\n".encode())
        os._exit(EXIT_PREEMPTED)
