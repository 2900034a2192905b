"""`make images` started when `make test` starts, beside the other tests, for tests/system/images.

Building the images from a cold podman store takes minutes, mostly pip downloading and unpacking:
run on the worker that reaches the image tests it was the longest single step of the suite. The
pytest-xdist controller starts the build (`start`, from tests/conftest.py's pytest_configure when
GANGFLOW_TEST_EARLY_IMAGES=1, as `make test` sets it); the image tests' `built` fixture waits for it
(`wait`). Run as a script, this module is the wrapper that records the build's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REQUEST = "GANGFLOW_TEST_EARLY_IMAGES"  # "1": start the build early (set by `make test`)
FOLDER = "GANGFLOW_TEST_EARLY_IMAGES_DIR"  # where the started build writes: set for the workers
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def start() -> subprocess.Popen | None:
    """Start `python -m operators.cli.images` in the background (a state dir of its own), or None
    when not asked to or podman cannot build here (the image tests then skip, saying why)."""
    if os.environ.get(REQUEST) != "1" or FOLDER in os.environ:
        return None
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="gangflow-early-images-"))
    os.environ[FOLDER] = str(folder)  # inherited by the xdist workers, started after pytest_configure
    env = {**os.environ, "GANGFLOW_HOME": str(folder / "home")}
    return subprocess.Popen([sys.executable, __file__, str(folder)], cwd=PROJECT_ROOT, env=env, start_new_session=True,
                            stdout=open(folder / "build.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip


def stop(proc: subprocess.Popen | None) -> None:
    """At the end of the session: a build still running (its tests were deselected) is stopped."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def wait(timeout: float = 1800) -> tuple[dict, Path, float] | None:
    """The started build's summary, its state dir's images folder and the seconds this test waited;
    None when no build was started early. A failed build fails here with its log's tail."""
    folder = os.environ.get(FOLDER)
    if not folder:
        return None
    folder, started = Path(folder), time.monotonic()
    done = folder / "exit_code"
    while not done.exists():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the early `make images` did not finish in {timeout:.0f}s: {folder / 'build.log'}")
        time.sleep(2)
    output = (folder / "build.log").read_text()
    if done.read_text().strip() != "0":
        raise AssertionError(f"the early `make images` failed (exit {done.read_text().strip()}):\n{output[-8000:]}")
    summary = next(line for line in reversed(output.splitlines()) if line.startswith("{"))  # the build's last JSON line
    return json.loads(summary), folder / "home" / "images", time.monotonic() - started


def main(folder: Path) -> int:
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "operators.cli.images"], cwd=PROJECT_ROOT)
    print(f"early make images: exit {code} after {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    (folder / "exit_code.tmp").write_text(str(code))
    os.replace(folder / "exit_code.tmp", folder / "exit_code")
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
