"""The drill's ssh for an MPIJob's launcher (stdlib only): `ssh [OPTIONS] HOST COMMAND...` run as
PRRTE's ssh agent (`PRTE_MCA_plm_ssh_agent`), and the stand-in for the workers' `/usr/sbin/sshd`.

`install(folder, image)` writes both under `folder` and maps the image's `/usr/bin/ssh` to the
drill's ssh and its `/usr/sbin/sshd` to the stand-in (paths of the drill's image, like its
`/opt/venv`); the launcher names `/usr/bin/ssh` as PRRTE's ssh agent. The ssh maps HOST (a worker's DNS
name from the hostfile, `<job>-worker-<i>.<job>...`) to the worker pod `<job>-worker-<i>` of the
same drill and runs COMMAND (PRRTE's `prted`, which starts that host's ranks) with `/bin/sh -c`, as
sshd would, but as a process of that pod: its `GANGFLOW_DRILL_POD` marker (stopping the pod stops
its ranks), the drill's additions to that pod's environment (audit hook, fault), the pod's PATH,
its `/tmp` as HOME and cwd, and its CPUs. Nothing else of the launcher's environment goes along: the ranks
get the launcher's variables only as `mpirun -x` forwards them, as over ssh. A host whose pod has
no running process answers as sshd's absence would (exit 255). Each session is appended to the
worker pod's `ssh.log` (beside its audit file).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

MARKER = "GANGFLOW_DRILL_POD"
AUDIT = "GANGFLOW_DRILL_AUDIT"
# what an ssh session gets of the worker container's environment: its paths and the drill's additions
SESSION_ENV = ("PATH", "HOME", "TMPDIR", "PYTHONPATH", "LANG", "LC_ALL", AUDIT, MARKER, "GANGFLOW_FAULT", "GANGFLOW_ALLOW_FAULTS")
OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")
SSHD_STAND_IN = """#!/bin/sh
# The drill's stand-in for the image's sshd (-De): stays up until the pod is stopped
# (operators/cli/drill/mpi_ssh.py); the launcher's ssh runs the ranks in this pod.
trap 'exit 0' TERM INT
echo "sshd stand-in of the cluster drill: up (pid $$)"
while :; do sleep 1 & wait $!; done
"""


SSH, SSHD = "/usr/bin/ssh", "/usr/sbin/sshd"  # in the image


def install(folder: Path, image) -> str:
    """Write the drill's ssh and sshd stand-in under `folder`, map the image's ssh and sshd to them,
    and return the image's ssh path (the launchers' `PRTE_MCA_plm_ssh_agent`)."""
    folder.mkdir(parents=True, exist_ok=True)
    ssh, sshd = folder / "ssh", folder / "sshd"
    ssh.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    sshd.write_text(SSHD_STAND_IN)
    for path in (ssh, sshd):
        path.chmod(0o555)
    image.mounts[SSHD], image.mounts[SSH] = str(sshd), str(ssh)
    return SSH


def parse(argv: list[str]) -> tuple[str, list[str]]:
    """(host, command) of an ssh command line; options (`-o X`, `-x`, ...) are skipped."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        flag = argv[i]
        i += 2 if len(flag) == 2 and flag[1] in OPTIONS_WITH_VALUE else 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    if i >= len(argv):
        raise SystemExit("usage: ssh [OPTIONS] HOST COMMAND...")
    host = argv[i].rsplit("@", 1)[-1]
    return host, argv[i + 1 :]


def pod_process(marker: str) -> tuple[int, dict[str, str]] | None:
    """(pid, environment) of the first process (lowest pid) whose `GANGFLOW_DRILL_POD` is exactly `marker`."""
    needle = f"{MARKER}={marker}".encode()
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                items = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in items:
            return pid, dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)
    return None


def main(argv: list[str]) -> int:
    host, command = parse(argv)
    own = os.environ.get(MARKER, "")
    if "/" not in own:
        print(f"ssh (cluster drill): {MARKER} is not set: not a drill pod", file=sys.stderr)
        return 255
    pod = host.split(".", 1)[0]
    found = pod_process(f"{own.rsplit('/', 1)[0]}/{pod}")
    if found is None:
        print(f"ssh: connect to host {host} port 22: Connection refused", file=sys.stderr)
        return 255
    pid, env = found
    try:  # the worker container's CPUs (the kubelet pinned its process), not the launcher's
        os.sched_setaffinity(0, os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        pass
    session = {k: env[k] for k in SESSION_ENV if k in env}
    if env.get(AUDIT):
        with open(Path(env[AUDIT]).with_name("ssh.log"), "a") as log:
            log.write(f"from {own}: {' '.join(command)}\n")
    home = session.get("HOME") or "/"
    os.chdir(home if os.path.isdir(home) else "/")
    shell = shutil.which("sh", path="/bin:/usr/bin") or "/bin/sh"
    os.execve(shell, ["sh", "-c", " ".join(command)] if command else ["sh"], session)
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
