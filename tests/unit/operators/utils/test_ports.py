"""free_port: a port picked now stays free until its server binds it, minutes later (the drill's
Ray nodes, a rendezvous): no port-0 bind and no other picking process can be handed it."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys

import pytest

from operators.utils import ports
from operators.utils.ports import FLOOR, ephemeral_range, free_port


def test_the_port_is_below_the_range_the_kernel_hands_port_0_binds():
    low, _ = ephemeral_range()
    if low - FLOOR < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it")
    picked = [free_port() for _ in range(50)]
    assert all(FLOOR <= port < low for port in picked), picked
    assert len(set(picked)) == len(picked)  # never handed twice in one process


def test_a_port_another_server_listens_on_is_never_picked(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1000, 60999))
        monkeypatch.setattr(ports, "FLOOR", taken)
        # The busy port is offered first, twice; then the ports above it, in order (the next one may be
        # in use or claimed by another test process: it is skipped like the busy one, never returned).
        choices, offered = itertools.chain([taken, taken], range(taken + 1, taken + 1000)), []
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: offered.append(next(choices)) or offered[-1])
        port = free_port()
        assert offered[:3] == [taken, taken, taken + 1] and taken < port < taken + 1000 and port == offered[-1]


_PICK = "import json; from operators.utils.ports import free_port; print(json.dumps([free_port() for _ in range(300)]), flush=True); input()"


def test_processes_picking_at_once_never_get_the_same_port():
    # each keeps its ports (it has not exited): as a drill keeps its pods' ports until they bind
    procs = [subprocess.Popen([sys.executable, "-c", _PICK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        picked = [json.loads(proc.stdout.readline()) for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("\n", timeout=30)
    every = [port for ports_of_one in picked for port in ports_of_one]
    assert len(set(every)) == len(every), f"{len(every) - len(set(every))} ports handed to two processes"


def test_claims_are_let_go_after_a_while(monkeypatch):
    # a scheduler picks a rendezvous port per run for days: its claims (open files) must not pile up
    monkeypatch.setattr(ports, "CLAIM_S", 0.0)
    for _ in range(20):
        free_port()
    assert len(ports._claims) <= 1
