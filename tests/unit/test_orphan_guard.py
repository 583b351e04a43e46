"""OrphanGuard (connectors/devtools/guard.py): a server started by a developer tool dies with the
process that started it, even when that process is SIGKILLed; a released guard touches nothing.

Real processes: a Python child starts a stand-in server (`sleep`, in a session of its own like
the brokers) under a guard and prints its pid; the test kills the child and watches the server.
The broker and SeaweedFS wrappers use the same guard (tests/integration/test_broker.py kills a
process holding a real Tansu broker).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_CHILD = r"""
import subprocess, sys, time
from kcompact.connectors.devtools.guard import OrphanGuard
server = subprocess.Popen(["sleep", "600"], start_new_session=True)
guard = OrphanGuard(server.pid, grace_s=2.0)
if sys.argv[1] == "release":
    server.kill(); server.wait(); guard.release()
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    print(other.pid, guard.pid is None, flush=True)
else:
    print(server.pid, guard.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (the killed child's children are reparented and reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _child(mode: str) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().split()


def test_a_sigkilled_starter_takes_its_server_with_it():
    child, (server_pid, watcher_pid) = _child("guard")
    server, watcher = int(server_pid), int(watcher_pid)
    try:
        assert _alive(server) and _alive(watcher)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _gone_within(server, 30), "the guard did not stop the orphaned server"
        assert _gone_within(watcher, 30), "the guard outlived its server"
    finally:
        for pid in (server, watcher):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_released_guard_touches_nothing():
    child, (other_pid, released) = _child("release")
    other = int(other_pid)
    try:
        assert released == "True"
        child.send_signal(signal.SIGKILL)
        child.wait()
        # Nothing watches any more: a process that is not the guarded server keeps running.
        time.sleep(1.0)
        assert _alive(other)
    finally:
        if _alive(other):
            os.kill(other, signal.SIGKILL)
