"""Path audit for the drill's emulated pods, installed as `sitecustomize` (stdlib only).

Every Python process of a pod appends each path it opens, lists, creates, renames, removes or
executes (PEP 578 audit events) to `$GANGFLOW_DRILL_AUDIT`, so the drill proves that no pod touched
the Airflow worker's state dir. Blind to the interpreter's own start-up and to I/O done in C.
"""

from __future__ import annotations

import os
import sys

ENV = "GANGFLOW_DRILL_AUDIT"
# events whose arguments name paths (https://docs.python.org/3/library/audit_events.html)
PATH_EVENTS = frozenset({
    "open", "os.listdir", "os.scandir", "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.link",
    "os.symlink", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.chdir", "os.exec", "os.posix_spawn",
    "os.spawn", "shutil.rmtree", "shutil.copyfile", "shutil.move", "glob.glob", "sqlite3.connect",
    "subprocess.Popen", "os.startfile",
})  # fmt: skip


def install(path: str | None = None) -> bool:
    """Start recording into `path` (default: $GANGFLOW_DRILL_AUDIT); False when neither is set."""
    target = path or os.environ.get(ENV)
    if not target:
        return False
    # opened before the hook exists, so the log never records itself; os.write has no audit event
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    seen: set[str] = set()
    busy = [False]

    def note(value) -> None:
        if isinstance(value, bytes):
            value = os.fsdecode(value)
        elif hasattr(value, "__fspath__"):
            value = os.fspath(value)
        if not isinstance(value, str) or not value or "\n" in value:
            return
        absolute = os.path.normpath(value if os.path.isabs(value) else os.path.join(os.getcwd(), value))
        if absolute not in seen:
            seen.add(absolute)
            os.write(fd, (absolute + "\n").encode("utf-8", "surrogateescape"))

    def hook(event: str, args: tuple) -> None:
        if event not in PATH_EVENTS or busy[0]:
            return
        busy[0] = True
        try:
            if event == "subprocess.Popen":  # (executable, args, cwd, env)
                argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
                items = [args[0], args[2], *(a for a in argv if isinstance(a, str) and a.startswith("/"))]
            elif event in ("open", "os.listdir", "os.scandir", "os.chdir", "os.truncate", "os.chmod", "os.chown", "os.utime", "glob.glob"):
                items = [args[0]] if args else []  # later arguments are modes, flags or fds
            else:
                items = [a for a in args if isinstance(a, (str, bytes)) or hasattr(a, "__fspath__")]
            for item in items:
                note(item)
        except Exception:  # an audit hook must never break the process it watches
            pass
        finally:
            busy[0] = False

    sys.addaudithook(hook)
    return True


def read(path: str | os.PathLike) -> list[str]:
    """The paths one audit log recorded."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            return [line.rstrip("\n") for line in fh if line.strip()]
    except FileNotFoundError:
        return []


if __name__ == "sitecustomize":
    install()
