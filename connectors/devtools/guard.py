"""A server a developer tool starts dies with the process that started it.

`stop()` and the exit-time finalizers cover every normal end, but not a SIGKILLed parent (an
OOM kill, `kill -9` of a test session, a CI timeout): its broker, Kafka JVM or SeaweedFS would
keep running, holding ports and disk. An :class:`OrphanGuard` is a tiny `/bin/sh` watcher
started next to the server, in a session of its own, reading the read end of a pipe whose only
write end the starting process keeps. When that process ends for any reason the kernel closes
the write end, the watcher reads end-of-file, sends SIGTERM to the server's process group,
and SIGKILL after a grace period if the group is still there.

A pipe rather than Linux's PR_SET_PDEATHSIG: the death signal follows the *thread* that forked
the child, so a server started from a worker thread would be killed when that thread ends; the
pipe follows the process (and any child it forked, which inherits the write end). It also works
where prctl does not exist.
"""

from __future__ import annotations

import os
import subprocess

# $1 = the server's process group, $2 = grace period in 0.2 s ticks.
# `kill -s SIG -- -PGID` is the spelling both dash and bash take for a process group.
_WATCH = ('read _; kill -s TERM -- "-$1" 2>/dev/null || exit 0; i=0; '
          'while [ "$i" -lt "$2" ]; do kill -s 0 -- "-$1" 2>/dev/null || exit 0; '
          'sleep 0.2; i=$((i+1)); done; kill -s KILL -- "-$1" 2>/dev/null; exit 0')


class OrphanGuard:
    """Watch a server's process group; stop it when this process dies. :meth:`release` once
    the server has been stopped normally (the guard goes without touching anything)."""

    def __init__(self, pgid: int, grace_s: float = 15.0) -> None:
        read_end, self._write_end = os.pipe()  # both non-inheritable: no exec'd child holds them
        try:
            self._watcher: subprocess.Popen[bytes] | None = subprocess.Popen(
                ["/bin/sh", "-c", _WATCH, "kcompact-guard", str(pgid),
                 str(max(1, int(grace_s * 5)))],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=True, start_new_session=True)
        except OSError:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)

    @property
    def pid(self) -> int | None:
        """The watcher's pid (None once released)."""
        return None if self._watcher is None else self._watcher.pid

    def release(self) -> None:
        """Stop watching (idempotent): kill the watcher first, so it never signals a process
        group id the system may have handed to someone else by now."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        if watcher.poll() is None:
            watcher.kill()
        watcher.wait()
        os.close(self._write_end)
